"""Hugging Face `transformers` models, as the library writes them, under Megatron plans: they compile,
communicate exactly as Megatron does, and train equal to serial (outputs and every gradient)."""

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pardsl.compiler import compile_file
from pardsl.program.ir import Text

from .test_distributed import check, check_example

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# layers = 2: 2 all-reduces forward and 2 backward per layer, plus the vocabulary-parallel embedding's
# forward all-reduce and the column-parallel head input's backward all-reduce where the plan has them.
PER_LAYERS = {"forward": {"all_reduce": 4}, "backward": {"all_reduce": 4}}
WITH_VOCABULARY = {"forward": {"all_reduce": 5}, "backward": {"all_reduce": 5}}
EXPECTED = {
    "hf_gpt2_tp2": PER_LAYERS, "hf_gpt2_tp4": WITH_VOCABULARY,
    "hf_llama_tp2": PER_LAYERS, "hf_llama_tp4": WITH_VOCABULARY,
    "hf_bert_tp2": PER_LAYERS, "hf_bert_tp4": PER_LAYERS,
    # the model's own loss, vocabulary parallel: + 1 forward (each rank's row statistics, gathered)
    "hf_llama_loss_tp2": {"forward": {"all_reduce": 5, "all_gather": 1}, "backward": {"all_reduce": 5}},
}


def _nonzero(counts):
    return {phase: {k: v for k, v in kinds.items() if v} for phase, kinds in counts.items()}


@pytest.mark.parametrize("example", sorted(EXPECTED))
def test_megatron_plan_counts_and_equivalence(pools, example):
    check_example(pools, example, EXPECTED[example])


def test_llama_rotary_tables_under_no_grad_are_inlined_and_detached():
    compiled = compile_file("examples/hf_llama_tp2.par")
    assert "wrap_with_set_grad_enabled" not in compiled.source
    assert compiled.source.count("aten.detach.default(") == 2  # cos and sin, per model (shared by layers)
    # 4 KV heads of 8 dims over 2 ranks, the 4 query heads they serve on each rank
    shapes = {p.name: p.local_shape for p in compiled.program.parameters}
    assert shapes["model.model.layers.0.self_attn.k_proj.weight"] == (16, 64)
    assert shapes["model.model.layers.0.self_attn.q_proj.weight"] == (32, 64)


def test_eager_attention_masks_split_heads_with_a_replicated_mask():
    lines = compile_file("examples/hf_gpt2_tp2.par").source.splitlines()
    # the additive mask is made once, with `where`, whole on every rank; each rank adds it to its heads
    [where] = [line for line in lines if "aten.where.ScalarOther(" in line]
    assert where.endswith("# B  [2, 1, 16, 16]")
    masked = [line for line in lines if "aten.add.Tensor(" in line and ", where)" in line]
    assert len(masked) == 2 and all(line.endswith("S(1)@tp  [2, 8, 16, 16] local [2, 4, 16, 16]") for line in masked)


def test_causal_lm_loss_is_vocabulary_parallel():
    compiled = compile_file("examples/hf_llama_loss_tp2.par")
    assert 'rt.cross_entropy(' in compiled.source
    assert "rt.all_gather" not in compiled.source  # the logits are never gathered
    loss = [c for c in compiled.program.collectives if "classes split" in c.reason]
    # 32 rows: max, sum of exps and target logit in float32, from the other rank
    assert [(c.kind, c.phase, c.bytes) for c in loss] == [("all_gather", "forward", 3 * 4 * 32)]


def test_causal_lm_loss_data_times_tensor_parallel(pools):
    compiled = compile_file("examples/hf_llama_loss_dp2_tp2.par")
    # dp: the loss's sum and count of targets, in one all-reduce; the 21 parameter gradients (9 per layer,
    # embedding, norm, head: 80 KiB in all) in one bucket
    expected = {"forward": {"dp:all_reduce": 1, "tp:all_reduce": 5, "tp:all_gather": 1},
                "backward": {"dp:all_reduce": 1, "tp:all_reduce": 5}}
    [bucket] = compiled.program.buckets
    assert bucket.axes == ("dp",) and len(bucket.members) == 21
    assert compiled.program.collective_counts_by_axis() == expected
    assert "mean=('dp',)" in compiled.source and "rt.all_gather" not in compiled.source
    check(pools, compiled)


