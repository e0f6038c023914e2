"""The known recipes (Megatron's tensor parallelism with sequence parallelism, FSDP, HSDP, data parallelism)
written for a model from its graph alone, and weighed against the search's plan: the compiled plan is
never rated behind one of them, and note N009 says which one it was weighed against."""

import os
import re

import pytest

from pardsl.compiler import compile_text
from pardsl.language.syntax import parse
from pardsl.model.binding import bind
from pardsl.planning import descent
from pardsl.planning.cost import PRESETS, estimate
from pardsl.planning.recipes import recipes

from tests.test_recipes import GIB, H100, compiled, per_layer, recipe

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def without_layouts(path: str, extra: str = "") -> tuple[str, str]:
    """An example's file with its layout block left out (the search's to fill), and the block it wrote."""
    with open(os.path.join(REPO, path), encoding="utf-8") as handle:
        text = handle.read()
    head, block = text[:text.index("layout {")], text[text.index("layout {"):]
    return head + extra, block


def written_weights(bound, block: str) -> dict[str, str]:
    """What an example's layout block writes for each parameter, by state-dict name."""
    with_block = bind(parse(bound.par.source.text + block, bound.par.source.path))
    return {with_block.parameters[name]: pin.layout.render(with_block.mesh)
            for name, pin in with_block.pins.items() if name in with_block.parameters}


def megatron(bound):
    return next(r for r in recipes(bound, PRESETS["h100-nvlink-ib"]) if r.name.startswith("Megatron TP on tp"))


@pytest.mark.parametrize("path", ["examples/hf_llama_tp2.par", "examples/hf_gpt2_tp2.par", "examples/bert_tp2.par",
                                  "examples/hf_t5_tp2.par"])
def test_megatron_layers_are_recognised_from_the_graph_as_the_examples_write_them(path):
    """Each example written by hand with Megatron's layers: the recipe the compiler writes from the graph
    alone splits every weight the example splits, the same way (GPT-2's Conv1D by its [in, out] weight,
    its fused q/k/v in three blocks; T5's cross attention)."""
    text, block = without_layouts(path)
    bound = bind(parse(text, os.path.join(REPO, path)))
    recipe = megatron(bound)
    wrote = written_weights(bound, block)
    found = {bound.parameters[name]: pin.layout.render(bound.mesh) for name, pin in recipe.pins.items()
             if name in bound.parameters}
    splits = {name: layout for name, layout in wrote.items() if layout.startswith("S(")}
    # the one the examples differ on: T5's relative position bias, written split by heads in one example
    splits = {name: layout for name, layout in splits.items() if "relative_attention_bias" not in name}
    assert splits and {name: found.get(name) for name in splits} == splits
    assert recipe.name == "Megatron TP on tp with sequence parallelism"


def test_a_recipe_keeps_every_layout_the_file_writes():
    """A weight written whole stays as written; one written on `tp` alone (`S(1) @ tp`, against Megatron's
    S(0)) keeps its split there and takes the recipe's on the data-parallel axis."""
    text, _ = without_layouts("examples/hf_llama_tp2.par")
    text = text.replace("mesh   tp = 2", "mesh   dp = 2, tp = 2").replace("int64[2, 16]", "int64[4, 16]")
    text += ("memory <= 90 %\nlayout {\n    model.model.layers.*.self_attn.q_proj.weight : S(1) @ tp\n"
             "    model.model.layers.*.mlp.up_proj.weight : [B, B]\n}\n")
    bound = bind(parse(text, os.path.join(REPO, "examples", "plan.par")))
    by_name = {name: pin for name, pin in megatron(bound).pins.items()}
    layouts = {bound.parameters[name]: pin.layout.render(bound.mesh) for name, pin in by_name.items()
               if name in bound.parameters}
    assert "model.model.layers.0.mlp.up_proj.weight" not in layouts  # written whole: the file's
    assert layouts["model.model.layers.0.self_attn.q_proj.weight"] == "S(0)@dp, S(1)@tp"
    assert layouts["model.model.layers.0.self_attn.k_proj.weight"] == "S(1)@dp, S(0)@tp"
    assert layouts["model.model.layers.0.mlp.down_proj.weight"] == "S(0)@dp, S(1)@tp"


