"""The fused-norm pass (pardsl/passes/fused_norms.py): a model's RMSNorm, seven ATen ops, runs as one op of the
runtime where its chain is local, with a backward that is autograd's through the chain; elsewhere the
chain stays as it was."""

import contextlib
import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pardsl.runtime import kernels
from pardsl.compiler import compile_file
from pardsl.runtime.parallel_ops import RMSNorm

from .test_distributed import check, lines_calling
from .test_narrow_conversions import compiled_without_narrowing

NORMED = """\
mesh tp = 2
model tests.zoo:RMSNormed(width=32{dtype})
input x : {input_dtype}[8, 32]
layout {{
{layouts}}}
"""


def _chain(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _aten_ops_only():
    """The runtime's norm as the ATen ops, where a CPU float norm would take numba's kernels."""
    return mock.patch.object(kernels, "rms_norm_fits", lambda *args: False)


@pytest.mark.parametrize("kernel", [True, False], ids=["numba kernel", "ATen ops"])
@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), width=st.integers(1, 9),
       eps=st.sampled_from([1e-6, 1e-5, 0.1]), seed=st.integers(0, 2**16))
def test_the_fused_norms_gradients_are_autograds_through_the_chain(kernel, shape, width, eps, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, width, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(width, dtype=torch.float64, generator=generator, requires_grad=True)
    grad = torch.randn(*shape, width, dtype=torch.float64, generator=generator)
    with contextlib.nullcontext() if kernel else _aten_ops_only():
        assert kernels.rms_norm_fits(x, weight, torch.float64) == kernel
        fused = RMSNorm.apply(x, weight, eps, torch.float64)
        if kernel:  # sums reassociated to vectorise: within rounding
            torch.testing.assert_close(fused, _chain(x, weight, eps), rtol=1e-13, atol=1e-13)
        else:
            assert torch.equal(fused, _chain(x, weight, eps))  # the same ops forward: the same bits
        fused_grads = torch.autograd.grad(fused, (x, weight), grad)
        chain_grads = torch.autograd.grad(_chain(x, weight, eps), (x, weight), grad)
        for got, expected in zip(fused_grads, chain_grads):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        assert torch.autograd.gradcheck(lambda a, b: RMSNorm.apply(a, b, eps, torch.float64), (x, weight))


@settings(max_examples=10, deadline=None)
@given(tokens=st.integers(1, 300), width=st.sampled_from([7, 64, 512, 1000]), seed=st.integers(0, 2**16),
       weight_grad=st.booleans())
def test_the_float32_kernel_is_within_rounding_of_the_chain_at_a_models_sizes(tokens, width, seed, weight_grad):
    # the weight's gradient sums every row: over a long sequence, float32 terms summed in float64
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, tokens, width, generator=generator, requires_grad=True)
    weight = torch.randn(width, generator=generator).requires_grad_(weight_grad)
    grad = torch.randn(2, tokens, width, generator=generator)
    assert kernels.rms_norm_fits(x, weight, torch.float32)  # numba is installed: the fast path is taken
    fused = RMSNorm.apply(x, weight, 1e-6, torch.float32)
    expected = _chain(x.double(), weight.double(), 1e-6)
    torch.testing.assert_close(fused, expected.float(), rtol=1e-5, atol=1e-5)
    inputs = (x, weight) if weight_grad else (x,)
    got = torch.autograd.grad(fused, inputs, grad)
    wanted = torch.autograd.grad(expected, inputs, grad.double())
    for g, w in zip(got, wanted):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w.float(), rtol=1e-4, atol=1e-4 * max(1.0, tokens ** 0.5))


def test_a_norm_the_kernels_do_not_fit_takes_the_aten_ops():
    x, weight = torch.randn(3, 8), torch.randn(8)
    assert kernels.rms_norm_fits(x, weight, torch.float32)
    assert not kernels.rms_norm_fits(x.bfloat16(), weight.bfloat16(), torch.bfloat16)  # half precision
    assert not kernels.rms_norm_fits(x, weight.bfloat16(), torch.bfloat16)  # a norm that casts
    assert not kernels.rms_norm_fits(x, weight.double(), torch.float32)
    assert not kernels.rms_norm_fits(x.to("meta"), weight.to("meta"), torch.float32)  # not on a CPU


