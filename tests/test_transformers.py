"""GPT-, LLaMA- and BERT-style models under Megatron plans: exact collectives per phase, ≡ serial."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pardsl.compiler import compile_file
from pardsl.language.diagnostics import CompileError

from .test_distributed import check

# Per model: n_layer = 2. Megatron: 2 all-reduces forward and 2 backward per layer, plus the embedding's
# forward all-reduce (vocabulary parallel) and the LM head input's backward all-reduce (column parallel).
EXPECTED = {
    "gpt": {"forward": {"all_reduce": 5}, "backward": {"all_reduce": 5}},
    "llama": {"forward": {"all_reduce": 5}, "backward": {"all_reduce": 5}},
    "bert": {"forward": {"all_reduce": 4}, "backward": {"all_reduce": 4}},  # replicated embeddings and pooler
}


def _nonzero(counts):
    return {phase: {k: v for k, v in kinds.items() if v} for phase, kinds in counts.items()}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("model", ["gpt", "llama", "bert"])
def test_megatron_plan_counts_and_equivalence(pools, model, tp):
    compiled = compile_file(f"examples/{model}_tp{tp}.par")
    assert _nonzero(compiled.program.collective_counts()) == EXPECTED[model]
    report = check(pools, compiled)
    assert _nonzero(report["collectives"]) == EXPECTED[model]


def test_fused_qkv_split_plainly_is_converted_not_miscomputed(pools, compile_par):
    text = open("examples/gpt_tp2.par").read().replace("S(0, blocks=3)", "S(0)")
    compiled = compile_par(text)
    counts = compiled.program.collective_counts()
    assert sum(counts["forward"].values()) > 5  # the q/k/v cut needs a conversion
    check(pools, compiled)


def test_blocked_split_needs_divisible_blocks(compile_par):
    text = open("examples/gpt_tp2.par").read().replace("c_attn.weight : S(0, blocks=3)", "c_attn.weight : S(0, blocks=5)")
    with pytest.raises(CompileError) as caught:
        compile_par(text)
    [error] = caught.value.diagnostics  # one line, one error: h.0's, naming h.1 in a note
    assert error.code == "E054" and "not divisible by tp = 2 × 5 blocks" in error.message
    assert "h.0.attn.c_attn.weight`" in error.message and error.notes[-1].startswith("also for `")
    assert error.notes[-1].endswith("h.1.attn.c_attn.weight`")


def test_unequal_blocks_need_a_dim_their_sizes_divide_and_no_empty_block(compile_par):
    original = open("examples/gpt_tp2.par").read()
    text = original.replace("c_attn.weight : S(0, blocks=3)", "c_attn.weight : S(0, blocks=[5, 1, 1])")
    with pytest.raises(CompileError) as caught:
        compile_par(text)
    [error] = caught.value.diagnostics
    assert error.code == "E054" and "not divisible by tp = 2 × 7 (blocks sized [5, 1, 1])" in error.message
    text = original.replace("c_attn.weight : S(0, blocks=3)", "c_attn.weight : S(0, blocks=[2, 0, 1])")
    with pytest.raises(CompileError) as caught:
        compile_par(text)
    [error] = caught.value.diagnostics
    line = next(i for i, written in enumerate(text.splitlines(), 1) if "blocks=[2, 0, 1]" in written)
    assert error.code == "E057" and error.message == ("S(0, blocks=[2, 0, 1]): blocks must be at least 1, and "
                                                      "each block's size")
    assert (error.span.line, error.span.column) == (line, text.splitlines()[line - 1].index("S(0") + 1)


def test_vocabulary_parallel_embedding_is_a_masked_lookup():
    source = compile_file("examples/llama_tp2.par").source
    assert 'rt.masked_embedding(self.embed_tokens_weight, input_ids, "tp")' in source
    assert "embedding__B = rt.all_reduce(embedding, \"tp\")" in source


def test_grouped_query_heads_split_with_the_query_heads():
    compiled = compile_file("examples/llama_tp2.par")
    k_proj = next(p for p in compiled.program.parameters if p.name == "layers.0.self_attn.k_proj.weight")
    assert k_proj.local_shape == (16, 64)  # 4 KV heads of 8 over 2 ranks
    assert "aten.scaled_dot_product_attention.default" in compiled.source


def test_unsupported_op_names_the_op_and_the_module(compile_par):
    with pytest.raises(CompileError) as caught:
        compile_par("mesh tp = 2\nmodel tests.test_transformers:Noisy()\ninput x : float32[4, 8]\n")
    [error] = caught.value.diagnostics
    assert error.code == "E060" and "aten.scaled_dot_product_attention.default" in error.message
    assert error.notes[0] == "used in inner"


GPT2_DROPOUT = open("examples/hf_gpt2_tp2.par").read().replace('attention="eager")', 'attention="eager", dropout=0.1)')


@pytest.mark.parametrize("text", [
    GPT2_DROPOUT,  # Megatron: attention weights' dropout split by heads, the residuals' after the all-reduce
    GPT2_DROPOUT.replace("mesh   tp = 2", "mesh   tp = 2\nmemory <= 60 %").split("layout {")[0],  # searched
    'mesh dp = 2\nmodel examples.hf_models:HFGPT2(attention="eager", dropout=0.2)\n'
    "input input_ids : int64[4, 16] in [0, 256)\ninput labels : int64[4, 16] in [0, 256)\n"
    "layout {\n  input_ids : S(0)\n  labels : S(0)\n}\n",  # data parallel, the library's own loss
], ids=["megatron", "searched", "data-parallel"])
def test_dropout_draws_serials_masks_under_any_layout(pools, round_figures, compile_par, text):
    """GPT-2 with dropout 0.1 (embeddings, attention weights, residuals) equals serial: each rank draws the
    whole tensor's mask as serial's call does and keeps its part (the check restores the generator serial
    started from). The plan's collectives are the same as without dropout (under the round figures; under
    gloo's defaults the searched plan with dropout has one all-gather more forward than without, and so had
    it under the round figures on a loaded machine while the solver's limits were wall-clock seconds)."""
    compiled = compile_par(text)
    assert "rt.dropout(" in compiled.source and "aten.dropout" not in compiled.source
    without = compile_par(text.replace("dropout=0.1", "dropout=0.0").replace("dropout=0.2", "dropout=0.0"))
    assert compiled.program.collective_counts() == without.program.collective_counts()
    check(pools, compiled)


