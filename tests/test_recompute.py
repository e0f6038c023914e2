"""Activation recomputation (`recompute`): the program's regions, their collectives and memory, outputs and
gradients bit-equal to the plan without it, and the mistakes a file can make."""

import collections
import functools
import os
import re
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pardsl.language.diagnostics import CompileError

from .conftest import run_on

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_TP2 = open(os.path.join(REPO, "examples/llama_tp2.par")).read()
HF_LLAMA_TP2 = open(os.path.join(REPO, "examples/hf_llama_tp2.par")).read()
GPT2_DP2_TP2 = open(os.path.join(REPO, "examples/gpt2_train_dp2_tp2.par")).read()


def recomputed(text: str, *lines: str) -> str:
    return text.replace("layout {", "\n".join(lines) + "\n\nlayout {", 1)


def _steps(path: str, inputs: dict, steps: int = 2) -> dict:
    """On every rank: two forward and backward steps of the plan at `path` from serial's initial values,
    every output, every gradient (this rank's shards) and the collectives counted."""
    import pardsl

    torch.manual_seed(0)
    plan = pardsl.load(path)
    model = plan.module()
    model.train()
    model.rt.counter.reset()
    outputs, gradients = [], []
    for step in range(steps):
        torch.manual_seed(100 + step)  # dropout's draws: the same for every plan compared
        result = model(**plan.shard_inputs(**inputs))
        flat = [result] if isinstance(result, torch.Tensor) else [v for v in result.values()] \
            if isinstance(result, dict) else list(result)
        loss = sum((t.float() ** 2).mean() if t.dim() else t.float() for t in flat)
        loss.backward()
        outputs.append([t.detach().clone() for t in flat])
        gradients.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
    summary = model.rt.counter.summary()
    return {"outputs": outputs, "gradients": gradients, "counts": summary["collectives"],
            "by_axis": summary["collectives_by_axis"]}


def _bit_equal(a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) for xs, ys in zip(a["outputs"], b["outputs"]) for x, y in zip(xs, ys)) and \
        all(ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)
            for ga, gb in zip(a["gradients"], b["gradients"]))


# the plan without recomputation's steps, by file, inputs and ranks: each policy's test compares with the same run
_PLAIN_RUNS: dict[tuple, list] = {}


def _compare(pools, tmp_path, text: str, recompute_lines: tuple[str, ...], inputs: dict, ranks: int):
    from pardsl.compiler import compile_text

    plain, again = tmp_path / "plain.par", tmp_path / "recomputed.par"
    plain.write_text(text)
    again.write_text(recomputed(text, *recompute_lines))
    key = (text, ranks, tuple((name, value.numpy().tobytes()) for name, value in sorted(inputs.items())))
    if key not in _PLAIN_RUNS:
        _PLAIN_RUNS[key] = pools(ranks).run_on_every_rank(functools.partial(_steps, str(plain), inputs))
    results = [_PLAIN_RUNS[key], pools(ranks).run_on_every_rank(functools.partial(_steps, str(again), inputs))]
    return results, compile_text(plain.read_text()), compile_text(again.read_text())


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recomputed_layers_give_bit_equal_outputs_and_gradients_and_the_planned_collectives(pools, tmp_path, policy):
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    line = "recompute layers.*" + ("" if policy == "full" else " : selective")
    (plain, again), compiled_plain, compiled = _compare(pools, tmp_path, LLAMA_TP2, (line,), {"input_ids": ids}, 2)
    # each layer's down projection is made once (a stand-in in backward); under `selective` its output
    # projection too, whose all-reduce's result is kept
    assert compiled.source.count("= rt.made_once(") == (4 if policy == "selective" else 2)
    for rank in range(2):
        assert _bit_equal(plain[rank], again[rank]), f"rank {rank}"
    planned = compiled.program.collective_counts()
    before = compiled_plain.program.collective_counts()
    # under `full`, the attention's all-reduce of each layer is issued again in backward; the residual sum's
    # that ends the layer is not (the region ends at its last op that keeps something: what follows runs
    # once); under `selective` none is
    extra = 2 * 1 * 2 if policy == "full" else 0  # 2 layers × 1 all-reduce, 2 steps
    if policy == "full":
        assert re.search(r"= rt\.recompute\(layers_0, 'full', .*\n.*= aten\.add\.Tensor\(.*\n.*= rt\.all_reduce\(",
                         compiled.source)
    assert planned["forward"] == before["forward"]
    assert planned["backward"]["all_reduce"] == before["backward"]["all_reduce"] + extra // 2
    for rank in range(2):
        assert again[rank]["counts"]["forward"] == plain[rank]["counts"]["forward"]
        assert again[rank]["counts"]["backward"]["all_reduce"] == plain[rank]["counts"]["backward"]["all_reduce"] + extra
        assert again[rank]["counts"]["backward"]["all_reduce"] == 2 * planned["backward"]["all_reduce"]


