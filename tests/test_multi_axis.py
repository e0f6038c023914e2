"""Multi-axis meshes: every conversion pair round-trips, data × tensor, ZeRO-3 and sequence parallelism
run at their theoretical cost, and random per-axis layouts on 2 × 2 meshes equal serial."""

import itertools
import math
import re
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pardsl.planning import cost
from pardsl.compiler import compile_file
from pardsl.layouts.algebra import CONVERSION_OF_KIND, B, P, S, Layout, Mesh, collective_bytes, plan_conversion
from pardsl.runtime.collectives import EXCHANGE_MAX_BYTES

from .figures import ROUND_GLOO
from .test_distributed import check


@dataclass(frozen=True)
class ConversionRoundTrip:
    """Run on every rank: shard a tensor in layout A, convert it to B with the runtime's collectives in
    the planned order, and compare the value (forward) and the gradient that comes back (backward) with
    the shards of the serial ones; the collectives the runtime counts must be the catalogue's (a
    mismatch reports an infinite backward error)."""

    mesh: Mesh
    shape: tuple[int, ...]
    pairs: tuple[tuple[Layout, Layout], ...]

    def __call__(self) -> list[tuple[str, str, float, float]]:
        from pardsl.program.lowering import step_call
        from pardsl.runtime.core import Runtime

        rt = Runtime(self.mesh)
        full = torch.randn(self.shape, generator=torch.Generator().manual_seed(0))
        seed = torch.randn(self.shape, generator=torch.Generator().manual_seed(1))
        results = []
        for source, target in self.pairs:
            local = rt.shard(full, source).detach().clone().requires_grad_()
            value = local
            rt.counter.reset()
            catalogued = {"forward": Counter(), "backward": Counter()}
            for step in plan_conversion(source, target, self.shape, 4, self.mesh):
                method, kwargs = step_call(step)
                value = getattr(rt, method)(value, self.mesh.axis_names[step.axis], **kwargs)
                conversion = CONVERSION_OF_KIND[step.kind]
                catalogued["forward"].update([conversion.forward] if conversion.forward else [])
                catalogued["backward"].update([conversion.backward] if conversion.backward else [])
            got = rt.unshard(value, target) if target.has_partial else value
            expected = full if target.has_partial else rt.shard(full, target)
            forward_err = (got - expected).abs().max().item()
            value.backward(rt.shard(seed, _gradient_layout(target)))
            backward_err = (local.grad - rt.shard(seed, _gradient_layout(source))).abs().max().item()
            # what the runtime counted is what the conversion catalogue says each step issues
            counted = all(+rt.counter.counts[phase] == +catalogued[phase] for phase in catalogued)
            results.append((str(source.placements), str(target.placements), forward_err,
                            backward_err if counted else float("inf")))
        return results


