"""Fused CPU kernels for the runtime's fused ops, compiled with numba.

Eager, an op the runtime fuses (an RMSNorm's seven ATen ops) is still several passes over its
[tokens, hidden] activation, each reading and writing it whole: on a CPU the time goes to memory, not
arithmetic. A kernel here makes one pass per row, the row kept in cache between its reduction and its
elementwise part, as Megatron's fused norm kernels do on a GPU. On this machine a [4, 64, 512] RMSNorm's
forward and backward, autograd's node included, take 0.30 ms against 0.52 ms as ATen ops. In a training
step of examples/hf_llama_tp2.par on 2 gloo ranks the kernels take the step to 0.96 of the ATen ops' and
to 0.78 of the same fused ops compiled by torch.compile, whose call costs more than the ops at such sizes
(benchmarks/cpu_kernels.py; the figures in docs/compile.md).

What fits: CPU tensors of float32 or float64, of one dtype. Anything else (CUDA tensors, half precision,
a norm that casts) takes the ATen ops (`parallel_ops.RMSNorm`, `parallel_ops.Rotary`).

- RMSNorm: the sums are reassociated (numba's fastmath: reassoc, contract, nsz, arcp) so that they
  vectorise: the results are within rounding of the ATen ops', not their bits. Every rank runs the same
  kernel on the same values, so a value held whole on every rank stays identical across ranks. The
  weight's gradient is summed over rows in float64: a long sequence of float32 terms would otherwise lose
  digits.
- Rotary embedding: no fastmath, so each element is the chain's two products and one sum, its bits
  (`parallel_ops.Rotary` says why those are the chain's). x in either layout a projection leaves it in,
  [batch, heads, seq, dim] or its heads and seq swapped, and tables broadcast over heads; learned tables
  (which need gradients) take the ATen ops.

numba is imported and the kernels compiled on first use (cached on disk, `cache=True`), so `import pardsl`
stays fast and a process that never runs a fused norm on a CPU never loads it.
"""

from __future__ import annotations

import functools
import types

import torch

_DTYPES = (torch.float32, torch.float64)
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