def test_zero3_on_llama_is_fsdps_communication(pools):
    """Every weight stored S(0) @ dp, the batch split: FSDP's units, one all-gather forward per layer and per
    run of weights outside the layers (the next one prefetched), each layer's gathered again for backward
    (resharded after forward: the embedding's backward reads no weight, the head's group comes first), the
    gradients reduce-scattered in buckets backward, and nothing else but the loss's two numbers (its sum
    and count, in one all-reduce)."""
    compiled = compile_file("examples/llama_zero3.par")
    program = compiled.program
    assert program.collective_counts_by_axis() == {"forward": {"dp:all_gather": 4, "dp:all_reduce": 1},
                                                   "backward": {"dp:all_gather": 2, "dp:reduce_scatter": 1}}
    assert [(g.resharded, g.regather is not None) for g in program.gathers] == [
        (True, False), (True, True), (True, True), (False, False)]
    assert all(c.bytes <= 8 for c in program.collectives if c.kind == "all_reduce")  # the loss's sum and count
    groups = [[m.attr.removeprefix("model_").removesuffix("_weight") for m in g.members] for g in program.gathers]
    layer = ["input_layernorm", "self_attn_q_proj", "self_attn_k_proj", "self_attn_v_proj", "self_attn_o_proj",
             "post_attention_layernorm", "mlp_gate_proj", "mlp_up_proj", "mlp_down_proj"]
    assert groups == [["embed_tokens"], [f"layers_0_{w}" for w in layer], [f"layers_1_{w}" for w in layer],
                      ["norm", "lm_head"]]
    assert sorted(m[0] for m in program.buckets[0].members) == sorted(m.attr for g in program.gathers for m in g.members)
    assert not compiled.program.notes  # gathering a parameter stored split for its op is what the plan means
    assert "rt.all_gather(" not in compiled.source and "rt.all_to_all(" not in compiled.source
    memory = program.memory()
    assert memory["parameters_per_rank"] * 2 == memory["parameters_total"]
    check(pools, compiled)


def _gathered_bytes_held(path: str) -> tuple[int, int]:
    """On every rank: the bytes of gathered parameters still alive between forward and backward, and those of
    the group gathered last."""
    import gc
    import weakref

    import torch

    import pardsl
    from pardsl.runtime.parameter_sync import ParameterSync

    made = []
    unpack = ParameterSync._unpack

    def watched(self, group, buffer):
        wholes = unpack(self, group, buffer)
        made.extend((weakref.ref(t.untyped_storage()), t.untyped_storage().nbytes()) for t in (buffer, *wholes))
        return wholes

    ParameterSync._unpack = watched
    try:
        plan = pardsl.load(path)
        model = plan.module()
        ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
        out = model(**plan.shard_inputs(input_ids=ids, labels=ids))
        loss = out if isinstance(out, torch.Tensor) else out[0]  # the loss, or Hugging Face's output
        gc.collect()
        storages = {ref().data_ptr(): nbytes for ref, nbytes in made if ref() is not None}
        last = sum(m.nbytes for m in plan.compiled.program.gathers[-1].members)
        loss.backward()
        return sum(storages.values()), last
    finally:
        ParameterSync._unpack = unpack