def test_what_a_recomputed_layer_keeps_is_counted(compile_par):
    """Under `full`, sixteen layers keep their inputs alone, and backward makes one layer's activations
    again at a time: under a third of the activations kept without (the head's are kept as before; each
    MLP's silu is made again in backward either way, pardsl/passes/fused_swiglu.py). Under
    `selective` the matrix products', attention's and collectives' results are kept too: on this narrow
    model (MLP twice the width) more than autograd keeps without recomputation."""
    text = LLAMA_TP2.replace("n_layer=2", "n_layer=16")
    plain = compile_par(text).program.memory()["activations_per_rank"]
    full = compile_par(recomputed(text, "recompute layers.*")).program.memory()["activations_per_rank"]
    selective = compile_par(recomputed(text, "recompute layers.* : selective")).program.memory()["activations_per_rank"]
    per_layer_input = 2 * 16 * 64 * 4  # [batch, seq, hidden] float32, twice: the residual and its all-reduced copy
    head = 2 * 16 * 64 * 4 * 2 + 2 * 16 * 4 + 2 * 16 * 128 * 4  # the final norm's, and the logits' shard
    one_layer = (plain - head) // 16  # what a layer keeps without recomputation, made again in backward
    assert full == 16 * 2 * per_layer_input + head + one_layer
    assert full < plain / 3
    assert full < selective


def _long_hf_llama(attention: str = "sdpa", precision: str = "") -> str:
    """The tp 2 Hugging Face LLaMA of the examples with 8 layers and a sequence of 256."""
    return HF_LLAMA_TP2.replace('HFLlama(layers=2, attention="sdpa")',
                                f'HFLlama(layers=8, positions=256, attention="{attention}")') \
        .replace("int64[2, 16]", "int64[4, 256]").replace("layout {", f"{precision}\nlayout {{", 1)


def test_under_a_precision_policy_a_recomputed_layer_is_one_region_with_its_casts(compile_par):
    """The policy's casts of a layer's weights stand between its ops: they are made again with the layer
    rather than cutting it into a region per product (each keeping its inputs), so full recomputation
    saves about as much as in float32: 0.316 of the activations kept without, 0.304 in float32 (its norms
    keep their inputs in bf16 either way, pardsl/passes/fused_norms.py)."""
    text = _long_hf_llama(precision="precision params bf16, reduce fp32")
    plain = compile_par(text).program.memory()["activations_per_rank"]
    compiled = compile_par(recomputed(text, "recompute model.model.layers.*"))
    assert compiled.source.count("= rt.recompute(") == 8
    (region,) = [s for s in compiled.program.statements if s.target.startswith("add_") and s.body][:1]
    assert any(s.instruction.callee == "rt.cast" for s in region.body)
    assert compiled.program.memory()["activations_per_rank"] < plain / 3


def test_selective_recomputation_makes_unfused_attention_again(compile_par):
    """Attention in its reference form (two batched products with a softmax between them, a sequence² per
    head): `selective` keeps the linear layers' results and makes the scores and softmax again, as
    Megatron's selective recomputation does, so nothing a layer keeps grows with the square of the
    sequence; the weighted values, a product no larger than a linear layer's, are kept."""
    text = _long_hf_llama(attention="eager")
    plain = compile_par(text).program
    compiled = compile_par(recomputed(text, "recompute model.model.layers.* : selective"))
    selective = compiled.program
    scores = re.findall(r"= (\S+)\(aten\.matmul\.default, .*\[4, 8, 256, 256\]", compiled.source)
    assert not scores and len(re.findall(r"= aten\.matmul\.default\(.*\[4, 8, 256, 256\]", compiled.source)) == 8
    weighted = re.findall(r"= rt\.kept\(aten\.matmul\.default, .*\[4, 8, 256, 8\]", compiled.source)
    assert len(weighted) == 8
    def per_head_square(value):  # [batch, heads, sequence, sequence]; the causal mask is one for all heads
        return value["local_shape"][-2:] == [256, 256] and value["local_shape"][-3] > 1

    assert not [name for name, v in selective.values.items() if v.get("held_here") and per_head_square(v)]
    assert any(v.get("kept_for_backward") and per_head_square(v) for v in plain.values.values())
    assert selective.memory()["activations_per_rank"] < 0.5 * plain.memory()["activations_per_rank"]


