"""Collective matmuls at run time: the column-parallel linears' gather and a row-parallel linear's
reduce-scatter done in pieces that overlap the products beside them (`chunks` of
`rt.column_parallel_linears` and `rt.linear_reduce_scatter`) give what the unchunked composition gives, its
gradients too, and count the same collectives; through the shared-memory transport and gloo's own, in a
recomputed region too (where they run unchunked)."""

from dataclasses import dataclass

import pytest
import torch

from pardsl.layouts.algebra import Mesh


def _pieces_issued(rt) -> dict:
    """Counts, by kind, of the transfers of pieces the runtime starts from now on (a collective done whole
    through the shared-memory transport starts none)."""
    issued = {"all_gather": 0, "reduce_scatter": 0}
    for kind in issued:
        uncounted = getattr(rt, f"_{kind}_uncounted")

        def counting(*args, kind=kind, uncounted=uncounted):
            issued[kind] += 1
            return uncounted(*args)
        setattr(rt, f"_{kind}_uncounted", counting)
    return issued


def _run(rt, step, inputs, grad):
    """step(*inputs)'s result, the inputs' gradients after backward from `grad` (one per result), and the
    collectives counted meanwhile."""
    rt.counter.reset()
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    results = step(*inputs)
    results = results if isinstance(results, tuple) else (results,)
    torch.autograd.backward(results, grad)
    return [r.detach() for r in results], [t.grad for t in inputs], rt.counter.summary()


@dataclass(frozen=True)
class CollectiveMatmuls:
    """Run on every rank, through the shared-memory transport or gloo's own: each step chunked
    (chunks = the number of ranks) against unchunked, outputs, gradients and counts compared; the
    number of pieces the chunked ones moved."""

    shared_memory: bool

    def __call__(self) -> dict:
        import torch.distributed as dist
        import torch.nn.functional as F

        from pardsl.runtime.core import Runtime

        n, rank = dist.get_world_size(), dist.get_rank()
        rt = Runtime(Mesh(("tp",), (n,)))
        if not self.shared_memory:
            rt.shared = {}
        generator = torch.Generator().manual_seed(rank)  # each rank's own shards and gradients
        pieces = {}

        def compare(name, chunked, unchunked, inputs, out_shapes):
            grad = [torch.randn(shape, generator=generator) for shape in out_shapes]
            expected = _run(rt, unchunked, inputs, grad)
            issued = _pieces_issued(rt)
            got = _run(rt, chunked, inputs, grad)
            del rt._all_gather_uncounted, rt._reduce_scatter_uncounted  # the class's again
            for want, have in zip(expected[0] + expected[1], got[0] + got[1]):
                torch.testing.assert_close(have, want)
            assert got[2] == expected[2], (name, got[2], expected[2])
            pieces[name] = (issued, got[2]["collectives"])

        # (1) Megatron-SP's g and two linears: x [batch, sequence, hidden], the sequence split (in two
        # blocks, zig-zag, too), cut along the batch; with the sequence first ([sequence, batch, hidden]),
        # cut along the batch, the second dim
        for blocks, mirrored in ((1, False), (2, True)):
            x = torch.randn(4, 2 * blocks, 8, generator=generator)
            linears = [torch.randn(3, 8, generator=generator), torch.randn(3, generator=generator),
                       torch.randn(2, 8, generator=generator), torch.randn(2, generator=generator)]

            def linears_of(chunks, gather_dim=1):
                return lambda x, w1, b1, w2, b2: rt.column_parallel_linears(
                    x, ("tp",), (w1, b1), (w2, b2), gather_dim=gather_dim, blocks=blocks, mirrored=mirrored,
                    chunks=chunks)
            shapes = [(4, 2 * blocks * n, 3), (4, 2 * blocks * n, 2)]
            compare(f"column, {blocks} block(s)", linears_of(n), linears_of(1), [x, *linears], shapes)
            sequence_first = x.transpose(0, 1).contiguous()
            compare(f"column, sequence first, {blocks} block(s)", linears_of(n, 0), linears_of(1, 0),
                    [sequence_first, *linears], [(2 * blocks * n, 4, 3), (2 * blocks * n, 4, 2)])

        x = torch.randn(4, 2, 8, generator=generator)
        weight = torch.randn(8, 3, generator=generator)  # x @ W: [in, out]
        compare("column, matmul", lambda x, w: rt.column_parallel_linears(x, ("tp",), (w, None), gather_dim=1,
                                                                           op="matmul", chunks=n),
                lambda x, w: rt.column_parallel_linears(x, ("tp",), (w, None), gather_dim=1, op="matmul"),
                [x, weight], [(4, 2 * n, 3)])

        # (2) a row-parallel linear's partial sums reduce-scattered along the sequence, x's hidden dim split
        for blocks, mirrored in ((1, False), (2, False), (2, True)):
            x = torch.randn(4, 2 * blocks * n, 5, generator=generator)
            weight = torch.randn(6, 5, generator=generator)
            compare(f"row, {blocks} block(s){', mirrored' if mirrored else ''}",
                    lambda x, w: rt.linear_reduce_scatter(x, w, "tp", 1, blocks, mirrored, chunks=n),
                    lambda x, w: rt.reduce_scatter(F.linear(x, w), "tp", 1, blocks, mirrored),
                    [x, weight], [(4, 2 * blocks, 6)])
        x = torch.randn(2 * n, 4, 5, generator=generator)
        weight = torch.randn(5, 6, generator=generator)
        compare("row, matmul, sequence first", lambda x, w: rt.linear_reduce_scatter(x, w, "tp", 0, op="matmul",
                                                                                     chunks=n),
                lambda x, w: rt.reduce_scatter(x @ w, "tp", 0), [x, weight], [(2, 4, 6)])
        # nothing to cut (tokens flattened, split on dim 0): unchunked
        x = torch.randn(2 * n, 5, generator=generator)
        compare("row, mm, nothing to cut", lambda x, w: rt.linear_reduce_scatter(x, w, "tp", 0, op="mm", chunks=n),
                lambda x, w: rt.reduce_scatter(torch.mm(x, w), "tp", 0), [x, weight], [(2, 6)])

        # in recomputed regions: as the unchunked step, counted the same (run again: counted in backward)
        x = torch.randn(4, 2 * n, 5, generator=generator)
        row_weight, column_weight = torch.randn(8, 5, generator=generator), torch.randn(3, 8, generator=generator)
        for policy in ("selective", "full"):
            def region_of(chunks, policy=policy):
                def region(x, w1, w2):
                    y = rt.linear_reduce_scatter(x, w1, "tp", 1, chunks=chunks)
                    return rt.column_parallel_linears(y, ("tp",), (w2, None), gather_dim=1, chunks=chunks)[0]
                return lambda x, w1, w2: rt.recompute(region, policy, x, w1, w2)
            compare(f"recomputed, {policy}", region_of(n), region_of(1), [x, row_weight, column_weight],
                    [(4, 2 * n, 3)])
        return pieces


