"""A sequence-parallel linear's input kept split for backward and gathered again there
(pardsl/passes/regather.py): equal to serial with one all-gather more in backward per gathered input,
the gathered copies no longer counted in memory, applied where the file asks or where a memory bound
needs it, and never inside a recomputed layer."""

import re

from pardsl.planning.cost import default_machine, estimate, memory_per_rank
from pardsl.tools.explain import report as explain_report

from .test_distributed import _nonzero, check

SP_TP2 = open("examples/hf_llama_sp_tp2.par").read()
# per layer: the attention's input gathered for q, k and v, the MLP's for gate and up; and the final
# norm's output for the head
GATHERED_INPUTS = 2 * 2 + 1


def substituted(text: str, *choices: str) -> str:
    lines = "".join(f"substitute {choice}\n" for choice in choices)
    return text.replace("layout {", f"{lines}\nlayout {{", 1)


def test_sequence_parallel_llama_regathered_on_2_ranks(pools, compile_par):
    kept = compile_par(substituted(SP_TP2, "regather_inputs : off", "collective_matmul : off"))
    regathered = compile_par(substituted(SP_TP2, "regather_inputs : on", "collective_matmul : off"), "on.par")
    assert regathered.source.count("regather=True)") == GATHERED_INPUTS
    assert "regather=" not in kept.source
    counts = _nonzero(kept.program.collective_counts())
    counts["backward"]["all_gather"] += GATHERED_INPUTS
    assert _nonzero(regathered.program.collective_counts()) == counts
    # a gathered copy no longer held per input: the whole [2, 16, 64] float32 minus nothing else
    saved = memory_per_rank(kept.program)["activations"] - memory_per_rank(regathered.program)["activations"]
    assert saved == GATHERED_INPUTS * 2 * 16 * 64 * 4
    report = check(pools, regathered)  # equal to serial, outputs and gradients, counted as planned
    assert _nonzero(report["collectives"]) == _nonzero(regathered.program.collective_counts())
    # explain names it, with what it gathers more (5 inputs of [2, 16, 64] float32: a 4 KiB split each)
    explained = explain_report(regathered, estimate(regathered, default_machine()))
    assert "substitutions: 5 sequence-parallel inputs kept split for backward and gathered again there, as " \
           "Megatron-LM does (20.0 KiB more gathered in backward, each whole input no longer held until then), " \
           "as the file asks" in explained
    assert explained.count("kept split until backward, gathered again there for the weights' gradients") == \
        GATHERED_INPUTS - 2  # each layer's once, the repeated layer's listed as the first's


def test_regathered_in_pieces_beside_the_products(pools, compile_par):
    """With collective matmuls the forward gathers in pieces; backward still gathers the split it kept."""
    both = compile_par(substituted(SP_TP2, "regather_inputs : on", "collective_matmul : on"))
    assert len(re.findall(r"gather_dim=1, chunks=2, regather=True\)|gather_dim=1, regather=True, chunks=2\)",
                          both.source)) == GATHERED_INPUTS
    report = check(pools, both)
    assert _nonzero(report["collectives"]) == _nonzero(both.program.collective_counts())


def test_not_written_it_is_applied_where_a_memory_bound_needs_it(compile_par, monkeypatch):
    """Not written, it is a memory technique: applied where the plan holds more than the file's bound
    (before the compiler chooses layers to recompute), not where it holds to it or there is none."""
    from pardsl.passes import regather

    compiled = compile_par(SP_TP2)
    assert "regather=" not in compiled.source  # no bound
    program = compiled.program
    passes = compiled.typed
    held = memory_per_rank(program)["total"]
    monkeypatch.setattr(regather, "memory_limit", lambda bound: held)
    assert regather.regather_split_inputs(program, passes) is program
    monkeypatch.setattr(regather, "memory_limit", lambda bound: held - 1)
    kept_split = regather.regather_split_inputs(program, passes)
    assert sum(s.instruction.kwargs[-1:] == (("regather", regather.Text("True")),)
               for s in kept_split.statements) == GATHERED_INPUTS
    assert memory_per_rank(kept_split)["total"] == held - GATHERED_INPUTS * 2 * 16 * 64 * 4


def test_not_inside_a_recomputed_layer(compile_par):
    """A recomputed layer's step runs again in backward and gathers its input there anyway: only the
    head's input, outside the layers, is kept split."""
    text = substituted(SP_TP2, "regather_inputs : on").replace("layout {", "recompute model.model.layers.*\n\nlayout {", 1)
    compiled = compile_par(text)
    assert compiled.source.count("regather=True)") == 1


FSDP_SP = ("mesh dp = 2, tp = 2\nmodel examples.hf_models:HFLlama(layers=2)\n"
           "input input_ids : int64[4, 16] in [0, 256)\n\nlayout {\n    input_ids : S(0) @ dp\n" +
           "".join(f"    model.model.layers.*.{w}.weight : {p}\n" for w, p in {
               "self_attn.q_proj": "S(0) @ tp, S(1) @ dp", "self_attn.k_proj": "S(0) @ tp, S(1) @ dp",
               "self_attn.v_proj": "S(0) @ tp, S(1) @ dp", "self_attn.o_proj": "S(1) @ tp, S(0) @ dp",
               "mlp.gate_proj": "S(0) @ tp, S(1) @ dp", "mlp.up_proj": "S(0) @ tp, S(1) @ dp",
               "mlp.down_proj": "S(1) @ tp, S(0) @ dp"}.items()) +
           "    model.model.layers.*.self_attn() : S(0) @ dp, S(1) @ tp\n"
           "    model.model.layers.*.mlp() : S(0) @ dp, S(1) @ tp\n"
           "    model.model.embed_tokens() : S(0) @ dp, S(1) @ tp\n}\n")


