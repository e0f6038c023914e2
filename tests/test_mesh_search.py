"""`mesh dp, tp = 4`: the search chooses the axes' sizes with the layouts. Each shape is compiled as its
own file would be, from one trace; the shape kept is estimated no slower than any fixed shape compiled
alone with the same bound, runs equal to serial, and `explain` prices every shape."""

import functools

import pytest

from pardsl.compiler import compile_text, mesh_shapes
from pardsl.language.diagnostics import CompileError
from pardsl.planning.cost import default_machine, estimate, machine_named

from .test_distributed import check

# a GPT of two blocks, its embedding tied to its head: each shape's layouts are searched in half the time a
# Hugging Face LLaMA of two layers takes, and the 2-D shape is the fastest all the same
GPT = "model examples.language_models:GPT(n_layer=2)\ninput idx : int64[4, 16] in [0, 256)\n"


# what these tests compare is shapes, each compiled alike: each shape's layouts searched once
pytestmark = pytest.mark.usefixtures("search_once")


def _compiled(mesh: str, rest: str = "memory <= 40 %\n", machine=None):
    return compile_text(f"mesh {mesh}\n{GPT}{rest}", "examples/searched_mesh.par", machine=machine)


@functools.cache
def _searched():
    """`mesh dp, tp = 4` under a bound, compiled once for the tests that read it (none changes it)."""
    return _compiled("dp, tp = 4")


def test_every_shape_of_the_ranks_is_priced():
    assert mesh_shapes(8, 2) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert len(mesh_shapes(8, 3)) == 10 and all(a * b * c == 8 for a, b, c in mesh_shapes(8, 3))


@pytest.mark.slow  # about 40 s on 2 cores: make test-slow
def test_the_shape_kept_is_no_slower_than_any_fixed_shape_and_runs_equal_to_serial(pools):
    searched = _searched()
    machine = default_machine()
    kept = estimate(searched, machine).step_s
    sizes = searched.program.mesh.axis_sizes
    assert searched.mesh_shapes[0].sizes == sizes and searched.mesh_shapes[0].step_s == pytest.approx(kept)
    assert sorted(shape.sizes for shape in searched.mesh_shapes) == [(1, 4), (2, 2), (4, 1)]
    for dp, tp in [(1, 4), (2, 2), (4, 1)]:
        fixed = _compiled(f"dp = {dp}, tp = {tp}")
        assert kept <= estimate(fixed, machine).step_s * (1 + 1e-9), (dp, tp)
    check(pools, searched)


def test_shapes_that_are_each_others_axes_renamed_are_priced_once_on_a_flat_machine_only():
    flat = _compiled("dp, tp = 4", rest="")
    assert [shape.same_as for shape in flat.mesh_shapes if shape.same_as] == [(1, 4)]  # (4, 1) is (1, 4) renamed
    # nodes of 2 ranks: an axis of 4 spans nodes where one of 2 does not, so every shape is compiled
    nodes = machine_named("h100-nvlink-ib")
    nodes = type(nodes)(**{**vars(nodes), "ranks_per_node": 2})
    assert not any(shape.same_as for shape in _compiled("dp, tp = 4", rest="", machine=nodes).mesh_shapes)


@pytest.mark.slow  # about 30 s on 2 cores: make test-slow; the shapes' pricing is tested above
def test_explain_lists_every_shape_with_its_estimate():
    from pardsl.tools.explain import report

    searched = _searched()
    text = report(searched, estimate(searched, default_machine()), searched.memory_bound)
    listed = [line for line in text.splitlines() if line.startswith("  dp = ")]
    assert len(listed) == 3 and all("step" in line and "per rank" in line for line in listed)
    assert text.splitlines()[2].startswith("mesh shape searched: dp = 2, tp = 2 kept, the fastest of 3 within the bound")


@pytest.mark.slow
def test_a_kept_shape_whose_plan_swaps_the_roles_of_dp_and_tp_says_so():
    """The search prices either role on either axis: where the plan it keeps splits the weights over the
    axis the file calls dp and synchronises gradients over tp, note N008 names the mapping (the plan is
    kept as priced: exchanging the axes would reorder the file's mesh or change its groups of ranks)."""
    from pardsl.compiler import axis_roles

    searched = _searched()
    tensor, data = axis_roles(searched.program)
    swapped = [note for note in searched.program.notes if note.code == "N008"]
    assert bool(swapped) == (tensor == {"dp"} and data == {"tp"})
    if swapped:
        [note] = swapped
        assert note.severity == "note" and note.span == searched.par.mesh.span
        assert note.message.startswith(f"the search kept {searched.program.mesh}: the weights are split over dp")
        assert "gradients synchronised over tp" in note.message and "roles swapped" in note.message