def test_attention_dropout_inside_the_fused_kernel_is_refused_with_what_to_write(compile_par):
    with pytest.raises(CompileError) as caught:
        compile_par(GPT2_DROPOUT.replace('attention="eager", ', ""))
    [error] = caught.value.diagnostics
    assert error.message == ("operation `aten.scaled_dot_product_attention.default` with dropout_p=0.1 (pardsl "
                             "supports dropout_p=0.0) is not supported")
    assert 'eager attention (Hugging Face\'s attn_implementation="eager")' in error.notes[-1]


class _Inner(__import__("torch").nn.Module):
    def forward(self, x):  # the fused attention's dropout, drawn per rank's heads inside the kernel
        return __import__("torch").nn.functional.scaled_dot_product_attention(x, x, x, dropout_p=0.5)


class Noisy(__import__("torch").nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Inner()

    def forward(self, x):
        return self.inner(x)


@st.composite
def llama_plans(draw):
    n_head = draw(st.sampled_from([2, 4]))
    n_kv_head = draw(st.sampled_from([h for h in (1, 2, 4) if n_head % h == 0]))
    head_dim = draw(st.sampled_from([4, 8]))
    d_ff = draw(st.sampled_from([16, 32]))
    entries = []
    for proj in ("q_proj", "k_proj", "v_proj"):
        splittable = (n_head if proj == "q_proj" else n_kv_head) % 2 == 0
        entries.append(f"layers.*.self_attn.{proj}.weight : {draw(st.sampled_from(['S(0)', 'B'] if splittable else ['B']))}")
    entries.append(f"layers.*.self_attn.o_proj.weight : {draw(st.sampled_from(['S(1)', 'B'] if n_head % 2 == 0 else ['B']))}")
    for proj in ("gate_proj", "up_proj"):
        entries.append(f"layers.*.mlp.{proj}.weight : {draw(st.sampled_from(['S(0)', 'B']))}")
    entries.append(f"layers.*.mlp.down_proj.weight : {draw(st.sampled_from(['S(1)', 'B']))}")
    entries.append(f"embed_tokens.weight : {draw(st.sampled_from(['S(0)', 'S(1)', 'B']))}")
    entries.append(f"lm_head.weight : {draw(st.sampled_from(['S(0)', 'S(1)', 'B']))}")
    return (f"mesh tp = 2\nmodel examples.language_models:Llama(vocab_size=64, n_layer=1, n_head={n_head}, "
            f"n_kv_head={n_kv_head}, d_model={n_head * head_dim}, d_ff={d_ff})\n"
            "input input_ids : int64[2, 8] in [0, 64)\nlayout {\n" + "".join(f"  {e}\n" for e in entries) + "}\n")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=llama_plans())
