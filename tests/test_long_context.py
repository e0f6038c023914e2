"""Long sequences split over ranks: a LLaMA whose tokens are written split (`input_ids : S(1)`) and left
to the search under a memory bound keeps its sequence split, attention included: ring attention, the
key/value chunks passed around the ranks (or, where it is priced cheaper, the heads split between two
all-to-alls: DeepSpeed-Ulysses' form), and holds a share of the activations; at a short sequence the
same file runs equal to serial. Ring attention itself against serial attention: causal, full, under a
mask tensor, grouped-query."""

import pytest

from pardsl.compiler import compile_text

from .conftest import run_on
from .test_distributed import check


def _llama(ranks: int, tokens: int, bound: str, batch: int = 1, split: str = "S(1)", labels: bool = False) -> str:
    return (f"mesh cp = {ranks}\nmodel examples.hf_models:HFLlama(layers=2, attention=\"sdpa\")\n"
            f"input input_ids : int64[{batch}, {tokens}] in [0, 256)\n"
            + (f"input labels : int64[{batch}, {tokens}] in [0, 256)\n" if labels else "") +
            f"memory <= {bound}\nlayout {{\n    input_ids : {split}\n}}\n")


def _activation_share(compiled) -> float:
    memory = compiled.program.memory()
    return memory["activations_per_rank"] / memory["activations_total"]


def test_the_sequence_stays_split_around_attention():
    at_2k = compile_text(_llama(2, 2048, "60 %"), "examples/long.par")
    assert _activation_share(at_2k) <= 0.6
    attention = [line for line in at_2k.source.splitlines() if "rt.attention(" in line]
    assert len(attention) == 2 and all("ring=('cp',)" in line for line in attention)  # the sequence stays split
    # per layer one send of its keys and values forward; backward their one, their gradients' two
    assert at_2k.program.collective_counts_by_axis() == {"forward": {"cp:send": 2},
                                                         "backward": {"cp:all_reduce": 1, "cp:send": 6}}
    # the mask and the rotary tables are built per shard: no rank makes the [seq, seq] mask or whole tables
    lines = at_2k.source.splitlines()
    masks = [line for line in lines if "  [1, 1, 2048, 2048]" in line]
    assert masks and all("S(2)@cp  [1, 1, 2048, 2048] local [1, 1, 1024, 2048]" in line for line in masks)
    tables = [line for line in lines if "aten.cos.default(" in line or "aten.sin.default(" in line]
    assert tables and all("local [1, 1024, 8]" in line for line in tables)
    at_16k = compile_text(_llama(4, 16384, "30 %"), "examples/long.par")
    assert _activation_share(at_16k) <= 0.3


def test_a_sequence_written_split_with_no_bound_stays_split_through_every_layer(pools):
    """Token ids and the output written split along the sequence, the rest left to the compiler with no
    bound: the greedy completion, deciding op by op, gathered the sequence at the first attention (0.86 of
    serial's activations a rank); the file is completed by the search, which keeps it split through every
    layer with ring attention. Equal to serial on 2 ranks."""
    from pardsl.compiler import _lowered
    from pardsl.planning.inference import infer

    text = ('mesh cp = 2\nmodel examples.hf_models:HFLlama(layers=2, attention="sdpa")\n'
            "input input_ids : int64[1, 512] in [0, 256)\nlayout {\n    input_ids : S(1)\n    output : S(1)\n}\n")
    compiled = compile_text(text, "examples/long.par")
    assert _activation_share(compiled) <= 0.6
    attention = [line for line in compiled.source.splitlines() if "rt.attention(" in line]
    assert len(attention) == 2 and all("ring=('cp',)" in line for line in attention)
    assert compiled.program.collective_counts_by_axis() == {"forward": {"cp:send": 2},
                                                            "backward": {"cp:all_reduce": 1, "cp:send": 6}}
    greedy = _lowered(infer(compiled.bound), 25, None).memory()
    assert greedy["activations_per_rank"] / greedy["activations_total"] > 0.8
    check(pools, compiled)