@pytest.mark.slow
def test_zero3_releases_gathered_weights_after_forward_unless_the_bound_allows_keeping_them(pools, tmp_path):
    """Resharded after forward, a rank holds between forward and backward the last group's weights whole and
    no other gathered weight (autograd keeps where the others lie in their group); under a memory bound
    they all fit in, every group autograd keeps stays gathered from forward to backward and nothing is
    gathered twice. Held: the gathered storages still alive (weak references) once forward returns."""
    import functools
    import os

    text = open("examples/llama_zero3.par").read()
    kept = tmp_path / "kept.par"
    kept.write_text(text.replace("mesh   dp = 2\n", "mesh   dp = 2\nmemory <= 100 %\n"))
    resharded = compile_file("examples/llama_zero3.par")
    keeping = compile_file(str(kept))
    assert not any(g.resharded for g in keeping.program.gathers) and "RESHARDED" not in keeping.source
    assert _nonzero(keeping.program.collective_counts())["backward"] == {"reduce_scatter": 1}
    whole = [sum(m.nbytes for m in g.members) for g in resharded.program.gathers]
    held, last = pools(2).run_on_every_rank(functools.partial(_gathered_bytes_held, os.path.abspath("examples/llama_zero3.par")))[0]
    assert held == last == whole[-1]
    held, _ = pools(2).run_on_every_rank(functools.partial(_gathered_bytes_held, str(kept)))[0]
    assert held == sum(whole[1:])  # all but the embedding's table, whose backward reads the indices only
    from pardsl.planning.cost import memory_per_rank

    assert memory_per_rank(resharded.program)["gathered_parameters"] == sum(sorted(whole)[-2:])  # two layers
    assert memory_per_rank(keeping.program)["gathered_parameters"] == sum(whole)
    check(pools, keeping)


GPT2_ZERO3 = """mesh dp = 2
model examples.hf_models:HFGPT2(layers=2)
input input_ids : int64[4, 16] in [0, 256)
input labels : int64[4, 16] in [0, 256)
layout {
    input_ids : S(0)
    labels : S(0)
    model.transformer.wte.weight : S(0)
    model.transformer.h.*.attn.c_attn.weight : S(0)
    model.transformer.h.*.attn.c_proj.weight : S(0)
    model.transformer.h.*.mlp.c_fc.weight : S(0)
    model.transformer.h.*.mlp.c_proj.weight : S(0)
}
"""


def test_zero3_regathers_a_tied_head_first_in_backward_and_holds_only_the_last_group(pools, tmp_path):
    """GPT-2's embedding is its head: the first group gathered is read again last in the forward. It is
    released after the head and gathered again first in backward, the layers' groups after it; before, a
    rank kept its weights whole from forward to backward, and backward prefetched it again for nothing
    once the first layer's group was gathered (Whisper measured one all-gather more than planned)."""
    import functools

    path = tmp_path / "gpt2_zero3.par"
    path.write_text(GPT2_ZERO3)
    compiled = compile_file(str(path))
    head, first, last = compiled.program.gathers
    assert [m.attr for m in head.members] == ["model_lm_head_weight"] and head.resharded and first.resharded
    assert "RESHARDED_AFTER_FORWARD = [(0, True), (1, True)]" in compiled.source  # backward's order: the head first
    held, last_bytes = pools(2).run_on_every_rank(functools.partial(_gathered_bytes_held, str(path)))[0]
    assert held == last_bytes == sum(m.nbytes for m in last.members)
    report = check(pools, compiled)
    assert _nonzero(report["collectives_by_axis"])["backward"] == {"dp:all_gather": 2, "dp:all_reduce": 2,
                                                                   "dp:reduce_scatter": 1}


def test_zero3_with_small_buckets_issues_each_as_it_fills(pools):
    from pardsl.compiler import compile_text

    text = open("examples/llama_zero3.par").read()
    compiled = compile_text(text, "examples/llama_zero3.par", bucket_mb=0.05)  # 51 KiB
    buckets = compiled.program.buckets
    assert len(buckets) == 6 and all(b.kind == "reduce_scatter" for b in buckets)
    # in the order backward makes the gradients: the head's first, the embedding's last
    assert buckets[0].members[0][0] == "lm_head_weight" and buckets[-1].members[-1][0] == "model_embed_tokens_weight"
    assert all(b.nbytes >= 50 * 1024 for b in buckets[:-1])
    report = check(pools, compiled)
    assert report["collectives_by_axis"]["backward"] == {"dp:all_gather": 2, "dp:reduce_scatter": 6}


def test_sequence_parallel_llama(pools):
    compiled = compile_file("examples/hf_llama_sp_tp2.par")
    # per layer 2 all-gathers + 2 reduce-scatters forward, and 1 all-gather into the head; backward the
    # mirror image, the embedding output's gradient gathered, and the 5 RMSNorm weights' gradients (partial
    # over the sequence shards) all-reduced in one bucket
    expected = {"forward": {"all_gather": 5, "reduce_scatter": 4},
                "backward": {"all_gather": 5, "reduce_scatter": 5, "all_reduce": 1}}
    # q/k/v and gate/up of each layer, and the head, are one step each: gathered first, their input gradient's
    # reduce-scatter overlapped with the weights' gradients (Megatron-SP)
    assert compiled.source.count("rt.column_parallel_linears(") == 5
    assert compiled.source.count(", gather_dim=1)") == 5
    assert _nonzero(compiled.program.collective_counts()) == expected
    check(pools, compiled)


