import pytest

from pardsl.layouts.algebra import B, P, S, Layout, Mesh, plan_conversion

TP = Mesh(("tp",), (4,))
MESH2 = Mesh(("dp", "tp"), (2, 2))


def test_local_shape_and_divisibility():
    assert Layout((S(1),)).local_shape((16, 1024), TP) == (16, 256)
    assert Layout((S(0), S(0))).local_shape((8, 6), MESH2) == (2, 6)
    assert Layout((S(0), S(1))).local_shape((8, 6), MESH2) == (4, 3)
    assert Layout((S(0),)).indivisible_dims((6, 4), TP) == [0]
    assert not Layout((S(0), S(0))).fits((6, 4), MESH2)  # 6 is not divisible by 2 × 2
    assert Layout((S(2),)).out_of_range_dims(2) == [2]


@pytest.mark.parametrize("source, target, kind, forward_bytes, backward_bytes", [
    # per-rank volumes: T = 4096 bytes of global tensor ([32, 32] float32) over n = 4 ranks
    (P, B, "all_reduce", 2 * 4096 * 3 // 4, 0),
    (P, S(0), "reduce_scatter", 4096 * 3 // 4, 4096 * 3 // 4),
    (S(0), B, "all_gather", 4096 * 3 // 4, 0),
    (S(0), S(1), "all_to_all", 4096 * 3 // 16, 4096 * 3 // 16),
    (B, S(0), "split", 0, 4096 * 3 // 4),
    (B, P, "to_partial", 0, 0),
])
def test_one_axis_conversions_move_the_bytes_of_the_design_table(source, target, kind, forward_bytes, backward_bytes):
    [step] = plan_conversion(Layout((source,)), Layout((target,)), (32, 32), 4, TP)
    assert (step.kind, step.forward_bytes, step.backward_bytes) == (kind, forward_bytes, backward_bytes)


def test_nested_split_gathers_the_inner_axis_first():
    steps = plan_conversion(Layout((S(0), S(0))), Layout((B, B)), (8, 8), 4, MESH2)
    assert [(s.kind, MESH2.axis_names[s.axis]) for s in steps] == [("all_gather", "tp"), ("all_gather", "dp")]


def test_nested_split_splits_the_outer_axis_first():
    steps = plan_conversion(Layout((B, B)), Layout((S(0), S(0))), (8, 8), 4, MESH2)
    assert [(s.kind, MESH2.axis_names[s.axis]) for s in steps] == [("split", "dp"), ("split", "tp")]


def test_cheapest_order_reduces_before_gathering():
    # P over dp on a tensor split over tp: all-reduce the small shard first, then gather.
    steps = plan_conversion(Layout((P, S(1))), Layout((B, B)), (8, 8), 4, MESH2)
    assert [s.kind for s in steps] == ["all_reduce", "all_gather"]
    assert sum(s.forward_bytes for s in steps) == 128 + 128


def test_every_pair_of_one_axis_layouts_has_a_plan():
    placements = [B, P, S(0), S(1)]
    for a in placements:
        for b in placements:
            for c in placements:
                for d in placements:
                    source, target = Layout((a, b)), Layout((c, d))
                    steps = plan_conversion(source, target, (8, 8), 4, MESH2)
                    layout = source
                    for step in steps:
                        assert step.source == layout
                        layout = step.target
                    assert layout == target


def test_render_and_keys():
    assert Layout((S(0),)).render(TP) == "S(0)"
    assert Layout((S(0), B)).render(MESH2) == "S(0)@dp"
    assert Layout.from_key(("S(1)", "P")) == Layout((S(1), P))


@pytest.mark.slow
def test_a_conversion_over_many_axes_moves_only_the_axes_whose_placements_differ_or_interact():
    """On seven axes a matrix has more layouts than the whole search takes (_WHOLE_SEARCH_LAYOUTS): the
    conversion then moves only the axes whose placements differ and those splitting the same dims, and
    still reaches the target from the source, step by legal step."""
    import random

    from pardsl.layouts import algebra

    mesh, shape = Mesh(tuple("abcdefg"), (2, 2, 1, 2, 1, 2, 1)), (8, 8)
    assert 4 ** mesh.ndim > algebra._WHOLE_SEARCH_LAYOUTS  # B, P, S(0), S(1) on every axis: restricted
    rng = random.Random(0)
    cases = []
    while len(cases) < 20:
        source, target = (Layout(tuple(rng.choice([B, P, S(0), S(1)]) for _ in range(7))) for _ in range(2))
        if source != target and not target.has_partial and source.fits(shape, mesh) and target.fits(shape, mesh):
            cases.append((source, target))
    for source, target in cases:
        steps = algebra._planned_conversion(source, target, shape, 4, mesh, True)
        assert steps[0].source == source and steps[-1].target == target
        assert all(a.target == b.source for a, b in zip(steps, steps[1:]))
        differ = {a for a in range(mesh.ndim) if source.placements[a] != target.placements[a]}
        dims = {p.dim for a in differ for p in (source.placements[a], target.placements[a]) if p.is_split}
        allowed = differ | {a for a in range(mesh.ndim) for p in (source.placements[a], target.placements[a])
                            if p.is_split and p.dim in dims}
        assert {step.axis for step in steps} <= allowed, (source, target)


def test_a_zigzag_split_reads_and_converts():
    """`S(d, zigzag)`: rank r of n holds pieces r and 2n - 1 - r of 2n. Written and read back; gathered by
    one all-gather (whose rank-by-rank result reorders into the tensor) and split locally; no all-to-all
    changes it (it goes through B)."""
    import torch

    from pardsl.layouts.algebra import Placement, block_major, rank_major, zigzag

    assert str(zigzag(1)) == "S(1, zigzag)" and Placement.parse("S(1, zigzag)") == zigzag(1)
    assert Layout.from_key(Layout((zigzag(0), B)).key()) == Layout((zigzag(0), B))
    mesh = Mesh(("cp",), (4,))
    assert Layout((zigzag(0),)).local_shape((16, 3), mesh) == (4, 3)
    full = torch.arange(16)
    shards = [torch.cat([full.chunk(8)[r], full.chunk(8)[7 - r]]) for r in range(4)]
    assert torch.equal(block_major(torch.cat(shards), 4, 2, mirrored=True), full)  # an all-gather's result
    assert all(torch.equal(chunk, shard) for chunk, shard in zip(rank_major(full, 4, 2, mirrored=True).chunk(4), shards))
    [gather] = plan_conversion(Layout((zigzag(0),)), Layout((B,)), (16, 3), 4, mesh)
    assert (gather.kind, gather.src_blocks, gather.src_mirrored) == ("all_gather", 2, True)
    to_plain = plan_conversion(Layout((zigzag(0),)), Layout((S(0),)), (16, 3), 4, mesh)
    assert [step.kind for step in to_plain] == ["all_gather", "split"]


def test_unequal_blocks_are_written_read_and_reordered_as_the_runtime_moves_them():
    """S(0, blocks=[4, 1, 1]): q, k and v of a fused projection under grouped-query attention, each split
    over the axis. It reads back from its key, sizes in lowest terms; equal sizes are equal blocks; a
    dim divides by its split times the sizes' sum. Each rank holds its chunk of every block, which an
    all-gather's result (rank by rank) reorders into the tensor, and a reduce-scatter's input comes from."""
    import torch

    from pardsl.layouts.algebra import Placement, block_major, rank_major

    q_k_v = S(0, (3072, 1024, 1024))
    assert q_k_v == S(0, (3, 1, 1)) and str(q_k_v) == "S(0, blocks=[3, 1, 1])"
    assert Placement.parse(str(q_k_v)) == q_k_v and S(0, (2, 2, 2)) == S(0, 3)
    assert Layout.from_key(Layout((q_k_v, B)).key()) == Layout((q_k_v, B))
    mesh = Mesh(("tp",), (2,))
    assert Layout((q_k_v,)).fits((10, 3), mesh) and not Layout((q_k_v,)).fits((12, 3), mesh)
    full = torch.arange(20)
    shards = [torch.cat([full[0:12].chunk(2)[r], full[12:16].chunk(2)[r], full[16:20].chunk(2)[r]]) for r in range(2)]
    assert torch.equal(block_major(torch.cat(shards), 2, (3, 1, 1)), full)
    assert all(torch.equal(chunk, shard) for chunk, shard in zip(rank_major(full, 2, (3, 1, 1)).chunk(2), shards))
    [gather] = plan_conversion(Layout((q_k_v,)), Layout((B,)), (20, 3), 4, mesh)
    assert (gather.kind, gather.src_blocks) == ("all_gather", (3, 1, 1))
    # the search's offers of several arrangements for one dim sort (a count and sizes do not compare)
    from pardsl.layouts.algebra import arrangement_order
    from pardsl.planning.search import _frozen

    offered = {(3, False), ((2, 1, 1), False), (2, True), (1, False)}
    assert sorted(offered, key=arrangement_order) == [(1, False), (2, True), (3, False), ((2, 1, 1), False)]
    assert _frozen({"n": offered}) == (("n", ((1, False), (2, True), (3, False), ((2, 1, 1), False))),)
