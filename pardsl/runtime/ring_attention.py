"""Ring attention: scaled dot-product attention over a sequence split across ranks, without gathering it.

Each rank holds its chunk of the queries, keys and values. The key/value chunks travel around the ring
of ranks, one point-to-point send per step; at each step a rank attends its queries to the chunk it
holds, and folds the result into what it has with the log-sum-exp of each row (the online softmax of
flash attention). Under `is_causal`, a chunk from a later rank is skipped and the rank's own chunk takes
the causal mask; earlier chunks are attended in full. A mask tensor comes with the rank's query rows and
every key column (what a traced model builds): each step reads the columns of the chunk it holds.

Under a causal mask a plain split leaves the work uneven: the first rank's queries see only their own
chunk, the last rank's every chunk. Split zig-zag (`S(d, zigzag)`: rank r of n holds pieces r and
2n - 1 - r of 2n), every rank attends the same number of (piece, piece) blocks at every step, and each
step half of the pairs at most. Blocks run piece by piece: a pair is skipped where the causal order, or a
mask tensor that hides it whole, lets no query see a key of it (the mask is read once per call for that).

Backward goes around the ring again: with the forward's output and row log-sum-exps it recomputes each
block's probabilities and adds its share to the queries' gradient locally. The keys' and values' shares
a rank computes for the chunk it holds are added to that chunk's sum from the ranks before it, which
travels on to the next rank while the next step computes; one last send brings each chunk's sum home.

On CPU each block is torch's fused flash attention kernel (forward with its log-sum-exps, and its
backward given the whole output and log-sum-exps, which is exactly the block's share): no block's scores
are held. Elsewhere the blocks are computed in their reference form (the scores materialised).
Forward sends n - 1 messages (keys and values), backward 2n - 1 (the keys and values again, n - 1; the
sums of their gradients, n - 1, then home), counted as `send`s over the ring's innermost axis. Each
travels while a step computes (NCCL runs it on its own stream; gloo on its own threads): the keys and
values beside the step that reads them, a sum beside the step after the one that made it (as
ring-flash-attention passes them). Only the last send waits.
"""

from __future__ import annotations

import math

import torch