def test_kv_heads_that_do_not_divide_the_axis_stay_replicated(pools, compile_par):
    text = open("examples/hf_llama_tp4.par").read().replace("layers=2", "layers=1, kv_heads=2")
    text = "\n".join(line for line in text.splitlines() if "k_proj" not in line and "v_proj" not in line)
    compiled = compile_par(text)
    shapes = {p.name: p.local_shape for p in compiled.program.parameters}
    assert shapes["model.model.layers.0.self_attn.k_proj.weight"] == (16, 64)  # 2 KV heads, whole on each rank
    check(pools, compiled)


def test_column_parallel_linears_overlap_the_input_gradients_all_reduce():
    source = compile_file("examples/hf_llama_tp2.par").source
    # per layer: q, k, v in one step and gate, up in another; f is inside them, so no separate grad_all_reduce
    assert source.count("rt.column_parallel_linears(") == 4 and "grad_all_reduce" not in source
    assert ("linear_4, linear_5 = rt.column_parallel_linears(mul_10, ('tp',), (self.model_model_layers_0_mlp_gate_proj_weight, "
            "None), (self.model_model_layers_0_mlp_up_proj_weight, None))") in source


def test_gpt2_conv1d_projections_overlap_the_input_gradients_all_reduce():
    # GPT-2's Conv1D is an addmm with its weight stored [in, out]: c_attn and c_fc each one step, as linears are
    source = compile_file("examples/hf_gpt2_tp2.par").source
    assert source.count("rt.column_parallel_linears(") == 4 and source.count(", op='addmm')") == 4
    assert "grad_all_reduce" not in source
    assert ("addmm_2, = rt.column_parallel_linears(view_8, ('tp',), (self.model_transformer_h_0_mlp_c_fc_weight, "
            "self.model_transformer_h_0_mlp_c_fc_bias), op='addmm')") in source


def test_mask_construction_is_replicated_not_gathered():
    # HF builds its causal mask from position ids with diff/cumsum/index: all on every rank, no collective
    source = compile_file("examples/hf_llama_tp2.par").source
    assert "rt.all_gather" not in source and "rt.split" not in source


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    kv_heads=st.sampled_from([2, 4]),
    head_dim=st.sampled_from([4, 8]),
    ffn=st.sampled_from([32, 96]),
    split_attention=st.booleans(),
    split_mlp=st.booleans(),
    attention=st.sampled_from(["sdpa", "eager"]),
)
def test_llama_sizes_and_split_projections_equal_serial(pools, compile_par, kv_heads, head_dim, ffn,
                                                        split_attention, split_mlp, attention):
    heads = 2 * kv_heads
    hidden = heads * head_dim
    layouts = []
    if split_attention:
        layouts += [f"model.model.layers.*.self_attn.{p}_proj.weight : S(0)" for p in "qkv"]
        layouts += ["model.model.layers.*.self_attn.o_proj.weight : S(1)"]
    if split_mlp:
        layouts += [f"model.model.layers.*.mlp.{p}_proj.weight : S(0)" for p in ("gate", "up")]
        layouts += ["model.model.layers.*.mlp.down_proj.weight : S(1)"]
    text = (f"mesh tp = 2\nmodel examples.hf_models:HFLlama(layers=1, hidden={hidden}, heads={heads}, "
            f"kv_heads={kv_heads}, ffn={ffn}, vocab=64, attention=\"{attention}\")\n"
            "input input_ids : int64[2, 8] in [0, 64)\nlayout {\n" + "".join(f"  {l}\n" for l in layouts) +
            "  output : B\n}\n")
    compiled = compile_par(text)
    blocks = split_attention + split_mlp
    assert _nonzero(compiled.program.collective_counts()) == (
        {"forward": {"all_reduce": blocks}, "backward": {"all_reduce": blocks}} if blocks
        else {"forward": {}, "backward": {}})
    check(pools, compiled)