@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), width=st.integers(2, 64),
       seed=st.integers(0, 2**16))
def test_a_bfloat16_norm_computed_in_float32_has_the_chains_bits_forward_and_its_gradients(shape, width, seed):
    # LLaMA's in bf16: x cast to float32 by the model, the normalised x cast back to bf16 before the weight
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, width, generator=generator).requires_grad_()
    weight = torch.randn(width, generator=generator).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(*shape, width, generator=generator).to(torch.bfloat16)

    def chain(a, w):
        return w * (a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)

    fused = RMSNorm.apply(x, weight, 1e-6, torch.bfloat16)
    assert fused.dtype == torch.bfloat16 and torch.equal(fused, chain(x, weight))
    got_x, got_w = torch.autograd.grad(fused, (x, weight), grad)
    expected_x, expected_w = torch.autograd.grad(chain(x, weight), (x, weight), grad)
    assert got_x.dtype == torch.float32 and got_w.dtype == torch.bfloat16
    assert torch.equal(got_w, expected_w)  # the same ops: the same bits
    torch.testing.assert_close(got_x, expected_x, rtol=1e-5, atol=1e-5)  # float32, summed in another order


def test_hugging_face_llamas_norms_are_fused_under_tensor_parallelism(pools):
    # 2 layers: each layer's two norms and the final one, each one op; no rsqrt left; equal to serial
    compiled = compile_file("examples/hf_llama_tp2.par")
    fused = lines_calling(compiled, "rt.rms_norm")
    assert len(fused) == 5 and "aten.rsqrt" not in compiled.source, fused
    assert all(", 1e-06)" in line for line in fused)
    check(pools, compiled)


def test_a_norm_of_a_batch_split_activation_is_fused_with_its_weights_gradient_bucketed(pools, compile_par):
    # data parallel: the weight reaches the fused op through its gradient's bucket wrapper
    compiled = compile_par(NORMED.format(dtype="", input_dtype="float32", layouts="    x : S(0)\n"))
    fused = lines_calling(compiled, "rt.rms_norm")
    assert len(fused) == 1 and "weight__f" in fused[0] and "aten.rsqrt" not in compiled.source, fused
    check(pools, compiled)


def test_a_half_precision_norm_computed_in_float32_is_fused_with_its_casts(pools, compile_par):
    # bfloat16: the model casts x to float32, the chain computes there and casts back to bf16 before the
    # weight; the fused op makes both casts, and keeps x in bf16
    compiled = compile_par(NORMED.format(dtype=', dtype="bfloat16"', input_dtype="bfloat16", layouts="    x : S(0)\n"))
    fused = lines_calling(compiled, "rt.rms_norm")
    assert len(fused) == 1 and ", 1e-06, torch.bfloat16, compute=torch.float32)" in fused[0], fused
    assert "aten.to.dtype" not in compiled.source
    check(pools, compiled)


@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), width=st.integers(2, 64),
       seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_a_norm_that_casts_its_input_has_the_chains_bits_keeping_the_input_narrow(shape, width, seed, dtype):
    # LLaMA's in bf16 with its first cast made by the op: forward and both gradients are the chain's bits
    # (the float32 gradient cast back, as autograd casts it through `to`); what backward keeps is the
    # input in its own dtype and the float32 rsqrt, no float32 copy of the input
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, width, generator=generator).to(dtype).requires_grad_()
    weight = torch.randn(width, generator=generator).to(dtype).requires_grad_()
    grad = torch.randn(*shape, width, generator=generator).to(dtype)

    def chain(h, w):
        a = h.to(torch.float32)
        return w * (a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)

    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fused = RMSNorm.apply(x, weight, 1e-6, dtype, torch.float32)
    assert fused.dtype == dtype and torch.equal(fused, chain(x, weight))
    assert sorted((str(t.dtype), tuple(t.shape)) for t in saved if t is not weight) == \
        sorted([(str(dtype), tuple(x.shape)), ("torch.float32", (*shape, 1))])
    got = torch.autograd.grad(fused, (x, weight), grad)
    expected = torch.autograd.grad(chain(x, weight), (x, weight), grad)
    assert got[0].dtype == dtype and torch.equal(got[1], expected[1])
    torch.testing.assert_close(got[0], expected[0])  # float32 summed in another order, then rounded to dtype