def test_a_product_that_only_a_kept_collective_reads_is_made_once(compile_par):
    """Megatron's layers, the residual stream summed partially over tp: the output and down projections'
    partial sums are read only by the all-reduce, whose result `selective` keeps, and by residual adds that
    keep nothing. So they are neither kept nor made again: `rt.made_once`. The column-parallel products,
    which attention and the MLP keep or read, are kept; full recomputation makes the down projection once."""
    compiled = compile_par(recomputed(LLAMA_TP2, "recompute layers.* : selective"))
    once = re.findall(r"(\w+) = rt\.made_once\(aten\.linear\.default, \w+, self\.(\w+)\)", compiled.source)
    assert [weight for _, weight in once] == [f"layers_{layer}_{projection}_weight" for layer in (0, 1)
                                              for projection in ("self_attn_o_proj", "mlp_down_proj")]
    assert "made once: backward needs nothing of it" in compiled.source
    held = {name for name, *_ in compiled.program.held_for_backward()}
    assert not held & {name for name, _ in once}
    assert {"linear", "linear_1", "linear_2", "linear_4", "linear_5"} <= held  # the column-parallel products
    # under `full` the all-reduce is issued again and reads the output projection: only the down projection
    full = compile_par(recomputed(LLAMA_TP2, "recompute layers.*"), "full.par")
    once = re.findall(r"(\w+) = rt\.made_once\(aten\.linear\.default, \w+, self\.(\w+)\)", full.source)
    assert [weight for _, weight in once] == [f"layers_{layer}_mlp_down_proj_weight" for layer in (0, 1)]


def test_a_selective_region_keeps_collectives_results_but_makes_local_conversions_again(compile_par):
    """Hugging Face's LLaMA on tp 2: in a selective region the residual sum's all-reduce results are kept and
    given back; the residual's local conversion to a partial sum (B→P: the value on one rank, zeros on the
    other) is made again like any cheap op, so the estimate does not count it as kept."""
    compiled = compile_par(recomputed(HF_LLAMA_TP2, "recompute model.model.layers.* : selective"))
    inside = re.findall(r"^ {12}(\w+) = rt\.(all_reduce|to_partial)\(", compiled.source, re.M)
    assert {kind for _, kind in inside} == {"all_reduce", "to_partial"}
    held = {name for name, _, _, again in compiled.program.held_for_backward() if not again}
    assert {name for name, kind in inside if kind == "all_reduce"} <= held
    assert not {name for name, kind in inside if kind == "to_partial"} & held


@pytest.mark.parametrize("policy, conversion, collectives, marked", [
    ("selective", "rt.all_reduce", (("all_reduce", "forward"),), "rt.made_once"),  # its result given back
    ("selective", "rt.split", (), "rt.kept"),  # a local conversion, made again from the product: it is needed
    ("full", "rt.all_reduce", (("all_reduce", "forward"),), "aten.linear.default"),  # issued again: needed
])
def test_a_product_is_made_once_only_where_nothing_backward_needs_depends_on_it(policy, conversion, collectives,
                                                                               marked):
    """A product read only by a conversion whose result a later op keeps: under `selective` made once where
    the conversion communicates (its result is kept and given back), kept where it is a local one, made
    again from it; under `full` the collective is issued again from it, so it is made again."""
    from pardsl.model.saved_for_backward import Kept
    from pardsl.passes.recompute import _marked
    from pardsl.program.ir import Collective, Instruction, Statement, Text, Var

    body = (
        Statement("linear", Instruction("compute", "aten.linear.default", (Var("x"), Var("self.w"))), "", node="linear"),
        Statement("moved", Instruction("convert", conversion, (Var("linear"), Text('"tp"'))), "",
                  tuple(Collective(kind, "tp", phase, 64, "linear", "") for kind, phase in collectives), node="linear"),
        Statement("mul", Instruction("compute", "aten.mul.Tensor", (Var("moved"), Var("moved"))), "", node="mul"),
    )
    region = Statement("mul", Instruction("recompute", "rt.recompute", (Text("layer"), Text("'selective'"), Var("x"))),
                       "", body=body)
    kept = Kept(frozenset({"linear"}), frozenset({("mul", "linear")}), {}, frozenset())
    callees = [statement.instruction.callee for statement in _marked(region, kept, policy).body]
    assert callees == [marked, conversion, "aten.mul.Tensor"]


