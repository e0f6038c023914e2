"""Which blocks of an attention mask hide every query from every key, found without building the mask.

A traced model builds its attention mask from positions: Hugging Face's causal mask is "key position ≤
query position", and'ed with whatever else the model asks (packed sequences, a sliding window, padding).
Ring attention skips a block of queries by keys that the mask hides whole, so pricing it needs to know
which blocks those are; but at a long sequence the mask is too large to build for that (131,072²
booleans). So the mask's ops are run on bounds instead. Every dim as long as the sequence is cut into
equal blocks, and a value holds, per block, the least and the greatest value any element of the block
may take (a boolean as 0 and 1). A block of the mask whose greatest value is false, or -inf for an
additive mask, is hidden whole.

The bounds are sound, not tight: a model input may take any value, and an op whose bounds are loose
(a cumulative sum) only leaves more blocks visible. An op not listed here, or a shape the blocks cannot
follow, gives no answer, and the attention is then priced as computing every block.
"""

from __future__ import annotations

import functools
import math
import weakref

import torch

# the most elements one value's bounds may hold (a mask's producers are positions and small tables)
_MOST_ELEMENTS = 1 << 20
# the most ops a mask may be made by: more, and it is made from the model's activations, not positions
_MOST_PRODUCERS = 400
# the most blocks the sequence is cut into
MOST_BLOCKS = 64


class _Unfollowed(Exception):
    """An op or a shape the bounds cannot follow."""


class _Bounds:
    """Per element of a value's blocked shape, the least and the greatest value it may take (float64)."""

    def __init__(self, lo: torch.Tensor, hi: torch.Tensor):
        # inf - inf and 0 * inf give nan: nothing is known there
        self.lo = torch.where(torch.isnan(lo), -math.inf, lo)
        self.hi = torch.where(torch.isnan(hi), math.inf, hi)

    @staticmethod
    def exactly(value) -> "_Bounds":
        value = torch.as_tensor(value, dtype=torch.float64)
        return _Bounds(value, value)

    def definitely(self) -> torch.Tensor:
        return self.lo > 0  # a boolean's bounds: true in every element

    def possibly(self) -> torch.Tensor:
        return self.hi > 0


# per mask, what it hides at a sequence length (every layer's attention reads the one mask)
_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def hidden_blocks(mask: torch.fx.Node, sequence: int) -> "HiddenBlocks | None":
    """Per query block and key block (the sequence cut into `blocks_of(sequence)` equal blocks), whether
    `mask`, an attention's mask of [..., sequence, sequence], hides every query of the block from every key
    of it; None where its ops cannot be followed, or it is not one row per query and column per key."""
    if not isinstance(mask, torch.fx.Node):
        return None
    found = _FOUND.setdefault(mask, {})
    if sequence not in found:
        found[sequence] = _hidden_blocks(mask, sequence)
    return found[sequence]


def _hidden_blocks(mask: torch.fx.Node, sequence: int) -> "HiddenBlocks | None":
    blocks = blocks_of(sequence)
    value = mask.meta.get("val")
    if blocks is None or not isinstance(value, torch.Tensor) or tuple(value.shape[-2:]) != (sequence, sequence):
        return None
    try:
        bounds = _Evaluation(sequence, blocks).run(mask)
        hidden = bounds.hi == (0 if value.dtype == torch.bool else -math.inf)
        return HiddenBlocks(map(tuple, hidden.reshape(-1, blocks, blocks).all(dim=0).tolist()))
    except Exception:  # noqa: BLE001 - an op or shape not followed (or followed wrong) only leaves the blocks unknown
        return None


class HiddenBlocks(tuple):
    """Per query block, per key block, whether a mask hides it whole: a tuple whose hash is kept (the
    search hashes the signatures that carry it, 64 x 64 of them)."""

    def __hash__(self) -> int:
        if "_hash" not in self.__dict__:
            self.__dict__["_hash"] = tuple.__hash__(self)
        return self.__dict__["_hash"]


def blocks_of(sequence: int) -> int | None:
    """The blocks a sequence is cut into: the most, up to MOST_BLOCKS, that divide it evenly in an even
    number (a zig-zag split pairs them)."""
    return next((b for b in range(min(sequence, MOST_BLOCKS), 1, -1) if b % 2 == 0 and sequence % b == 0), None)


