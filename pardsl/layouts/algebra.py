"""Layouts (SBP): one placement per mesh axis, local shapes, and the conversions between them.

A dim split by several axes is chunked by those axes in mesh order, the first axis outermost: on a
`dp = 2, tp = 2` mesh, `[S(0), S(0)]` gives rank (i, j) chunk `2 * i + j` of dim 0. A conversion on one
axis is a plain collective only when that axis is the innermost one splitting the dims it touches, so a
multi-axis conversion is a sequence of one-axis steps in a legal order; `plan_conversion` finds the
cheapest such sequence.
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:  # the reorderings take tensors; the algebra itself needs no torch
    import torch


@dataclass(frozen=True, order=True)
class Placement:
    kind: str  # "S" split, "B" broadcast, "P" partial sum
    dim: int | None = None  # the split dim, for "S" (negative only as written, before binding)
    blocks: int = 1  # S(d, blocks=k): dim d is k equal blocks, each chunked over the axis
    # S(d, zigzag): two blocks, the second chunked in reverse rank order, so rank r of n holds chunks r and
    # 2n - 1 - r of the dim: under a causal mask every rank's queries see as many keys (ring attention)
    mirrored: bool = False
    # S(d, blocks=[4, 1, 1]): the blocks' sizes in proportion, where they differ (a fused q, k and v
    # projection under grouped-query attention); () where the blocks are equal
    sizes: tuple[int, ...] = ()

    def __post_init__(self):
        assert self.kind in ("S", "B", "P") and (self.kind == "S") == (self.dim is not None), self
        assert self.blocks >= 1 and (self.blocks == 1 or self.kind == "S"), self
        assert not self.mirrored or self.blocks == 2, self
        assert not self.sizes or (len(self.sizes) == self.blocks and not self.mirrored and
                                  len(set(self.sizes)) > 1 and math.gcd(*self.sizes) == 1), self

    @property
    def arrangement(self) -> tuple[int | tuple[int, ...], bool]:
        """How the split dim is cut into blocks: (blocks, mirrored), blocks the count of equal blocks or
        the sizes of unequal ones (`block_spec`); (1, False) for a plain split."""
        return (self.sizes or self.blocks), self.mirrored

    @property
    def units(self) -> int:
        """How many equal units the dim is cut into before each is split: the blocks, or their sizes' sum."""
        return sum(self.sizes) if self.sizes else self.blocks

    @property
    def is_split(self) -> bool:
        return self.kind == "S"

    def __str__(self) -> str:
        if self.kind != "S":
            return self.kind
        if self.mirrored:
            return f"S({self.dim}, zigzag)"
        if self.sizes:
            return f"S({self.dim}, blocks=[{', '.join(map(str, self.sizes))}])"
        return f"S({self.dim})" if self.blocks == 1 else f"S({self.dim}, blocks={self.blocks})"

    @staticmethod
    def parse(text: str) -> "Placement":
        text = text.strip()
        if text in ("B", "P"):
            return Placement(text)
        if text.startswith("S(") and text.endswith(")"):
            dim, _, blocks = text[2:-1].partition(",")
            if blocks.strip() == "zigzag":
                return zigzag(int(dim))
            if not blocks:
                return S(int(dim))
            count = blocks.split("=", 1)[1].strip()
            if count.startswith("[") and count.endswith("]"):
                return S(int(dim), tuple(int(size) for size in count[1:-1].split(",")))
            return S(int(dim), int(count))
        raise ValueError(f"not a placement: {text!r}")


B = Placement("B")
P = Placement("P")


def S(dim: int, blocks: int | tuple[int, ...] = 1, mirrored: bool = False) -> Placement:
    """A split of `dim`; `blocks` a count of equal blocks, or the sizes of blocks (any scale: sizes that are
    all equal are that many equal blocks)."""
    if isinstance(blocks, tuple):
        sizes = block_sizes(blocks)
        return Placement("S", dim, len(blocks), mirrored, () if len(set(sizes)) == 1 else sizes)
    return Placement("S", dim, blocks, mirrored)


