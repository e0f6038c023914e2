"""The fused-rotary pass (pardsl/passes/fused_rotary.py): a rotary position embedding, seven ATen ops, runs as one
op of the runtime where its chain is local, with the chain's bits forward and backward; elsewhere the chain
stays as it was."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pardsl.runtime import kernels
from pardsl.compiler import compile_file
from pardsl.runtime.parallel_ops import Rotary

from .test_distributed import check, lines_calling

ROTATED = """\
mesh tp = 2
model tests.zoo:Rotated({arguments})
input x : float32[4, 6, 16]
layout {{
{layouts}}}
"""


def _chain(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@settings(max_examples=40, deadline=None)
@given(batch=st.lists(st.integers(1, 4), min_size=0, max_size=2), seq=st.integers(1, 6),
       half=st.integers(1, 8), table_dims=st.sampled_from(["whole", "broadcast", "seq only"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]), seed=st.integers(0, 2**16))
def test_the_fused_rotation_has_the_chains_bits_forward_and_backward(batch, seq, half, table_dims, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, seq, 2 * half, generator=generator).to(dtype).requires_grad_()
    # tables as models pass them: [1, …, seq, 2h] broadcast over batch and heads, or of x's own shape, or
    # one angle per position (last dim 1)
    table_shape = {"whole": x.shape, "broadcast": (1,) * len(batch) + (seq, 2 * half),
                   "seq only": (seq, 1)}[table_dims]
    cos = torch.randn(table_shape, generator=generator).to(dtype)
    sin = torch.randn(table_shape, generator=generator).to(dtype)
    grad = torch.randn(x.shape, generator=generator).to(dtype)
    fused = Rotary.apply(x, cos, sin)
    assert torch.equal(fused, _chain(x, cos, sin))
    (fused_grad,) = torch.autograd.grad(fused, x, grad)
    (chain_grad,) = torch.autograd.grad(_chain(x, cos, sin), x, grad)
    assert torch.equal(fused_grad, chain_grad)


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 3), heads=st.integers(1, 4), seq=st.integers(1, 6), half=st.integers(1, 8),
       projected=st.booleans(), tables=st.sampled_from(["seq", "broadcast", "per batch"]),
       dtype=st.sampled_from([torch.float32, torch.float64]), grad_projected=st.booleans(),
       seed=st.integers(0, 2**16))
def test_the_cpu_kernels_rotation_has_the_chains_bits_in_either_layout(batch, heads, seq, half, projected, tables,
                                                                       dtype, grad_projected, seed):
    generator = torch.Generator().manual_seed(seed)
    dim = 2 * half
    if projected:  # as attention makes it: a projection's [batch, seq, heads·dim] viewed as heads, transposed
        x = torch.randn(batch, seq, heads * dim, generator=generator, dtype=dtype).view(batch, seq, heads, dim)
        x = x.transpose(1, 2)
    else:
        x = torch.randn(batch, heads, seq, dim, generator=generator, dtype=dtype)
    x.requires_grad_()
    table_shape = {"seq": (seq, dim), "broadcast": (1, 1, seq, dim), "per batch": (batch, 1, seq, dim)}[tables]
    cos = torch.randn(table_shape, generator=generator, dtype=dtype)
    sin = torch.randn(table_shape, generator=generator, dtype=dtype)
    grad = torch.randn(batch, seq, heads, dim, generator=generator, dtype=dtype).transpose(1, 2) if grad_projected \
        else torch.randn(batch, heads, seq, dim, generator=generator, dtype=dtype)
    assert kernels.rotary_fits(x, cos, sin)
    fused = Rotary.apply(x, cos, sin)
    assert torch.equal(fused, _chain(x, cos, sin))
    for memory_order in (lambda t: t, lambda t: t.transpose(1, 2)):  # x's layout
        assert memory_order(fused).is_contiguous() == memory_order(x).is_contiguous()
    (fused_grad,) = torch.autograd.grad(fused, x, grad)
    (chain_grad,) = torch.autograd.grad(_chain(x, cos, sin), x, grad)
    assert torch.equal(fused_grad, chain_grad)


def test_rotations_the_kernel_does_not_fit_take_the_aten_ops():
    x, table = torch.randn(2, 3, 5, 8), torch.randn(5, 8)
    assert kernels.rotary_fits(x, table, table)
    assert not kernels.rotary_fits(x.bfloat16(), table.bfloat16(), table.bfloat16())  # half precision
    assert not kernels.rotary_fits(x[..., :7], table[:, :7], table[:, :7])  # no halves
    assert not kernels.rotary_fits(x, torch.randn(1, 3, 5, 8), table)  # a table per head
    assert not kernels.rotary_fits(x, torch.randn(5, 1), torch.randn(5, 1))  # one angle per position
    assert not kernels.rotary_fits(x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2), table, table)
    assert not kernels.rotary_fits(x[..., 0, :, :], table, table)  # not [batch, heads, seq, dim]
    assert not kernels.rotary_fits(x.to("meta"), table.to("meta"), table.to("meta"))  # not on a CPU


def test_learned_tables_get_autograds_gradients():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    cos = torch.randn(1, 1, 5, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    sin = torch.randn(5, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    grad = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=generator)
    fused = torch.autograd.grad(Rotary.apply(x, cos, sin), (x, cos, sin), grad)
    chain = torch.autograd.grad(_chain(x, cos, sin), (x, cos, sin), grad)
    for got, expected in zip(fused, chain):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(Rotary.apply, (x, cos, sin))


def test_hugging_face_llamas_rotations_are_fused_under_tensor_parallelism(pools):
    # 2 layers: each layer's query and key rotations, one op each; no cat of halves or neg left
    compiled = compile_file("examples/hf_llama_tp2.par")
    fused = lines_calling(compiled, "rt.rotary")
    assert len(fused) == 4 and "aten.neg.default(" not in compiled.source, fused
    check(pools, compiled)


def test_a_rotation_of_heads_split_over_ranks_is_fused_and_equals_serial(pools, compile_par):
    # the projection column-parallel: each rank rotates its own heads, each head's dim whole
    layouts = "    proj.weight : S(0)\n    proj.bias : S(0)\n    out.weight : S(1)\n"
    compiled = compile_par(ROTATED.format(arguments="", layouts=layouts))
    assert len(lines_calling(compiled, "rt.rotary")) == 1
    check(pools, compiled)


def test_a_rotation_with_learned_tables_is_fused_with_their_gradients_all_reduced(pools, compile_par):
    # data parallel: the tables' gradients, computed by the fused op, all-reduced as the chain's would be
    compiled = compile_par(ROTATED.format(arguments="learned=True", layouts="    x : S(0)\n"))
    assert len(lines_calling(compiled, "rt.rotary")) == 1
    check(pools, compiled)


def test_a_rotation_over_a_split_head_dim_is_left_as_its_ops_and_equals_serial(pools, compile_par):
    # one head, its dim split by the column-parallel projection: the halves the rotation swaps lie on
    # different ranks, so the chain keeps its ops (and the exchanges they need)
    layouts = "    proj.weight : S(0)\n    proj.bias : S(0)\n    out.weight : S(1)\n"
    compiled = compile_par(ROTATED.format(arguments="heads=1, head_dim=16", layouts=layouts))
    assert lines_calling(compiled, "rt.rotary") == [] and "aten.neg.default(" in compiled.source
    check(pools, compiled)