MLP_LAYOUTS = ("mesh dp = 2, tp = 2\nmodel examples.models:MLP(d_model=16, d_ff=32)\ninput x : float32[4, 16]\n"
               "layout {{\n    x : S(0)@{batch}\n    fc1.weight : S(0)@{weights}\n    fc1.bias : S(0)@{weights}\n"
               "    fc2.weight : S(1)@{weights}\n    output : S(0)@{batch}\n}}\n")


@pytest.mark.parametrize("batch, weights, swapped", [("dp", "tp", False), ("tp", "dp", True)])
def test_the_roles_of_dp_and_tp_are_read_from_the_plan(batch, weights, swapped):
    """Weights split over tp and the batch over dp is what the names say: no note. The other way round is
    tensor parallelism on dp and data parallelism on tp: the note, naming the mapping."""
    from pardsl.compiler import axis_roles, roles_swapped_note

    compiled = compile_text(MLP_LAYOUTS.format(batch=batch, weights=weights), "examples/mlp.par")
    assert axis_roles(compiled.program) == ({weights}, {batch})
    note = roles_swapped_note(compiled.program, None)
    assert (note is not None) == swapped
    if swapped:
        assert note.code == "N008" and "kept dp = 2, tp = 2: the weights are split over dp" in note.message


def test_a_mesh_no_shape_of_which_fits_the_written_layouts_is_located():
    with pytest.raises(CompileError) as caught:
        compile_text("mesh dp, tp = 4\nmodel examples.models:MLP(d_model=16, d_ff=32)\ninput x : float32[3, 3, 16]\n"
                     "layout {\n    x : S(0)@dp, S(1)@tp\n}\n", "examples/searched_mesh.par")
    [error] = caught.value.diagnostics
    assert (error.code, error.span.line, error.span.column) == ("E013", 1, 1)
    assert len(error.notes) == 3 and all("error[E05" in note for note in error.notes)


def test_an_axis_named_twice_in_a_searched_mesh_is_located():
    with pytest.raises(CompileError) as caught:
        compile_text("mesh dp, dp = 4\n" + GPT, "examples/searched_mesh.par")
    assert (caught.value.diagnostics[0].code, caught.value.diagnostics[0].span.column) == ("E010", 10)


@pytest.mark.slow
def test_three_axes_with_the_pipeline_searched_keep_a_shape_no_slower_than_any_fixed_one():
    """`mesh dp, tp, pp = 4` with `pipeline pp : schedule ?, microbatches ?, cut ?` (compiled only): the
    shape kept is estimated no slower than each shape written out and compiled alone, its pipeline
    searched too; the shape whose pipeline cannot be cut (four stages of two layers) has no plan, and
    says why."""
    from pardsl.planning.pipeline_search import pipelined_step_seconds

    text = f"mesh {{mesh}}\n{GPT.replace('[4, 16]', '[8, 16]')}memory <= 50 %\n{{pipeline}}"
    machine = default_machine()
    searched = compile_text(text.format(mesh="dp, tp, pp = 4", pipeline="pipeline pp : schedule ?, microbatches ?, cut ?\n"),
                            "examples/searched_mesh.par")
    kept = searched.mesh_shapes[0]
    assert len(searched.mesh_shapes) == 6
    unplanned = [shape for shape in searched.mesh_shapes if shape.why_not]
    assert [shape.sizes for shape in unplanned] == [(1, 1, 4)]
    assert unplanned[0].why_not.startswith("error[E075]")
    for dp, tp, pp in [shape.sizes for shape in searched.mesh_shapes if not shape.why_not]:
        pipeline = "pipeline pp : schedule ?, microbatches ?, cut ?\n" if pp > 1 else ""
        fixed = compile_text(text.format(mesh=f"dp = {dp}, tp = {tp}, pp = {pp}", pipeline=pipeline),
                             "examples/searched_mesh.par")
        step = pipelined_step_seconds(fixed, machine) if fixed.pipeline else estimate(fixed, machine).step_s
        assert kept.step_s <= step * (1 + 1e-9), (dp, tp, pp)