LLAMA_NAMES = ["self_attn.q_proj.weight : S(0)", "self_attn.k_proj.weight : S(0)", "self_attn.v_proj.weight : S(0)",
               "self_attn.o_proj.weight : S(1)", "mlp.gate_proj.weight : S(0)", "mlp.up_proj.weight : S(0)",
               "mlp.down_proj.weight : S(1)"]
PHI_NAMES = ["self_attn.q_proj.weight : S(0)", "self_attn.q_proj.bias : S(0)", "self_attn.k_proj.weight : S(0)",
             "self_attn.k_proj.bias : S(0)", "self_attn.v_proj.weight : S(0)", "self_attn.v_proj.bias : S(0)",
             "self_attn.dense.weight : S(1)", "mlp.fc1.weight : S(0)", "mlp.fc1.bias : S(0)", "mlp.fc2.weight : S(1)"]
NEOX_NAMES = ["attention.query_key_value.weight : S(0)", "attention.query_key_value.bias : S(0)",
              "attention.dense.weight : S(1)", "mlp.dense_h_to_4h.weight : S(0)", "mlp.dense_h_to_4h.bias : S(0)",
              "mlp.dense_4h_to_h.weight : S(1)"]


@pytest.mark.parametrize("family, layers_path, names, kwargs, forward, backward", [
    ("Mistral", "model.model.layers", LLAMA_NAMES, "", 2, 2),
    ("Qwen2", "model.model.layers", LLAMA_NAMES, "", 2, 2),  # q/k/v biases inferred column parallel
    ("Qwen3", "model.model.layers", LLAMA_NAMES, "", 2, 3),  # + one bucket: the q/k RMSNorm weights' gradients
    ("Gemma", "model.model.layers", LLAMA_NAMES, "", 2, 2),
    ("Olmo", "model.model.layers", LLAMA_NAMES, "", 2, 2),
    ("StableLm", "model.model.layers", LLAMA_NAMES, "", 2, 2),
    # parallel attention and MLP off one residual: their partial sums are added before one all-reduce
    ("Phi", "model.model.layers", PHI_NAMES, ", kv_heads=8", 1, 1),
    ("GPTNeoX", "model.gpt_neox.layers", NEOX_NAMES, ", kv_heads=8", 1, 2),  # two LayerNorms on one input
])
def test_more_transformers_families_under_megatron(pools, compile_par, family, layers_path, names, kwargs,
                                                   forward, backward):
    layouts = "".join(f"  {layers_path}.*.{name}\n" for name in names)
    compiled = compile_par(f"mesh tp = 2\nmodel examples.hf_models:HFCausalLM(family=\"{family}\"{kwargs})\n"
                           f"input input_ids : int64[2, 16] in [0, 128)\nlayout {{\n{layouts}  output : B\n}}\n")
    assert _nonzero(compiled.program.collective_counts()) == {"forward": {"all_reduce": forward},
                                                             "backward": {"all_reduce": backward}}
    check(pools, compiled)


def test_grouped_query_attention_reads_its_key_value_heads_without_repeating_them(pools):
    """Traced, Hugging Face repeats LLaMA's 4 key/value heads to its 8 query heads before SDPA (copies kept
    for backward); eagerly it passes them with `enable_gqa`. Compiled, SDPA reads the 4 heads themselves
    again, split over tp with the query heads, equal to serial."""
    compiled = compile_file("examples/hf_llama_tp2.par")
    attention = [s for s in compiled.program.statements
                 if s.instruction.callee == "aten.scaled_dot_product_attention.default"]
    assert len(attention) == 2 and all(("enable_gqa", Text("True")) in s.instruction.kwargs for s in attention)
    assert [name for name, info in compiled.bound.tensors.items() if len(info.shape) == 5] == []  # no repeat
    check(pools, compiled)


