"""Checkpoint geometry: the boxes each rank holds under a layout (what it saves and what it reads)."""

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pardsl.runtime.checkpoint import local_regions, owns
from pardsl.layouts.algebra import B, Layout, Mesh, S


def reference_shard(full: torch.Tensor, layout: Layout, mesh: Mesh, coordinate) -> torch.Tensor:
    """A rank's local value by torch.chunk, axis by axis, as the runtime's `shard` defines it."""
    local = full
    for axis, placement in enumerate(layout.placements):
        if placement.mirrored:  # zig-zag: pieces r and 2n - 1 - r of 2n
            n, d, r = mesh.axis_sizes[axis], placement.dim, coordinate[axis]
            pieces = local.chunk(2 * n, dim=placement.dim)
            local = torch.cat([pieces[r], pieces[2 * n - 1 - r]], dim=d)
        elif placement.is_split:
            n, d = mesh.axis_sizes[axis], placement.dim
            unit = local.shape[d] // placement.units  # unequal blocks: that many units each
            lengths = [unit * size for size in placement.sizes] or [local.shape[d] // placement.blocks] * placement.blocks
            local = torch.cat([block.chunk(n, dim=d)[coordinate[axis]]
                               for block in local.split(lengths, dim=d)], dim=d)
    return local


@st.composite
def meshes_and_layouts(draw):
    axes = draw(st.integers(1, 2))
    sizes = tuple(draw(st.integers(1, 3)) for _ in range(axes))
    mesh = Mesh(tuple(f"a{i}" for i in range(axes)), sizes)
    rank = draw(st.integers(1, 3))
    placements, factors, split, blocked = [], [1] * rank, set(), set()
    for axis in range(axes):
        dim = draw(st.integers(-1, rank - 1))  # -1: B
        if dim < 0 or dim in blocked:  # a dim split in blocks is split by one axis (E056 otherwise)
            placements.append(B)
            continue
        # equal blocks, or unequal ones (q, k and v under grouped-query attention)
        blocks = draw(st.sampled_from([1, 1, 2, 3, (2, 1, 1), (1, 3)])) if dim not in split else 1
        mirrored = blocks == 2 and draw(st.booleans())  # S(d, zigzag)
        if blocks != 1:
            blocked.add(dim)
        split.add(dim)
        placement = S(dim, blocks, mirrored)
        placements.append(placement)
        factors[dim] *= sizes[axis] * placement.units
    shape = tuple(f * draw(st.integers(1, 2)) for f in factors)
    return mesh, Layout(tuple(placements)), shape


@settings(max_examples=150, deadline=None)
@given(meshes_and_layouts())
def test_regions_are_the_shard_and_owners_cover_every_element_once(case):
    mesh, layout, shape = case
    full = torch.arange(math.prod(shape)).reshape(shape)
    covered = torch.zeros(shape, dtype=torch.int64)
    for coordinate in itertools.product(*(range(n) for n in mesh.axis_sizes)):
        local = reference_shard(full, layout, mesh, coordinate)
        regions = local_regions(layout, shape, mesh, coordinate)
        assert sum(math.prod(r.sizes) for r in regions) == local.numel()
        for region in regions:
            box = tuple(slice(o, o + s) for o, s in zip(region.offsets, region.sizes))
            assert torch.equal(local[region.local_index()], full[box])
            if owns(layout, coordinate):
                covered[box] += 1
    assert bool((covered == 1).all())


def test_blocked_split_holds_its_chunk_of_every_block():
    mesh = Mesh(("tp",), (2,))
    regions = local_regions(Layout((S(0, 3),)), (12, 4), mesh, (1,))
    assert [(r.offsets, r.sizes, r.local_offsets) for r in regions] == [
        ((2, 0), (2, 4), (0, 0)), ((6, 0), (2, 4), (2, 0)), ((10, 0), (2, 4), (4, 0))]


def test_unequal_blocks_hold_their_chunk_of_every_block():
    # q of 8 rows, k and v of 2 each: rank 1 of 2 holds q's rows 4-7, k's row 9 and v's row 11
    mesh = Mesh(("tp",), (2,))
    regions = local_regions(Layout((S(0, (4, 1, 1)),)), (12, 4), mesh, (1,))
    assert [(r.offsets, r.sizes, r.local_offsets) for r in regions] == [
        ((4, 0), (4, 4), (0, 0)), ((9, 0), (1, 4), (4, 0)), ((11, 0), (1, 4), (5, 0))]