@pytest.mark.usefixtures("search_once")
def test_a_split_sequence_trains_equal_to_serial(pools):
    check(pools, compile_text(_llama(2, 64, "60 %", batch=2), "examples/long.par"))


def test_a_zigzag_sequence_stays_zigzag_and_trains_equal_to_serial(pools):
    """`input_ids : S(1, zigzag)`: rank r of n holds pieces r and 2n - 1 - r of the sequence. The search
    keeps it so through the model: the positions, the mask's rows and the rotary tables are built zig-zag
    (split from what every rank makes, locally), attention is ring attention over the zig-zag pieces, and
    the model's own loss reads its rows where they are (the shifted labels split alike); nothing gathers
    the sequence. Equal to serial."""
    compiled = compile_text(_llama(2, 512, "60 %", split="S(1, zigzag)", labels=True), "examples/long.par")
    lines = compiled.source.splitlines()
    attention = [line for line in lines if "rt.attention(" in line]
    assert len(attention) == 2 and all("ring_zigzag=('cp',)" in line for line in attention)
    masks = [line for line in lines if "  [1, 1, 512, 512]" in line]
    assert masks and all("S(2, zigzag)@cp  [1, 1, 512, 512] local [1, 1, 256, 512]" in line for line in masks)
    assert all("rt.all_gather(" not in line for line in lines)
    assert any("rt.cross_entropy(" in line and "mean=('cp',)" in line for line in lines)
    # priced for the blocks the causal mask the model traced leaves to compute: each rank 5 of its 8
    # (query piece, key piece) pairs, where it would be all 8 under a mask not known
    from pardsl.planning.cost import DEFAULTS, estimate
    from pardsl.tools.explain import report

    estimated = estimate(compiled, DEFAULTS["gloo"])
    priced = [o for o in estimated.ops if o.op == "scaled_dot_product_attention.default"]
    assert len(priced) == 2
    assert all(o.flops == int(compiled.bound.flops[o.node] * 5 / 8) // 2 for o in priced)
    assert "\nring attention: 2 attentions over `cp` compute 5 of each rank's 8 (query piece, key piece) pairs: " \
           "the mask the model builds hides the others whole" in report(compiled, estimated)
    assert compiled.program.collective_counts_by_axis()["forward"]["cp:send"] == 2
    check(pools, compiled)


# Megatron's layers over `tp`: each rank its heads and its part of the MLP
MEGATRON_OVER_TP = "".join(f"    model.model.layers.*.{name}.weight : {split} @ tp\n" for name, split in (
    ("self_attn.q_proj", "S(0)"), ("self_attn.k_proj", "S(0)"), ("self_attn.v_proj", "S(0)"),
    ("self_attn.o_proj", "S(1)"), ("mlp.gate_proj", "S(0)"), ("mlp.up_proj", "S(0)"), ("mlp.down_proj", "S(1)")))


def _tp_cp_llama(model_arguments: str, bound: str = ""):
    """HF LLaMA on `mesh tp = 2, cp = 2`, Megatron's layers over tp and the tokens zig-zag over cp,
    compiled: (the plan, its attention lines)."""
    text = (f"mesh tp = 2, cp = 2\nmodel examples.hf_models:HFLlama({model_arguments})\n"
            f"input input_ids : int64[1, 512] in [0, 256)\n{bound}"
            f"layout {{\n    input_ids : S(1, zigzag) @ cp\n{MEGATRON_OVER_TP}}}\n")
    compiled = compile_text(text, "examples/long.par")
    return compiled, [line for line in compiled.source.splitlines() if "rt.attention(" in line]


def test_a_zigzag_ring_composes_with_tensor_parallel_heads(pools):
    """`mesh tp = 2, cp = 2`: Megatron's layers written over tp (each rank its heads), the sequence
    zig-zag over cp: ring attention over cp for each tp rank's heads, an all-reduce over tp per half
    layer. Equal to serial on 4 ranks."""
    compiled, attention = _tp_cp_llama('layers=2, attention="sdpa"', "memory <= 60 %\n")
    assert len(attention) == 2 and all("ring_zigzag=('cp',)" in line and "S(1)@tp, S(2, zigzag)@cp" in line
                                       for line in attention)
    assert compiled.program.collective_counts_by_axis()["forward"] == {"cp:send": 2, "tp:all_reduce": 4}
    check(pools, compiled)


def test_a_ring_passes_the_key_value_heads_not_their_repeats_where_the_mesh_outnumbers_them(pools):
    """`mesh tp = 2, cp = 2` on two key/value heads: four ranks, but only tp's two split heads (cp splits
    the sequence). Traced, the model repeats each key/value head for its four query heads; the ring passes
    the heads themselves (a quarter of the bytes) and attends with `enable_gqa`, which explain says. Equal
    to serial."""
    from pardsl.planning.cost import DEFAULTS, estimate
    from pardsl.tools.explain import report

    compiled, attention = _tp_cp_llama('layers=2, kv_heads=2, attention="sdpa"')
    assert len(attention) == 2 and all("enable_gqa=True" in line and "ring_zigzag=('cp',)" in line
                                       for line in attention)
    # keys and values of one head a tp rank (of 8 features, float32) for its 256 of the 512 tokens
    sends = [c for c in compiled.program.collectives if c.kind == "send" and c.phase == "forward"]
    assert len(sends) == 2 and all(c.bytes == 256 * 1 * 8 * 2 * 4 for c in sends)
    explained = report(compiled, estimate(compiled, DEFAULTS["gloo"]))
    assert "\nsubstitutions: 2 attentions read the grouped-query key/value heads themselves (`enable_gqa`)" in explained
    check(pools, compiled)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_a_zigzag_split_evens_the_ranks_causal_work(ranks):
    """Under a causal mask, ring attention's blocks per rank and step (in the area of the queries by keys
    they cover, a diagonal block half of it): a plain split leaves rank 0 its own chunk only and the last
    rank every chunk; split zig-zag, every rank does the same at every step, and the busiest does about
    half of the plain split's busiest."""
    from pardsl.runtime.ring_attention import block_plan, pieces

    def work(chunk: int, step: int, zigzag: bool) -> float:
        own, held = pieces(chunk, ranks, zigzag), pieces((chunk - step) % ranks, ranks, zigzag)
        area = 1.0 / len(own) ** 2  # a piece of a rank's chunk by a piece of another's
        return sum(area * (0.5 if diagonal else 1.0) for _, _, diagonal in block_plan(own, held, True, None))

    plain = [[work(chunk, step, False) for step in range(ranks)] for chunk in range(ranks)]
    zigzag = [[work(chunk, step, True) for step in range(ranks)] for chunk in range(ranks)]
    assert [sum(row) for row in plain] == [0.5 + chunk for chunk in range(ranks)]
    assert all(row == zigzag[0] for row in zigzag)  # every rank alike, step by step
    assert sum(zigzag[0]) == ranks / 2
    # the whole causal triangle, however it is split
    assert sum(map(sum, plain)) == sum(map(sum, zigzag)) == ranks * ranks / 2


def _sequence_attention(ranks: int, arguments: str, width: int = 8, split: str = "S(1)") -> str:
    return (f"mesh cp = {ranks}\nmodel tests.zoo:SequenceAttention({arguments})\n"
            f"input x : float32[1, 16, {width}]\nlayout {{\n    x : {split}\n    output : {split}\n}}\n")


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("arguments, width, split", [
    ("causal=True", 8, "S(1)"),                        # is_causal: later chunks skipped, the own one masked
    ("causal=False", 8, "S(1)"),                       # every chunk attended in full
    ("masked=True", 8, "S(1)"),                        # a mask tensor: each step reads its chunk's columns
    ("heads=4, kv_heads=1, causal=True", 32, "S(1)"),  # grouped-query: one key/value head, nothing to split by heads
    ("causal=True", 8, "S(1, zigzag)"),                # zig-zag: each rank's two pieces, the later keys skipped
    ("masked=True", 8, "S(1, zigzag)"),                # the mask's rows zig-zag too; blocks it hides skipped
    ("heads=4, kv_heads=1, causal=True", 32, "S(1, zigzag)"),
])
def test_ring_attention_equals_serial_attention(pools, compile_par, ranks, arguments, width, split):
    """One sequence (no batch to split) of one head (no heads to split), split over the ranks: the
    attention keeps it split, its key/value chunks passed around the ring: n - 1 sends forward, 2n - 1
    backward (the chunks again, n - 1; their gradients' sums, n - 1, then home), each rank; equal to
    serial."""
    compiled = compile_par(_sequence_attention(ranks, arguments, width, split))
    form = "ring_zigzag" if "zigzag" in split else "ring"
    assert f"{form}=('cp',)" in compiled.source and "rt.all_gather" not in compiled.source
    report = check(pools, compiled)
    assert report["collectives_by_axis"]["forward"].get("cp:send") == ranks - 1
    assert report["collectives_by_axis"]["backward"].get("cp:send") == 2 * ranks - 1
    assert report["sends"] == {"forward": ranks * (ranks - 1), "backward": ranks * (2 * ranks - 1)}


@pytest.mark.parametrize("diagonal, masked", [(False, False), (True, False), (False, True)])
def test_a_ring_blocks_fused_kernel_and_reference_form_agree(diagonal, masked):
    """A block as the CPU's flash attention kernel computes it and in the reference form (what other
    devices run): the same output, log-sum-exps (-inf where the mask hides a row whole) and gradients."""
    import torch

    from pardsl.runtime.ring_attention import _block, _block_gradients

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=generator) for _ in range(3))
    mask = torch.rand(6, 6, generator=generator) < 0.5 if masked else None
    if masked:
        mask[0] = False  # one row sees nothing of this block
    (out, lse), (ref, ref_lse) = (_block(q, k, v, 0.5, diagonal, mask, fused) for fused in (True, False))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    grad = torch.randn(out.shape, generator=generator)
    seen = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # as the whole row's, other blocks seen
    fused, reference = (_block_gradients(grad, q, k, v, out, seen, 0.5, diagonal, mask, fused) for fused in (True, False))
    for a, b in zip(fused, reference):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_zigzag_ring_runs_inside_pipeline_stages(pools):
    """`mesh pp = 2, cp = 2`: 1F1B over the pipeline axis, the sequence zig-zag over cp in each stage (the
    model's loss at the last one): ring attention over cp in both stages, its sends per micro-batch. Equal
    to serial on 4 ranks."""
    text = ("mesh pp = 2, cp = 2\nmodel examples.hf_models:HFLlama(layers=2, attention=\"sdpa\")\n"
            "input input_ids : int64[2, 256] in [0, 256)\ninput labels : int64[2, 256] in [0, 256)\n"
            "pipeline pp : schedule 1F1B, microbatches 2, cut before model.model.layers.1\nmemory <= 60 %\n"
            "layout {\n    input_ids : S(1, zigzag) @ cp\n}\n")
    compiled = compile_text(text, "examples/long.par")
    assert len(compiled.stages) == 2 and sum("ring_zigzag=('cp',)" in line for line in compiled.source.splitlines()) == 2
    report = run_on(pools, compiled, steps=2)
    assert report["ok"], report
    # rank 0 (the first stage, one layer): per micro-batch one send forward (n - 1), three backward (2n - 1)
    assert report["collectives_by_axis"]["forward"] == {"cp:send": 2, "pp:send": 2}
    assert report["collectives_by_axis"]["backward"]["cp:send"] == 6