def test_random_llama_sizes_and_splits_equal_serial(pools, compile_par, text):
    check(pools, compile_par(text))


@pytest.mark.parametrize("reduction, x_layout, collectives", [
    ("sum", "S(0)", {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}),  # P loss; a DP bucket
    # a split mean, returned whole: the local sum and count of targets in one all-reduce
    ("mean", "S(0)", {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}),
    ("none", "S(0)", {"forward": {}, "backward": {"all_reduce": 1}}),
    ("mean", "B", None),
])
def test_cross_entropy_loss(pools, compile_par, reduction, x_layout, collectives):
    compiled = compile_par(f"mesh dp = 2\nmodel tests.zoo:Classifier(d=16, classes=8, reduction=\"{reduction}\")\n"
                           "input x : float32[8, 16]\ninput labels : int64[8] in [0, 8)\n"
                           f"layout {{\n  x : {x_layout}\n  labels : {x_layout}\n  *.weight : B\n  *.bias : B\n}}\n")
    if collectives is not None:
        assert _nonzero(compiled.program.collective_counts()) == collectives
    check(pools, compiled)


@pytest.mark.parametrize("output, dtype, form, forward", [
    ("", "float32", "mean=('dp',)", [("all_reduce", 8)]),  # returned whole: the sum and count in one all-reduce
    ("", "bfloat16", "mean=('dp',)", [("all_reduce", 8)]),  # reduced in float32, cast back
    ("  output : P\n", "float32", "counts=('dp',)", [("all_reduce", 4)]),  # written partial: the count alone
])
def test_a_split_mean_loss_returned_whole_reduces_its_sum_and_count_at_once(pools, compile_par, output, dtype,
                                                                             form, forward):
    """Over a split batch, the mean loss is every rank's summed losses over every rank's count of targets
    (ignored ones, uneven per rank, left out). Returned whole, it takes the rule's `mean` form: both numbers
    in one all-reduce, where the partial mean (`counts`) and its all-reduce at the output took two. The
    generated line says what its all-reduce carries."""
    compiled = compile_par("mesh dp = 2\nmodel tests.zoo:Classifier(d=16, classes=8, reduction=\"mean\", "
                           f"ignored_class=3, dtype=\"{dtype}\")\ninput x : {dtype}[8, 16]\n"
                           "input labels : int64[8] in [0, 8)\n"
                           "layout {\n  x : S(0)\n  labels : S(0)\n  *.weight : B\n  *.bias : B\n" + output + "}\n")
    assert form in compiled.source
    assert [(c.kind, c.bytes) for c in compiled.program.collectives if c.phase == "forward"] == forward
    what = "sum and count of targets" if "mean" in form else "count of targets"
    assert f"all-reduce {forward[0][1]} B over dp (forward): {what}" in compiled.source
    check(pools, compiled)


@pytest.mark.parametrize("options, backward", [
    ('reduction="mean"', 1),
    ('reduction="sum", label_smoothing=0.1', 1),
    ('reduction="none", ignored_class=0', 1),
    ('reduction="mean", label_smoothing=0.2, ignored_class=3', 1),
])
def test_vocabulary_parallel_cross_entropy_never_gathers_the_logits(pools, compile_par, options, backward):
    # The head is column parallel, so its logits are split over the classes: the loss all-gathers each
    # rank's max, sum of exps and target logit per row in one collective, and its backward is local (the
    # one backward all-reduce is the head's input).
    # (With few classes per row an all-to-all to a split batch moves fewer bytes, and inference takes it.)
    compiled = compile_par(f"mesh tp = 2\nmodel tests.zoo:Classifier(d=16, classes=64, {options})\n"
                           "input x : float32[8, 16]\ninput labels : int64[8] in [0, 64)\n"
                           "layout {\n  head.weight : S(0)\n  head.bias : S(0)\n}\n")
    assert "rt.cross_entropy(" in compiled.source
    assert _nonzero(compiled.program.collective_counts()) == {"forward": {"all_gather": 1},
                                                             "backward": {"all_reduce": backward}}
    check(pools, compiled)