def test_megatron_is_offered_only_on_an_axis_inside_a_node():
    """On the H100 preset (8 GPUs a node), dp = 32 spans nodes: Megatron's collectives in every layer are
    not offered there, only on tp."""
    text = recipe("llama31_70b_fsdp32_tp8.par", layers=2, batch=512)
    bound = bind(parse(text[:text.index("layout {")], os.path.join(REPO, "examples", "recipes", "plan.par")))
    names = [r.name for r in recipes(bound, H100)]
    assert names == ["FSDP over dp × tp", "HSDP: FSDP over tp, data parallelism over dp",
                     "data parallelism over dp × tp",
                     "Megatron TP on tp with sequence parallelism, FSDP over dp",
                     "Megatron TP on tp with sequence parallelism, data parallelism over dp"]


def test_hsdp_shards_the_weights_inside_a_node_and_replicates_them_across():
    """dp = 2 across two nodes of 8 GPUs, fsdp = 8 inside each: HSDP is offered beside FSDP and data
    parallelism, and compiled as written it gathers the weights and reduce-scatters their gradients on the
    node's links only, with one all-reduce of each gradient shard across the nodes."""
    text, _ = without_layouts("examples/hf_llama_tp2.par")
    text = text.replace("mesh   tp = 2", "mesh   dp = 2, fsdp = 8").replace("int64[2, 16]", "int64[16, 16]")
    path = os.path.join(REPO, "examples", "plan.par")
    bound = bind(parse(text, path))
    found = {r.name: r for r in recipes(bound, H100)}
    assert list(found)[:3] == ["FSDP over dp × fsdp", "HSDP: FSDP over fsdp, data parallelism over dp",
                               "data parallelism over dp × fsdp"]  # then Megatron's on fsdp, inside a node
    hsdp = found["HSDP: FSDP over fsdp, data parallelism over dp"]
    layouts = {name: pin.layout.render(bound.mesh) for name, pin in hsdp.pins.items()}
    assert layouts["input_ids"] == "S(0)@dp, S(0)@fsdp"
    weights = [name for name in layouts if name in bound.parameters]
    assert weights and all(re.fullmatch(r"S\(\d\)@fsdp", layouts[name]) for name in weights)
    written = "\n".join(f"    {bound.parameters.get(name, name)} : {layouts[name]}" for name in layouts)
    plan = compile_text(f"{text}layout {{\n{written}\n}}\n", path, machine=H100)
    kinds = {(c.kind, c.axis) for c in estimate(plan, H100).collectives}
    assert ("all_gather", "fsdp") in kinds and ("reduce_scatter", "fsdp") in kinds
    assert {axis for _, axis in kinds} == {"dp", "fsdp"} and {kind for kind, axis in kinds if axis == "dp"} == \
        {"all_reduce"}


def test_context_parallelism_keeps_the_weights_whole_on_the_axis_that_splits_the_tokens():
    """The file splits its tokens zig-zag over cp and its batch over dp, as Llama 3's long context does.
    Beside FSDP over every axis, the recipes shard the weights over the batch's axes only, whole on each
    context-parallel rank (whose ring already crosses nodes); Megatron is not offered on cp, whose ranks
    hold pieces of the sequence, nor sequence parallelism beside it."""
    text = ("mesh dp = 2, cp = 2, tp = 2\nmodel examples.hf_models:HFLlama(layers=2, attention=\"sdpa\")\n"
            "input input_ids : int64[2, 256] in [0, 256)\ninput labels : int64[2, 256] in [0, 256)\n"
            "layout {\n    input_ids : S(0) @ dp, S(1, zigzag) @ cp\n    labels : S(0) @ dp, S(1, zigzag) @ cp\n}\n")
    bound = bind(parse(text, os.path.join(REPO, "examples", "plan.par")))
    found = {r.name: r for r in recipes(bound, H100)}
    assert list(found) == [
        "FSDP over dp × cp × tp", "FSDP over dp × tp, context parallelism over cp",
        "data parallelism over dp × tp, context parallelism over cp",
        "Megatron TP on dp, FSDP over cp × tp", "Megatron TP on dp, FSDP over tp, context parallelism over cp",
        "Megatron TP on dp, data parallelism over tp, context parallelism over cp",
        "Megatron TP on tp, FSDP over dp × cp", "Megatron TP on tp, FSDP over dp, context parallelism over cp",
        "Megatron TP on tp, data parallelism over dp, context parallelism over cp"]
    layouts = {bound.parameters.get(name, name): pin.layout.render(bound.mesh)
               for name, pin in found["Megatron TP on tp, FSDP over dp, context parallelism over cp"].pins.items()}
    assert layouts["model.model.layers.0.self_attn.q_proj.weight"] == "S(1)@dp, S(0)@tp"
    assert layouts["model.model.layers.0.self_attn.o_proj.weight"] == "S(0)@dp, S(1)@tp"
    assert "input_ids" not in layouts  # the file's own split stands
    # labels left unwritten are split by the batch over dp alone: cp's ranks hold pieces of the sequences
    bound = bind(parse(text.replace("    labels : S(0) @ dp, S(1, zigzag) @ cp\n", ""),
                       os.path.join(REPO, "examples", "plan.par")))
    context = next(r for r in recipes(bound, H100)
                   if r.name == "Megatron TP on tp, FSDP over dp, context parallelism over cp")
    assert context.pins["labels"].layout.render(bound.mesh) == "S(0)@dp"