class _OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_a_selective_region_gives_its_kept_products_back_and_makes_the_rest_again():
    """In one process, a region of a kept linear, two pointwise ops and a kept batched product of their
    result with another activation (unfused attention's weighted values): under `selective` backward makes
    the pointwise ops again but neither product (backward's own products aside), under `full` all of them;
    the gradients are serial's bits. A second backward, or a kept result changed in place, is refused."""
    from pardsl.runtime.recompute import kept, recompute

    aten = torch.ops.aten
    rt = types.SimpleNamespace(region=None)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    v = torch.randn(2, 8, 3, requires_grad=True)

    def layer(x, v, in_place=False):
        h = kept(rt, aten.linear.default, x, w)
        if in_place:
            h.add_(1.0)
        return kept(rt, aten.matmul.default, aten.sin.default(aten.relu.default(h)).view(2, 2, 8), v)

    found = {}
    for policy in (None, "full", "selective"):
        w.grad = x.grad = v.grad = None
        with _OpCount() as count:
            out = layer(x, v) if policy is None else recompute(rt, layer, policy, x, v)
            out.sum().backward()
        found[policy] = ({op: count.calls[op] for op in ("mm", "bmm", "relu", "sin")},
                         [x.grad.clone(), w.grad.clone(), v.grad.clone()])
    assert found[None][0] == {"mm": 3, "bmm": 3, "relu": 1, "sin": 1}
    assert found["full"][0] == {"mm": 4, "bmm": 4, "relu": 2, "sin": 2}
    assert found["selective"][0] == {"mm": 3, "bmm": 3, "relu": 2, "sin": 2}
    for policy in ("full", "selective"):
        assert all(map(torch.equal, found[policy][1], found[None][1]))

    out = recompute(rt, layer, "selective", x, v)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran a second time"):
        out.sum().backward()
    out = recompute(rt, functools.partial(layer, in_place=True), "selective", x, v)
    with pytest.raises(RuntimeError, match="changed in place"):
        out.sum().backward()


# `full` in make test-slow: `selective` draws the masks again for a part of the layer, full for all of it
@pytest.mark.parametrize("policy", [pytest.param("full", marks=pytest.mark.slow), "selective"])
def test_recomputed_layers_with_dropout_draw_serials_masks_again(pools, tmp_path, policy):
    """GPT-2 with dropout on dp 2 × tp 2, its gradients in data-parallel buckets, its attention unfused: the
    masks drawn again in backward are the forward's, so every output and gradient is the plan's without
    recomputation; under `selective` the weighted values, made from the dropped-out softmax, are given back
    while the softmax and its mask are made again for their gradient."""
    text = GPT2_DP2_TP2.replace("gpt2_lm_head(layers=2)", 'gpt2_lm_head(layers=2, attention="eager", dropout=0.1)')
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(2))
    line = "recompute transformer.h.*" + (" : selective" if policy == "selective" else "")
    (plain, again), _, compiled = _compare(pools, tmp_path, text, (line,), {"input_ids": ids, "labels": ids}, 4)
    assert compiled.source.count("= rt.kept(aten.matmul.default,") == (2 if policy == "selective" else 0)
    for rank in range(4):
        assert _bit_equal(plain[rank], again[rank]), f"rank {rank}"


def test_the_generated_module_shows_each_region_and_why(compile_par):
    compiled = compile_par(recomputed(LLAMA_TP2, "recompute layers.0 : selective", "recompute layers.1"))
    source = compiled.source
    assert "def layers_0(embedding__B, embedding):" in source
    assert "layers.0 made again in backward (selective: linear layers', fused attention's and collectives' " \
           "results kept; no collective issued again)" in source
    assert "layers.1 made again in backward (full: only its inputs kept; its 1 forward collective issued " \
           "again there)" in source
    assert "= rt.recompute(layers_1, 'full', " in source
    again = [c for c in compiled.program.collectives if c.reason.startswith("made again in backward")]
    assert [(c.kind, c.phase) for c in again] == [("all_reduce", "backward")]


@pytest.mark.parametrize("line, code, column, message", [
    ("recompute layers.* : sometimes", "E080", 22, "`sometimes` is no recomputation policy"),
    ("recompute blocks.*", "E081", 11, "`blocks.*` names no submodule the model's forward calls"),
])
def test_a_recompute_line_that_cannot_be_taken_says_where(compile_par, line, code, column, message):
    with pytest.raises(CompileError) as error:
        compile_par(recomputed(LLAMA_TP2, line))
    (diagnostic,) = error.value.diagnostics
    assert (diagnostic.code, diagnostic.span.column, diagnostic.message) == (code, column, message)
    assert diagnostic.span.line == LLAMA_TP2[:LLAMA_TP2.index("layout {")].count("\n") + 1
    if code == "E081":  # what the file could have named
        assert diagnostic.notes == ("recompute one of layers.0, layers.1, or all of them: `layers.*`",)


