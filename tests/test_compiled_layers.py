"""Regional compilation (`pardsl.load(..., compile=True)`, `pardsl run --compile`): the forward's runs of
ATen ops as functions torch.compile compiles, one per distinct run, shared by the repeated layers."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from pardsl.compiler import compile_text
from pardsl.program.codegen import render

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF_LLAMA_TP2 = open(os.path.join(REPO, "examples/hf_llama_tp2.par")).read()


def _with_layers(layers: int) -> str:
    return HF_LLAMA_TP2.replace('HFLlama(layers=2, attention="sdpa")', f'HFLlama(layers={layers}, attention="sdpa")')


def _run_compiled(example: str, *options: str) -> dict:
    """`pardsl run --compile --json` of the example on two ranks, three steps: its report, checked ok."""
    result = subprocess.run([sys.executable, "-m", "pardsl.cli", "run", f"examples/{example}.par", "--nproc", "2",
                             "--steps", "3", "--json", "--compile", "--timeout", "400", *options],
                            capture_output=True, text=True, cwd=REPO, timeout=600,
                            env={**os.environ, "PYTHONPATH": REPO})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["ok"], report
    return report


def test_every_repeated_layer_calls_the_same_pieces():
    """Two layers or six: the same functions, each layer calling them, so torch.compile compiles each
    once whatever the depth, with the collectives in the graphs too (a conversion's bytes and the layer it
    serves are in each call's comment, not in the shared piece); the module without `compile` is as it
    was."""
    os.chdir(REPO)
    programs = {layers: compile_text(_with_layers(layers)) for layers in (2, 6)}
    assert all("self.pieces" not in compiled.source for compiled in programs.values())
    for collectives in (False, True):
        sources = {layers: render(compiled.program, pieces=True, collectives=collectives)
                   for layers, compiled in programs.items()}
        defined = {layers: re.findall(r"^def (_piece_\d+)\(", source, re.M) for layers, source in sources.items()}
        calls = {layers: re.findall(r"self\.pieces\[(\d+)\]\(rt", source) for layers, source in sources.items()}
        assert defined[2] == defined[6] and len(defined[2]) >= 3
        # the layers after the first run the first's pieces: four more layers, four more calls of each
        repeated = {number for number in calls[2] if calls[2].count(number) == 2}
        assert repeated and all(calls[6].count(number) == 6 for number in repeated)
    assert "in model.model.layers.5.post_attention_layernorm" in sources[6]  # the call's comment


def test_a_module_without_pieces_is_compiled_as_it_is():
    """A forward with no run of ATen ops long enough to be a piece: `compile` leaves the module as it is."""
    from pardsl.program.codegen import load_module
    from pardsl.runtime.pieces import compile_pieces

    module = load_module("VALUE = 1\n")
    assert compile_pieces(module) is module and not hasattr(module, "PIECES")


@pytest.mark.slow
def test_compiled_layers_run_equal_to_serial_with_the_plans_collectives_and_no_recompilation(tmp_path):
    """Two ranks of the tp 2 LLaMA, three steps: equal to serial (at the tolerance: inductor's kernels
    order sums their own way), the plan's collectives, and no graph compiled after the first step."""
    report = _run_compiled("hf_llama_tp2")
    planned = compile_text(HF_LLAMA_TP2).program.collective_counts()
    assert report["collectives"] == planned
    graphs = report["compiled_graphs"]
    assert graphs["first_step"] >= 3 and graphs["last_step"] == graphs["first_step"]


def test_the_stages_of_a_pipeline_share_the_pieces_of_their_layers():
    """Each stage's runs of ATen ops are pieces of the one module, numbered across stages: a layer in the
    second stage calls the pieces the first stage's layer calls, compiled once for both."""
    from pardsl.compiler import compile_file

    os.chdir(REPO)
    compiled = compile_file("examples/hf_llama_pp2.par")
    source = compiled.source_with_pieces()
    assert "self.pieces" not in compiled.source
    stages = source.split("\nclass Stage")[1:]
    calls = [re.findall(r"self\.pieces\[(\d+)\]\(rt", stage) for stage in stages]
    assert len(calls) == 2 and all(calls)
    shared = set(calls[0]) & set(calls[1])
    assert len(shared) >= 2, calls  # the attention's runs of layer 0 and of layer 1
    assert len(re.findall(r"^def (_piece_\d+)\(", source, re.M)) == len(set(calls[0]) | set(calls[1]))


@pytest.mark.slow
def test_a_compiled_pipeline_runs_equal_to_serial_with_no_recompilation():
    """`hf_llama_pp2` (1F1B over two stages, four micro-batches) with compiled layers: equal to serial, the
    sends between stages as planned, and no graph compiled after the first step (by aot_eager: the same
    graphs as inductor's, whose kernels the run of the tp 2 LLaMA checks)."""
    report = _run_compiled("hf_llama_pp2", "--compile-backend", "aot_eager")
    assert report["collectives_by_axis"] == {"forward": {"pp:send": 4}, "backward": {}}
    graphs = report["compiled_graphs"]
    assert graphs["first_step"] >= 3 and graphs["last_step"] == graphs["first_step"]


@pytest.mark.parametrize("example, message", [
    ("llama_zero3", "not supported yet where gathered weights are resharded after forward"),
])
def test_what_regional_compilation_cannot_take_yet_is_refused_with_why(example, message, capsys):
    """ZeRO-3's resharded groups (autograd keeps their weights through saved-tensor hooks, which compiled
    graphs do not take: the run died of a segmentation fault) are refused by `load` and by `pardsl run
    --compile` (called here as the command line calls it), before anything runs."""
    import pardsl
    from pardsl import cli

    os.chdir(REPO)
    with pytest.raises(NotImplementedError, match=message):
        pardsl.load(f"examples/{example}.par", compile=True)
    assert cli.main(["run", f"examples/{example}.par", "--nproc", "2", "--compile"]) == 2
    assert message in capsys.readouterr().err


def _piece_with_conversions(rt, a0, w0):
    """A piece as codegen writes one with collectives in the graphs: ATen ops and conversions."""
    aten = torch.ops.aten
    v0 = aten.linear.default(a0, w0)
    v1 = rt.all_reduce(v0, "tp")
    v2 = aten.relu.default(v1)
    v3 = rt.all_gather(v2, "tp", 0, backward="reduce_scatter")
    v4 = rt.reduce_scatter(v3, "tp", 1)
    v5 = rt.grad_all_reduce(v4, "tp")
    return (aten.mul.Tensor(v5, 2.0), )


def test_a_piece_with_conversions_counts_what_its_graph_issues_at_each_size():
    """The conversions inside a compiled piece are functional collectives in its graph (one graph per
    size, no break), out of the runtime's sight: the piece counts them for it, forward at each call and
    backward when its backward runs, with the bytes at that call's size — what the same piece run eagerly
    counts, collective by collective. Over torch's fake process group of two ranks, in this process."""
    from torch._dynamo.utils import counters

    from pardsl.layouts.algebra import Mesh
    from pardsl.runtime.core import Runtime
    from pardsl.runtime.pieces import CompiledPiece
    from pardsl.tools.dryrun import _fake_process_group

    torch._dynamo.reset()
    counters.clear()
    with _fake_process_group(0, 2):
        rt = Runtime(Mesh(("tp",), (2,)))
        piece = CompiledPiece(_piece_with_conversions, "aot_eager")
        weight = torch.nn.Parameter(torch.randn(8, 8))
        for rows in (4, 6, 4):  # a new size, then the first again
            counted = {}
            for run in (_piece_with_conversions, piece):
                rt.counter.reset()
                x = torch.randn(rows, 8, requires_grad=True)
                out, = run(rt, x, weight)
                out.sum().backward()
                counted[run] = rt.counter.summary()
            assert counted[piece] == counted[_piece_with_conversions]
            assert counted[piece]["collectives"]["forward"]["all_reduce"] == 1
            assert counted[piece]["collectives"]["backward"] == \
                {"all_reduce": 1, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 0}
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 2  # one per size


def _piece_with_a_data_dependent_op(rt, a0):
    aten = torch.ops.aten
    v0 = aten.nonzero.default(a0)
    v1 = rt.all_reduce(aten.mul.Tensor(a0, 2.0), "tp")
    return (v0, v1)


def test_a_piece_whose_shapes_are_its_datas_runs_as_written_and_counted():
    """An op whose result's shape is its data's (nonzero) cannot run on fake tensors, so the piece's
    collectives cannot be logged ahead: it runs as written, uncompiled, each collective counted as issued."""
    from pardsl.layouts.algebra import Mesh
    from pardsl.runtime.core import Runtime
    from pardsl.runtime.pieces import CompiledPiece
    from pardsl.tools.dryrun import _fake_process_group

    with _fake_process_group(0, 2):
        rt = Runtime(Mesh(("tp",), (2,)))
        piece = CompiledPiece(_piece_with_a_data_dependent_op, "aot_eager")
        indices, summed = piece(rt, torch.tensor([0.0, 1.0, 2.0]))
        assert indices.tolist() == [[1], [2]] and summed.shape == (3,)
        assert rt.counter.summary()["collectives"]["forward"]["all_reduce"] == 1
        assert list(piece.logged.values()) == [None]


def test_compiled_layers_with_collectives_in_the_graphs_run_equal_to_serial_with_the_plans_collectives(tmp_path):
    """Sequence parallelism (reduce-scatters out of the row-parallel projections, all-gathers in their
    backward) with `--collectives-in-graphs yes` on gloo: the pieces hold the conversions between their ATen
    ops, the run equals serial, issues the plan's collectives and bytes, and compiles nothing after the
    first step. Its graphs run by aot_eager: the capture is inductor's, whose kernels the run of the tp 2
    LLaMA checks."""
    from pardsl.compiler import compile_file

    os.chdir(REPO)
    compiled = compile_file("examples/gpt_sp_tp2.par")
    source = compiled.source_with_pieces(collectives=True)
    inside = r'^    v\d+ = rt\.reduce_scatter\(v\d+, "tp", dim=1\)'
    assert re.search(inside, source, re.M) and not re.search(inside, compiled.source_with_pieces(), re.M)
    assert "conversion(s) (functional collectives), compiled as one piece" in source
    report = _run_compiled("gpt_sp_tp2", "--collectives-in-graphs", "yes", "--compile-backend", "aot_eager")
    assert report["collectives"] == compiled.program.collective_counts()
    assert report["bytes"] == compiled.program.collective_bytes()
    graphs = report["compiled_graphs"]
    assert graphs["first_step"] == len(re.findall(r"^def _piece_", source, re.M)) == graphs["last_step"]


@pytest.mark.parametrize("options, message", [
    (["--collectives-in-graphs", "yes"], "--collectives-in-graphs needs --compile"),
    (["--compile-backend", "aot_eager"], "--compile-backend needs --compile"),
    (["--compile", "--compile-backend", "nope"], "no torch.compile backend is named 'nope'"),
])
def test_compile_options_without_compile_or_with_an_unknown_backend_are_usage_errors(options, message, capsys):
    import pardsl
    from pardsl import cli

    os.chdir(REPO)
    assert cli.main(["run", "examples/mlp.par", "--nproc", "2", *options]) == 2
    assert message in capsys.readouterr().err
    if "nope" in options:
        with pytest.raises(ValueError, match=message):
            pardsl.load("examples/mlp.par", compile=True, compile_backend="nope")


@pytest.mark.slow
def test_training_through_the_api_with_collectives_in_the_graphs_equals_serial_as_shapes_change(tmp_path):
    """`pardsl.load(..., compile=True, collectives_in_graphs=True)` under torchrun: the tp 2 LLaMA on its own
    loss with AdamW and clipping, a batch and sequence length that change at the second step (the new size
    compiles the pieces once more), equal to serial step by step. Its graphs run by aot_eager (the same
    capture, forward and backward, without inductor's kernels, which the runs above check)."""
    from examples.hf_models import llama_causal_lm
    from tests.launch import torchrun
    from tests.test_training import serial_training

    out = tmp_path / "result.json"
    torchrun(2, "tests/scripts/api_train.py", "examples/llama_train_tp2.par", str(out), "--compile", "--steps", "2",
             "--compile-backend", "aot_eager")
    result = json.loads(out.read_text())
    expected = serial_training(llama_causal_lm)
    assert result["logits"] == [2, 8, 128]  # the second step's (batch 2, seq 8), the vocabulary split
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(result[key]), torch.tensor(expected[key][:2]), rtol=1e-4, atol=1e-5)
