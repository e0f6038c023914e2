"""Multi-axis meshes: every conversion pair round-trips, data × tensor, ZeRO-3 and sequence parallelism
run at their theoretical cost, and random per-axis layouts on 2 × 2 meshes equal serial."""

import itertools
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pardsl.compiler import compile_file
from pardsl.layouts import CONVERSION_OF_KIND, B, P, S, Layout, Mesh, plan_conversion

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
        from pardsl.lowering import step_call
        from pardsl.runtime import Runtime

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


def _gradient_layout(layout: Layout) -> Layout:
    """DESIGN §2: the gradient of an S value is its shard, of a B or P value the full gradient."""
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


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=two_by_two())
def test_random_per_axis_layouts_on_2x2_meshes_equal_serial(pools, compile_par, text):
    check(pools, compile_par(text))


# Collectives per phase and per axis of each scheme, as planned (and measured: `check` compares them).
# Parameter gradients go in buckets, one collective per bucket; on the axis that splits the batch (r, d),
# weights stored split are gathered ahead of use where the batch shards would otherwise be exchanged.
SCHEME_COUNTS = {
    'mlp_1d': {'forward': {'tp:all_reduce': 1}, 'backward': {}},
    'mlp_2d': {'forward': {'c:all_gather': 2, 'c:all_to_all': 1, 'c:reduce_scatter': 1, 'r:all_gather': 2}, 'backward': {'c:all_gather': 1, 'c:all_to_all': 1, 'r:all_reduce': 2, 'r:reduce_scatter': 2}},
    'mlp_2p5d': {'forward': {'c:all_gather': 2, 'r:all_gather': 1}, 'backward': {'c:reduce_scatter': 1, 'd:all_reduce': 3, 'r:all_reduce': 1, 'r:reduce_scatter': 1}},
    'mlp_3d': {'forward': {'j:all_reduce': 1, 'l:all_reduce': 1}, 'backward': {'i:all_reduce': 1, 'l:all_reduce': 1}},
    'layer_1d': {'forward': {'tp:all_reduce': 2}, 'backward': {'tp:all_reduce': 2}},
    'layer_2d': {'forward': {'c:all_gather': 6, 'c:all_reduce': 1, 'c:all_to_all': 3, 'c:reduce_scatter': 1, 'r:all_gather': 4}, 'backward': {'c:all_gather': 1, 'c:all_reduce': 2, 'c:all_to_all': 2, 'c:reduce_scatter': 2, 'r:all_reduce': 6, 'r:reduce_scatter': 3}},
    'layer_2p5d': {'forward': {'c:all_gather': 6, 'c:all_to_all': 2, 'r:all_gather': 2}, 'backward': {'c:all_reduce': 1, 'c:all_to_all': 1, 'c:reduce_scatter': 5, 'd:all_reduce': 10, 'r:all_reduce': 4, 'r:reduce_scatter': 1}},
    'layer_3d': {'forward': {'j:all_reduce': 2, 'l:all_reduce': 4, 'l:all_to_all': 4}, 'backward': {'i:all_reduce': 2, 'j:all_reduce': 2, 'l:all_reduce': 3, 'l:all_to_all': 3}},
}


@pytest.mark.parametrize("scheme", ["mlp_1d", "mlp_2d", "mlp_2p5d", "mlp_3d", "layer_1d", "layer_2d", "layer_2p5d",
                                    "layer_3d"])
def test_tensor_parallel_schemes_of_the_literature_equal_serial(pools, scheme):
    compiled = compile_file(f"examples/tp_schemes/{scheme}.par")
    memory = compiled.program.memory()
    assert memory["parameters_per_rank"] * 4 <= memory["parameters_total"] * 1.1  # a quarter, but for norms and biases
    assert compiled.program.collective_counts_by_axis() == SCHEME_COUNTS[scheme]
    report = check(pools, compiled)
    assert report["collectives_by_axis"] == SCHEME_COUNTS[scheme]