def test_a_submodule_named_twice_is_refused(compile_par):
    with pytest.raises(CompileError) as error:
        compile_par(recomputed(LLAMA_TP2, "recompute layers.*", "recompute layers.1 : selective"))
    (diagnostic,) = error.value.diagnostics
    assert diagnostic.code == "E003" and "`layers.1` is recomputed twice" in diagnostic.message


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recomputed_zero3_layers_gather_their_group_again_and_stay_bit_equal(pools, tmp_path, policy):
    """ZeRO-3 (every weight split over dp, a layer's gathered by one all-gather, resharded after forward and
    gathered again for backward): a recomputed layer takes that backward gather for its second run, so
    the collectives are the plan's without recomputation, and outputs and gradients are bit-equal."""
    text = open(os.path.join(REPO, "examples/llama_zero3.par")).read()
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(3))
    line = "recompute model.layers.*" + ("" if policy == "full" else " : selective")
    (plain, again), compiled_plain, compiled = _compare(pools, tmp_path, text, (line,),
                                                        {"input_ids": ids, "labels": ids}, 2)
    assert compiled.program.collective_counts() == compiled_plain.program.collective_counts()
    for rank in range(2):
        assert _bit_equal(plain[rank], again[rank]), f"rank {rank}"
        assert again[rank]["counts"] == plain[rank]["counts"]
    assert "rt.recompute(model_layers_0" in compiled.source
    # under `selective` the layers' linears keep their products' results (rt.kept), given back in backward
    assert ("= rt.kept(aten.linear.default, " in compiled.source) == (policy == "selective")


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recomputed_ring_attention_stays_bit_equal_and_passes_its_chunks_again_only_under_full(pools, tmp_path,
                                                                                              policy):
    """A LLaMA whose sequence is split over cp 2 (ring attention: the key/value chunks passed around the
    ranks): under `full` a layer's ring runs again in backward, its sends issued again; under `selective`
    its result is kept and given back, so backward sends no more than without recomputation. Outputs and
    gradients are bit-equal either way."""
    text = ('mesh cp = 2\nmodel examples.hf_models:HFLlama(layers=2, attention="sdpa")\n'
            "input input_ids : int64[1, 512] in [0, 256)\nmemory <= 60 %\nlayout {\n    input_ids : S(1)\n}\n")
    ids = torch.randint(0, 256, (1, 512), generator=torch.Generator().manual_seed(4))
    line = "recompute model.model.layers.*" + ("" if policy == "full" else " : selective")
    (plain, again), compiled_plain, compiled = _compare(pools, tmp_path, text, (line,), {"input_ids": ids}, 2)
    assert compiled.source.count("= rt.attention(") == 2 and "ring=('cp',)" in compiled.source
    held = {name for name, _, _, again in compiled.program.held_for_backward() if not again}
    attended = set(re.findall(r"(\w+) = rt\.attention\(", compiled.source))
    assert (attended <= held) == (policy == "selective")  # kept under `selective`, made again under `full`
    extra = 2 if policy == "full" else 0  # a send a layer, its keys and values, in each step's backward
    before = compiled_plain.program.collective_counts_by_axis()
    assert compiled.program.collective_counts_by_axis()["backward"]["cp:send"] == before["backward"]["cp:send"] + extra
    for rank in range(2):
        assert _bit_equal(plain[rank], again[rank]), f"rank {rank}"
        assert again[rank]["by_axis"]["forward"] == plain[rank]["by_axis"]["forward"]
        assert again[rank]["by_axis"]["backward"]["cp:send"] == plain[rank]["by_axis"]["backward"]["cp:send"] + 2 * extra


def test_recomputation_lowers_the_measured_peak(pools, compile_par):
    """A sequence of 256 (activations outweigh parameters): each rank's measured peak is lower with every
    layer recomputed, lowest under `full`, and every plan runs equal to serial."""
    text = LLAMA_TP2.replace("int64[2, 16]", "int64[8, 256]")
    peaks, kept = {}, {}
    for name, line in (("plain", ""), ("full", "recompute layers.*"), ("selective", "recompute layers.* : selective")):
        report = run_on(pools, compile_par(recomputed(text, line), f"{name}.par"), steps=2)
        assert report["ok"], report
        peaks[name] = max(report["memory"]["peak_bytes"])
        kept[name] = max(report["memory"]["forward_bytes"])  # what the forward left for backward
    assert peaks["full"] < 0.9 * peaks["plain"], peaks
    assert peaks["full"] < peaks["selective"] < peaks["plain"], peaks
    # two layers: the embedding's output and the head's logits, which no region holds, weigh more than with
    # eight (benchmarks/memory.py measures the targets)
    assert kept["full"] < 0.4 * kept["plain"] and kept["full"] < kept["selective"] < 0.85 * kept["plain"], kept


