"""A mixed-precision policy (`precision params bf16, reduce fp32`): float32 masters on the shards, compute and
ZeRO-3 gathers in bf16, gradients reduced in the `reduce` dtype; checked against a serial reference that
computes as the policy says, at bf16's tolerance, with the bytes each collective moves in its dtype."""

import os

import pytest

from pardsl.language.diagnostics import CompileError

from .conftest import REPO, run_on


def with_precision(example: str, line: str = "precision params bf16, reduce fp32") -> str:
    text = open(os.path.join(REPO, "examples", example)).read()
    return text.replace("layout {", line + "\n\nlayout {", 1)


def collective_bytes(program, kind: str, phase: str) -> int:
    return sum(c.bytes for c in program.collectives if c.kind == kind and c.phase == phase)


def test_tensor_parallel_layers_compute_in_bf16_from_float32_masters(pools, compile_par):
    compiled = compile_par(with_precision("hf_llama_tp2.par"))
    plain = compile_par(open(os.path.join(REPO, "examples/hf_llama_tp2.par")).read())
    assert {p.dtype for p in compiled.program.parameters} == {"torch.float32"}
    assert "PRECISION = (torch.bfloat16, torch.float32)" in compiled.source
    assert "= rt.cast(self.model_model_layers_0_self_attn_q_proj_weight, torch.bfloat16)" in compiled.source
    # the activations' gradients move in bf16: half the backward bytes
    assert collective_bytes(compiled.program, "all_reduce", "backward") * 2 == \
        collective_bytes(plain.program, "all_reduce", "backward")
    report = run_on(pools, compiled, steps=2)
    assert report["ok"] and report["tolerance"] == 5e-2, report
    assert 0 < report["max_rel_err"]["grad"] < 2e-2  # bf16's rounding shows, far below a wrong plan's error
    assert report["bytes"] == compiled.program.collective_bytes()


@pytest.mark.parametrize("reduce, scatter_ratio", [("fp32", 1), ("bf16", 2)])
def test_zero3_gathers_move_half_the_bytes_and_gradients_reduce_in_their_dtype(pools, compile_par, reduce,
                                                                                scatter_ratio):
    compiled = compile_par(with_precision("llama_zero3.par", f"precision params bf16, reduce {reduce}"))
    plain = compile_par(open(os.path.join(REPO, "examples/llama_zero3.par")).read())
    for phase in ("forward", "backward"):  # the gathers, and backward's gathers again, in bf16
        assert collective_bytes(compiled.program, "all_gather", phase) * 2 == \
            collective_bytes(plain.program, "all_gather", phase)
    assert collective_bytes(compiled.program, "reduce_scatter", "backward") * scatter_ratio == \
        collective_bytes(plain.program, "reduce_scatter", "backward")
    report = run_on(pools, compiled, steps=2)
    assert report["ok"], report
    assert report["bytes"] == compiled.program.collective_bytes()
    assert report["collectives"] == compiled.program.collective_counts()


def test_outputs_can_be_given_in_float32(pools, compile_par):
    compiled = compile_par(with_precision("hf_llama_tp2.par", "precision params bf16, reduce fp32, output fp32"))
    lines = [line for line in compiled.source.splitlines() if "= rt.cast(" in line and "torch.float32" in line]
    assert len(lines) == 1 and "output `output` in float32" in lines[0]
    report = run_on(pools, compiled, steps=2)
    assert report["ok"], report


@pytest.mark.parametrize("line, code, column, message", [
    ("precision params bf16, reduce fp64", "E083", 31, "`fp64` is no precision dtype"),
    ("precision params bf16, colour fp32", "E083", 24, "`colour` is no precision option"),
    ("precision reduce fp32", "E004", 1, "the precision has no `params` dtype"),
    ("precision params bf16, params fp16", "E003", 24, "precision option `params` given twice"),
])
def test_a_precision_line_that_cannot_be_taken_says_where(compile_par, line, code, column, message):
    with pytest.raises(CompileError) as error:
        compile_par(with_precision("hf_llama_tp2.par", line))
    (diagnostic,) = error.value.diagnostics
    assert (diagnostic.code, diagnostic.span.column, diagnostic.message) == (code, column, message)


def test_a_pipelined_plan_computes_its_stages_in_bf16_from_float32_masters(pools, compile_par):
    text = open(os.path.join(REPO, "examples/hf_llama_pp2.par")).read()
    compiled = compile_par(text.replace("layout {", "precision params bf16, reduce fp32\n\nlayout {", 1)
                           if "layout {" in text else text + "precision params bf16, reduce fp32\n")
    plain = compile_par(text, "plain.par")
    assert "PRECISION = (torch.bfloat16, torch.float32)" in compiled.source
    assert all(p.dtype == "torch.float32" for stage in compiled.stages for p in stage.parameters)
    report = run_on(pools, compiled, steps=2)
    assert report["ok"] and report["tolerance"] == 5e-2, report
    assert 0 < report["max_rel_err"]["grad"] < 2e-2
    assert report["collectives"] == run_on(pools, plain, steps=1)["collectives"]