def test_a_pipeline_completed_op_by_op_builds_each_ranks_mask_rows_zigzag_in_every_stage(pools):
    """`mesh pp = 2, cp = 2`, tokens and labels written zig-zag and no bound: the stages are completed op
    by op, which kept the causal mask (built from positions, every operand whole) whole on every rank and
    sliced its rows at each attention: [seq, seq] a rank and micro-batch, 32 GiB of Llama 3 405B's 131,072
    tokens. Each rank now builds only the rows its queries read, in the same zig-zag pieces, and each
    stage builds its own: made from constants alone, the mask is not sent between stages (a receive
    buffer per micro-batch), nor counted twice where a recomputed layer reads it expanded. Equal to
    serial on 4 ranks."""
    text = ("mesh pp = 2, cp = 2\nmodel examples.hf_models:HFLlama(layers=2, attention=\"sdpa\")\n"
            "input input_ids : int64[2, 256] in [0, 256)\ninput labels : int64[2, 256] in [0, 256)\n"
            "pipeline pp : schedule 1F1B, microbatches 2, cut before model.model.layers.1\n"
            "recompute model.model.layers.*\n"
            "layout {\n    input_ids : S(1, zigzag) @ cp\n    labels : S(1, zigzag) @ cp\n}\n")
    compiled = compile_text(text, "examples/long.par")
    lines = compiled.source.splitlines()
    masks = [line for line in lines if "  [1, 1, 256, 256]" in line]
    assert len(masks) >= 10 and all("S(2, zigzag)@cp  [1, 1, 256, 256] local [1, 1, 128, 256]" in line
                                    for line in masks)
    assert sum("ring_zigzag=('cp',)" in line for line in lines) == 2
    first, last = compiled.stages
    assert [slot.shape for slot in last.inputs] == [(1, 256), (1, 256, 64)]  # a micro-batch's labels, hidden state
    for stage in compiled.stages:  # each builds its mask, kept once: its rows, 128 × 256 booleans
        masks_kept = [size for name, size, _, region in stage.held_for_backward()
                      if not region and stage.values[name]["shape"] == [1, 1, 256, 256]]
        assert masks_kept == [128 * 256]
    # the layer's ring: one send forward; backward makes the forward's again, then its three
    assert first.collective_counts_by_axis() == {"forward": {"cp:send": 1},
                                                 "backward": {"cp:all_reduce": 1, "cp:send": 4}}
    report = run_on(pools, compiled, steps=2)
    assert report["ok"], report