def test_under_a_bound_the_fewest_layers_are_recomputed_and_the_plan_runs_equal_to_serial(pools, compile_par):
    """One rank, eight layers, a long sequence: a bound of half the serial model's memory is met by
    recomputing five layers (N007), not all eight; four do not meet it."""
    from pardsl.planning.cost import memory_per_rank
    from pardsl.planning.search import memory_limit

    text = LLAMA_TP2.replace("n_layer=2", "n_layer=8").replace("int64[2, 16]", "int64[8, 256]").replace("tp = 2", "tp = 1")
    compiled = compile_par(text + "memory <= 50 %\n")
    (note,) = [n for n in compiled.program.notes if n.code == "N007"]
    assert note.message.startswith("recomputes layers.0 to layers.4 (5 of 8 layers, full) in backward")
    assert not [n for n in compiled.program.notes if n.code == "N003"]
    limit = memory_limit(compiled.bound)
    assert memory_per_rank(compiled.program)["total"] <= limit
    fewer = compile_par(recomputed(text, *(f"recompute layers.{i}" for i in range(4))) + "memory <= 50 %\n")
    assert memory_per_rank(fewer.program)["total"] > limit
    report = run_on(pools, compiled, steps=2)
    assert report["ok"], report


# data parallelism over 2 ranks, under a bound the replicated model does not meet as lowering counts its
# activations
DP_LLAMA_47 = ("mesh dp = 2\nmodel examples.language_models:Llama(vocab_size=256, n_layer=4, n_head=8, n_kv_head=4, "
               "d_model=256, d_ff=512)\ninput input_ids : int64[8, 256] in [0, 256)\nmemory <= 47 %\n")


def test_the_search_counts_activations_as_the_passes_keep_them(compile_par, monkeypatch):
    """The search run once (no weighing) on DP_LLAMA_47 counts activations as the passes keep them (fused
    norms and SwiGLUs keep less), and finds a plan within the bound with nothing recomputed, rated more than
    5 % faster than the plan it finds counting them as lowering holds them: that one shards the weights
    (gathered for use: collectives in every layer) and recomputes two layers on top to fit."""
    from pardsl import compiler
    from pardsl.planning import descent
    from pardsl.planning.cost import default_machine, estimate
    from pardsl.planning.search import memory_limit

    monkeypatch.setattr(compiler, "RECOMPUTATION_STEPS", 0)
    # the known recipes left out: plain data parallelism is one of them, recomputed within the bound as
    # compiled, and would be weighed whatever the search counted
    monkeypatch.setattr(descent, "recipe_plans", lambda *args, **kwargs: [])
    counted_as_kept = compile_par(DP_LLAMA_47)
    shares = compiler._activation_shares
    monkeypatch.setattr(compiler, "_activation_shares", lambda *args: (1.0, shares(*args)[1]))
    counted_as_lowered = compile_par(DP_LLAMA_47, "lowered.par")
    machine, limit = default_machine(), memory_limit(counted_as_kept.bound)
    kept, lowered = estimate(counted_as_kept, machine), estimate(counted_as_lowered, machine)
    assert kept.memory["total"] <= limit and lowered.memory["total"] <= limit
    assert kept.step_s < 0.95 * lowered.step_s, (kept.step_s, lowered.step_s)
    assert counted_as_lowered.program.collective_counts_by_axis()["forward"]["dp:all_gather"] > 0
    (note,) = [n for n in counted_as_lowered.program.notes if n.code == "N007"]
    assert note.message.startswith("recomputes layers.0 to layers.1 (2 of 4 layers")
    assert not [n for n in counted_as_kept.program.notes if n.code == "N007"]


@pytest.mark.slow
def test_under_a_bound_the_plan_weighed_recomputes_nothing_and_runs_equal_to_serial(pools, compile_par, monkeypatch):
    """DP_LLAMA_47 compiled as a user would, recomputation weighed against the layouts: within the bound,
    nothing recomputed, equal to serial."""
    from pardsl.planning import descent
    from pardsl.planning.cost import memory_per_rank
    from pardsl.planning.search import memory_limit

    monkeypatch.setattr(descent, "recipe_plans", lambda *args, **kwargs: [])
    compiled = compile_par(DP_LLAMA_47)
    assert memory_per_rank(compiled.program)["total"] <= memory_limit(compiled.bound)
    assert not [n for n in compiled.program.notes if n.code == "N007"]
    report = run_on(pools, compiled, steps=2)
    assert report["ok"], report