def test_a_bfloat16_llamas_norms_keep_their_inputs_in_bf16(compile_par):
    # tensor parallel, the residual a partial sum: each norm's input is all-reduced in bf16 and kept so;
    # against the program with the first cast left to the model, each of the five norms holds its input's
    # bf16 bytes in place of its float32 copy and of the partial sum's (4 × 16 × 64 values a norm)
    compiled = compile_file("examples/llama_bf16_tp2.par")
    fused = lines_calling(compiled, "rt.rms_norm")
    assert len(fused) == 5 and all("compute=torch.float32" in line for line in fused), fused
    cast_by_the_model = compiled_without_narrowing("examples/llama_bf16_tp2.par")
    assert all(", torch.bfloat16)" in line for line in lines_calling(cast_by_the_model, "rt.rms_norm"))
    values = 4 * 16 * 64
    held, before = compiled.program.memory(), cast_by_the_model.program.memory()
    assert before["activations_per_rank"] - held["activations_per_rank"] == 5 * values * (4 + 4 - 2)
    assert held["activations_total"] == before["activations_total"]  # the serial model's: unchanged


def test_a_norm_over_a_split_last_dim_is_left_as_its_ops_and_equals_serial(pools, compile_par):
    # the last dim split: the mean is a partial sum, all-reduced inside the chain
    layouts = "    proj.weight : S(0)\n    proj.bias : S(0)\n    out.weight : S(1)\n"
    compiled = compile_par(NORMED.format(dtype="", input_dtype="float32", layouts=layouts))
    assert lines_calling(compiled, "rt.rms_norm") == [] and "aten.rsqrt.default(" in compiled.source
    check(pools, compiled)


def test_the_kernels_compile_where_numba_has_nowhere_to_cache_them():
    import numba

    njit = numba.njit

    def uncachable(*args, cache=False, **options):
        if cache:  # what numba raises where no cache locator applies (a read-only install, no home)
            raise RuntimeError("cannot cache function: no locator available")
        return njit(*args, **options)

    kernels._compiled.cache_clear()
    try:
        with mock.patch.object(numba, "njit", uncachable):
            x, weight = torch.randn(3, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
            assert kernels.rms_norm_fits(x, weight, torch.float64)
            torch.testing.assert_close(kernels.rms_norm_forward(x, weight, 1e-6)[0], _chain(x, weight, 1e-6))
    finally:
        kernels._compiled.cache_clear()


def test_a_norm_input_kept_narrow_is_counted_whatever_makes_it(compile_par):
    # under sequence parallelism in bf16 each norm reads the residual as the graph made it (split by
    # tokens, no conversion): a value autograd never keeps, which the fused op keeps. Every such input is
    # counted among what the rank holds, at its bf16 bytes
    text = open("examples/llama_bf16_tp2.par").read().replace("layout {", "layout {\n" + "".join(
        f"    {module} : S(1)\n" for module in ("model.embed_tokens()", "model.layers.*.self_attn()",
                                              "model.layers.*.mlp()")))
    compiled = compile_par(text)
    assert "all-gather" in compiled.source and "reduce-scatter" in compiled.source  # sequence parallel
    fused = [s for s in compiled.program.statements if s.instruction.callee == "rt.rms_norm"]
    narrow = [s.instruction.args[0].name for s in fused if s.instruction.kwargs]
    assert len(narrow) == 5, [s.instruction for s in fused]
    held = {name: size for name, size, _, _ in compiled.program.held_for_backward()}
    values = compiled.program.values
    for name in narrow:
        assert name in compiled.program.inputs_kept or held.get(name) == \
            math.prod(values[name]["local_shape"]) * 2 and values[name]["dtype"] == "bfloat16", name