@pytest.mark.parametrize("mesh, weight, dtype, expected", [
    ("tp = 4", "S(0)", "float32", {"tp:all_gather": 1}),
    ("tp = 2", "S(0)", "bfloat16", {"tp:all_gather": 1}),
    ("dp = 2, tp = 2", "[S(0), S(0)]", "float32", {"dp:all_gather": 1, "tp:all_gather": 1}),  # classes over both
])
def test_vocabulary_parallel_cross_entropy_gathers_each_ranks_row_statistics_once_per_axis(
        pools, compile_par, mesh, weight, dtype, expected):
    """Each rank's max, sum of exps below it, target logit and logit sum (label smoothing) per row, in one
    all-gather per axis; every rank combines them alike (the max of the maxima, each sum rescaled to it).
    Float32 statistics for a bfloat16 head. A sum of exps taken as it is, without rescaling to the global
    max, fails the float32 cases: the ranks' maxima differ."""
    compiled = compile_par(f"mesh {mesh}\nmodel tests.zoo:Classifier(d=16, classes=64, reduction=\"mean\", "
                           f"label_smoothing=0.1, ignored_class=3, dtype=\"{dtype}\")\n"
                           f"input x : {dtype}[8, 16]\ninput labels : int64[8] in [0, 64)\n"
                           f"layout {{\n  head.weight : {weight}\n  head.bias : {weight}\n}}\n")
    by_axis = compiled.program.collective_counts_by_axis()
    assert by_axis["forward"] == expected
    ranks = 4 if mesh == "tp = 4" else 2  # per axis
    loss = [c.bytes for c in compiled.program.collectives if "classes split" in c.reason]
    assert loss == [8 * 4 * 4 * (ranks - 1)] * len(expected)  # 8 rows, 4 statistics, float32, from each other rank
    check(pools, compiled)


def test_vocabulary_parallel_cross_entropy_with_data_parallel_batch(pools, compile_par):
    compiled = compile_par("mesh dp = 2, tp = 2\nmodel tests.zoo:Classifier(d=16, classes=64, reduction=\"sum\")\n"
                           "input x : float32[8, 16]\ninput labels : int64[8] in [0, 64)\n"
                           "layout {\n  x : S(0) @ dp\n  labels : S(0) @ dp\n  head.weight : S(0) @ tp\n"
                           "  head.bias : S(0) @ tp\n}\n")
    by_axis = compiled.program.collective_counts_by_axis()
    # tp: the loss's statistics per row, in one all-gather; dp: the summed loss's partial sums, once
    assert by_axis["forward"] == {"dp:all_reduce": 1, "tp:all_gather": 1}
    check(pools, compiled)


class ReturnsACacheInATuple(__import__("torch").nn.Module):
    """A forward returning (output, cache, hidden) as a tuple, as generation-minded forwards may."""

    def __init__(self):
        super().__init__()
        self.first, self.second = (__import__("torch").nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        from transformers import DynamicCache

        hidden = self.first(x)
        return self.second(hidden), DynamicCache(), hidden


def test_a_key_value_cache_in_a_returned_tuple_is_left_out_and_the_rest_runs_equal_to_serial(compile_par, pools):
    compiled = compile_par("mesh tp = 2\nmodel tests.test_transformers:ReturnsACacheInATuple()\n"
                           "input x : float32[4, 8]\nlayout {\n  first.weight : S(0)\n  second.weight : S(1)\n}\n")
    assert len(compiled.bound.outputs) == 2
    assert compiled.program.collective_counts()["forward"]["all_reduce"] == 1
    check(pools, compiled)