def test_a_bound_that_does_not_bind_costs_one_search_more(compile_par, monkeypatch):
    """The first search counts activations at the share the passes keep of what lowering holds (fused
    norms and SwiGLUs keep less: below 1 on LLaMA). Under a loose bound the next share below it finds the
    same plan, and weighing stops there: two searches, nothing recomputed. Under a tight one it goes on
    while plans get faster."""
    from pardsl import compiler
    from pardsl.planning.cost import DEFAULT_BUCKET_MB, default_machine
    from pardsl.planning.inference import infer
    from pardsl.planning.search import memory_limit

    weights = []
    real = compiler.searched_or_greedy

    def counted(*args, **kwargs):
        weights.append(kwargs["activation_weight"])
        return real(*args, **kwargs)

    monkeypatch.setattr(compiler, "searched_or_greedy", counted)
    text = ("mesh dp = 2\nmodel examples.language_models:Llama(vocab_size=256, n_layer=4, n_head=8, n_kv_head=4, "
            "d_model=256, d_ff=512)\ninput input_ids : int64[8, 256] in [0, 256)\nmemory <= {} %\n")
    loose = compile_par(text.format(90))
    greedy = infer(loose.bound)
    kept, least = compiler._activation_shares(
        greedy, compiler._lowered(greedy, DEFAULT_BUCKET_MB, memory_limit(loose.bound)), default_machine())
    assert least < kept < 1.0
    assert len(weights) == 2 and weights[0] == kept and least < weights[1] < kept
    assert loose.program.collective_counts_by_axis() == {"forward": {}, "backward": {"dp:all_reduce": 2}}
    assert not [n for n in loose.program.notes if n.code in ("N003", "N007")]
    weights.clear()
    compile_par(text.format(40), "tight.par")
    assert len(weights) > 2 and weights == sorted(weights, reverse=True)


def test_weighing_recomputation_stops_at_the_search_budget_and_says_so(compile_par, monkeypatch):
    from pardsl.planning import descent

    monkeypatch.setattr(descent, "SEARCH_BUDGET_S", 0.0)
    compiled = compile_par("mesh dp = 2\nmodel examples.language_models:Llama(vocab_size=256, n_layer=4, n_head=8, "
                           "n_kv_head=4, d_model=256, d_ff=512)\ninput input_ids : int64[8, 256] in [0, 256)\n"
                           "memory <= 50 %\n")
    notes = [n.message for n in compiled.program.notes if n.code == "N006"]
    assert notes == ["the layout search stopped at its time budget of 0 s, after weighing recomputation at 0 of 4 "
                     "shares: the best plan found so far is compiled"]


def test_named_recomputation_is_counted_by_the_search(compile_par):
    """Ring attention over cp 2, every layer named to recompute, under a bound. Counting activations as
    lowering holds them, the search shards the weights over cp (gathered for use, their gradients
    reduce-scattered); counting what the recomputed regions leave, it keeps them whole, which the cost
    model rates faster."""
    from pardsl.compiler import _lowered, _passes_after_lowering
    from pardsl.planning.cost import default_machine, estimate
    from pardsl.planning.descent import CompletedPlan, searched_or_greedy

    text = ('mesh cp = 2\nmodel examples.hf_models:HFLlama(layers=2, attention="sdpa")\n'
            "input input_ids : int64[1, 512] in [0, 256)\nmemory <= 60 %\nrecompute model.model.layers.*\n"
            "layout {\n    input_ids : S(1)\n}\n")
    compiled, machine = compile_par(text), default_machine()
    typed, counted_whole = searched_or_greedy(compiled.bound, machine, lambda typed, limit: _lowered(typed, 25, limit), {})
    assert counted_whole.collective_counts_by_axis()["forward"]["cp:all_gather"] > 0
    counts = compiled.program.collective_counts_by_axis()
    assert "cp:all_gather" not in counts["forward"] and "cp:reduce_scatter" not in counts["backward"]
    recomputed = _passes_after_lowering(counted_whole, typed, None)  # its layers recomputed, as the file names them
    assert estimate(compiled, machine).step_s < estimate(CompletedPlan(typed, recomputed), machine).step_s


def test_recompute_searched_and_named_together_is_refused(compile_par):
    with pytest.raises(CompileError) as error:
        compile_par(recomputed(LLAMA_TP2, "recompute ?", "recompute layers.*"))
    (diagnostic,) = error.value.diagnostics
    assert diagnostic.code == "E003" and diagnostic.message == "`recompute ?` with submodules named to recompute"