def test_fsdp_and_sequence_parallel_regathered_on_4_ranks(pools, compile_par):
    """The 70B recipe's form at small size: FSDP over dp, Megatron's layers on tp, the activations between
    blocks split by tokens. The weights are gathered over dp before use, so each layer's input gather is a
    conversion of its own, read by the linears: the split is kept for them (`rt.kept_split`), each linear
    keeps it rather than the whole, and the first backward that needs the whole gathers it again."""
    kept = compile_par(substituted(FSDP_SP, "regather_inputs : off", "collective_matmul : off"))
    regathered = compile_par(substituted(FSDP_SP, "regather_inputs : on", "collective_matmul : off"), "on.par")
    inputs = 2 * 2  # the attention's and the MLP's a layer
    assert regathered.source.count("= rt.kept_split(") == inputs
    assert regathered.source.count("= rt.linear_of_gathered(") == 2 * (3 + 2)
    counts = _nonzero(kept.program.collective_counts_by_axis())
    counts["backward"]["tp:all_gather"] = counts["backward"].get("tp:all_gather", 0) + inputs
    assert _nonzero(regathered.program.collective_counts_by_axis()) == counts
    # a [4, 16, 64] float32 input a rank held whole, dp's half of the batch: [2, 16, 64]
    saved = memory_per_rank(kept.program)["activations"] - memory_per_rank(regathered.program)["activations"]
    assert saved == inputs * 2 * 16 * 64 * 4
    report = check(pools, regathered)  # equal to serial, outputs and gradients, counted as planned
    assert _nonzero(report["collectives_by_axis"]) == counts


def test_layers_the_compiler_recomputes_keep_their_inputs_whole(compile_par):
    """Under a bound the inputs are kept split before the compiler chooses layers to recompute
    (recompute.recomputed_within); a layer it recomputes gathers its input again when its forward runs
    again, so its inputs are kept whole again inside it: the same collectives as recomputing the plan
    without them."""
    from pardsl.language.syntax import RecomputeDecl
    from pardsl.passes.recompute import recompute_layers

    kept = compile_par(substituted(FSDP_SP, "regather_inputs : off", "collective_matmul : off"))
    regathered = compile_par(substituted(FSDP_SP, "regather_inputs : on", "collective_matmul : off"), "on.par")
    span = regathered.par.substitutes[0].span
    decls = tuple(RecomputeDecl(f"model.model.layers.{i}", "full", span, span) for i in range(2))
    both = recompute_layers(regathered.program, regathered.typed, decls)
    alone = recompute_layers(kept.program, kept.typed, decls)
    assert both.collective_counts_by_axis() == alone.collective_counts_by_axis()
    assert not any(s.instruction.callee in ("rt.kept_split", "rt.linear_of_gathered")
                   for region in both.statements for s in region.body)
    assert memory_per_rank(both)["activations"] == memory_per_rank(alone)["activations"]


def test_asked_for_the_search_counts_the_inputs_as_kept_split(compile_par):
    """With `substitute regather_inputs : on` the layout search's integer program counts what the compiled
    plan holds: a linear's input gathered on one axis is counted at its split layout, not as a whole copy.
    The Megatron-SP plan, priced by the program deciding its axis again, holds the copies' bytes less."""
    import pytest

    from pardsl.layouts.algebra import B, S
    from pardsl.planning import search
    from pardsl.planning.cost import default_machine

    held, seconds = {}, {}
    for choice in ("off", "on"):
        compiled = compile_par(substituted(SP_TP2, f"regather_inputs : {choice}"), f"{choice}.par")
        bound, typed = compiled.bound, compiled.typed
        facts = search.graph_facts(bound)
        decided = search._Decided.of(facts, typed)
        decided.forget((0,))
        program = search._GroupProgram(bound, default_machine(), facts, decided, (0,), 1, None, typed,
                                       search.OPTIMIZER_STATES["adamw"], 1.0)
        hint = search._hint(typed, (0,), program.choice, program.legal, program.domain)
        solution = program.program._completed(program.program.rows, hint)
        held[choice] = program.fixed_memory + sum(v * solution[c] for c, v in program.memory.items())
        seconds[choice] = program.program.objective(solution)
    assert held["off"] - held["on"] == GATHERED_INPUTS * 2 * 16 * 64 * 4
    # and priced with the gathers backward issues again: each a [2, 8, 64] float32 split over 2 ranks
    machine, split = default_machine(), 2 * 8 * 64 * 4
    again = machine.steps_seconds(search.one_axis_collectives(S(1), B, split, 2, False), 2, 1)
    assert seconds["on"] - seconds["off"] == pytest.approx(GATHERED_INPUTS * again, rel=1e-9)