def block_sizes(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Block sizes in lowest terms: (3072, 1024, 1024) → (3, 1, 1)."""
    divisor = math.gcd(*sizes)
    return tuple(size // divisor for size in sizes)


def block_spec_units(blocks: int | tuple[int, ...]) -> int:
    """A block spec's (an arrangement's first element's) units: its count, or its sizes' sum."""
    return sum(blocks) if isinstance(blocks, tuple) else blocks


def is_blocked(blocks: int | tuple[int, ...]) -> bool:
    return isinstance(blocks, tuple) or blocks > 1


def arrangement_order(arrangement: tuple) -> tuple:
    """A sort key for arrangements, plain first, then equal blocks by count, then unequal ones."""
    blocks, mirrored = arrangement
    return (isinstance(blocks, tuple), blocks if isinstance(blocks, int) else len(blocks), str(blocks), mirrored)


def zigzag(dim: int) -> Placement:
    return Placement("S", dim, 2, True)


@dataclass(frozen=True)
class Mesh:
    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.axis_sizes)

    @property
    def ndim(self) -> int:
        return len(self.axis_names)

    def axis_index(self, name: str) -> int:
        return self.axis_names.index(name)

    def axis_stride(self, axis: int) -> int:
        """How far apart in rank numbers the ranks of one group of `axis` are: the product of the sizes
        of the axes after it (row-major, the last axis innermost, as torch's DeviceMesh lays ranks out)."""
        return math.prod(self.axis_sizes[axis + 1:])

    def __str__(self) -> str:
        return ", ".join(f"{n} = {s}" for n, s in zip(self.axis_names, self.axis_sizes))

    def coordinates(self, rank: int) -> tuple[int, ...]:
        """Row-major: the last axis varies fastest."""
        coords = []
        for size in reversed(self.axis_sizes):
            coords.append(rank % size)
            rank //= size
        return tuple(reversed(coords))


@functools.lru_cache(maxsize=1 << 16)
def _fits(placements: tuple[Placement, ...], shape: tuple[int, ...], axis_sizes: tuple[int, ...]) -> bool:
    factor: dict[int, int] = {}
    blocks: dict[int, int] = {}
    splitters: dict[int, int] = {}
    for placement, size in zip(placements, axis_sizes):
        if placement.kind != "S":
            continue
        if placement.dim >= len(shape):
            return False
        factor[placement.dim] = factor.get(placement.dim, 1) * size
        blocks[placement.dim] = max(blocks.get(placement.dim, 1), placement.units)
        splitters[placement.dim] = splitters.get(placement.dim, 0) + 1
    return all(shape[d] % (f * blocks[d]) == 0 and (blocks[d] == 1 or splitters[d] == 1) for d, f in factor.items())


@functools.lru_cache(maxsize=1 << 16)
def _local_shape(placements: tuple[Placement, ...], shape: tuple[int, ...], axis_sizes: tuple[int, ...]) -> tuple[int, ...]:
    local = list(shape)
    for placement, size in zip(placements, axis_sizes):
        if placement.kind == "S" and placement.dim < len(local):
            local[placement.dim] //= size
    return tuple(local)


@dataclass(frozen=True, order=True)
class Layout:
    placements: tuple[Placement, ...]

    @staticmethod
    def broadcast(mesh: Mesh) -> "Layout":
        return Layout((B,) * mesh.ndim)

    def with_axis(self, axis: int, placement: Placement) -> "Layout":
        return Layout(self.placements[:axis] + (placement,) + self.placements[axis + 1 :])

    @property
    def has_partial(self) -> bool:
        return any(p.kind == "P" for p in self.placements)

    def axes_splitting(self, dim: int) -> tuple[int, ...]:
        return tuple(a for a, p in enumerate(self.placements) if p.kind == "S" and p.dim == dim)

    def split_factor(self, dim: int, mesh: Mesh) -> int:
        return math.prod(mesh.axis_sizes[a] for a in self.axes_splitting(dim))

    def blocks_of(self, dim: int) -> int:
        return max((p.blocks for p in self.placements if p.kind == "S" and p.dim == dim), default=1)

    def block_spec_of(self, dim: int) -> int | tuple[int, ...]:
        """The dim's blocks as the runtime takes them: a count of equal blocks, or unequal blocks' sizes."""
        return next((p.arrangement[0] for p in self.placements if p.kind == "S" and p.dim == dim and p.blocks > 1), 1)

    def units_of(self, dim: int) -> int:
        """What the dim's size must divide by beyond its split: its blocks, or unequal blocks' sizes' sum."""
        return max((p.units for p in self.placements if p.kind == "S" and p.dim == dim), default=1)

    def mirrored_dims(self) -> list[int]:
        return [p.dim for p in self.placements if p.kind == "S" and p.mirrored]

    def local_shape(self, shape: Iterable[int], mesh: Mesh) -> tuple[int, ...]:
        return _local_shape(self.placements, tuple(shape), mesh.axis_sizes)

    def indivisible_dims(self, shape: tuple[int, ...], mesh: Mesh) -> list[int]:
        return [d for d, size in enumerate(shape) if size % (self.split_factor(d, mesh) * self.units_of(d))]

    def blocks_on_shared_dims(self) -> list[int]:
        """Dims split in blocks by more than one axis (not supported: one axis splits a blocked dim)."""
        return [d for d in {p.dim for p in self.placements if p.kind == "S" and p.blocks > 1}
                if len(self.axes_splitting(d)) > 1]

    def out_of_range_dims(self, rank: int) -> list[int]:
        return [p.dim for p in self.placements if p.kind == "S" and p.dim >= rank]

    def fits(self, shape: tuple[int, ...], mesh: Mesh) -> bool:
        """Every split dim exists, divides by its split (times its blocks), and no blocked dim is split by
        more than one axis. Inference asks this for every candidate on every axis: one pass, cached."""
        return _fits(self.placements, tuple(shape), mesh.axis_sizes)

    def innermost_splitter(self, dim: int) -> int | None:
        axes = self.axes_splitting(dim)
        return axes[-1] if axes else None

    def render(self, mesh: Mesh) -> str:
        """`S(0)` on a one-axis mesh; `S(0)@dp, S(1)@tp` (B axes left out) on a larger one."""
        if mesh.ndim == 1:
            return str(self.placements[0])
        named = [f"{p}@{mesh.axis_names[a]}" for a, p in enumerate(self.placements) if p != B]
        return ", ".join(named) if named else "B"

    def key(self) -> tuple[str, ...]:
        """Plain strings, as the generated module and plan.json carry them."""
        return tuple(str(p) for p in self.placements)

    @staticmethod
    def from_key(key: Iterable[str]) -> "Layout":
        return Layout(tuple(Placement.parse(p) for p in key))


# ---------------------------------------------------------------------------------------------------
# Conversions


@dataclass(frozen=True)
class ConversionStep:
    """One collective (or local op) on one mesh axis, with its forward and backward bytes per rank."""

    kind: str  # all_reduce, reduce_scatter, all_gather, all_to_all, split, to_partial
    axis: int
    source: Layout
    target: Layout
    src_dim: int | None  # the dim the source is split on (all_gather, all_to_all)
    dst_dim: int | None  # the dim the target is split on (reduce_scatter, all_to_all, split)
    forward_bytes: int
    backward_bytes: int
    src_blocks: int | tuple[int, ...] = 1  # a count of equal blocks, or unequal blocks' sizes
    dst_blocks: int | tuple[int, ...] = 1
    src_mirrored: bool = False
    dst_mirrored: bool = False


@dataclass(frozen=True)
class Conversion:
    """One row of the conversion catalogue: a one-axis change of placement, the runtime
    function that makes it (`rt.<kind>(x, axis, **arguments)`), the collective its forward issues and the
    one its adjoint issues. Bytes per rank: `collective_bytes(forward, the source's local bytes)` and
    `collective_bytes(backward, the target's local bytes)` (the adjoint starts from the target's gradient).
    Inference prices, `plan_conversion` plans, lowering emits and counts, and the generated comments
    describe conversions from these rows alone."""

    source: str  # placement kind: S, B or P
    target: str
    kind: str  # the step, and the runtime method that performs it
    forward: str | None  # collective issued forward; None: local
    backward: str | None  # collective of the adjoint; None: identity or a local slice
    arguments: tuple[tuple[str, str], ...] = ()  # (keyword, ConversionStep field) of the runtime call


CONVERSIONS: dict[tuple[str, str], Conversion] = {(c.source, c.target): c for c in (
    Conversion("P", "B", "all_reduce", "all_reduce", None),  # adjoint: identity (P's gradient is full)
    Conversion("P", "S", "reduce_scatter", "reduce_scatter", "all_gather",
               (("dim", "dst_dim"), ("blocks", "dst_blocks"), ("mirrored", "dst_mirrored"))),
    # adjoint: this rank's slice, or a reduce-scatter where the gathered value's consumers are sharded
    Conversion("S", "B", "all_gather", "all_gather", None,
               (("dim", "src_dim"), ("blocks", "src_blocks"), ("mirrored", "src_mirrored"))),
    Conversion("S", "S", "all_to_all", "all_to_all", "all_to_all", (("split_dim", "dst_dim"), ("concat_dim", "src_dim"))),
    Conversion("B", "S", "split", None, "all_gather",
               (("dim", "dst_dim"), ("blocks", "dst_blocks"), ("mirrored", "dst_mirrored"))),
    Conversion("B", "P", "to_partial", None, None),  # adjoint: identity
)}
CONVERSION_OF_KIND = {c.kind: c for c in CONVERSIONS.values()}

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def collective_bytes(kind: str, local_bytes: int, n: int) -> int:
    """Bytes each rank sends for a collective over n ranks whose local input is local_bytes."""
    if n == 1:
        return 0
    if kind == "all_reduce":
        return 2 * local_bytes * (n - 1) // n
    if kind == "all_gather":
        return local_bytes * (n - 1)
    if kind in ("reduce_scatter", "all_to_all"):
        return local_bytes * (n - 1) // n
    if kind == "send":  # point to point: what one send carries
        return local_bytes
    return 0  # split, to_partial: local


def _one_axis_step(
    layout: Layout, axis: int, placement: Placement, shape: tuple[int, ...], itemsize: int, mesh: Mesh
) -> ConversionStep | None:
    current = layout.placements[axis]
    conversion = CONVERSIONS.get((current.kind, placement.kind))
    if conversion is None or current == placement:
        return None
    kind = conversion.kind
    target = layout.with_axis(axis, placement)
    # Only the innermost axis splitting a dim can gather or scatter it with one plain collective.
    if current.is_split and layout.innermost_splitter(current.dim) != axis:
        return None
    if placement.is_split and (target.innermost_splitter(placement.dim) != axis or not target.fits(shape, mesh)):
        return None
    if kind == "all_to_all" and (current.blocks > 1 or placement.blocks > 1):
        return None  # blocked splits go through B
    local_bytes = math.prod(layout.local_shape(shape, mesh)) * itemsize
    n = mesh.axis_sizes[axis]
    forward = collective_bytes(conversion.forward, local_bytes, n) if conversion.forward else 0
    backward_input = math.prod(target.local_shape(shape, mesh)) * itemsize
    backward = collective_bytes(conversion.backward, backward_input, n) if conversion.backward else 0
    return ConversionStep(
        kind,
        axis,
        layout,
        target,
        current.dim if current.is_split else None,
        placement.dim if placement.is_split else None,
        forward,
        backward,
        current.arrangement[0],
        placement.arrangement[0],
        current.mirrored,
        placement.mirrored,
    )


def plan_conversion(
    source: Layout,
    target: Layout,
    shape: tuple[int, ...],
    itemsize: int,
    mesh: Mesh,
    with_backward: bool = True,
    still: frozenset[int] = frozenset(),
) -> list[ConversionStep]:
    """The cheapest legal sequence of one-axis steps from source to target (Dijkstra over layouts).

    Cost is bytes per rank, forward plus backward when the value needs a gradient; ties go to fewer
    steps. Every layout reaches every other (gather innermost-first to all-B, then split outermost-first),
    so a plan always exists. `still`: axes no step may move on, where source and target agree on them (a
    pipeline's axis, whose ranks hold other stages: a detour through it would be cheaper in bytes, split
    there, reduced over a smaller share and gathered back, but those ranks run other layers).
    """
    if source == target:
        return []
    return list(_planned_conversion(source, target, tuple(shape), itemsize, mesh, with_backward,
                                    frozenset(a for a in still if source.placements[a] == target.placements[a])))


@functools.lru_cache(maxsize=1 << 16)
def _planned_conversion(source: Layout, target: Layout, shape: tuple[int, ...], itemsize: int, mesh: Mesh,
                        with_backward: bool, still: frozenset[int] = frozenset()) -> tuple[ConversionStep, ...]:
    """plan_conversion's search, once per question: a joint layout search prices every pair of a
    value's placements, and many values share a shape."""
    arrangements = {p.arrangement for p in (*source.placements, *target.placements) if p.is_split}
    candidates = (B, P) + tuple(S(d, k, mirrored) for d in range(len(shape))
                                for k, mirrored in sorted(arrangements | {(1, False)}, key=arrangement_order))
    axes = tuple(a for a in range(mesh.ndim) if a not in still)
    movable = len(axes)
    if len(candidates) ** mesh.ndim > _WHOLE_SEARCH_LAYOUTS:
        # Every layout of many axes is too many to search: only the axes whose placements differ move, and
        # those splitting a dim that one of them splits (their nesting decides who holds which chunk).
        moving = {a for a in axes if source.placements[a] != target.placements[a]}
        dims = {p.dim for a in moving for p in (source.placements[a], target.placements[a]) if p.is_split}
        moving |= {a for a in axes if any(p.is_split and p.dim in dims
                                          for p in (source.placements[a], target.placements[a]))}
        axes = tuple(sorted(moving))
    # Entries: (cost, steps, layout, push order, path); layouts are ordered, so ties are deterministic.
    frontier: list[tuple[int, int, Layout, int, list[ConversionStep]]] = [(0, 0, source, 0, [])]
    pushed = 0
    settled: set[Layout] = set()
    while frontier:
        cost, steps, layout, _, path = heapq.heappop(frontier)
        if layout == target:
            return tuple(path)
        if layout in settled:
            continue
        if len(settled) == _SETTLED_BEFORE_DIRECT and len(axes) < movable:
            direct = _through_broadcast(source, target, axes, shape, itemsize, mesh)
            if direct is not None:
                return direct
        settled.add(layout)
        for step in _steps_from(layout, candidates, shape, itemsize, mesh, axes):
            if step.target not in settled:
                step_cost = step.forward_bytes + (step.backward_bytes if with_backward else 0)
                pushed += 1
                heapq.heappush(frontier, (cost + step_cost, steps + 1, step.target, pushed, path + [step]))
    raise AssertionError(f"no conversion from {source} to {target} for shape {shape}")  # unreachable


# Above this many layouts of a value (placements per axis to the power of the axes), a conversion moves only
# the axes it must: a mesh of 10 axes has a million layouts of a matrix. Where even those are many, after
# this many layouts settled the conversion goes the way every conversion can: through B.
_WHOLE_SEARCH_LAYOUTS = 1 << 12
_SETTLED_BEFORE_DIRECT = 64


def _through_broadcast(source: Layout, target: Layout, axes: tuple[int, ...], shape: tuple[int, ...],
                       itemsize: int, mesh: Mesh) -> tuple[ConversionStep, ...] | None:
    """Source to B on `axes` innermost first, then B to target outermost first; None where a step of it
    is not legal (the search goes on instead)."""
    path, layout = [], source
    moves = [(a, B) for a in reversed(axes) if layout.placements[a] != B] + \
            [(a, target.placements[a]) for a in axes if target.placements[a] != B]
    for axis, placement in moves:
        step = _one_axis_step(layout, axis, placement, shape, itemsize, mesh)
        if step is None:
            return None
        path.append(step)
        layout = step.target
    return tuple(path) if layout == target else None


@functools.lru_cache(maxsize=1 << 16)
def _steps_from(layout: Layout, candidates: tuple[Placement, ...], shape: tuple[int, ...], itemsize: int,
                mesh: Mesh, axes: tuple[int, ...]) -> tuple[ConversionStep, ...]:
    """Every legal one-axis step out of a layout, on `axes`: plan_conversion's questions about one value
    meet the same layouts again and again (a search asks thousands of them)."""
    steps = (_one_axis_step(layout, axis, placement, shape, itemsize, mesh)
             for axis in axes for placement in candidates)
    return tuple(step for step in steps if step is not None)


def one_group_gather(steps: list[ConversionStep], mesh: Mesh) -> bool:
    """Whether a parameter's conversion is one all-gather over ranks, which lowering puts in a prefetched
    gather group (ZeRO's) rather than converting it where it is used."""
    return len(steps) == 1 and steps[0].kind == "all_gather" and mesh.axis_sizes[steps[0].axis] > 1


def step_collectives(step: ConversionStep, with_backward: bool = True) -> list[tuple[str, str, int]]:
    """A planned step's collectives from its row of the catalogue, as (phase, kind, bytes per rank); the
    adjoint's where the value needs a gradient."""
    conversion = CONVERSION_OF_KIND[step.kind]
    collectives = [("forward", conversion.forward, step.forward_bytes)] if conversion.forward else []
    if with_backward and conversion.backward:
        collectives.append(("backward", conversion.backward, step.backward_bytes))
    return collectives


def conversion_cost(steps: list[ConversionStep], with_backward: bool = True) -> int:
    return sum(s.forward_bytes + (s.backward_bytes if with_backward else 0) for s in steps)


# A dim split in blocks, as collectives move it: each rank's chunks of every block adjacent (rank-major),
# or the tensor's own order (block-major).


def collective_matmul_cut(shape: tuple[int, ...], whole_dim: int, ranks: int) -> tuple[int, int] | None:
    """How a collective matmul cuts a rank's value of `shape` into pieces, each piece's transfer beside
    another's product: (dim, pieces), along the first dim of two or more elements that is neither
    `whole_dim` (the collective's) nor the last (the product contracts or makes it), into as many pieces as
    the axis has `ranks`, at most that dim's size. None where no dim can be cut (a micro-batch of one
    sequence split by tokens). The runtime, the pass that writes the cut and the search that prices it all
    read it here, so that they cut alike."""
    if not shape:
        return None
    whole_dim %= len(shape)
    dim = next((d for d in range(len(shape) - 1) if d != whole_dim and shape[d] >= 2), None)
    return None if dim is None else (dim, min(ranks, shape[dim]))


def rank_major(moved: "torch.Tensor", n: int, blocks: int | tuple[int, ...], mirrored: bool = False) -> "torch.Tensor":
    """A dim (moved first) split over n ranks in `blocks` blocks, reordered so each rank's chunks of every
    block are adjacent: block-major [blocks, n, chunk] → rank-major [n, blocks, chunk]. `mirrored`: the odd
    blocks are chunked in reverse rank order (a zig-zag split). `blocks` may be unequal blocks' sizes."""
    if isinstance(blocks, tuple):
        import torch

        chunked = [block.reshape(n, -1, *moved.shape[1:]) for block in moved.split(block_lengths(moved.shape[0], blocks))]
        return torch.cat([torch.cat([block[r] for block in chunked]) for r in range(n)])
    if blocks == 1:
        return moved
    return _mirror_odd_blocks(moved.reshape(blocks, n, -1, *moved.shape[1:]), mirrored) \
        .transpose(0, 1).reshape(moved.shape)


def block_major(gathered: "torch.Tensor", n: int, blocks: int | tuple[int, ...], mirrored: bool = False) -> "torch.Tensor":
    """The inverse of `rank_major`: what an all-gather returns, rank by rank, back in block order."""
    if isinstance(blocks, tuple):
        import torch

        lengths = [length // n for length in block_lengths(gathered.shape[0], blocks)]
        by_rank = [held.split(lengths) for held in gathered.chunk(n)]
        return torch.cat([by_rank[r][b] for b in range(len(blocks)) for r in range(n)])
    if blocks == 1:
        return gathered
    by_block = gathered.reshape(n, blocks, -1, *gathered.shape[1:]).transpose(0, 1)
    return _mirror_odd_blocks(by_block, mirrored).reshape(gathered.shape)


def block_lengths(size: int, blocks: int | tuple[int, ...]) -> list[int]:
    """The lengths of a dim of `size` cut into `blocks`: equal ones, or in proportion to unequal sizes."""
    if isinstance(blocks, int):
        return [size // blocks] * blocks
    unit = size // sum(blocks)
    return [unit * b for b in blocks]


def _mirror_odd_blocks(chunks: "torch.Tensor", mirrored: bool) -> "torch.Tensor":
    """[blocks, n, ...] with the chunks of every odd block in reverse order where `mirrored` (its own
    inverse)."""
    if not mirrored:
        return chunks
    blocks, n = chunks.shape[:2]
    order = [b * n + chunk_of_block(b, i, n, True) for b in range(blocks) for i in range(n)]
    return chunks.reshape(blocks * n, *chunks.shape[2:])[order].reshape(chunks.shape)


def chunk_of_block(block: int, coordinate: int, n: int, mirrored: bool) -> int:
    """Which of a block's n chunks the rank at `coordinate` holds."""
    return n - 1 - coordinate if mirrored and block % 2 else coordinate


# Windows over a split dim (convolutions, pools): the rows of its neighbours a rank reads. The compiler offers
# the split with these (oprules), the runtime exchanges by them (Runtime.convolution_halo).


def per_dim(value, k: int, default=1) -> list[int]:
    """A window argument (an int, or one per spatial dim; left out or empty: the default) as one int per dim."""
    if value is None or (isinstance(value, (list, tuple)) and not value):
        value = default
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value] if len(value) == k else [int(value[0])] * k
    return [int(value)] * k


def halo_rows(kernel: int, stride: int, padding: int, dilation: int) -> tuple[int, int]:
    """The rows of its neighbours, before and after its own, that a rank's windows read where they tile
    the dim (rank r's first output reads from its first row less `padding`). The compiler offers the split
    with these; the runtime exchanges them."""
    return padding, dilation * (kernel - 1) - padding - stride + 1


def transposed_halo_rows(kernel: int, stride: int, padding: int, dilation: int) -> tuple[int, int]:
    """A transposed convolution's: the input rows before and after a rank's own whose contributions reach
    its output rows, each input row making `stride` of them."""
    reach = dilation * (kernel - 1)
    return (reach - padding) // stride, (padding - 1 + stride) // stride
