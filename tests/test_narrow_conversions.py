"""The pass that converts a value before its cast to a wider dtype (pardsl/passes/narrow_conversions.py): a
bf16 model's norm input is all-reduced in bf16, as Megatron's is, not in the float32 its norm computes in."""

from unittest import mock

from pardsl import compiler
from pardsl.compiler import compile_file

from .test_distributed import check, lines_calling


def compiled_without_narrowing(path: str):
    """The file compiled with every pass but this one: the model's own cast to the wider dtype first."""
    with mock.patch.object(compiler, "PASSES_AFTER_LOWERING", tuple(
            (what, run) for what, run in compiler.PASSES_AFTER_LOWERING if "wider dtype" not in what)):
        return compile_file(path)


def test_a_bfloat16_llamas_partial_sums_are_all_reduced_in_bfloat16(pools):
    # tensor parallel over 2, 2 layers: the residual stream is a partial sum, which each of the five norms
    # (two a layer, the final one) needs whole. Each all-reduce moves the bf16 value, 4 × 16 × 64 × 2
    # bytes, where it moved its float32 cast; the same collectives, and the run measures the bytes planned
    compiled = compile_file("examples/llama_bf16_tp2.par")
    before = compiled_without_narrowing("examples/llama_bf16_tp2.par")
    assert compiled.program.collective_counts() == before.program.collective_counts()
    reduced = [c for c in compiled.program.collectives if c.kind == "all_reduce" and c.phase == "forward"]
    assert [c.bytes for c in reduced] == [4 * 16 * 64 * 2] * 5
    assert [c.bytes for c in before.program.collectives if c.kind == "all_reduce" and c.phase == "forward"] == \
        [4 * 16 * 64 * 4] * 5
    assert compiled.program.collective_bytes()["forward"] == before.program.collective_bytes()["forward"] - 5 * 8192
    assert compiled.program.collective_bytes()["backward"] == before.program.collective_bytes()["backward"]
    moved = [line for line in lines_calling(compiled, "rt.all_reduce") if "before its cast" in line]
    assert len(moved) == 5 and all("all-reduce 8.0 KiB (forward) in bfloat16" in line for line in moved), moved
    assert compiled.source.count("aten.to.dtype(") == before.source.count("aten.to.dtype(") - 5  # fused in the norms
    check(pools, compiled)


def test_a_float32_model_is_left_as_it_was():
    compiled = compile_file("examples/hf_llama_tp2.par")
    assert "before its cast" not in compiled.source
    assert compiled.source == compiled_without_narrowing("examples/hf_llama_tp2.par").source
