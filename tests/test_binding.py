import pytest

from pardsl.layouts.algebra import B, S, Layout

HEAD = "mesh tp = 2\n"


def test_names_bind_to_parameters_buffers_inputs_outputs_and_submodules(compile_par):
    compiled = compile_par(HEAD + "model tests.zoo:DictOut(d=8)\ninput x : float32[4, 8]\ninput y : float32[4, 8]\n"
                           "layout {\n  enc.weight : S(0)\n  scale : S(0)\n  y : S(1)\n  output.logits : S(1)\n"
                           "  output.aux[0] : B\n  enc() : S(1)\n}\n")
    bound = compiled.bound
    assert set(bound.parameters.values()) == {"enc.weight", "enc.bias"}
    assert set(bound.buffers.values()) == {"scale"}
    assert list(bound.inputs.values()) == ["x", "y"]
    assert [path for path, _ in bound.outputs] == ["output.logits", "output.aux[0]"]
    pinned = {bound.parameters.get(n) or bound.buffers.get(n) or bound.inputs.get(n) or n: p.layout
              for n, p in bound.pins.items()}
    assert pinned["enc.weight"] == Layout((S(0),)) and pinned["scale"] == Layout((S(0),))
    assert pinned["y"] == Layout((S(1),)) and pinned["linear"] == Layout((S(1),))  # enc() is the linear node
    assert bound.output_pins[0].layout == Layout((S(1),)) and bound.output_pins[1].layout == Layout((B,))


def test_wildcards_match_one_segment(compile_par):
    compiled = compile_par(HEAD + "model examples.models:DeepMLP(depth=3, d_model=8, d_ff=16)\ninput x : float32[4, 8]\n"
                           "layout {\n  blocks.*.fc1.weight : S(0)\n  blocks.*.fc1.bias : S(0)\n}\n")
    layouts = {p.name: p.layout for p in compiled.program.parameters}
    assert all(layouts[f"blocks.{i}.fc1.weight"] == Layout((S(0),)) for i in range(3))
    assert all(layouts[f"blocks.{i}.fc1.bias"] == Layout((S(0),)) for i in range(3))


def test_bare_output_names_every_flat_output(compile_par):
    compiled = compile_par(HEAD + "model tests.zoo:TwoHeads(d=8, h=16)\ninput x : float32[4, 8]\n"
                           "layout {\n  output : B\n}\n")
    assert set(compiled.bound.output_pins) == {0, 1}


def test_negative_split_dims_are_normalised(compile_par):
    compiled = compile_par(HEAD + "model examples.models:MLP(d_model=8, d_ff=16)\ninput x : float32[4, 8]\n"
                           "layout {\n  fc2.weight : S(-1)\n}\n")
    assert {p.name: p.layout for p in compiled.program.parameters}["fc2.weight"] == Layout((S(1),))


def test_same_layout_twice_is_not_an_error(compile_par):
    compiled = compile_par(HEAD + "model examples.models:MLP(d_model=8, d_ff=16)\ninput x : float32[4, 8]\n"
                           "layout {\n  fc1.weight : S(0)\n  *.weight : S(0)\n}\n")
    assert compiled.program.parameters[0].layout == Layout((S(0),))


def test_model_module_is_imported_from_the_par_files_folder(tmp_path, monkeypatch):
    from pardsl.compiler import compile_file

    (tmp_path / "local_models.py").write_text(
        "import torch\nclass Tiny(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.lin = torch.nn.Linear(4, 4)\n    def forward(self, x):\n        return self.lin(x)\n")
    par = tmp_path / "tiny.par"
    par.write_text("mesh tp = 2\nmodel local_models:Tiny()\ninput x : float32[2, 4]\nlayout {\n  lin.weight : S(0)\n}\n")
    monkeypatch.chdir("/")
    assert compile_file(str(par)).program.parameters[0].local_shape == (2, 4)


MODEL_SOURCE = "import torch\n\ndef Tiny():\n    return torch.nn.Linear(8, 8)\n"
TINY_PAR = "mesh tp = 2\nmodel tiny_model_here:Tiny()\ninput input : float32[4, 8]\nlayout {\n  weight : S(0)\n}\n"


def test_the_par_files_folder_is_importable_only_while_the_model_is_imported(tmp_path):
    import sys

    from pardsl.compiler import compile_text

    (tmp_path / "tiny_model_here.py").write_text(MODEL_SOURCE)
    (tmp_path / "plan.par").write_text(TINY_PAR)
    before = list(sys.path)
    compiled = compile_text(TINY_PAR, str(tmp_path / "plan.par"))
    assert compiled.program.parameters and sys.path == before  # neither its folder nor the working directory
    sys.modules.pop("tiny_model_here", None)


def test_a_model_module_in_a_folder_anyone_may_write_to_is_refused_where_it_is(tmp_path):
    from pardsl.compiler import compile_text
    from pardsl.language.diagnostics import CompileError

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp is
    (shared / "tiny_model_here.py").write_text(MODEL_SOURCE)
    (shared / "plan.par").write_text(TINY_PAR)
    with pytest.raises(CompileError) as refused:
        compile_text(TINY_PAR, str(shared / "plan.par"))
    (diagnostic,) = refused.value.diagnostics
    assert (diagnostic.code, diagnostic.span.line, diagnostic.span.column) == ("E023", 2, 1)
    assert f"is not imported from `{shared}`: any user may write to that folder" in diagnostic.message


def test_a_package_qualified_module_is_imported_from_the_folder_that_holds_its_package():
    from pardsl.model.loading import par_import_paths
    from tests.launch import REPO

    assert par_import_paths(f"{REPO}/examples/mlp.par", "examples.models") == (f"{REPO}/examples", REPO)
    assert par_import_paths(f"{REPO}/examples/mlp.par", "models") == (f"{REPO}/examples",)
    assert par_import_paths("/a/b/c/x.par", "b.c.m") == ("/a/b/c", "/a")


def _sys_path_after_a_job(par: str) -> list:
    import sys

    from pardsl.compiler import compile_file
    from pardsl.tools.execution import job_for, run_rank

    run_rank(job_for(compile_file(par), timeout_s=60))
    return sys.path


def test_a_rank_leaves_sys_path_as_it_found_it(pools, tmp_path):
    import functools
    import shutil

    from tests.launch import REPO

    shutil.copy(f"{REPO}/examples/mlp.par", tmp_path / "mlp.par")
    paths = pools(2).run_on_every_rank(functools.partial(_sys_path_after_a_job, str(tmp_path / "mlp.par")))
    assert all(str(tmp_path) not in rank for rank in paths)