@functools.lru_cache(maxsize=256)  # asked for each attention priced, of one mask and a few rank counts
def busiest_zigzag_share(hidden, ranks: int) -> float:
    """The busiest rank's share of its (query piece, key piece) pairs that `hidden` (per query block and
    key block) leaves to compute, the sequence split zig-zag over `ranks`: 2 x ranks pieces, rank r
    holding pieces r and 2 x ranks - 1 - r, every key piece passed around the ring. A pair is computed
    unless the mask hides each of its blocks; a piece that cuts a block counts the whole block."""
    count, pieces = len(hidden), 2 * ranks

    def blocks(piece: int) -> range:
        return range(piece * count // pieces, -(-(piece + 1) * count // pieces))

    computed = [[not all(hidden[q][k] for q in blocks(i) for k in blocks(j)) for j in range(pieces)]
                for i in range(pieces)]
    return max(sum(computed[r]) + sum(computed[pieces - 1 - r]) for r in range(ranks)) / (2 * pieces)


class _Evaluation:
    """A mask's producers run on bounds, every dim of `sequence` elements cut into `blocks`."""

    def __init__(self, sequence: int, blocks: int):
        self.sequence, self.blocks, self.block = sequence, blocks, sequence // blocks
        self.values: dict[torch.fx.Node, _Bounds] = {}

    def run(self, mask: torch.fx.Node) -> _Bounds:
        stack, seen = [(mask, False)], {mask}  # each producer evaluated after its own producers
        while stack:
            node, ready = stack.pop()
            if node in self.values:
                continue
            if ready:
                self.values[node] = self._evaluate(node)
                continue
            stack.append((node, True))
            stack.extend((source, False) for source in node.all_input_nodes if source not in self.values)
            seen.update(node.all_input_nodes)
            if len(seen) > _MOST_PRODUCERS:
                raise _Unfollowed
        return self.values[mask]

    # -- shapes

    def shape_of(self, full) -> tuple[int, ...]:
        shape = tuple(self.blocks if size == self.sequence else int(size) for size in full)
        if math.prod(shape) > _MOST_ELEMENTS:
            raise _Unfollowed
        return shape

    def _output(self, node: torch.fx.Node) -> torch.Tensor:
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            raise _Unfollowed
        return value

    def _arg(self, value) -> _Bounds:
        if isinstance(value, torch.fx.Node):
            return self.values[value]
        if isinstance(value, (bool, int, float)):
            return _Bounds.exactly(float(value))
        raise _Unfollowed

    def _full(self, node: torch.fx.Node, fill: float | None = None) -> _Bounds:
        """Bounds of the node's shape: `fill` everywhere, or whatever its dtype allows."""
        value = self._output(node)
        shape = self.shape_of(value.shape)
        if fill is not None:
            return _Bounds(torch.full(shape, float(fill), dtype=torch.float64),
                           torch.full(shape, float(fill), dtype=torch.float64))
        low, high = (0.0, 1.0) if value.dtype == torch.bool else (-math.inf, math.inf)
        return _Bounds(torch.full(shape, low, dtype=torch.float64), torch.full(shape, high, dtype=torch.float64))

    # -- ops

    def _evaluate(self, node: torch.fx.Node) -> _Bounds:
        value = self._output(node)
        shape = self.shape_of(value.shape)  # within the size allowed, before any bounds are made
        if node.op == "placeholder":  # an input, parameter or buffer: any value
            return self._full(node)
        handler = _OPS.get(node.target.overloadpacket.__name__) \
            if node.op == "call_function" and hasattr(node.target, "overloadpacket") else None
        if handler is None:
            raise _Unfollowed
        bounds = handler(self, node, *node.args, **node.kwargs)
        if tuple(bounds.lo.shape) != shape or tuple(bounds.hi.shape) != shape:
            raise _Unfollowed  # followed wrong: its bounds are not the value's blocks
        return _held_as(value.dtype, bounds.lo, bounds.hi)

    def arange(self, node, *args, **kwargs) -> _Bounds:
        start, end, step = (0, args[0], 1) if len(args) == 1 else (args + (1,))[:3]
        if not all(isinstance(x, (int, float)) for x in (start, end, step)):
            raise _Unfollowed
        length = self._output(node).shape[0]
        if length != self.sequence:
            return _Bounds.exactly(torch.arange(start, end, step, dtype=torch.float64))
        first = start + step * torch.arange(self.blocks, dtype=torch.float64) * self.block
        last = first + step * (self.block - 1)
        return _Bounds(torch.minimum(first, last), torch.maximum(first, last))

    def filled(self, node, *args, **kwargs) -> _Bounds:
        fills = {"ones": 1, "new_ones": 1, "ones_like": 1, "zeros": 0, "new_zeros": 0, "zeros_like": 0}
        name = node.target.overloadpacket.__name__
        fill = fills.get(name, kwargs.get("fill_value", args[-1] if args else None))
        if not isinstance(fill, (bool, int, float)):
            raise _Unfollowed
        return self._full(node, float(fill))

    def same(self, node, x, *args, **kwargs) -> _Bounds:
        """A copy or a change of dtype: the bounds as the new dtype holds them (_held_as, after every op)."""
        return self.values[x]

    def add(self, node, a, b, *, alpha=1) -> _Bounds:
        a, b = self._arg(a), self._arg(b)
        if alpha != 1:
            b = _scaled(b, alpha)
        return _Bounds(a.lo + b.lo, a.hi + b.hi)

    def sub(self, node, a, b, *, alpha=1) -> _Bounds:
        a, b = self._arg(a), _scaled(self._arg(b), -alpha)
        return _Bounds(a.lo + b.lo, a.hi + b.hi)

    def rsub(self, node, a, b, *, alpha=1) -> _Bounds:
        return self.sub(node, b, a, alpha=alpha)

    def mul(self, node, a, b) -> _Bounds:
        a, b = self._arg(a), self._arg(b)
        corners = torch.stack(torch.broadcast_tensors(a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi))
        if torch.isnan(corners).any():
            raise _Unfollowed
        return _Bounds(corners.amin(0), corners.amax(0))

    def neg(self, node, x) -> _Bounds:
        x = self.values[x]
        return _Bounds(-x.hi, -x.lo)

    def compare(self, node, a, b) -> _Bounds:
        # a float whose bounds are every value may be NaN, which compares false (and `ne` true)
        nan = torch.zeros((), dtype=torch.bool)
        for operand in (a, b):
            if isinstance(operand, torch.fx.Node) and self._output(operand).dtype.is_floating_point:
                bounds = self.values[operand]
                nan = nan | ((bounds.lo == -math.inf) & (bounds.hi == math.inf))
        a, b = self._arg(a), self._arg(b)
        name = node.target.overloadpacket.__name__
        if name in ("ge", "gt"):  # a >= b is b <= a
            a, b, name = b, a, {"ge": "le", "gt": "lt"}[name]
        if name == "le":
            always, never = a.hi <= b.lo, a.lo > b.hi
        elif name == "lt":
            always, never = a.hi < b.lo, a.lo >= b.hi
        else:
            always = (a.lo == a.hi) & (b.lo == b.hi) & (a.lo == b.lo)
            never = (a.hi < b.lo) | (b.hi < a.lo)
            if name == "ne":
                always, never = never, always
        if name == "ne":
            never = never & ~nan
        else:
            always = always & ~nan
        return _Bounds(always.double(), (~never).double())

    def both(self, node, a, b) -> _Bounds:
        a, b = self._arg(a), self._arg(b)
        _booleans(node, a, b)
        return _Bounds(torch.minimum(a.lo, b.lo), torch.minimum(a.hi, b.hi))

    def either(self, node, a, b) -> _Bounds:
        a, b = self._arg(a), self._arg(b)
        _booleans(node, a, b)
        return _Bounds(torch.maximum(a.lo, b.lo), torch.maximum(a.hi, b.hi))

    def negated(self, node, x) -> _Bounds:
        x = self.values[x]
        _booleans(node, x)
        return _Bounds(1 - x.hi, 1 - x.lo)

    def where(self, node, condition, a, b) -> _Bounds:
        condition, a, b = self.values[condition], self._arg(a), self._arg(b)
        chosen = torch.where(condition.definitely(), 1, torch.where(condition.possibly(), 0, -1))
        lo = torch.where(chosen > 0, a.lo, torch.where(chosen < 0, b.lo, torch.minimum(a.lo, b.lo)))
        hi = torch.where(chosen > 0, a.hi, torch.where(chosen < 0, b.hi, torch.maximum(a.hi, b.hi)))
        return _Bounds(lo, hi)

    def masked_fill(self, node, x, condition, value) -> _Bounds:
        return self.where(node, condition, value, x)

    def reshaped(self, node, x, *args, **kwargs) -> _Bounds:
        """unsqueeze, squeeze, view, reshape: only where they add or take away dims of one element."""
        if getattr(node.target, "_overloadname", "") == "dtype":  # view(dtype): the bits read as another dtype
            raise _Unfollowed
        before, after = self._output(x).shape, self._output(node).shape
        if [s for s in before if s != 1] != [s for s in after if s != 1]:
            raise _Unfollowed
        x, shape = self.values[x], self.shape_of(after)
        return _Bounds(x.lo.reshape(shape), x.hi.reshape(shape))

    def expand(self, node, x, *args, **kwargs) -> _Bounds:
        x, shape = self.values[x], self.shape_of(self._output(node).shape)
        try:
            return _Bounds(x.lo.expand(shape), x.hi.expand(shape))
        except RuntimeError:
            raise _Unfollowed from None

    def permute(self, node, x, dims) -> _Bounds:
        x = self.values[x]
        return _Bounds(x.lo.permute(dims), x.hi.permute(dims))

    def transpose(self, node, x, a, b) -> _Bounds:
        x = self.values[x]
        return _Bounds(x.lo.transpose(a, b), x.hi.transpose(a, b))

    def slice(self, node, x, dim=0, start=None, end=None, step=1) -> _Bounds:
        size = self._output(x).shape[dim]
        positions = range(size)[slice(start, end, step)]
        bounds = self.values[x]
        if positions == range(size):
            return bounds
        if len(positions) == self.sequence:
            raise _Unfollowed  # a longer dim cut to the sequence's length: its blocks would not be whole
        at = torch.tensor(positions, dtype=torch.long)
        if size == self.sequence:
            at = at // self.block
        return _Bounds(bounds.lo.index_select(dim, at), bounds.hi.index_select(dim, at))

    def select(self, node, x, dim, index) -> _Bounds:
        size = self._output(x).shape[dim]
        index = index % size
        if size == self.sequence:
            index //= self.block
        bounds = self.values[x]
        return _Bounds(bounds.lo.select(dim, index), bounds.hi.select(dim, index))

    def index(self, node, x, indices) -> _Bounds:
        """x[i, j, ...] with index tensors: where each index's bounds fall in one element (or block) of x."""
        full, bounds = self._output(x).shape, self.values[x]
        if any(i is None for i in indices):
            raise _Unfollowed
        positions = []
        for dim, index in enumerate(indices):
            index = self.values[index]
            if not (torch.isfinite(index.lo).all() and (index.lo >= 0).all() and (index.hi < full[dim]).all()):
                raise _Unfollowed
            lo, hi = index.lo.long(), index.hi.long()
            if full[dim] == self.sequence:
                lo, hi = lo // self.block, hi // self.block
            if not torch.equal(lo, hi):
                raise _Unfollowed
            positions.append(lo)
        positions = tuple(torch.broadcast_tensors(*positions))
        return _Bounds(bounds.lo[positions], bounds.hi[positions])

    def diff(self, node, x, n=1, dim=-1, prepend=None, append=None) -> _Bounds:
        """x[i] - x[i - 1] along dim, x preceded by `prepend`: in a block, an element's predecessor is in
        the block or the one before it."""
        full = self._output(x).shape
        dim %= len(full)
        if n != 1 or append is not None or prepend is None or self._output(prepend).shape[dim] != 1:
            raise _Unfollowed
        x, before = self.values[x], self.values[prepend]
        if full[dim] == self.sequence:  # a block's predecessors: the block before it and itself
            previous_lo = torch.cat([before.lo.expand_as(x.lo.narrow(dim, 0, 1)), x.lo.narrow(dim, 0, self.blocks - 1)], dim)
            previous_hi = torch.cat([before.hi.expand_as(x.hi.narrow(dim, 0, 1)), x.hi.narrow(dim, 0, self.blocks - 1)], dim)
            previous_lo, previous_hi = torch.minimum(previous_lo, x.lo), torch.maximum(previous_hi, x.hi)
        else:
            lo, hi = torch.cat([before.lo, x.lo], dim), torch.cat([before.hi, x.hi], dim)
            previous_lo, previous_hi = lo.narrow(dim, 0, full[dim]), hi.narrow(dim, 0, full[dim])
        return _Bounds(x.lo - previous_hi, x.hi - previous_lo)

    def cumsum(self, node, x, dim, *args, **kwargs) -> _Bounds:
        """Running sums: along a blocked dim, the whole blocks before an element's and from one to all of
        its own block's elements."""
        full = self._output(x).shape
        dim %= len(full)
        x = self.values[x]
        if full[dim] != self.sequence:
            return _Bounds(x.lo.cumsum(dim), x.hi.cumsum(dim))
        whole_lo, whole_hi = x.lo * self.block, x.hi * self.block
        before_lo = whole_lo.cumsum(dim) - whole_lo
        before_hi = whole_hi.cumsum(dim) - whole_hi
        return _Bounds(before_lo + torch.minimum(x.lo, whole_lo), before_hi + torch.maximum(x.hi, whole_hi))


def _held_as(dtype: torch.dtype, lo: torch.Tensor, hi: torch.Tensor) -> _Bounds:
    """Bounds as a value of `dtype` holds them: a boolean true where it cannot be 0 (bool addition is
    `or`, a diff of booleans `xor`); an integer rounded outward, refused where it may overflow; a float
    widened by its rounding, beyond its largest value infinite."""
    if dtype == torch.bool:
        return _Bounds(((lo > 0) | (hi < 0)).double(), ((lo != 0) | (hi != 0)).double())
    if not dtype.is_floating_point:
        lo, hi = torch.floor(lo), torch.ceil(hi)
        info = torch.iinfo(dtype)
        finite = torch.cat([lo[torch.isfinite(lo)], hi[torch.isfinite(hi)]])
        if not dtype.is_signed or (finite.numel() and (finite.min() < info.min or finite.max() > info.max)):
            raise _Unfollowed  # a value that wraps around
        return _Bounds(lo, hi)
    info = torch.finfo(dtype)
    lo = torch.where(torch.isfinite(lo), lo - lo.abs() * info.eps, lo)
    hi = torch.where(torch.isfinite(hi), hi + hi.abs() * info.eps, hi)
    return _Bounds(torch.where(lo < -info.max, -math.inf, lo), torch.where(hi > info.max, math.inf, hi))


def _scaled(bounds: _Bounds, factor: float) -> _Bounds:
    lo, hi = bounds.lo * factor, bounds.hi * factor
    return _Bounds(torch.minimum(lo, hi), torch.maximum(lo, hi))


def _booleans(node: torch.fx.Node, *operands: _Bounds) -> None:
    """Logical ops are followed on booleans only (a bitwise and of integers has other bounds)."""
    if node.meta["val"].dtype != torch.bool or any(((b.lo != 0) & (b.lo != 1)).any() or ((b.hi != 0) & (b.hi != 1)).any()
                                                   for b in operands):
        raise _Unfollowed


_OPS = {
    "arange": _Evaluation.arange,
    **dict.fromkeys(("ones", "new_ones", "ones_like", "zeros", "new_zeros", "zeros_like", "full", "new_full",
                     "full_like", "scalar_tensor"), _Evaluation.filled),
    **dict.fromkeys(("to", "_to_copy", "clone", "alias", "detach", "lift_fresh_copy", "contiguous", "type_as"),
                    _Evaluation.same),
    "add": _Evaluation.add, "sub": _Evaluation.sub, "rsub": _Evaluation.rsub, "mul": _Evaluation.mul,
    "neg": _Evaluation.neg,
    **dict.fromkeys(("le", "lt", "ge", "gt", "eq", "ne"), _Evaluation.compare),
    **dict.fromkeys(("__and__", "bitwise_and", "logical_and"), _Evaluation.both),
    **dict.fromkeys(("__or__", "bitwise_or", "logical_or"), _Evaluation.either),
    **dict.fromkeys(("logical_not", "bitwise_not", "__invert__"), _Evaluation.negated),
    "where": _Evaluation.where, "masked_fill": _Evaluation.masked_fill,
    **dict.fromkeys(("unsqueeze", "squeeze", "view", "reshape", "_unsafe_view"), _Evaluation.reshaped),
    "expand": _Evaluation.expand, "permute": _Evaluation.permute, "transpose": _Evaluation.transpose,
    "slice": _Evaluation.slice, "select": _Evaluation.select, "index": _Evaluation.index,
    "diff": _Evaluation.diff, "cumsum": _Evaluation.cumsum,
}