def n009(plan) -> str:
    [note] = [n.message for n in plan.program.notes if n.code == "N009"]
    return note


def test_a_search_cut_short_compiles_the_recipe_it_could_not_beat(monkeypatch):
    """torchtitan's Llama 3.1 70B (two layers at real size) with every layout left to the search under the
    memory the recipe holds, the search given no time (one order of the axes, no descent: its plan had
    all-to-alls and 1.07 times the recipe's step): Megatron TP + sequence parallelism + FSDP, written by the
    compiler from the graph, is compiled, with the recipe's collectives and memory. At 80 layers the
    search's budget runs out so, and its plan held 74.7 GiB against the recipe's 53.0."""
    written_recipe = recipe("llama31_70b_fsdp32_tp8.par", layers=2, batch=512)
    _, written = compiled(written_recipe)
    bound = f"{written.memory['total'] / GIB * 1.001:.3f} GiB"
    searched = written_recipe[:written_recipe.index("layout {")] + f"memory <= {bound}\n" + \
        "layout {\n    input_ids : S(0) @ dp\n    labels : S(0) @ dp\n}\n"
    monkeypatch.setattr(descent, "SEARCH_BUDGET_S", 0.0)
    plan, result = compiled(searched)
    assert n009(plan).startswith("the best known recipe for this model and mesh, Megatron TP on tp with sequence "
                                 "parallelism, FSDP over dp, is compiled")
    assert per_layer(result) == per_layer(written) == {"all_gather@tp": 6, "reduce_scatter@tp": 5, "all_gather@dp": 2}
    assert result.memory["total"] == written.memory["total"] and result.step_s <= written.step_s


def test_the_note_is_in_explain_and_the_plan_never_behind_a_recipe(tmp_path):
    """A small searched file on gloo: explain prints note N009 with the recipe weighed against, and the
    compiled plan is rated no slower than it."""
    text, _ = without_layouts("examples/hf_llama_tp2.par")
    plan = compile_text(text.replace("mesh   tp = 2", "mesh   dp = 2, tp = 2").replace("int64[2, 16]", "int64[4, 16]"),
                        os.path.join(REPO, "examples", "plan.par"))
    note = n009(plan)
    assert "the best known recipe for this model and mesh" in note
    if "is compiled" not in note:
        assert float(re.search(r"the compiled plan, ([\d.]+) × its step", note).group(1)) <= 1.0
    from pardsl.tools.explain import report
    from pardsl.planning.cost import default_machine
    assert "note[N009]" in report(plan, estimate(plan, default_machine()))


def test_a_compiled_recipe_runs_equal_to_serial(pools, compile_par, monkeypatch):
    """A Hugging Face LLaMA on dp 2 × tp 2 under 40 % of the serial model's memory, the search given no
    time: the recipe compiled instead (Megatron's layers with sequence parallelism, FSDP over the other
    axis) trains equal to serial on 4 ranks, with the collectives the plan counts."""
    from tests.test_distributed import check

    text, _ = without_layouts("examples/hf_llama_tp2.par")
    text = text.replace("mesh   tp = 2", "mesh   dp = 2, tp = 2").replace("int64[2, 16]", "int64[4, 16]")
    monkeypatch.setattr(descent, "SEARCH_BUDGET_S", 0.0)
    compiled = compile_par(text + "memory <= 40 %\n")
    assert re.match(r"the best known recipe for this model and mesh, Megatron TP on \w+ with sequence "
                    r"parallelism, FSDP over \w+, is compiled", n009(compiled))
    check(pools, compiled)