@dataclass(frozen=True)
class ReduceScatterAgainstGloo:
    """Run on every rank: the runtime's reduce-scatter (on gloo an all-to-all and a local sum) against
    gloo's own `reduce_scatter_single`, along each dim, in one block and in two. (ZeRO-3's gradient
    buckets take the same path, flat: the ZeRO-3 tests run them equal to serial.)"""

    mesh: Mesh

    def __call__(self) -> dict:
        import torch.distributed as dist

        from pardsl.runtime.core import Runtime

        rt = Runtime(self.mesh)
        rt.shared = {}  # gloo's path, as between hosts (through shared memory: tests/test_shared_memory.py)
        n = self.mesh.size
        errors = {}
        sent = []  # per all-to-all: (elements sent to the other ranks, elements sent to this rank itself)
        all_to_all = dist.all_to_all_single

        def recorded(out, data, out_splits=None, in_splits=None, **kwargs):
            to_itself = in_splits[dist.get_rank()] if in_splits else data.numel() // n
            sent.append((data.numel() - to_itself, to_itself, out.data_ptr()))
            return all_to_all(out, data, out_splits, in_splits, **kwargs)

        dist.all_to_all_single = recorded
        try:
            self.reduce_scatter_each_way(rt, n, errors, sent)
        finally:
            dist.all_to_all_single = all_to_all
        return {"by_all_to_all": rt.by_all_to_all, "errors": errors}

    @staticmethod
    def reduce_scatter_each_way(rt, n: int, errors: dict, sent: list) -> None:
        import torch.distributed as dist

        from pardsl.layouts.algebra import rank_major

        for dim, blocks in itertools.product(range(3), (1, 2)):
            shape = [3, 5, 7]
            shape[dim] = 2 * n * blocks
            x = torch.randn(shape, generator=torch.Generator().manual_seed(dist.get_rank() * 10 + dim))
            rt.counter.reset()
            sent.clear()
            got = rt._reduce_scatter(x, "tp", dim, "forward", blocks)
            summed_where_received = got.data_ptr() in [out for _, _, out in sent]
            moved = rank_major(x.movedim(dim, 0), n, blocks).contiguous()
            expected = torch.empty((moved.shape[0] // n, *moved.shape[1:]))
            dist.reduce_scatter_single(expected, moved)
            expected = expected.movedim(0, dim)
            share = moved.numel() * (n - 1) // n  # what a ring sends of it
            errors[(dim, blocks)] = ((got - expected).abs().max().item(), tuple(got.shape) == tuple(expected.shape),
                                     got.is_contiguous(), dict(+rt.counter.counts["forward"]),
                                     [(others == share, to_itself) for others, to_itself, _ in sent],
                                     summed_where_received)


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_reduce_scatter_on_gloo_is_an_all_to_all_and_a_sum_equal_to_gloos_own(pools, ranks):
    # gloo's reduce-scatter all-reduces the whole input: 2 to 8 times slower here than the all-to-all
    for rank in pools(ranks).run_on_every_rank(ReduceScatterAgainstGloo(Mesh(("tp",), (ranks,)))):
        assert rank["by_all_to_all"]
        for (dim, blocks), (error, same_shape, contiguous, counted, sent, summed_where_received) in rank["errors"].items():
            assert error < 1e-5 and same_shape and contiguous, (dim, blocks, error)
            assert counted == {"reduce_scatter": 1}, counted  # counted as what it is: one reduce-scatter
            assert len(sent) == 1 and sent[0][0], sent  # one all-to-all; to other ranks, their chunks
            if ranks == 2:  # and nothing through gloo to itself: its own chunk is added where the other's came
                # (a sum along dim 0 is returned there; along another, made contiguous as the serial value was)
                assert sent[0][1] == 0 and (summed_where_received or dim > 0), (sent, summed_where_received)


@dataclass(frozen=True)
class AllReduceAndAllGatherAgainstGloo:
    """Run on every rank: the runtime's all-reduce and all-gather against gloo's own, for a small tensor
    and one over the exchange's limit, in float32 and float64; and which of gloo's primitives carried each."""

    mesh: Mesh

    def __call__(self) -> dict:
        import torch.distributed as dist

        from pardsl.runtime.core import Runtime

        rt = Runtime(self.mesh)
        rt.shared = {}  # gloo's path, as between hosts (through shared memory: tests/test_shared_memory.py)
        used = []
        originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather_single", "all_to_all_single")}

        sent = []  # per all-to-all: (elements this rank sends to others, whether they are read from x itself)
        received = []  # per all-to-all: where it receives

        def recorded(name):
            def call(*args, **kwargs):
                used.append(name)
                if name == "all_to_all_single":
                    data, splits = args[1], (args[3] if len(args) > 3 else None)
                    to_itself = splits[dist.get_rank()] if splits else data.numel() // self.mesh.size
                    sent.append((data.numel() - to_itself, data.data_ptr() == x.data_ptr()))
                    received.append(args[0].data_ptr())
                return originals[name](*args, **kwargs)
            return call

        results = {}
        try:
            for name in originals:
                setattr(dist, name, recorded(name))
            for kind, numel, dtype in itertools.product(("all_reduce", "all_gather"),
                                                        (105, EXCHANGE_MAX_BYTES // 4 + 1),
                                                        (torch.float32, torch.float64)):
                x = torch.randn(numel, dtype=dtype, generator=torch.Generator().manual_seed(dist.get_rank()))
                rt.counter.reset()
                used.clear()
                sent.clear()
                received.clear()
                if kind == "all_reduce":
                    got = rt._all_reduce(x.view(5, -1) if numel == 105 else x, "tp", "forward").reshape(-1)
                    expected = x.clone()
                    originals["all_reduce"](expected)
                else:
                    got = rt._all_gather(x, "tp", 0, "forward")
                    expected = torch.empty(numel * self.mesh.size, dtype=dtype)
                    originals["all_gather_single"](expected, x)
                results[(kind, numel, str(dtype))] = (torch.equal(got, expected), list(used),
                                                      dict(+rt.counter.counts["forward"]), rt.counter.bytes["forward"],
                                                      x.numel() * x.element_size(), list(sent),
                                                      got.data_ptr() in received)
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)
        return results


@pytest.mark.parametrize("ranks", [2, 4])
def test_two_rank_collectives_and_small_all_gathers_on_gloo_are_one_all_to_all_equal_to_gloos_own(pools, ranks):
    # gloo's all-reduce is a ring, two dependent steps on two ranks, its all-gather n − 1: one all-to-all
    # moves the same bytes in one (an all-reduce only on two ranks, whose sum of two is the ring's bit for
    # bit). On two ranks each rank sends its tensor once, to the other, at any size; on more, an all-gather
    # sends n copies, up to EXCHANGE_MAX_BYTES. Megatron TP's LLaMA step on two gloo ranks 49.9 ms against
    # 55.1, an SP plan's 59.7 against 65.8
    for rank in pools(ranks).run_on_every_rank(AllReduceAndAllGatherAgainstGloo(Mesh(("tp",), (ranks,)))):
        for (kind, numel, dtype), (equal, primitive, counted, counted_bytes, nbytes, sent, in_received) in rank.items():
            assert equal, (kind, numel, dtype)
            small = numel * (8 if "64" in dtype else 4) <= EXCHANGE_MAX_BYTES
            own = "all_reduce" if kind == "all_reduce" else "all_gather_single"
            exchanged = ranks == 2 or (kind == "all_gather" and small)
            assert primitive == (["all_to_all_single"] if exchanged else [own]), (kind, numel, dtype, primitive)
            if ranks == 2:  # the tensor itself, to the other rank alone: no send buffer
                assert sent == [(numel, True)], (kind, numel, dtype, sent)
                # and the sum made where the other's arrived (x1 + x0 is x0 + x1 bit for bit): no tensor for it
                assert in_received or kind != "all_reduce", (kind, numel, dtype)
            # counted as what it is, at the ring's bytes per rank (what the all-to-all sends, where it is used)
            assert counted == {kind: 1} and counted_bytes == collective_bytes(kind, nbytes, ranks)


def _gradient_layout(layout: Layout) -> Layout:
    """The gradient of an S value is its shard, of a B or P value the full gradient."""
    return Layout(tuple(B if p == P else p for p in layout.placements))


def _round_trip(pools, mesh, placements, shape):
    layouts = [Layout(combo) for combo in itertools.product(placements, repeat=mesh.ndim)]
    pairs = tuple(itertools.product(layouts, layouts))
    per_rank = pools(mesh.size).run_on_every_rank(ConversionRoundTrip(mesh, shape, pairs))
    bad = [(s, t, f, b) for rank in per_rank for s, t, f, b in rank if f > 1e-5 or b > 1e-5]
    assert not bad, bad[:5]
    return len(pairs)


def test_every_one_axis_conversion_pair_round_trips(pools):
    count = _round_trip(pools, Mesh(("tp",), (2,)), [B, P, S(0), S(1), S(0, blocks=2), S(1, blocks=2)], (8, 8))
    assert count == 36


def test_every_two_axis_conversion_pair_round_trips(pools):
    count = _round_trip(pools, Mesh(("dp", "tp"), (2, 2)), [B, P, S(0), S(1)], (8, 8))
    assert count == 256


def _nonzero(counts):
    return {phase: {k: v for k, v in kinds.items() if v} for phase, kinds in counts.items()}


def test_data_times_tensor_parallel_gpt(pools):
    from examples.language_models import GPT

    compiled = compile_file("examples/gpt_dp2_tp2.par")
    parameters = len(list(GPT(vocab_size=256, block_size=16, n_layer=2, n_head=4, d_model=32).parameters()))
    # dp backward: every parameter gradient but the position embedding's in one bucket (the position
    # embedding's lookup output, B, is what is read by the batch-split sum, and its gradient is all-reduced)
    expected = {"forward": {"tp:all_reduce": 5},
                "backward": {"dp:all_reduce": 2, "tp:all_reduce": 5}}
    [bucket] = compiled.program.buckets
    assert len(bucket.members) == parameters - 1
    assert compiled.program.collective_counts_by_axis() == expected
    report = check(pools, compiled)
    assert report["collectives_by_axis"] == expected


def test_zero3_gathers_parameters_and_reduce_scatters_their_gradients(pools):
    compiled = compile_file("examples/mlp_zero3.par")
    program = compiled.program
    # one gather group (the MLP has no repeated layers), one bucket
    assert program.collective_counts_by_axis() == {"forward": {"dp:all_gather": 1},
                                                   "backward": {"dp:reduce_scatter": 1}}
    assert [m.attr for g in program.gathers for m in g.members] == ["fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]
    assert [m[0] for m in program.buckets[0].members] == ["fc2_bias", "fc2_weight", "fc1_bias", "fc1_weight"]
    memory = program.memory()
    assert memory["parameters_per_rank"] * 2 == memory["parameters_total"]
    # all-gather and reduce-scatter each move T(n-1)/n of every parameter: half of them, on 2 ranks
    assert program.collective_bytes() == {"forward": memory["parameters_total"] // 2,
                                          "backward": memory["parameters_total"] // 2}
    report = check(pools, compiled, steps=3)  # SGD steps on the shards, checked against serial each step
    assert report["bytes"] == program.collective_bytes()


def test_sequence_parallel_gpt(pools):
    compiled = compile_file("examples/gpt_sp_tp2.par")
    counts = compiled.program.collective_counts_by_axis()
    layers, norms = 2, 2 * 2 * 2 + 2  # (ln_1, ln_2) × (weight, bias) per layer, and ln_f
    assert counts["forward"] == {"tp:all_gather": 2 * layers, "tp:reduce_scatter": 2 * layers}
    assert counts["backward"] == {
        "tp:all_gather": 2 * layers + 1,  # the reduce-scatters' adjoints, and the embedding's split
        "tp:reduce_scatter": 2 * layers,  # the all-gathers' adjoints
        "tp:all_reduce": 1,  # one bucket: LayerNorm weights, and the tied head weight read by split tokens
    }
    assert len(compiled.program.buckets[0].members) == norms + 1
    tp = compile_file("examples/gpt_tp2.par").program
    # the same bytes as the all-reduces of plain tensor parallelism, per layer
    sp_bytes = sum(c.bytes for c in compiled.program.collectives if c.phase == "forward")
    tp_layer_bytes = sum(c.bytes for c in tp.collectives if c.phase == "forward") * layers // (2 * layers + 1)
    assert sp_bytes == tp_layer_bytes * 2
    check(pools, compiled)


def test_one_dim_split_over_two_axes_is_legal(pools, compile_par):
    compiled = compile_par("mesh dp = 2, tp = 2\nmodel examples.models:MLP(d_model=16, d_ff=32)\n"
                           "input x : float32[8, 16]\nlayout {\n  x : S(0) @ dp, S(0) @ tp\n"
                           "  fc1.weight : S(0) @ dp, S(0) @ tp\n}\n")
    assert compiled.program.inputs[0].local_shape == (2, 16)
    check(pools, compiled)


LAYOUTS_2D = ["B", "S(0)", "S(1)"]


@st.composite
def two_by_two(draw):
    depth = draw(st.integers(1, 2))
    widths = [4 * draw(st.integers(1, 3)) for _ in range(depth + 1)]
    acts = [draw(st.sampled_from(["relu", "tanh", "none"])) for _ in range(depth)]
    biases = [draw(st.booleans()) for _ in range(depth)]

    def layout(rank):
        return "[" + ", ".join(draw(st.sampled_from(LAYOUTS_2D[: rank + 1])) for _ in range(2)) + "]"

    entries = [f"x : {layout(2)}"]
    for i in range(depth):
        entries.append(f"layers.{i}.weight : {layout(2)}")
        if biases[i]:
            entries.append(f"layers.{i}.bias : {layout(1)}")
    return ("mesh dp = 2, tp = 2\n"
            f"model tests.zoo:Stack(widths={widths}, acts={acts}, biases={biases}, residual={[True] * depth}, "
            f"tails={['none'] * depth})\n"
            f"input x : float32[8, {widths[0]}]\nlayout {{\n" + "".join(f"  {e}\n" for e in entries) + "}\n"
            ).replace("'", '"')


def test_a_resharded_group_no_op_keeps_for_backward_is_not_gathered_again(pools, compile_par):
    """A bias stored split over dp and gathered alone (group 0) is read by an add, whose backward keeps no
    operand: released after forward (reshard), and backward does not gather it again; the weight gathered
    after it, for a matmul that keeps it, is the last group and stays gathered. Found by the test below."""
    compiled = compile_par('mesh dp = 2, tp = 2\nmodel tests.zoo:Stack(widths=[4, 4, 4], acts=["relu", "relu"], '
                           'biases=[True, False], residual=[True, True], tails=["none", "none"])\n'
                           'input x : float32[8, 4]\nlayout {\n  x : [S(0), B]\n  layers.0.weight : [B, B]\n'
                           '  layers.0.bias : [S(0), B]\n  layers.1.weight : [S(0), B]\n}\n')
    gathers = compiled.program.gathers
    assert [(g.resharded, g.regather) for g in gathers] == [(True, None), (False, None)]
    assert [line.split("#")[0].strip() for line in compiled.source.splitlines() if line.strip().startswith("del ")] \
        == ["del layers_0_bias__B_B"]
    check(pools, compiled)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=two_by_two())
def test_random_per_axis_layouts_on_2x2_meshes_equal_serial(pools, compile_par, text):
    check(pools, compile_par(text))


# Collectives per phase and per axis of each scheme, as planned (and measured: `check` compares them).
# Parameter gradients go in buckets, one collective per bucket; on the axis that splits the batch (r, d),
# weights stored split are gathered ahead of use where the batch shards would otherwise be exchanged.
SCHEME_COUNTS = {
    'mlp_1d': {'forward': {'tp:all_reduce': 1}, 'backward': {}},
    'mlp_2d': {'forward': {'c:all_gather': 2, 'r:all_gather': 1}, 'backward': {'c:reduce_scatter': 1, 'r:all_reduce': 1, 'r:reduce_scatter': 1}},
    'mlp_2p5d': {'forward': {'c:all_gather': 2, 'r:all_gather': 1}, 'backward': {'c:reduce_scatter': 1, 'd:all_reduce': 2, 'r:all_reduce': 1, 'r:reduce_scatter': 1}},
    'mlp_3d': {'forward': {'j:all_reduce': 1, 'l:all_gather': 1, 'l:reduce_scatter': 1}, 'backward': {'i:all_reduce': 1, 'l:all_gather': 1, 'l:reduce_scatter': 1}},
    'layer_1d': {'forward': {'tp:all_reduce': 2}, 'backward': {'tp:all_reduce': 2}},
    'layer_2d': {'forward': {'c:all_gather': 5, 'c:all_reduce': 1, 'r:all_gather': 2}, 'backward': {'c:all_reduce': 1, 'c:reduce_scatter': 3, 'r:all_reduce': 1, 'r:reduce_scatter': 1}},
    'layer_2p5d': {'forward': {'c:all_gather': 5, 'c:all_reduce': 1, 'r:all_gather': 2}, 'backward': {'c:all_reduce': 1, 'c:reduce_scatter': 3, 'd:all_reduce': 2, 'r:all_reduce': 1, 'r:reduce_scatter': 1}},
    'layer_3d': {'forward': {'j:all_gather': 2, 'j:all_reduce': 1, 'l:all_gather': 4}, 'backward': {'i:all_reduce': 1, 'j:all_reduce': 1, 'l:all_gather': 1}},
}


LAYER_2D_GREEDY = """
mesh   r = 2, c = 2
model  examples.models:TransformerLayer(d_model=32, n_head=4, d_ff=128)
input  x : float32[4, 8, 32]
layout {
    x              : [S(0), S(2)]
    q.weight       : [S(1), S(0)]
    k.weight       : [S(1), S(0)]
    v.weight       : [S(1), S(0)]
    o.weight       : [S(1), S(0)]
    mlp.fc1.weight : [S(1), S(0)]
    mlp.fc2.weight : [S(1), S(0)]
    *.bias         : [B, S(0)]
    mlp.*.bias     : [B, S(0)]
    output         : [S(0), S(2)]
}
"""


def test_distributed_layer_norm_keeps_a_split_hidden_dim_split_and_equals_serial(pools, compile_par):
    """Optimus's LayerNorm: with the hidden dim split over c, each norm all-reduces its rows' two sums
    forward and the gradient's two sums backward, over c only; nothing is converted for it. (All-reduce
    bytes per rank over 2 ranks: 2(n − 1)/n of the buffer, the buffer's own size.)"""
    compiled = compile_par(LAYER_2D_GREEDY)
    forms = [c for c in compiled.program.collectives if "per row, features split" in c.reason]
    rows = 4 * 8 // 2  # [4, 8] rows, the batch split over r
    assert sorted((c.phase, c.kind, c.axis, c.bytes, c.reason.split(",")[0]) for c in forms) == (
        # ln_1 reads the input, which needs no gradient: only ln_2 reduces backward
        [("backward", "all_reduce", "c", 2 * rows * 4, "gradient sums per row")]
        + [("forward", "all_reduce", "c", 2 * rows * 8, "sum and sum of squares per row")] * 2)
    assert not [c for c in compiled.program.collectives if "layer_norm.default" in c.reason and c not in forms]
    check(pools, compiled)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_distributed_layer_norm_after_a_column_parallel_linear_equals_serial(pools, compile_par, dtype):
    """The norm's input needs a gradient, so its backward all-reduce runs too; bfloat16 is normalised
    in float32 and its two sums reduced in float32, as planned."""
    compiled = compile_par(f'mesh tp = 2\nmodel tests.zoo:ProjectedNorm(width=64, dtype="{dtype}")\n'
                           f"input x : {dtype}[8, 64]\nlayout {{\n  proj.weight : S(0)\n  proj.bias : S(0)\n"
                           "  norm.weight : S(0)\n  norm.bias : S(0)\n  output : S(1)\n}\n")
    forms = sorted((c.phase, c.bytes) for c in compiled.program.collectives if "per row" in c.reason)
    assert forms == [("backward", 2 * 8 * 4), ("forward", 2 * 8 * 8)]  # float32 sums, float64 statistics
    check(pools, compiled)


def test_distributed_layer_norm_without_weights_equals_serial(pools, compile_par):
    compiled = compile_par("mesh tp = 2\nmodel torch.nn:LayerNorm(normalized_shape=256, elementwise_affine=False)\n"
                           "input input : float32[4, 2, 256]\nlayout {\n  input : S(2)\n  output : S(2)\n}\n")
    assert compiled.program.collective_counts_by_axis() == {"forward": {"tp:all_reduce": 1}, "backward": {}}
    check(pools, compiled)


def published_forward_bytes(compiled, scheme: str) -> float:
    """The literature's forward volume per rank (examples/README.md), summed over the scheme's matmuls
    Y = X Wᵀ (every linear): 2-D (q − 1)(|X| + |W|)/q², 2.5-D (q − 1)(|X|/d + |W|)/q², 3-D
    3(q − 1)/q³ (|X| + |W| + |Y|), in elements of 4 bytes."""
    q = 2
    total = 0.0
    for node in compiled.typed.nodes.values():
        if node.op != "aten.linear.default":
            continue
        x, w = (math.prod(compiled.typed.info(name).shape) for name in node.operands[:2])
        y = math.prod(compiled.typed.info(node.name).shape)
        if scheme.endswith("_2d"):
            total += (q - 1) * (x + w) / q ** 2
        elif scheme.endswith("_2p5d"):
            total += (q - 1) * (x / 2 + w) / q ** 2
        else:
            total += 3 * (q - 1) / q ** 3 * (x + w + y)
    return 4 * total


@pytest.mark.parametrize("figures", ["defaults", "round"])
@pytest.mark.parametrize("scheme", ["mlp_2d", "mlp_2p5d", "mlp_3d", "layer_2d", "layer_2p5d", "layer_3d"])
def test_searched_schemes_move_no_more_than_the_published_volumes_forward(monkeypatch, figures, scheme):
    """The files write the input, the weights' blocks and the output, and leave every intermediate to the
    layout search (`*() : ?`). Under gloo's defaults (a measured machine's figures) and under the round
    figures the search's own tests were worked out with (tests/figures.py)."""
    if figures == "round":
        monkeypatch.setitem(cost.DEFAULTS, "gloo", ROUND_GLOO)
    compiled = compile_file(f"examples/tp_schemes/{scheme}.par")
    assert "search" in compiled.seconds
    forward = sum(c.bytes for c in compiled.program.collectives if c.phase == "forward")
    assert forward <= published_forward_bytes(compiled, scheme)
    if scheme == "mlp_2d":  # SUMMA's volume exactly, in three all-gathers
        assert forward == published_forward_bytes(compiled, scheme)
        assert compiled.program.collective_counts_by_axis()["forward"] == {"c:all_gather": 2, "r:all_gather": 1}


@pytest.mark.parametrize("scheme", ["layer_2d", "layer_2p5d"])
def test_the_search_prices_a_weight_gathered_on_the_batch_axis_as_compile_lowers_it(scheme):
    """A 2-D or 2.5-D weight gathered over the axis that splits the batch, and still split over another,
    is gathered once: compile reshards after forward only groups that leave their parameters whole
    (reshard.py), and these files set no memory bound. Priced with a second gather for backward, the
    search's programs rated the plans that gather so dearer than cost.estimate does, and under gloo's
    defaults returned plans estimated 6 % (2-D: 6.26 against 5.91 ms, 23.9 KB forward) and 3 % slower than
    the plans the same search finds under the round figures."""
    measured = cost.DEFAULTS["gloo"]
    path = f"examples/tp_schemes/{scheme}.par"
    found = compile_file(path, machine=measured)
    found_under_round = compile_file(path, machine=ROUND_GLOO)
    assert cost.estimate(found, measured).step_s <= cost.estimate(found_under_round, measured).step_s
    fsdp_groups = [group for group in found.program.gathers if group.regather is not None]
    assert fsdp_groups == []  # no group is gathered again: none leaves its weights whole


# the 2.5-D and 3-D MLPs in make test-slow: the 2.5-D and 3-D layers run the same schemes
@pytest.mark.parametrize("scheme", ["mlp_1d", "mlp_2d", pytest.param("mlp_2p5d", marks=pytest.mark.slow),
                                    pytest.param("mlp_3d", marks=pytest.mark.slow),
                                    "layer_1d", "layer_2d", "layer_2p5d", "layer_3d"])
def test_tensor_parallel_schemes_of_the_literature_equal_serial(pools, round_figures, scheme):
    compiled = compile_file(f"examples/tp_schemes/{scheme}.par")
    memory = compiled.program.memory()
    assert memory["parameters_per_rank"] * 4 <= memory["parameters_total"] * 1.1  # a quarter, but for norms and biases
    assert compiled.program.collective_counts_by_axis() == SCHEME_COUNTS[scheme]
    report = check(pools, compiled)
    assert report["collectives_by_axis"] == SCHEME_COUNTS[scheme]


def test_a_weight_gathered_over_two_axes_for_a_batch_split_over_a_third_syncs_its_shard_in_a_bucket(round_figures):
    """3-D: the MLP's weights are stored split over j and l, gathered over both for their matmuls, and
    read by computation that splits the batch over i, so their gradients are whole on j and l and partial
    over i. Each gather's adjoint takes this rank's slice and the bucket all-reduces the shard over i (a
    quarter of the weight's bytes), behind the rest of backward; not the gathered weight's gradient on
    its own in backward's way (equal to serial in test_tensor_parallel_schemes_of_the_literature_equal_serial).
    Under the round figures, as that test: the shared-memory defaults make collectives cheap enough that
    the search gathers fc1's weight over l alone (a cheaper plan for the same file)."""
    compiled = compile_file("examples/tp_schemes/layer_3d.par")
    [bucket] = [b for b in compiled.program.buckets if "mlp_fc1_weight" in [m[0] for m in b.members]]
    assert (bucket.kind, bucket.axes) == ("all_reduce", ("i",))
    assert {"mlp_fc1_weight", "mlp_fc2_weight"} <= {m[0] for m in bucket.members}
    assert not [c for c in compiled.program.collectives if c.axis == "i" and "weight" in c.value]
    assert re.search(r"mlp_fc1_weight__shard__f = sync\.grad_all_reduce\(self\.mlp_fc1_weight, bucket=\d+, "
                     r"member=\d+\) +# gathered over j, l for use by computation split over i", compiled.source)


def test_a_weight_gathered_for_use_and_replicated_over_depth_is_synchronised_in_its_bucket():
    """2.5-D: each weight is stored split over r, gathered over r for its matmul, and replicated over the
    depth d that splits the batch. Its gradient is reduce-scattered over r and the shard all-reduced over
    d by one bucket (equal to serial in test_tensor_parallel_schemes_of_the_literature_equal_serial),
    not all-reduced whole over d on its own."""
    compiled = compile_file("examples/tp_schemes/mlp_2p5d.par")
    [bucket] = [b for b in compiled.program.buckets if b.kind == "reduce_scatter"]
    assert bucket.axes == ("r", "d") and [m[0] for m in bucket.members] == ["fc2_weight", "fc1_weight"]
    whole = 2 * 256 * 64 * 4 // 2  # both weights, gathered over r (c still splits them)
    assert [(c.kind, c.axis, c.bytes) for c in bucket.collectives] == [
        ("reduce_scatter", "r", collective_bytes("reduce_scatter", whole, 2)),
        ("all_reduce", "d", collective_bytes("all_reduce", whole // 2, 2))]
    assert not [c for c in compiled.program.collectives if c.axis == "d" and "weight" in c.value]