def test_recomputed_layers_in_pipeline_stages_run_equal_to_serial(pools, compile_par):
    """1F1B over two stages, four micro-batches: each stage's layer is a region, made again in its backward."""
    compiled = compile_par(open(os.path.join(REPO, "examples/hf_llama_pp2.par")).read() +
                           "recompute model.model.layers.*\n")
    assert compiled.source.count("= rt.recompute(") == 2
    report = run_on(pools, compiled, steps=2)
    assert report["ok"], report
    assert len(report["memory"]["peak_bytes"]) == 2 and all(peak > 0 for peak in report["memory"]["peak_bytes"])
    assert "forward_bytes" not in report["memory"]  # forwards and backwards interleave: no end of forward


def test_a_pipeline_rank_makes_one_region_again_at_a_time_whatever_it_holds_in_flight(pools, compile_par):
    """1F1B over two stages of two recomputed layers, four micro-batches: the first rank holds two
    micro-batches in flight, the second one. Each keeps only its layers' inputs per micro-batch (and one
    mask and rotary tables for all of them); a layer's other activations are made again in its backward,
    one micro-batch at a time. So the first rank's estimate counts its kept activations twice and its
    largest region once, and measured, it holds less
    than one region more than the second rank (counted once per micro-batch in flight, a region more)."""
    from pardsl.planning.cost import pipeline_rank_memory

    text = open(os.path.join(REPO, "examples/hf_llama_pp2.par")).read().replace(
        "layers=2)", 'layers=4, attention="sdpa")').replace("layers.1", "layers.2").replace(
        "int64[8, 16]", "int64[8, 256]") + "recompute model.model.layers.*\n"
    compiled = compile_par(text)
    first = compiled.stages[0].memory()
    again, once = first["activations_made_again_per_rank"], first["activations_shared_by_micro_batches_per_rank"]
    kept = first["activations_per_rank"] - again - once  # once: the mask and rotary tables, shared
    assert again > kept > 0 and once > 0
    held = [pipeline_rank_memory(list(compiled.stages), compiled.pipeline, rank) for rank in range(2)]
    assert held[0]["activations"] == 2 * kept + once + again
    report = run_on(pools, compiled, steps=2)
    assert report["ok"], report
    peaks = report["memory"]["peak_bytes"]
    assert 0 < peaks[0] - peaks[1] < again, (peaks, kept, again)


def test_under_a_bound_a_pipeline_recomputes_layers_of_the_rank_that_holds_most(pools, compile_par):
    """1F1B over two stages of two layers, four micro-batches: the first rank holds the most micro-batches'
    activations, so under a bound that only it exceeds, its layers are recomputed and the second rank's
    are not (N007); every rank then holds to the bound, and the plan runs equal to serial."""
    from pardsl.planning.cost import pipeline_rank_memory

    text = open(os.path.join(REPO, "examples/hf_llama_pp2.par")).read().replace("layers=2", "layers=4").replace(
        "layers.1", "layers.2").replace("int64[8, 16]", "int64[8, 64]")
    plain = compile_par(text)
    held = [pipeline_rank_memory(list(plain.stages), plain.pipeline, rank)["total"] for rank in range(2)]
    assert held[0] > held[1]
    bound = (held[0] + held[1]) // 2  # between the two ranks
    compiled = compile_par(text + f"memory <= {bound // 1024} KiB\n", "bounded.par")
    (note,) = [n for n in compiled.program.notes if n.code == "N007"]
    assert note.message.startswith("recomputes model.model.layers.0")
    assert "layers.2" not in note.message and "layers.3" not in note.message
    assert not [n for n in compiled.program.notes if n.code == "N003"]
    first, second = compiled.stages
    assert first.recomputed_ops and not second.recomputed_ops
    assert max(pipeline_rank_memory(list(compiled.stages), compiled.pipeline, rank)["total"]
               for rank in range(2)) <= compiled.memory_bound
    report = run_on(pools, compiled, steps=2)
    assert report["ok"], report


def test_explain_says_which_layers_are_made_again(compile_par):
    from pardsl.planning.cost import DEFAULTS, estimate
    from pardsl.tools.explain import report

    compiled = compile_par(recomputed(LLAMA_TP2, "recompute layers.0 : selective", "recompute layers.1"))
    text = report(compiled, estimate(compiled, DEFAULTS["gloo"]))
    assert "  made again in backward (selective): matrix products, attention and collective results kept; " \
        "2 ops not made again, since backward needs none of their results" in text
    assert "  made again in backward (full): only its inputs kept" in text