def rms_norm_fits(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `rms_norm_forward` computes weight · (x · rsqrt(mean(x², -1) + eps)).to(dtype)."""
    return (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype in _DTYPES
            and x.dtype == weight.dtype == dtype and weight.dim() == 1 and x.dim() >= 1
            and x.shape[-1] == weight.shape[0] and _compiled() is not None)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the norm of x, x as rows [tokens, hidden], r = rsqrt(mean(x²) + eps) per row): the rows and r are
    what `rms_norm_backward` needs."""
    rows = x.detach().reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    r = torch.empty(rows.shape[0], dtype=rows.dtype)
    _compiled().forward(rows.numpy(), weight.detach().contiguous().numpy(), float(eps), out.numpy(), r.numpy())
    return out.view(x.shape), rows, r


def rms_norm_backward(grad: torch.Tensor, rows: torch.Tensor, r: torch.Tensor, weight: torch.Tensor,
                      needs_weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x's gradient, the weight's gradient or None), with n = x·r, m = g·w:
    gx = r·(m − n·mean(m·n)), gw = Σ over rows of g·n."""
    grad_rows = grad.reshape(rows.shape).contiguous()
    grad_x = torch.empty_like(rows)
    grad_weight = torch.zeros(rows.shape[1], dtype=torch.float64)
    _compiled().backward(grad_rows.numpy(), rows.numpy(), r.numpy(), weight.detach().contiguous().numpy(),
                         grad_x.numpy(), grad_weight.numpy(), needs_weight_grad)
    return grad_x.view(grad.shape), grad_weight.to(rows.dtype) if needs_weight_grad else None


def rotary_fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rotary_forward` computes x·cos + rotate_half(x)·sin: x [batch, heads, seq, dim], in one of
    the two layouts, the tables [seq, dim] or [1 or batch, 1, seq, dim], all of one float dtype on a CPU."""
    if not (x.dim() == 4 and x.device.type == "cpu" and x.dtype in _DTYPES and x.shape[-1] % 2 == 0
            and _seq_axis(x) is not None and _compiled() is not None):
        return False
    batch, _, seq, dim = x.shape
    return all(t.device.type == "cpu" and t.dtype == x.dtype
               and (tuple(t.shape) == (seq, dim) or (t.dim() == 4 and t.shape[0] in (1, batch) and t.shape[1] == 1
                                                     and tuple(t.shape[2:]) == (seq, dim)))
               for t in (cos, sin))


def rotary_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin, in x's layout."""
    return _rotated(x, cos, sin, transposed=False)


def rotary_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x's gradient: g·cos + rotate_halfᵀ(g·sin), in g's layout (or contiguous where it has neither)."""
    if _seq_axis(grad) is None:
        grad = grad.contiguous()
    return _rotated(grad, cos, sin, transposed=True)


def _seq_axis(x: torch.Tensor) -> int | None:
    """Where seq lies in x's memory: 2 where x is contiguous, 1 where it is [batch, seq, heads, dim] in
    memory (a projection's output viewed as heads and transposed); None otherwise."""
    if x.is_contiguous():
        return 2
    if x.transpose(1, 2).is_contiguous():
        return 1
    return None


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transposed: bool) -> torch.Tensor:
    seq_axis = _seq_axis(x)
    memory_order = x.detach() if seq_axis == 2 else x.detach().transpose(1, 2)
    out = torch.empty_like(memory_order)
    seq, dim = x.shape[-2:]
    tables = [t.detach().reshape(-1, seq, dim).contiguous().numpy() for t in (cos, sin)]
    _compiled().rotary(memory_order.numpy(), *tables, out.numpy(), seq_axis, transposed)
    return out if seq_axis == 2 else out.transpose(1, 2)


@functools.cache
def _compiled():
    """The compiled kernels (a namespace: the norm's `forward` and `backward`, and `rotary`), or None where
    numba is missing."""
    try:
        import numba
        import numpy as np
    except ImportError:
        return None

    def jit(**options):
        def compiled(function):
            try:
                return numba.njit(boundscheck=False, nogil=True, cache=True, **options)(function)
            except RuntimeError:  # nowhere numba may write its cache (a read-only install): compiled each run
                return numba.njit(boundscheck=False, nogil=True, **options)(function)
        return compiled

    @jit(fastmath=_FASTMATH)
    def forward(x, w, eps, out, r):
        rows, h = x.shape
        for i in range(rows):
            total = r.dtype.type(0.0)
            for j in range(h):
                total += x[i, j] * x[i, j]
            r[i] = 1.0 / np.sqrt(total / h + eps)
            ri = r[i]  # in x's dtype: the row's products below stay in it, and vectorise
            for j in range(h):
                out[i, j] = w[j] * (x[i, j] * ri)

    @jit(fastmath=_FASTMATH)
    def backward(g, x, r, w, gx, gw, weight_grad):
        rows, h = x.shape
        for i in range(rows):
            ri = r[i]
            dot = r.dtype.type(0.0)
            for j in range(h):
                n = x[i, j] * ri
                dot += g[i, j] * w[j] * n
                if weight_grad:
                    gw[j] += g[i, j] * n
            mean = r.dtype.type(dot / h)
            for j in range(h):
                gx[i, j] = (g[i, j] * w[j] - x[i, j] * ri * mean) * ri

    # x, out: [batch, p, q, dim] as in memory, seq being p or q (`seq_axis` 1 or 2); the tables
    # [1 or batch, seq, dim]. Each element is the chain's: a product plus (or minus) a product, no fma.
    # Backward (`transposed`), x is the gradient, rotated back: g₁·cos₁ + g₂·sin₂, g₂·cos₂ − g₁·sin₁.
    @jit()
    def rotary(x, cos, sin, out, seq_axis, transposed):
        batch, ps, qs, dim = x.shape
        h = dim // 2
        for b in range(batch):
            t = b if cos.shape[0] > 1 else 0
            for p in range(ps):
                for q in range(qs):
                    s = p if seq_axis == 1 else q
                    for d in range(h):
                        x1 = x[b, p, q, d]
                        x2 = x[b, p, q, d + h]
                        if transposed:
                            out[b, p, q, d] = x1 * cos[t, s, d] + x2 * sin[t, s, d + h]
                            out[b, p, q, d + h] = x2 * cos[t, s, d + h] - x1 * sin[t, s, d]
                        else:
                            out[b, p, q, d] = x1 * cos[t, s, d] - x2 * sin[t, s, d]
                            out[b, p, q, d + h] = x2 * cos[t, s, d + h] + x1 * sin[t, s, d + h]

    return types.SimpleNamespace(forward=forward, backward=backward, rotary=rotary)