@pytest.mark.parametrize("ranks", [2, 4])
def test_chunked_collective_matmuls_equal_the_unchunked_and_count_the_same(pools, ranks):
    for shared_memory in (True, False):
        reports = pools(ranks).run_on_every_rank(CollectiveMatmuls(shared_memory))
        issued = reports[0]
        once = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0, "all_to_all": 0}
        for blocks in (1, 2):
            # one piece per rank gathered forward, counted as the one all-gather of the unchunked step; its
            # backward unchanged: one reduce-scatter
            for name in (f"column, {blocks} block(s)", f"column, sequence first, {blocks} block(s)"):
                assert issued[name] == ({"all_gather": ranks, "reduce_scatter": 1},
                                        {"forward": {**once, "all_gather": 1},
                                         "backward": {**once, "reduce_scatter": 1}}), (name, issued[name])
        for name in ("row, 1 block(s)", "row, 2 block(s), mirrored", "row, matmul, sequence first"):
            assert issued[name] == ({"all_gather": ranks, "reduce_scatter": ranks},
                                    {"forward": {**once, "reduce_scatter": 1},
                                     "backward": {**once, "all_gather": 1}}), (name, issued[name])
        # nothing to cut: whole collectives (a whole gather through shared memory starts no piece)
        assert issued["row, mm, nothing to cut"][0] == {"all_gather": 0 if shared_memory else 1, "reduce_scatter": 1}
        # a selective region's forward unchunked: its reduce-scatter whole, and the column step's backward's
        assert issued["recomputed, selective"][0]["reduce_scatter"] == 2
