"""The fused-SwiGLU pass (pardsl/passes/fused_swiglu.py): silu(gate) · up runs as one op of the runtime that
keeps gate and up alone, silu made again in backward, with the ops' bits forward and backward; the program
holds one activation of the MLP's width less per layer."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pardsl import compiler
from pardsl.compiler import compile_file
from pardsl.runtime.parallel_ops import SwiGLU

from .conftest import run_on
from .test_distributed import check, lines_calling


@settings(max_examples=30, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]), seed=st.integers(0, 2**16))
def test_the_fused_swiglu_has_the_ops_bits_forward_and_backward(shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    gate, up, grad = (torch.randn(shape, generator=generator).to(dtype) for _ in range(3))
    gate.requires_grad_(), up.requires_grad_()
    fused = SwiGLU.apply(gate, up)
    eager = torch.nn.functional.silu(gate) * up
    assert torch.equal(fused, eager)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(fused, (gate, up), grad),
                                                 torch.autograd.grad(eager, (gate, up), grad)))
    # one operand's gradient alone, as where the other needs none
    (only_up,) = torch.autograd.grad(SwiGLU.apply(gate.detach(), up), (up,), grad)
    assert torch.equal(only_up, grad * torch.nn.functional.silu(gate.detach()))


def test_hugging_face_llamas_swiglus_are_fused_and_hold_silus_result_no_longer(pools, monkeypatch):
    # 2 layers under Megatron's TP: each MLP's silu and product, one op; equal to serial with the same
    # collectives; the rank holds each layer's silu(gate) less, [2, 16, ffn / 2] in float32
    compiled = compile_file("examples/hf_llama_tp2.par")
    fused = lines_calling(compiled, "rt.swiglu")
    assert len(fused) == 2 and "aten.silu.default(" not in compiled.source, fused
    check(pools, compiled)
    monkeypatch.setattr(compiler, "PASSES_AFTER_LOWERING", tuple(
        step for step in compiler.PASSES_AFTER_LOWERING if "SwiGLU" not in step[0]))
    unfused = compile_file("examples/hf_llama_tp2.par")
    assert "aten.silu.default(" in unfused.source and unfused.program.collective_counts() == \
        compiled.program.collective_counts()
    silus = [name for name, value in unfused.program.values.items()
             if value.get("kept_for_backward") and name.startswith("silu")]
    assert len(silus) == 2
    silu_bytes = sum(math.prod(unfused.program.values[name]["local_shape"]) * 4 for name in silus)
    held, unfused_held = compiled.program.memory(), unfused.program.memory()
    assert unfused_held["activations_per_rank"] - held["activations_per_rank"] == silu_bytes
    assert held["activations_total"] == unfused_held["activations_total"]  # the serial model's, unchanged


@pytest.mark.slow
@pytest.mark.parametrize("example", ["hf_llama_sp_tp2", "llama_bf16_tp2"])
def test_swiglus_under_sequence_parallelism_and_half_precision_equal_serial(pools, example):
    compiled = compile_file(f"examples/{example}.par")
    assert lines_calling(compiled, "rt.swiglu")
    check(pools, compiled)


@pytest.mark.slow
def test_swiglus_in_pipeline_stages_equal_serial(pools):
    compiled = compile_file("examples/hf_llama_pp2_dp2.par")
    assert "rt.swiglu(" in compiled.source and "aten.silu.default(" not in compiled.source
    assert run_on(pools, compiled, steps=2)["ok"]
