"""The early-count pass (pardsl/passes/early_count.py): a partial mean loss's count of targets is all-reduced from
the top of the forward, so that the forward has no barrier at the loss."""

import os

import pytest

from pardsl.layouts.algebra import collective_bytes

from .conftest import REPO, run_on
from .test_distributed import check
from .test_transformers import _nonzero

LLAMA = """\
mesh   dp = {ranks}
model  examples.hf_models:llama_causal_lm(layers=2)
input  input_ids : int64[4, 16] in [0, 256)
input  labels    : int64[4, 16] in [0, 256)

layout {{
    input_ids : S(0)
    labels    : S(0)
{output}}}
"""


def _forward_lines(source: str) -> list[str]:
    body = source[source.index("    def forward("):]
    return [line.strip() for line in body.splitlines()[1:]
            if line.startswith("        ") and "=" in line and not line.strip().startswith(("rt =", "sync ="))]


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_causal_lms_partial_loss_starts_its_count_before_the_first_layer_and_equals_serial(pools, compile_par,
                                                                                             ranks):
    # HF's loss shifts the labels (pad with ignore_index, slice): those ops move up with the count, so the
    # all-reduce is under way while every layer computes, and the loss only reads its result
    compiled = compile_par(LLAMA.format(ranks=ranks, output="    output.loss : P\n"))
    lines = _forward_lines(compiled.source)
    started = next(i for i, line in enumerate(lines) if "rt.count_targets_started(" in line)
    first_parameter = next(i for i, line in enumerate(lines) if "self." in line)
    assert started < first_parameter, lines[:started + 2]
    moved = collective_bytes("all_reduce", 4, ranks)  # one float32 count, at the ring's bytes per rank
    assert f"all-reduce {moved} B over dp (forward): count of targets" in lines[started]
    assert [line.split(" = ")[1].split("(")[0] for line in lines[:started]] == [
        "aten.pad.default", "aten.slice.Tensor", "aten.contiguous.default", "aten.view.default",
        "aten.to.dtype_layout"]
    loss = next(line for line in lines if "rt.cross_entropy(" in line)
    assert f"count_started={lines[started].split(' = ')[0]}" in loss
    # the count's all-reduce is the forward's only collective, counted once
    assert [(c.kind, c.bytes) for c in compiled.program.collectives if c.phase == "forward"] == [("all_reduce", moved)]
    check(pools, compiled)


def test_targets_masked_from_an_input_are_counted_before_the_first_layer(pools, compile_par):
    # the model marks a class as padding (masked_fill to -100) before the loss: the mask moves up too
    compiled = compile_par("mesh dp = 2\nmodel tests.zoo:Classifier(d=16, classes=8, reduction=\"mean\", "
                           "ignored_class=3)\ninput x : float32[8, 16]\ninput labels : int64[8] in [0, 8)\n"
                           "layout {\n  x : S(0)\n  labels : S(0)\n  *.weight : B\n  *.bias : B\n  output : P\n}\n")
    lines = _forward_lines(compiled.source)
    assert [line.split(" = ")[1].split("(")[0] for line in lines[:4]] == [
        "aten.eq.Scalar", "aten.masked_fill.Scalar", "aten.view.default", "rt.count_targets_started"]
    assert ", -100, 'dp')" in lines[3]
    assert _nonzero(compiled.program.collective_counts()) == {"forward": {"all_reduce": 1},
                                                             "backward": {"all_reduce": 1}}
    check(pools, compiled)


def test_a_half_precision_losss_count_is_float32_as_planned_and_as_measured(pools, compile_par):
    # bf16 logits: the count is all-reduced in float32 (exact past 256 targets), and the plan says so
    compiled = compile_par("mesh dp = 2\nmodel tests.zoo:Classifier(d=16, classes=8, reduction=\"mean\", "
                           "dtype=\"bfloat16\")\ninput x : bfloat16[8, 16]\ninput labels : int64[8] in [0, 8)\n"
                           "layout {\n  x : S(0)\n  labels : S(0)\n  *.weight : B\n  *.bias : B\n  output : P\n}\n")
    assert "rt.count_targets_started(" in compiled.source
    planned = compiled.program.collective_bytes()["forward"]
    assert planned == collective_bytes("all_reduce", 4, 2)
    report = run_on(pools, compiled, steps=1)
    assert report["ok"], {k: v for k, v in report.items() if "collectives" not in k}
    assert report["bytes"]["forward"] == planned


def test_a_loss_returned_whole_keeps_its_sum_and_count_in_one_all_reduce_at_the_loss(compile_par):
    # the sum is known only at the loss, and the count goes with it: nothing to start early
    compiled = compile_par(LLAMA.format(ranks=2, output=""))
    assert "count_targets_started" not in compiled.source
    assert "mean=('dp',)" in compiled.source


def test_a_pipelines_last_stage_starts_its_count_before_its_layers_and_equals_serial(pools, compile_par):
    # pp 2 × dp 2, the loss returned partial over dp; `pardsl run`'s check sums it over the last stage's
    # dp ranks, as it sums an unpipelined plan's
    with open(os.path.join(REPO, "examples", "hf_llama_pp2_dp2.par")) as handle:
        text = handle.read().replace("    labels    : S(0) @ dp\n", "    labels    : S(0) @ dp\n    output : P @ dp\n")
    compiled = compile_par(text)
    # the last stage's module starts the count from the labels it receives before any of its layers
    last = compiled.stages[-1]
    started = [s.instruction.callee for s in last.statements].index("rt.count_targets_started")
    parameters = {f"self.{p.var}" for p in last.parameters}
    reads_parameter = next(i for i, s in enumerate(last.statements)
                           if any(name in parameters for name in s.instruction.reads()))
    assert started < reads_parameter
    assert last.collective_counts()["forward"]["all_reduce"] == 1  # the count's, moved, not added
    report = run_on(pools, compiled)
    assert report["ok"], {k: v for k, v in report.items() if "collectives" not in k}
    assert report["max_abs_err"]["output"] < 1e-5