def test_the_grouped_query_fold_needs_the_ranks_to_divide_the_key_value_heads():
    """Where the ranks do not divide the key/value heads (8 ranks, 4 heads) the repeat stays: the repeated
    heads are what a plan can split."""
    import torch

    from examples.hf_models import HFLlama
    from pardsl.model.grouped_query import fold_grouped_query_repeats

    model = HFLlama(layers=1, attention="sdpa")  # 8 query heads, 4 key/value heads
    ids = torch.zeros(2, 16, dtype=torch.int64)

    def traced():
        return torch.export.export(model, (), {"input_ids": ids}).graph_module

    def five_dimensional(graph_module):
        return [n for n in graph_module.graph.nodes if len(getattr(n.meta.get("val"), "shape", ())) == 5]

    kept, folded = traced(), traced()
    assert fold_grouped_query_repeats(kept, 8) == 0 and len(five_dimensional(kept)) == 4  # unsqueeze, expand: k, v
    assert fold_grouped_query_repeats(folded, 4) == 1 and five_dimensional(folded) == []
    [attention] = [n for n in folded.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert attention.kwargs["enable_gqa"] is True and attention.args[1].meta["val"].shape[1] == 4


@pytest.mark.usefixtures("search_once")
@pytest.mark.parametrize("model, inputs, what", [
    ('examples.hf_models:HFCausalLM(family="Falcon", kv_heads=8)', "input input_ids : int64[2, 16] in [0, 128)\n",
     "lifted"),
    ("examples.hf_models:HFWhisper()", "input input_features : float32[2, 16, 32]\n"
                                       "input decoder_input_ids : int64[2, 8] in [0, 128)\n", "frozen"),
    ("examples.vision_models:HFSwin()", "input pixel_values : float32[2, 3, 32, 32]\n", "drawn"),
], ids=["falcon", "whisper", "swin"])
def test_families_with_constants_frozen_weights_or_random_depth_train_under_the_search(pools, compile_par, model,
                                                                                     inputs, what):
    """Three families, nothing written but the bound: Falcon splits its fused projection with an index list
    (constants export lifts), Whisper freezes its encoder's positions, Swin drops residual branches at
    random per sample (stochastic depth's `rand`). Each plan equals serial (outputs, every gradient)."""
    compiled = compile_par(f"mesh tp = 2\nmodel {model}\n{inputs}memory <= 60 %\n")
    if what == "lifted":
        assert [v.tolist() for v in compiled.bound.constant_values.values()] == [[-2], [-1]]
    elif what == "frozen":
        assert [p.name for p in compiled.program.parameters if not p.requires_grad] == [
            "model.model.encoder.embed_positions.weight"]
    else:
        assert "TRAINING_ONLY" in compiled.source and "drop_path" in compiled.source
    check(pools, compiled)


@pytest.mark.parametrize("plan", ["memory <= 60 %\n", "layout {\n  input_ids : S(0)\n  pixel_values : S(0)\n}\n"])
def test_clip_contrastive_loss_under_the_search_and_data_parallel(pools, compile_par, plan):
    """CLIP as the library writes it, its loss contrasting every caption of the batch with every image:
    under the search on tp 2, and data parallel, where each rank's captions meet the whole batch's
    images (the similarity matrix's rows split), both equal to serial."""
    compiled = compile_par("mesh tp = 2\nmodel examples.more_families:Contrastive()\n"
                           "input input_ids : int64[4, 8] in [0, 64)\ninput pixel_values : float32[4, 3, 32, 32]\n"
                           + plan)
    check(pools, compiled)


def _example(name: str, *replaced: tuple[str, str]) -> str:
    with open(os.path.join(REPO, "examples", name), encoding="utf-8") as handle:
        text = handle.read()
    for old, new in replaced:
        assert old in text, (name, old)
        text = text.replace(old, new)
    return text


QWEN3_TP4_KV2 = ("mesh tp = 4\nmodel examples.hf_models:HFCausalLM(family=\"Qwen3\", kv_heads=2)\n"
                 "input input_ids : int64[2, 16] in [0, 128)\nlayout {\n" +
                 "".join(f"  model.model.layers.*.{name}\n" for name in LLAMA_NAMES) + "  output : B\n}\n")


@pytest.mark.parametrize("text, forward, backward", [
    # 2 key/value heads over 4 ranks, eager attention (matmul): each layer's two all-reduces each way, and
    # in backward one all-gather per projection of its repeated weight's gradient
    (("hf_llama_tp4.par", ("HFLlama(layers=2,", "HFLlama(layers=2, kv_heads=2,")),
     {"all_reduce": 5}, {"all_reduce": 5, "all_gather": 4}),
    # Qwen3 (SDPA) normalises each key head (RMSNorm over its features) between the projection and the
    # repeat: an op that treats every head alike, so its 2 heads over 4 ranks are regrouped through it
    (QWEN3_TP4_KV2, {"all_reduce": 2}, {"all_reduce": 3, "all_gather": 2}),
])
def test_key_value_heads_fewer_than_the_ranks_are_regrouped(pools, compile_par, text, forward, backward):
    """Megatron's layers written on more ranks than the model has key/value heads: no rank can hold a head
    of its own, and the traced graph split each head's features across ranks, with all-to-alls in every
    layer each way. Regrouped, each rank computes the one key/value head its query heads read (the
    projection's weight repeated by heads before the linear, held whole on tp): Megatron's all-reduces,
    no all-to-all, equal to serial."""
    text = text if isinstance(text, str) else _example(*text)
    compiled = compile_par(text)
    assert _nonzero(compiled.program.collective_counts()) == {"forward": forward, "backward": backward}
    assert not [note for note in compiled.program.notes if note.code in ("N001", "N002")]
    layouts = {p.name: p.layout.render(compiled.program.mesh) for p in compiled.program.parameters}
    assert layouts["model.model.layers.0.self_attn.k_proj.weight"] == "B"
    assert layouts["model.model.layers.0.self_attn.q_proj.weight"] == "S(0)"
    regrouped = compiled.bound.regrouped
    assert regrouped and len(regrouped) % 2 == 0 and regrouped[0].ranks // regrouped[0].heads == 2  # k, v a layer
    from pardsl.planning.cost import default_machine, estimate
    from pardsl.tools.explain import report
    assert f"substitutions: key/value heads regrouped in {len(regrouped)} projections" in \
        report(compiled, estimate(compiled, default_machine()))
    check(pools, compiled)
    kept = compile_par(text.replace("layout {", "substitute regroup_heads : off\nlayout {"))
    assert not kept.bound.regrouped and "all_to_all" in _nonzero(kept.program.collective_counts())["forward"]


def test_heads_are_regrouped_on_tensor_parallel_axes_only(compile_par):
    """A weight split over more data-parallel ranks than there are key/value heads (ZeRO-3 on dp 4 of 2
    heads, its inputs' layouts written or not) is stored split and gathered whole for its op: nothing is
    computed in parts, and no head is regrouped. One key/value head over 2 ranks of tensor parallelism under SDPA is, and SDPA then reads the
    2 regrouped heads themselves (enable_gqa)."""
    zero3 = _example("llama_zero3.par", ("mesh   dp = 2", "mesh   dp = 4"), ("int64[batch=4, seq=16]", "int64[8, 16]"),
                     ("int64[batch, seq]", "int64[8, 16]"),
                     ("llama_causal_lm(layers=2)", "llama_causal_lm(layers=2, kv_heads=2)"))
    written = compile_par(zero3)
    assert not written.bound.regrouped
    assert not [note for note in written.program.notes if note.code in ("N001", "N002")]
    # the inputs' layouts left to the completion: the weights' S(0) alone still says ZeRO-3, not Megatron
    unwritten = compile_par("\n".join(line for line in zero3.splitlines()
                                      if not line.strip().startswith(("input_ids ", "labels "))), "unwritten.par")
    assert not unwritten.bound.regrouped
    sdpa = compile_par(_example("hf_llama_tp2.par", ("HFLlama(layers=2,", "HFLlama(layers=2, kv_heads=1,")))
    assert len(sdpa.bound.regrouped) == 4
    assert _nonzero(sdpa.program.collective_counts()) == {"forward": {"all_reduce": 4},
                                                         "backward": {"all_reduce": 4, "all_gather": 4}}
    attention = [s for s in sdpa.program.statements if s.instruction.callee == "aten.scaled_dot_product_attention.default"]
    assert len(attention) == 2 and all(("enable_gqa", Text("True")) in s.instruction.kwargs for s in attention)