from pardsl.runtime.recompute import kept_by_itself


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal_diagonal: bool,
            mask: torch.Tensor | None) -> torch.Tensor:
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal_diagonal:
        rows, cols = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(rows, cols, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    return scores


def _part(mask: torch.Tensor | None, query_piece: int, local_pieces: int, key_piece: int,
          width: int) -> torch.Tensor | None:
    """The mask's block for a local query piece and a global key piece of `width` keys (all its rows where
    it broadcasts over queries, all its columns where over keys)."""
    if mask is None:
        return None
    if mask.shape[-2] > 1 and local_pieces > 1:
        rows = mask.shape[-2] // local_pieces
        mask = mask[..., query_piece * rows:(query_piece + 1) * rows, :]
    return mask if mask.shape[-1] == 1 else mask[..., key_piece * width:(key_piece + 1) * width]


def _expanded(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query keys or values, each head repeated for the query heads it serves."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=-3)


def _grouped(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of an expanded key or value, summed back over the query heads of its group."""
    if groups == 1:
        return grad
    *lead, heads, rows, width = grad.shape
    return grad.reshape(*lead, heads // groups, groups, rows, width).sum(-3)


def pieces(chunk: int, ranks: int, zigzag: bool) -> tuple[int, ...]:
    """The pieces of the sequence the rank at `chunk` of the ring holds, in its local order (their number:
    `ranks`, or 2 · `ranks` split zig-zag)."""
    return (chunk, 2 * ranks - 1 - chunk) if zigzag else (chunk,)


def block_plan(queries: tuple[int, ...], keys: tuple[int, ...], causal: bool,
               hidden: list[list[bool]] | None) -> list[tuple[int, int, bool]]:
    """The (query piece, key piece, with the causal diagonal) blocks a rank computes for the keys it holds
    at a step: its own pieces `queries` against `keys` (indices into them), leaving out those no query of
    the block may see: a later piece under `is_causal`, or one the mask hides whole (`hidden`, by local
    query piece and global key piece)."""
    plan = []
    for i, a in enumerate(queries):
        for j, b in enumerate(keys):
            if causal and b > a or hidden is not None and hidden[i][b]:
                continue
            plan.append((i, j, causal and a == b))
    return plan


def _hidden(mask: torch.Tensor | None, local_pieces: int, all_pieces: int) -> list[list[bool]] | None:
    """Per local query piece and global key piece, whether the mask hides every query of it from every key
    of it (so the block need not be computed); None where there is no mask, or it broadcasts over keys."""
    if mask is None or mask.shape[-1] == 1:
        return None
    seen = mask if mask.dtype == torch.bool else torch.isfinite(mask)
    rows, columns = seen.shape[-2:]
    pieces_of_rows = local_pieces if rows > 1 else 1
    seen = seen.reshape(-1, pieces_of_rows, rows // pieces_of_rows, all_pieces, columns // all_pieces)
    visible = seen.any(dim=4).any(dim=2).any(dim=0)  # [query piece, key piece]
    hidden = (~visible).tolist()
    return hidden if pieces_of_rows == local_pieces else hidden * local_pieces


def _finite(x: torch.Tensor) -> torch.Tensor:
    """-inf (a row no key of the block may see) as 0, where it would make exp(-inf - -inf) a NaN."""
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A mask as the fused kernel takes it: added to the scores, in the queries' dtype."""
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, diagonal: bool,
           mask: torch.Tensor | None, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention in float32 and its rows' log-sum-exps (-inf for a row the mask hides whole);
    `fused`: by the CPU's flash attention kernel, else in the reference form."""
    if fused:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
            q, k, v, 0.0, diagonal, attn_mask=_additive(mask, q.dtype), scale=scale)
        if mask is not None:  # the kernel gives a hidden row 0 where its log-sum-exp is -inf
            seen = (mask if mask.dtype == torch.bool else torch.isfinite(mask)).any(-1)
            lse = lse.masked_fill(~seen.expand(lse.shape), float("-inf"))
        return out.float(), lse.float()
    scores = _scores(q.float(), k.float(), scale, diagonal, mask)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - _finite(lse).unsqueeze(-1)) @ v.float(), lse


def _block_gradients(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, scale: float, diagonal: bool, mask: torch.Tensor | None,
                     fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of the queries', keys' and values' gradients (float32), given the whole output and
    its rows' log-sum-exps."""
    if fused:
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            grad, q, k, v, out, lse, 0.0, diagonal, attn_mask=_additive(mask, q.dtype), scale=scale)
        return tuple(g.float() for g in grads)
    qf, kf, vf, g = q.float(), k.float(), v.float(), grad.float()
    probs = torch.exp(_scores(qf, kf, scale, diagonal, mask) - _finite(lse).unsqueeze(-1))
    grad_scores = probs * (g @ vf.transpose(-1, -2) - (g * out.float()).sum(-1, keepdim=True))
    return (grad_scores @ kf) * scale, (grad_scores.transpose(-1, -2) @ qf) * scale, probs.transpose(-1, -2) @ g


def _rows(x: torch.Tensor, piece: int, count: int) -> torch.Tensor:
    """Piece `piece` of `count` along the rows (dim -2) of x: a view."""
    rows = x.shape[-2] // count
    return x.narrow(-2, piece * rows, rows)


def _row_values(x: torch.Tensor, piece: int, count: int) -> torch.Tensor:
    """Piece `piece` of `count` of a value per row (the last dim of x: the rows' log-sum-exps): a view."""
    rows = x.shape[-1] // count
    return x.narrow(-1, piece * rows, rows)


def _attended(q, k, v, mask, causal: bool, scale: float, rt, axes, zigzag: bool, hidden) -> tuple:
    """Ring attention's forward on this rank's queries: (out, its rows' log-sum-exp), the key/value chunks
    passed once around the ring."""
    ranks, chunk = math.prod(rt.size[a] for a in axes), rt._chunk(axes)
    groups = q.shape[-3] // k.shape[-3]
    own = pieces(chunk, ranks, zigzag)
    count = len(own)
    width = k.shape[-2] // count  # keys per piece
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    held = torch.cat([k, v], dim=-1)  # one message a step
    fused = q.device.type == "cpu"
    for step in range(ranks):
        source = (chunk - step) % ranks  # the keys held came from the rank `step` places before
        keys = pieces(source, ranks, zigzag)
        # the chunk travels on while this step's blocks are computed from it, which only read it
        coming = rt.ring_shift_started(held, axes, "forward") if step < ranks - 1 else None
        for i, j, diagonal in block_plan(own, keys, causal, hidden):
            kh, vh = _rows(held, j, count).split([k.shape[-1], v.shape[-1]], dim=-1)
            block, block_lse = _block(_rows(q, i, count), _expanded(kh, groups), _expanded(vh, groups), scale,
                                      diagonal, _part(mask, i, count, keys[j], width), fused)
            rows_out, rows_lse = _rows(out, i, count), _row_values(lse, i, count)
            merged = torch.logaddexp(rows_lse, block_lse)
            rows_out.copy_(rows_out * torch.exp(rows_lse - _finite(merged)).unsqueeze(-1) +
                           block * torch.exp(block_lse - _finite(merged)).unsqueeze(-1))
            rows_lse.copy_(merged)
        if coming is not None:
            held = coming()
    return out.to(q.dtype), lse


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale, rt, axes, zigzag):
        ranks = math.prod(rt.size[a] for a in axes)
        count = len(pieces(rt._chunk(axes), ranks, zigzag))  # this rank's pieces of the sequence
        hidden = _hidden(mask, count, count * ranks)
        # in a selective recomputed region, kept from the first run and given back in the second: the ring
        # is neither computed nor passed around again (pardsl/runtime/recompute.py)
        out, lse = kept_by_itself(rt, RingAttention, lambda: _attended(q, k, v, mask, causal, scale, rt, axes, zigzag,
                                                                        hidden))
        ctx.save_for_backward(q, k, v, out, lse, *([mask] if mask is not None else []))
        ctx.causal, ctx.scale, ctx.rt, ctx.axes, ctx.zigzag, ctx.hidden = causal, scale, rt, axes, zigzag, hidden
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, *mask = ctx.saved_tensors
        mask = mask[0] if mask else None
        rt, axes, causal, scale, zigzag = ctx.rt, ctx.axes, ctx.causal, ctx.scale, ctx.zigzag
        ranks, chunk = math.prod(rt.size[a] for a in axes), rt._chunk(axes)
        groups = q.shape[-3] // k.shape[-3]
        own = pieces(chunk, ranks, zigzag)
        count = len(own)
        width = k.shape[-2] // count
        grad = grad.contiguous()
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        d, e = k.shape[-1], v.shape[-1]
        held = torch.cat([k, v], dim=-1)  # the chunk held, as forward passed it
        fused = q.device.type == "cpu"
        travelling = None  # the gradients of the chunk held, as the ranks before this one have added them up
        for step in range(ranks):
            source = (chunk - step) % ranks
            keys = pieces(source, ranks, zigzag)
            # as forward: the chunk travels on while this step's blocks are computed from it
            coming = rt.ring_shift_started(held, axes, "backward") if step < ranks - 1 else None
            # this rank's share of the held chunk's gradients (float32), added to the travelling sum once
            # computed: the sum comes from the rank before while these blocks are computed
            share = torch.zeros((*k.shape[:-1], d + e), dtype=torch.float32, device=k.device)
            for i, j, diagonal in block_plan(own, keys, causal, ctx.hidden):
                kh, vh = _rows(held, j, count).split([d, e], dim=-1)
                block_q, block_k, block_v = _block_gradients(
                    _rows(grad, i, count), _rows(q, i, count), _expanded(kh, groups), _expanded(vh, groups),
                    _rows(out, i, count), _row_values(lse, i, count), scale, diagonal,
                    _part(mask, i, count, keys[j], width), fused)
                _rows(grad_q, i, count).add_(block_q)
                grad_k, grad_v = _rows(share, j, count).split([d, e], dim=-1)
                grad_k.add_(_grouped(block_k, groups))
                grad_v.add_(_grouped(block_v, groups))
            summed = share if travelling is None else travelling() + share
            # the sum goes on to the rank that holds this chunk next (at the last step: the chunk's own
            # rank) while the next step's blocks are computed
            travelling = rt.ring_shift_started(summed, axes, "backward")
            if coming is not None:
                held = coming()
        grads = travelling()
        grad_k, grad_v = grads.split([d, e], dim=-1)
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None, None, None