def test_ring_attention_moves_each_message_while_a_step_computes():
    """Forward, the keys and values travel on while the step's blocks are computed from them: on a GPU
    machine each of the n - 1 forward sends hides behind a step's share of its attention's compute (the
    machine's overlap of it). Backward likewise, the keys and values again, and each sum of their
    gradients while the next step computes; only the last send, the sums home, stalls. CPU ranks share
    their cores: nothing hides there."""
    from pardsl.planning.cost import DEFAULTS, estimate, machine_named

    compiled = compile_text(_llama(4, 16384, "30 %"), "examples/long.par")
    gpu = machine_named("h100-nvlink-ib", "nccl")
    result = estimate(compiled, gpu)
    attention = {o.node: o.forward_s for o in result.ops if o.op == "scaled_dot_product_attention.default"}
    sends = [c for c in result.collectives if c.kind == "send"]
    forward = [c for c in sends if c.phase == "forward"]
    assert len(forward) == 2 * 3 and len(attention) == 2  # n - 1 a layer
    step_s = min(attention.values()) / 4
    for c in forward:
        assert c.beside_step_s == pytest.approx(gpu.overlap * min(c.seconds, step_s), rel=0.05) and c.beside_step_s > 0
    backward = [c for c in sends if c.phase == "backward"]
    home = [c for c in backward if "home" in c.reason]
    assert len(backward) == 2 * 7 and len(home) == 2  # 2n - 1 a layer
    for c in backward:
        hidden_s = 0.0 if c in home else gpu.overlap * min(c.seconds, step_s)
        assert c.beside_step_s == pytest.approx(hidden_s, rel=0.05)
    # the step counts what stalls: the sends' seconds less what hid beside their steps
    hidden = sum(c.beside_step_s for c in sends)
    ops = sum(o.forward_s + o.backward_s for o in result.ops)
    stalled = sum(c.seconds - c.hidden_s for c in result.collectives if not c.overlapped) - hidden
    assert result.step_s == pytest.approx(ops + stalled + result.seconds["overlapped_exposed"], rel=1e-9)
    assert all(c.beside_step_s == 0 for c in estimate(compiled, DEFAULTS["gloo"]).collectives)
