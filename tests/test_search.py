"""The layout search (pardsl/planning/search.py): `?`, a file with no layouts, the memory bound as a constraint,
repeated layers solved once, and searched plans that run equal to serial and cost no more than the
hand-written ones by the cost model."""

import math
import itertools
import re

import pytest

from pardsl.planning import search, solver
from pardsl.compiler import _lowered, compile_file, compile_text
from pardsl.planning.descent import CompletedPlan
from pardsl.planning.cost import DEFAULTS, LinkCost, Machine, estimate, memory_per_rank
from pardsl.language.diagnostics import CompileError
from pardsl.layouts.algebra import B, S
from pardsl.planning.cost import DEFAULT_BUCKET_MB
from pardsl.program.lowering import lower

from .figures import ROUND_GLOO
from .test_distributed import check

# The search's mechanics are checked under the round figures they were worked out with; what the search
# finds on a machine like this one (rediscovery) under gloo's defaults, this VM's measured figures.
pytestmark = pytest.mark.usefixtures("round_figures")
GLOO = ROUND_GLOO
MEASURED = DEFAULTS["gloo"]  # read at import, before any test pins the defaults
LLAMA = 'model examples.hf_models:HFLlama(layers={layers}, attention="sdpa")\ninput input_ids : int64[2, 16] in [0, 256)\n'
MLP = "model examples.models:ResidualMLP(d_model=32, d_ff=128, n_classes=8)\ninput x : float32[8, 32]\n"


def searched_step(bound, order=None, machine=GLOO) -> float:
    """The estimated step of the search's own plan, its axes decided in `order` (the mesh's by default)."""
    typed = search.search(bound, machine, search.memory_limit(bound), order=order)
    return estimate(CompletedPlan(typed, lower(typed)), machine).step_s


def programs_solved(monkeypatch) -> list[tuple]:
    """Each integer program the search solves from here on, in order: (program, hint, (status, solution)).
    The solver is given the time to prove each optimum: these tests read the solution, and on a loaded
    machine the 2-D layer's pair program (5 s here idle) ran past solver.TIME_LIMIT_S to a 'time limit'."""
    monkeypatch.setattr(solver, "TIME_LIMIT_S", 300.0)
    monkeypatch.setattr(solver, "FIRST_PLAN_S", 60.0)
    monkeypatch.setattr(solver, "STALL_S", 300.0)
    solved = []
    solve = solver.IntegerProgram.solve

    def keeping(program, *args, **kwargs):
        result = solve(program, *args, **kwargs)
        solved.append((program, kwargs.get("hint"), result))
        return result

    monkeypatch.setattr(solver.IntegerProgram, "solve", keeping)
    return solved


def memory_counted(program, solution: list[float], limit: int) -> float:
    """The bytes per rank a move's program counts for the plan it chose: its memory row (the last: Σ bytes ·
    column <= limit − what no choice changes) at the solution's choices, with the continuous columns (the
    held copies, the gathered groups' levels) at their least. Their cost in the objective is tiny
    (search.HELD_S), so a solver may leave them above their least within its tolerances (HiGHS 1.16 did on
    one move, before the move's start plan was given to it as a whole solution)."""
    terms, _, upper = program.rows[-1]
    least = solver.IntegerProgram([terms.get(c, 0.0) for c in range(len(program.cost))], list(program.integer),
                            list(program.rows[:-1]))
    rows = least.rows
    choices = {c: float(round(solution[c])) for c, is_integer in enumerate(program.integer) if is_integer}
    values = least._completed(rows, choices)
    assert values is not None
    counted = sum(v * values[column] for column, v in terms.items()) + limit - upper
    as_solved = sum(v * solution[column] for column, v in terms.items()) + limit - upper
    assert counted <= as_solved + 1.0
    return counted


def binaries(solved: list[tuple]) -> list[int]:
    return [sum(program.integer) for program, _, _ in solved]


def sizes(solved: list[tuple]) -> list[tuple[int, int, int]]:
    """Each program's binaries, columns and rows."""
    return [(sum(program.integer), len(program.cost), len(program.rows)) for program, _, _ in solved]


def layouts_of(compiled, prefix: str = "") -> dict[str, tuple]:
    names = compiled.bound.parameters
    return {names[p]: layout.placements for p, layout in compiled.typed.placeholder_layouts.items()
            if p in names and names[p].startswith(prefix)}


def test_the_search_runs_only_where_the_file_asks_for_it(compile_par):
    written = compile_par("mesh tp = 2\n" + MLP + "layout {\n  up.weight : S(0)\n}\n")
    assert "infer" in written.seconds and "search" not in written.seconds  # the greedy completion, as before
    for text in ("mesh tp = 2\n" + MLP,  # no layout at all
                 "mesh tp = 2\n" + MLP + "memory <= 80 %\nlayout {\n  up.weight : S(0)\n}\n",
                 "mesh tp = 2\n" + MLP + "layout {\n  x : ?\n}\n"):
        assert "search" in compile_par(text).seconds


def test_what_the_user_wrote_stands_in_a_search(compile_par):
    compiled = compile_par("mesh tp = 2\n" + MLP + "memory <= 50 %\nlayout {\n  up.weight : S(1)\n  down.weight : B\n}\n")
    layouts = layouts_of(compiled)
    assert layouts["up.weight"] == (S(1),) and layouts["down.weight"] == (B,)


def test_an_input_written_question_mark_may_be_split_and_others_stay_whole(compile_par):
    # a batch large enough that halving the compute pays for all-reducing the gradients
    compiled = compile_par("mesh dp = 2\n" + MLP.replace("[8, 32]", "[1024, 32]") + "layout {\n  x : ?\n}\n")
    x = next(p for p, name in compiled.bound.inputs.items() if name == "x")
    assert x in compiled.bound.searched
    # data parallelism: x (or the first activation) split by batch, every weight whole with its gradient
    # all-reduced in buckets; no activation moves in forward
    assert compiled.typed.output_layouts[0].placements == (S(0),)
    assert set(layouts_of(compiled).values()) == {(B,)}
    counts = compiled.program.collective_counts()
    assert sum(counts["forward"].values()) == 0
    buckets = compiled.program.buckets
    assert buckets and [b.kind for b in buckets] == ["all_reduce"] * len(buckets)


def test_question_mark_is_a_whole_layout_not_one_axiss_value(compile_par):
    with pytest.raises(CompileError) as caught:
        compile_par("mesh dp = 2, tp = 2\n" + MLP + "layout {\n  x : [?, B]\n}\n")
    (diagnostic,) = caught.value.diagnostics
    assert (diagnostic.code, diagnostic.span.line) == ("E001", 5)


def test_the_memory_bound_is_met_where_it_can_be_and_noted_where_it_cannot(compile_par):
    loose = compile_par("mesh tp = 2\n" + MLP + "memory <= 100 %\n")
    assert set(layouts_of(loose).values()) == {(B,)}  # nothing to save: nothing split, nothing moved
    assert not any(n.code == "N003" for n in loose.program.notes)
    tight = compile_par("mesh tp = 2\n" + MLP + "memory <= 60 %\n")
    memory = estimate(tight, GLOO).memory
    assert memory["total"] <= tight.memory_bound < memory["serial_total"] * 0.6 + 1
    assert not any(n.code == "N003" for n in tight.program.notes)
    impossible = compile_par("mesh tp = 2\n" + MLP + "memory <= 1 KiB\n")
    assert [n.code for n in impossible.program.notes if n.code == "N003"] == ["N003"]
    # where no plan meets the bound, the plan nearest it: no more than the tight plan's, which meets 60 %
    assert estimate(impossible, GLOO).memory["total"] <= memory["total"] < estimate(loose, GLOO).memory["total"]


def test_where_no_order_of_the_axes_meets_the_bound_the_plan_is_the_one_nearest_it(compile_par):
    """Compile asks each order but the last not to look for the plan nearest an unmeetable bound (an
    order whose plan meets the bound wins over it): such a search says the bound is unmet."""
    impossible = compile_par("mesh dp = 2, tp = 2\n" + MLP + "memory <= 1 KiB\n")
    with pytest.raises(search.BoundUnmet):
        search.search(impossible.bound, GLOO, search.memory_limit(impossible.bound), order=(0, 1), nearest=False)
    assert [n.code for n in impossible.program.notes if n.code == "N003"] == ["N003"]
    tight = compile_par("mesh dp = 2, tp = 2\n" + MLP + "memory <= 50 %\n")
    assert not any(n.code == "N003" for n in tight.program.notes)
    assert estimate(impossible, GLOO).memory["total"] <= estimate(tight, GLOO).memory["total"]


def test_the_plan_nearest_the_bound_starts_from_the_least_excess_found(monkeypatch):
    """The second of the two programs for an unmeetable bound (the fastest plan within the least excess)
    is given the first's plan as HiGHS's first incumbent: without it a hard program can find no plan
    within FIRST_PLAN_S, and a descent's move on T5 (dp 2 × tp 2, 30 %) ended in an error."""
    solved = programs_solved(monkeypatch)
    program = solver.IntegerProgram()
    a, b = program.column(1.0, integer=True), program.column(2.0, integer=True)
    program.row({a: 1.0, b: 1.0}, 1.0, 1.0)  # one of two choices
    memory_row = len(program.rows)
    program.row({a: 5.0, b: 3.0}, -float("inf"), 2.0)  # neither fits
    status, solution = solver.nearest_the_bound(program, memory_row, None)
    assert status == "optimal" and round(solution[b]) == 1  # the smaller, though slower
    (_, _, (_, least)), (last, hint, _) = solved[0], solved[-1]
    assert hint == dict(enumerate(least))
    for row, (terms, low, high) in enumerate(last.rows):  # a plan of the program the hint is given to
        if row != memory_row:
            assert low - 1e-9 <= sum(v * hint[c] for c, v in terms.items()) <= high + 1e-9


def test_branch_and_bound_stops_without_a_plan_at_first_plan_s_and_once_its_plan_has_stood_stall_s(monkeypatch):
    """The solver's interrupt rule, as HiGHS calls it during one solve: no plan by FIRST_PLAN_S stops it
    (the bound taken as unmet); a plan found goes on in the same tree until no plan better by STALL_GAIN
    has come for STALL_S; nothing goes past TIME_LIMIT_S. Each counted in seconds of work, by the calls
    back (work.branching): the wall's seconds, here ten times as many (a loaded machine), stop nothing."""
    from types import SimpleNamespace

    from pardsl.planning import work

    done = [0.0]
    monkeypatch.setattr(work, "branching", lambda calls, nonzeros: done[0])

    def asked(rule, elapsed: float, found: float) -> bool:
        done[0] = elapsed
        event = SimpleNamespace(data_out=SimpleNamespace(running_time=10 * elapsed, mip_primal_bound=found),
                                stopped=False)
        event.interrupt = lambda: setattr(event, "stopped", True)
        rule(event)
        return event.stopped

    def started(cutoff: float = math.inf):
        done[0] = 0.0
        return solver._StoppingRule(10_000, cutoff)

    rule = started()
    assert not asked(rule, solver.FIRST_PLAN_S - 0.1, math.inf)
    assert asked(rule, solver.FIRST_PLAN_S + 0.1, math.inf)
    rule = started()
    assert not asked(rule, 1.0, 0.30)  # the first plan
    assert not asked(rule, 1.0 + solver.STALL_S - 0.1, 0.30 * (1 - solver.STALL_GAIN / 2))  # within the gap: no news
    assert asked(rule, 1.0 + solver.STALL_S + 0.1, 0.30 * (1 - solver.STALL_GAIN / 2))
    rule = started(cutoff=0.30)  # HiGHS reports the cutoff as its bound until a plan beats it
    assert not asked(rule, solver.STALL_S + 0.1, 0.30)
    assert asked(rule, solver.FIRST_PLAN_S + 0.1, 0.30)
    rule = started()
    assert not asked(rule, 1.0, 0.30)
    assert not asked(rule, 1.5, 0.25)  # a better plan: the clock starts again
    assert not asked(rule, 1.5 + solver.STALL_S - 0.1, 0.25)
    assert asked(rule, 1.5 + solver.STALL_S + 0.1, 0.25)
    rule = started()
    for step in range(1, int(solver.TIME_LIMIT_S)):  # a better plan each second
        assert not asked(rule, step, 1.0 / step)
    assert asked(rule, solver.TIME_LIMIT_S + 0.1, 0.01)


def test_a_descents_move_whose_program_gives_no_plan_is_not_made(compile_par, monkeypatch):
    """A move whose program HiGHS finds no plan for in its time is a move that does not improve: compile
    keeps the plan it has (here, every move fails: the best order's plan), where it had raised."""
    from pardsl.planning import descent

    real = descent.search

    def moves_fail(bound, machine, limit=None, optimizer="adamw", order=None, start=None, **kwargs):
        if start is not None:
            raise search.NoPlanFound("no plan")
        return real(bound, machine, limit, optimizer, order, start, **kwargs)

    monkeypatch.setattr(descent, "search", moves_fail)
    # the known recipes left out: here FSDP over both axes is nearer the bound (which no plan meets once
    # through the passes) than the orders' plans, and would be compiled instead of them
    monkeypatch.setattr(descent, "recipe_plans", lambda *args, **kwargs: [])
    compiled = compile_par("mesh dp = 2, tp = 2\n" + MLP + "memory <= 50 %\n")
    orders = [searched_step(compiled.bound, order) for order in itertools.permutations(range(2))]
    assert estimate(compiled, GLOO).step_s == min(orders)  # the best order's plan, not an error


def calls_counted(monkeypatch, name: str) -> list[int]:
    """How often the search's module-level function `name` runs from here on (one entry per call)."""
    calls = []
    function = getattr(search, name)

    def counting(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    monkeypatch.setattr(search, name, counting)
    return calls


@pytest.mark.usefixtures("search_once")
def test_repeated_layers_are_one_set_of_choices(compile_par, monkeypatch):
    solved = programs_solved(monkeypatch)
    legal, priced = calls_counted(monkeypatch, "_legal"), calls_counted(monkeypatch, "_priced")
    compile_par("mesh tp = 2\n" + LLAMA.format(layers=2) + "memory <= 60 %\n")
    asked, shallow = (len(legal), len(priced)), len(solved)
    compiled = compile_par("mesh tp = 2\n" + LLAMA.format(layers=4) + "memory <= 60 %\n")
    # the integer programs do not grow with depth: not their choices, nor the pairs and conversions of a
    # value every layer reads (a value read by each of the shared layers is one set of conversions)
    assert sizes(solved[:shallow]) == sizes(solved[shallow:])
    # nor does building it: a repeated layer's ops ask the questions the layer before asked
    assert len(legal) - asked[0] == asked[0]
    # Pricing reads the solution, and a layer's neighbours (the first and the last layer's are the model's
    # ends) can make its question new by a candidate or two: pricing each of the two more layers afresh
    # would ask dozens more each.
    assert abs((len(priced) - asked[1]) - asked[1]) <= 2
    layers = [{name.split(".", 4)[4]: layout for name, layout in layouts_of(compiled, f"model.model.layers.{i}.").items()}
              for i in range(4)]
    assert layers[0] and all(layer == layers[0] for layer in layers[1:])
    assert any(p != (B,) for p in layers[0].values())  # the bound made it shard


# Megatron-LM's own plan also splits what the examples keep whole at tp 2: the embedding by vocabulary
# (an all-reduce of its masked lookup) and the head by columns (its logits gathered); tp 4's examples do
MEGATRON_LM_ENDS = {"llama": ["model.model.embed_tokens.weight : S(0)", "model.lm_head.weight : S(0)"],
                    "gpt2": ["model.transformer.wte.weight : S(0)"],  # tied with the head
                    "bert": ["model.embeddings.word_embeddings.weight : S(0)"]}


def _megatron_lm(text: str, model: str, tp: int) -> str:
    """The example's text with Megatron-LM's ends (the tp 4 examples have them)."""
    return text if tp == 4 else text.replace("    output ", "    " + "\n    ".join(MEGATRON_LM_ENDS[model]) + "\n    output ")


@pytest.mark.parametrize("model", ["llama", "gpt2", "bert"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.usefixtures("search_once")
def test_the_search_finds_megatrons_plan_or_one_estimated_cheaper(model, tp):
    """Rediscovery under gloo's defaults: nothing written but a bound that forces sharding (60 %); the
    search's plan meets it, and is estimated no slower and moves no more bytes than the fastest Megatron
    plan that meets it too: the example's, or Megatron-LM's with the embedding and head split by
    vocabulary (the tp 2 examples keep them whole and are over the bound for LLaMA, GPT-2 and BERT)."""
    path = f"examples/hf_{model}_tp{tp}.par"
    text = open(path).read()
    header = "".join(line for line in text.splitlines(keepends=True) if line.split(" ", 1)[0] in ("mesh", "model", "input"))
    searched = compile_text(header + "memory <= 60 %\n", "searched.par", machine=MEASURED)
    mine = estimate(searched, MEASURED)
    assert mine.memory["total"] <= searched.memory_bound
    fitting = []
    for plan in (compile_text(text, path, machine=MEASURED), compile_text(_megatron_lm(text, model, tp), "lm.par", machine=MEASURED)):
        theirs = estimate(plan, MEASURED)
        if theirs.memory["total"] <= searched.memory_bound:
            fitting.append((theirs.step_s, sum(plan.program.collective_bytes().values())))
    step, moved = min(fitting)
    assert mine.step_s <= step * 1.001, (mine.seconds, step)
    assert sum(searched.program.collective_bytes().values()) <= moved


# This VM's gloo as `pardsl calibrate` measured it (2026-11-25, two ranks, rounded), its overlap taken as
# none: a collective's latency is most of its cost at these sizes
LATENCY_BOUND = Machine("gloo", {"all_reduce": LinkCost(8.8e-4, 5.5e-10), "all_gather": LinkCost(1.8e-3, 6.1e-10),
                                 "reduce_scatter": LinkCost(2.0e-4, 1.4e-9), "all_to_all": LinkCost(1.8e-4, 5.7e-10)},
                        9.3e10, 1.3e10, 1.6e-6, "this VM, measured", cores=2, overlap=0.0)



def _at_hidden_512(model: str, path: str) -> str:
    """The example's text with the model at hidden 512 (vocabulary 1024) and 64 tokens a sequence."""
    return re.sub(r"\(layers=2", "(layers=2, hidden=512, vocab=1024, positions=128" + (", ffn=1024" if model != "gpt2" else ""),
                  open(path).read()).replace("[2, 16]", "[2, 64]").replace("[0, 256)", "[0, 1024)")


@pytest.mark.parametrize("model", ["gpt2", "bert"])
def test_where_latency_dominates_the_search_finds_megatrons_plan_itself(model):
    """A gradient bucket's latency is shared by the parameters in it, so the programs price a bucketed
    gradient at its bytes and the search weighs the latencies of the buckets a plan fills afterwards,
    against the plan that reduces no parameter's gradient on the axis. Megatron's is such a plan: its
    replicated weights (norms, biases) see whole activations. On a machine where latency is most of a
    collective's cost, the search's plan for GPT-2 and BERT at hidden 512 on tp 2 is Megatron's: 4 + 4
    all-reduces, 2 MiB a step. Pricing bytes alone it was a sequence-parallel plan that reduces the norms'
    gradients (6.15 and 4.90 MiB), estimated slower than Megatron's (60.4 against 58.8 ms for GPT-2)."""
    path = f"examples/hf_{model}_tp2.par"
    text = _at_hidden_512(model, path)
    megatron = compile_text(text, path, machine=LATENCY_BOUND)
    header = [line for line in text.splitlines(keepends=True) if line.split(" ", 1)[0] in ("mesh", "model", "input")]
    searched = compile_text("".join(header) + "memory <= 60 %\n", "searched.par", machine=LATENCY_BOUND)
    assert searched.program.collective_counts() == megatron.program.collective_counts()
    assert searched.program.collective_counts()["backward"]["all_reduce"] == 4
    assert searched.program.collective_bytes() == megatron.program.collective_bytes()
    mine, theirs = estimate(searched, LATENCY_BOUND), estimate(megatron, LATENCY_BOUND)
    assert mine.memory["total"] <= searched.memory_bound and mine.step_s <= theirs.step_s * 1.001


@pytest.mark.parametrize("model, tp", [("llama", 2), ("gpt2", 2), ("bert", 2),
                                       pytest.param("llama", 4, marks=pytest.mark.slow)])  # make test-slow
def test_on_gloos_defaults_the_search_is_megatron_per_layer_and_moves_no_more_than_megatron_lm(pools, model, tp):
    """Rediscovery at hidden 512 under gloo's defaults (this VM's measured figures): a bound Megatron's
    plans meet (70 %), nothing written but the bound and the example's output (what the caller receives).
    The search's layers are Megatron's: every weight the example splits is split as it is, and the step's
    collectives are all-reduces but for one gather, no more of them in either phase than Megatron-LM's plan
    has. The plan is estimated no slower than the example's and moves no more bytes than Megatron-LM's.
    (Where it splits the head that the tp 2 example keeps whole, it moves more than the example: LLaMA
    2.62 against 2.00 MiB, estimated 47.7 against 49.2 ms. Under the round figures that were gloo's
    defaults before, 20 GFLOP/s, every case here fails: those plans are sequence-parallel.)"""
    path = f"examples/hf_{model}_tp{tp}.par"
    text = _at_hidden_512(model, path)
    megatron = compile_text(text, path, machine=MEASURED)
    megatron_lm = megatron if tp == 4 else compile_text(_megatron_lm(text, model, tp), "lm.par", machine=MEASURED)
    header = "".join(line for line in text.splitlines(keepends=True) if line.split(" ", 1)[0] in ("mesh", "model", "input"))
    output = "".join(line for line in text.splitlines(keepends=True) if line.strip().startswith("output"))
    searched = compile_text(header + "memory <= 70 %\nlayout {\n" + output + "}\n", "searched.par", machine=MEASURED)
    mine, theirs = estimate(searched, MEASURED), estimate(megatron, MEASURED)
    assert theirs.memory["total"] <= searched.memory_bound and mine.memory["total"] <= searched.memory_bound
    assert mine.step_s <= theirs.step_s * 1.001
    split = {name: p for name, p in layouts_of(megatron).items() if re.search(r"\.\d+\.", name) and p != (B,)}
    assert split and {name: layouts_of(searched)[name] for name in split} == split
    counts, theirs_lm = searched.program.collective_counts(), megatron_lm.program.collective_counts()
    for phase in ("forward", "backward"):
        assert counts[phase]["reduce_scatter"] == counts[phase]["all_to_all"] == 0 and counts[phase]["all_gather"] <= 1
        assert sum(counts[phase].values()) <= sum(theirs_lm[phase].values())
    assert sum(searched.program.collective_bytes().values()) <= sum(megatron_lm.program.collective_bytes().values())
    if (model, tp) == ("llama", 2):
        check(pools, searched, steps=1)  # equal to serial, moving the bytes it planned


def test_compile_rates_the_plan_that_saved_buckets_against_the_programs_own(compile_par):
    """The bucket latencies are the search's own weighing, after its programs. On BERT at tp 2 (hidden 64,
    gloo's defaults) the plan without the axis's bucketed gradients is the search's choice, yet the cost
    model rates it 0.14 ms slower than the programs' own plan: compile looks at both and keeps the one
    the cost model rates faster."""
    path = "examples/hf_bert_tp2.par"
    header = [line for line in open(path) if line.split(" ", 1)[0] in ("mesh", "model", "input")]
    compiled = compile_par("".join(header) + "memory <= 60 %\n")
    limit = search.memory_limit(compiled.bound)
    plans = {fewer: search.search(compiled.bound, GLOO, limit, fewer_buckets=fewer) for fewer in (True, False)}
    assert plans[True].saved_buckets and not plans[False].saved_buckets
    # lowered as compile lowers its candidates (groups released after forward where over the bound)
    steps = {fewer: estimate(CompletedPlan(typed, _lowered(typed, DEFAULT_BUCKET_MB, limit)), GLOO).step_s
             for fewer, typed in plans.items()}
    assert steps[False] < steps[True]
    assert estimate(compiled, GLOO).step_s == steps[False]


LLAMA_512 = ('model examples.hf_models:HFLlama(layers=2, hidden=512, vocab=1024, ffn=1024, attention="sdpa")\n'
             "input input_ids : int64[2, 64] in [0, 1024)\ninput labels : int64[2, 64] in [0, 1024)\n")


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])  # tp 4: make test-slow
def test_trained_on_its_own_loss_the_searched_llama_moves_less_than_megatron_lm(pools, compile_par, tp):
    """Rediscovery where Megatron's plan is meant for: LLaMA at hidden 512 returning its own loss, nothing
    written but `memory <= 60 %`, against Megatron-LM's whole plan (the layouts of
    examples/hf_llama_loss_tp2.par: 2 + 2 all-reduces per layer, the vocabulary-parallel embedding, head
    and loss), which meets the same bound. The search keeps Megatron's column- and row-parallel layers in
    their sequence-parallel form and splits the embedding by hidden: estimated faster, and fewer bytes per
    step, as measured in a run (which equals serial)."""
    header = f"mesh tp = {tp}\n" + LLAMA_512
    megatron = compile_par(header + "layout {" + open("examples/hf_llama_loss_tp2.par").read().split("layout {")[1],
                           "megatron.par")
    searched = compile_par(header + "memory <= 60 %\n")
    mine, theirs = estimate(searched, GLOO), estimate(megatron, GLOO)
    assert theirs.memory["total"] <= searched.memory_bound and mine.memory["total"] <= searched.memory_bound
    assert mine.step_s < theirs.step_s
    assert sum(searched.program.collective_bytes().values()) < sum(megatron.program.collective_bytes().values())
    layer = layouts_of(searched, "model.model.layers.0.")
    column, row = (S(0),), (S(1),)
    assert {name.split(".", 4)[4]: p for name, p in layer.items() if "proj" in name} == {
        "self_attn.q_proj.weight": column, "self_attn.k_proj.weight": column, "self_attn.v_proj.weight": column,
        "self_attn.o_proj.weight": row, "mlp.gate_proj.weight": column, "mlp.up_proj.weight": column,
        "mlp.down_proj.weight": row}
    check(pools, searched, steps=1)  # equal to serial; measured bytes are the planned ones


def test_a_searched_plan_runs_equal_to_serial(pools, compile_par):
    check(pools, compile_par("mesh tp = 2\n" + LLAMA.format(layers=2) + "memory <= 60 %\n"))


def test_a_split_read_part_by_part_is_priced_per_part_and_the_plan_runs_equal_to_serial(pools, compile_par):
    # GPT's fused attention projection is split into q, k and v. The search once priced converting the
    # split once for its three parts, and its plan at 20 % reduce-scattered the list (a crash on every
    # rank); lowering converts each part as it is taken, and the search now pays per part: the plan keeps
    # the projection's parts as it computes them and converts the tensors after.
    text = open("examples/gpt_tp4.par").read()
    text = text[:text.index("layout {")] + "memory <= 20 %\n"
    compiled = compile_par(text)
    assert "converted once taken" not in compiled.source
    assert not [line for line in compiled.source.splitlines() if "rt." in line and "(split" in line]
    check(pools, compiled, steps=1)


def test_a_searched_data_parallel_plan_runs_equal_to_serial(pools, compile_par):
    check(pools, compile_par("mesh dp = 2\n" + MLP.replace("[8, 32]", "[1024, 32]") + "layout {\n  x : ?\n}\n"))


def test_zero3_storage_under_a_memory_bound_keeps_fsdps_parameter_gathers(pools, compile_par):
    """examples/llama_zero3.par (weights and batch S(0) over dp) with a bound: the search prices gathered
    parameters as memory_per_rank counts them resharded after forward (two units at a time, not the whole
    model), so the plan the greedy pass writes fits and the search keeps its parameter traffic: one
    all-gather per layer and per group outside, each layer's again backward (kept from forward to backward,
    every group would not fit), one reduce-scatter bucket backward, and nothing else but the loss's sum
    and count in one all-reduce (the rule's `mean` form: before it, the count and the partial mean took two
    all-reduces, and gathering this 256-word vocabulary's logits for the loss was estimated cheaper). The
    bound is 65 % of the serial model's bytes: the FSDP plan needs 62 %, data parallelism more than all."""
    text = open("examples/llama_zero3.par").read().replace("mesh   dp = 2\n", "mesh   dp = 2\nmemory <= 65 %\n")
    searched, greedy = compile_par(text), compile_file("examples/llama_zero3.par")
    assert "search" in searched.seconds
    assert estimate(greedy, GLOO).memory["total"] <= searched.memory_bound  # the FSDP plan fits
    assert estimate(searched, GLOO).memory["total"] <= searched.memory_bound
    groups = [[m.attr for m in group.members] for group in searched.program.gathers]
    assert groups == [[m.attr for m in group.members] for group in greedy.program.gathers]
    assert searched.program.collective_counts_by_axis() == {"forward": {"dp:all_gather": len(groups),
                                                                        "dp:all_reduce": 1},
                                                            "backward": {"dp:all_gather": 2, "dp:reduce_scatter": 1}}
    assert [g.resharded for g in searched.program.gathers] == [True, True, True, False]
    assert "mean=('dp',)" in searched.source
    check(pools, searched)


def test_the_search_splits_a_fused_qkv_projection_in_blocks(compile_par):
    """GPT-2 computes q, k and v with one Conv1D and splits its output in three. The search offers the
    projection a split in 3 blocks (each rank a share of q, of k and of v), as the cut downstream wants,
    and finds Megatron's layouts for every layer: c_attn and c_fc column parallel, the projections row
    parallel. (At hidden 512 bandwidth outweighs gloo's latency.)"""
    compiled = compile_par("mesh tp = 2\n"
                           'model examples.hf_models:HFGPT2(layers=2, hidden=512, vocab=1024, positions=128, '
                           'attention="eager")\ninput input_ids : int64[2, 64] in [0, 1024)\nmemory <= 60 %\n')
    layouts = layouts_of(compiled, "model.transformer.h.")
    for layer in (0, 1):
        prefix = f"model.transformer.h.{layer}."
        assert layouts[prefix + "attn.c_attn.weight"] == (S(1, 3),)
        assert layouts[prefix + "attn.c_attn.bias"] == (S(0, 3),)
        assert layouts[prefix + "attn.c_proj.weight"] == (S(0),)
        assert layouts[prefix + "mlp.c_fc.weight"] == (S(1),)
        assert layouts[prefix + "mlp.c_proj.weight"] == (S(0),)
    assert not any(c.kind == "all_to_all" and ".attn" in c.reason for c in compiled.program.collectives)


def test_the_search_splits_a_fused_qkv_projection_of_unequal_parts_in_blocks_of_their_sizes(compile_par):
    """Phi-3 under grouped-query attention (8 query heads, 4 key/value heads) computes q, k and v with one
    projection and takes them apart by slices, q twice as long as k and v. The search offers the
    projection a split in blocks of those sizes, and keeps it: each rank its share of q, of k and of v,
    no all-to-all in attention."""
    compiled = compile_par("mesh tp = 2\n"
                           'model examples.hf_models:HFCausalLM(family="Phi3", layers=2, hidden=512, heads=8, '
                           'kv_heads=4, ffn=1024, vocab=32064)\ninput input_ids : int64[2, 64] in [0, 32064)\n'
                           "memory <= 60 %\n")
    layouts = layouts_of(compiled, "model.model.layers.")
    for layer in (0, 1):
        assert layouts[f"model.model.layers.{layer}.self_attn.qkv_proj.weight"] == (S(0, (2, 1, 1)),)
    assert not any(c.kind == "all_to_all" and "self_attn" in c.reason for c in compiled.program.collectives)


def test_the_search_groups_gathered_parameters_as_lowering_does():
    """Memory of parameters gathered for use counts two groups at a time; the groups are lowering's: a
    layer's parameters, or those outside the layers before them and after them (the embedding alone; the
    final norm with the head)."""
    compiled = compile_file("examples/llama_zero3.par")
    typed = compiled.typed
    units = search._gather_units(compiled.bound, list(typed.nodes),
                                 {name: node.operands for name, node in typed.nodes.items()})
    lowered = [{"p_" + m.attr for m in group.members} for group in compiled.program.gathers]
    assert sorted(map(sorted, lowered)) == sorted(
        sorted(p for p in units if units[p] == unit) for unit in set(units.values()))


def test_the_greedy_completion_is_compiled_where_the_cost_model_rates_it_faster():
    """With NCCL's default figures the 2.5-D layer's greedy completion is estimated faster than the
    search's plan in every order of its three axes, and deciding each axis again does not improve on it:
    compile keeps it, and says so at the `?`."""
    nccl = DEFAULTS["nccl"]
    path = "examples/tp_schemes/layer_2p5d.par"
    compiled = compile_file(path, machine=nccl)
    [note] = [n for n in compiled.program.notes if n.code == "N004"]
    line = next(i for i, text in enumerate(open(path), 1) if ": ?" in text)
    assert (note.span.line, note.span.column) == (line, 5)
    alternative = compile_file("examples/tp_schemes/layer_2d.par", machine=nccl)  # the search's plan is faster
    assert not any(n.code == "N004" for n in alternative.program.notes)
    assert estimate(compiled, nccl).step_s < min(searched_step(compiled.bound, order, nccl)
                                                 for order in itertools.permutations(range(3)))


def estimated_step(typed) -> float:
    return estimate(CompletedPlan(typed, lower(typed)), GLOO).step_s


# at 30 % the descent runs longest (about a minute on 2 cores): make test-slow runs it, 40 % is in make test
@pytest.mark.parametrize("percent", [pytest.param(30, marks=pytest.mark.slow), 40])
def test_pairs_of_axes_are_decided_again_jointly_until_no_move_improves(pools, compile_par, percent):
    """The search decides one mesh axis at a time, with the later ones still whole. On the 2-D layer
    under a memory bound alone, compile descends from the better plan of the two orders, each round making
    the best-rated move: both axes decided again by one program (every op keeping its signature on one of
    them), or one axis alone. At 30 % both orders' plans are over the bound as the cost model counts memory
    (a weight moved where it is used and held until backward, which a program deciding one axis does not
    see) and the descent ends within it at 2.48 ms. At 40 % the better order's plan is within the bound
    at 2.02 ms and no move improves on it. (It reached 1.89 ms from an order's plan the search had taken to be
    within the bound: it left out a weight gathered on the axis decided first. Counting it, no order's
    plan and no move leads there.) Either way it is no slower than a descent of one-axis moves, no move
    improves on it, and it runs equal to serial."""
    text = open("examples/tp_schemes/layer_2d.par").read()
    compiled = compile_par(text.split("layout {")[0] + f"memory <= {percent} %\nlayout {{\n  x : ?\n}}\n")
    limit = search.memory_limit(compiled.bound)

    def rated(typed):  # as compile rates plans: one within the bound before one over it, then the faster
        plan = estimate(CompletedPlan(typed, lower(typed)), GLOO)
        return plan.memory["total"] > limit, plan.step_s

    plans = [search.search(compiled.bound, GLOO, limit, order=order) for order in itertools.permutations(range(2))]
    if percent == 30:
        assert all(rated(plan)[0] for plan in plans)
    one_axis = min(plans, key=rated)  # the descent one axis at a time, from the same start
    for _ in range(4):
        better = min((search.search(compiled.bound, GLOO, limit, order=(axis,), start=one_axis) for axis in range(2)),
                     key=rated)
        if rated(better) >= rated(one_axis):
            break
        one_axis = better
    ours = rated(compiled.typed)
    assert not ours[0] and ours <= rated(one_axis) and ours <= min(rated(plan) for plan in plans)
    if percent == 30:  # at 40 % the better order's plan is where the descent ends
        assert ours < min(rated(plan) for plan in plans)
    assert round(ours[1] * 1e3, 2) == {30: 2.48, 40: 2.02}[percent]
    for move in ((0,), (1,), ((0, 1),)):
        again = search.search(compiled.bound, GLOO, limit, order=move, start=compiled.typed)
        assert rated(again) >= ours
    if percent == 30:
        check(pools, compiled)


# the 2-D layer's is about 25 s on 2 cores: make test-slow; the 3-D layer's stays in make test
@pytest.mark.parametrize("scheme", [pytest.param("layer_2d", marks=pytest.mark.slow), "layer_3d"])
def test_a_descents_move_starts_branch_and_bound_from_the_plan_it_moves_from(compile_par, monkeypatch, scheme):
    """The pair move's program is given its start plan as a hint: every binary, one choice per op and free
    tensor. On the 3-D layer the plan stores the MLP's weights split over axes where no signature left in
    the neighbourhood takes them so: a free tensor's placement in the plan is one of its choices all the
    same. With the hint fixed the program is feasible (the plan is within the bound as the program counts
    memory, which is how cost.memory_per_rank counts it: on the 3-D layer, before a weight gathered over
    two axes was counted as a prefetched group's by the program and not at all by the cost model, the plan
    was over the bound as the program counted it) and the move's own solution costs no more."""
    text = open(f"examples/tp_schemes/{scheme}.par").read()
    compiled = compile_par(text.split("layout {")[0] + "memory <= 30 %\nlayout {\n  x : ?\n}\n")
    solved = programs_solved(monkeypatch)
    search.search(compiled.bound, GLOO, search.memory_limit(compiled.bound), order=((0, 1),), start=compiled.typed)
    (program, hint, (status, solution)), *_ = solved
    integer = [column for column, is_integer in enumerate(program.integer) if is_integer]
    exactly_one = [terms for terms, lower, upper in program.rows
                   if lower == upper == 1.0 and all(program.integer[c] for c in terms)]  # one choice per name
    assert sorted(hint) == integer and all(sum(hint[c] for c in terms) == 1 for terms in exactly_one)
    assert status == "optimal" and len(solved) == 1
    fixed = solver.IntegerProgram(list(program.cost), list(program.integer), list(program.rows))
    for column, value in hint.items():
        fixed.row({column: 1.0}, value, value)
    status, at_start = fixed.solve()
    assert status == "optimal"
    assert [round(at_start[c]) for c in integer] == [hint[c] for c in integer]

    def objective(values):
        return sum(c * v for c, v in zip(program.cost, values))

    assert objective(solution) <= objective(at_start) + 1e-12


# ZeRO-3 over both axes of a 2 × 2 mesh for the MLPs of a 3-layer LLaMA: each weight is gathered over
# both where it is used (two all-gathers, not one prefetched group), and the linear keeps the gathered
# weight for backward, in every layer
ZERO_OVER_TWO_AXES = """mesh a = 2, b = 2
model examples.hf_models:HFLlama(layers=3, attention="sdpa")
input input_ids : int64[4, 16] in [0, 256)
memory <= 60 %
layout {
    input_ids : [S(0), S(0)]
    model.model.layers.*.mlp.*.weight : [S(0), S(1)]
}
"""


# the 2-D layer in make test-slow: the 2.5-D and 3-D layers are counted on the same axes and more
@pytest.mark.parametrize("scheme", [pytest.param("layer_2d", marks=pytest.mark.slow), "layer_2p5d", "layer_3d",
                                    "zero over two axes", "sequence parallel"])
@pytest.mark.usefixtures("search_once")
def test_the_search_counts_a_plans_memory_as_the_cost_model_does(compile_par, monkeypatch, scheme):
    """A move from the compiled plan (pair moves start from a plan, so the bound is not scaled for axes
    decided later): the memory row of its integer program, at the solution, is cost.memory_per_rank of the
    plan it lowers to, byte for byte: activations autograd keeps, weights gathered a group at a time, and
    weights gathered where used over two axes (held until backward, in both: the 9 MLP weights of ZeRO
    over two axes, which the cost model left out and the search counted as prefetched groups, two layers'
    worth); and, for Megatron-SP, the whole copies the projections keep of the norms' gathered outputs,
    not the split values (which both left out, and counted instead)."""
    order = ((0, 1),)
    if scheme == "zero over two axes":
        compiled = compile_par(ZERO_OVER_TWO_AXES)
        assert compiled.program.memory()["parameter_copies_per_rank"] == 3 * 3 * 128 * 64 * 4
    elif scheme == "sequence parallel":
        as_written = compile_file("examples/gpt_sp_tp2.par").program.values.values()
        copies = {v["of"]: v for v in as_written if v["kind"] == "copy"}
        # each layer's two norms' outputs, held whole by the projections that read them gathered
        norms = [f"layer_norm{i}" for i in ("", "_1", "_2", "_3")]
        assert all(copies[n]["layout"] == "B" and copies[n]["local_shape"] == [2, 16, 32] for n in norms)
        text = open("examples/gpt_sp_tp2.par").read()
        compiled = compile_par(text.replace("layout {", "memory <= 80 %\nlayout {"))
        order = (0,)
    else:
        text = open(f"examples/tp_schemes/{scheme}.par").read()
        compiled = compile_par(text.split("layout {")[0] + "memory <= 30 %\nlayout {\n  x : ?\n}\n")
    limit = search.memory_limit(compiled.bound)
    solved = programs_solved(monkeypatch)
    # the plan taken: the move's program's, or that of the same program without an axis's bucketed
    # gradients (search._fewer_buckets), whose columns are the program's
    taken, fewer_buckets = [], search._fewer_buckets
    monkeypatch.setattr(search, "_fewer_buckets", lambda *args: taken.append(fewer_buckets(*args)) or taken[-1])
    moved = search.search(compiled.bound, GLOO, limit, order=order, start=compiled.typed)
    (program, _, _), = solved[:1]
    (status, solution), = taken
    assert status == "optimal"
    counted = memory_counted(program, solution, limit)
    assert round(counted) == memory_per_rank(lower(moved))["total"] <= limit


@pytest.mark.slow  # about 40 s on 2 cores: make test-slow
def test_a_move_counts_the_weights_gathered_on_an_axis_it_does_not_decide(compile_par, monkeypatch):
    """The MLP's weights stored split over a and gathered over it, a group per layer, resharded after
    forward: a move deciding b alone holds two groups whole, though none of its choices gathers them. The
    search had left them out (196,608 bytes: it took the move's plan to be within the bound, where the
    cost model counts it 8.9 % over); on T5 dp 2 × tp 2 under 30 % every plan came out over the bound."""
    from pardsl.compiler import _lowered
    from pardsl.planning.cost import DEFAULT_BUCKET_MB

    compiled = compile_par(ZERO_OVER_TWO_AXES.replace("[S(0), S(1)]", "[S(0), B]"))
    limit = search.memory_limit(compiled.bound)
    solved = programs_solved(monkeypatch)
    moved = search.search(compiled.bound, GLOO, limit, order=(1,), start=compiled.typed)
    program, _, (status, solution) = solved[-1]
    counted = memory_counted(program, solution, limit)
    memory = memory_per_rank(_lowered(moved, DEFAULT_BUCKET_MB, limit))
    assert memory["gathered_parameters"] == 2 * 3 * 128 * 64 * 4  # two layers' three weights, whole
    assert status == "optimal" and round(counted) == memory["total"] <= limit


FSDP_WITH_TENSOR_PARALLELISM = """mesh dp = 2, tp = 2
model examples.hf_models:HFLlama(layers=3, attention="sdpa")
input input_ids : int64[4, 16] in [0, 256)
memory <= 40 %
layout {
    input_ids : [S(0), B]
    model.model.layers.*.self_attn.q_proj.weight : [S(1), S(0)]
    model.model.layers.*.self_attn.k_proj.weight : [S(1), S(0)]
    model.model.layers.*.self_attn.v_proj.weight : [S(1), S(0)]
    model.model.layers.*.self_attn.o_proj.weight : [S(0), S(1)]
    model.model.layers.*.mlp.gate_proj.weight : [S(1), S(0)]
    model.model.layers.*.mlp.up_proj.weight : [S(1), S(0)]
    model.model.layers.*.mlp.down_proj.weight : [S(0), S(1)]
}
"""


@pytest.mark.slow
def test_fsdp_with_tensor_parallelism_releases_its_groups_under_a_bound_and_runs_equal_to_serial(pools, compile_par):
    """Weights stored split over dp and used Megatron-split over tp: each layer's group is gathered over dp
    and stays split over tp. Under a bound the plan does not meet holding every group from forward to
    backward, each group but the last is released after forward, and gathered again for backward where
    backward reads its weights (every layer's), as the search counts them (two groups whole at a time);
    only groups gathered whole had been."""
    compiled = compile_par(FSDP_WITH_TENSOR_PARALLELISM)
    groups = compiled.program.gathers
    assert [g.axis for g in groups if g.members[0].unit.startswith("model.model.layers")] == ["dp"] * 3
    # backward starts with the last group gathered, so it is held; every other one is released, and a
    # layer's gathered again for backward (which reads its weights)
    assert all(g.resharded for g in groups[:-1])
    assert all(g.regather is not None for g in groups[:-1] if g.members[0].unit.startswith("model.model.layers"))
    assert estimate(compiled, GLOO).memory["total"] <= compiled.memory_bound
    check(pools, compiled)


def test_a_pair_program_prices_a_parameter_gathered_over_both_axes_as_lowering_places_it(compile_par):
    """Lowering prefetches a stored-split parameter's gather where it is one all-gather; gathered over two
    axes it is gathered where it is used and its gradient reduce-scattered there. A pair program that
    priced both gathers as prefetched took, on the 3-D MLP under a bound, a move the cost model rates 2.1×
    slower (fc1's weight stored split over both batch axes); priced as lowering places it, the move it takes
    from the compiled plan stays near that plan's estimate."""
    text = open("examples/tp_schemes/mlp_3d.par").read()
    compiled = compile_par(text.split("layout {")[0] + "memory <= 30 %\nlayout {\n  x : ?\n}\n")
    moved = search.search(compiled.bound, GLOO, search.memory_limit(compiled.bound), order=((0, 2),),
                          start=compiled.typed)
    assert estimated_step(moved) < 1.2 * estimate(compiled, GLOO).step_s


def test_a_group_of_axes_is_decided_by_one_program_over_their_combinations(compile_par, monkeypatch):
    """`order=((0, 1),)`: both axes of the 2-D MLP at once, by one program whose choices are the
    combinations of each op's one-axis signatures (more binaries than both one-axis programs together).
    Its plan meets the bound, splits ops over both axes, and is estimated no slower than either order's."""
    text = open("examples/tp_schemes/mlp_2d.par").read()
    compiled = compile_par(text.split("layout {")[0] + "memory <= 30 %\nlayout {\n  x : ?\n}\n")
    limit = search.memory_limit(compiled.bound)
    solved = programs_solved(monkeypatch)
    search.search(compiled.bound, GLOO, limit, order=(0, 1))
    joint = search.search(compiled.bound, GLOO, limit, order=((0, 1),))
    one, other, both = binaries(solved)
    assert both > one + other
    assert estimate(CompletedPlan(joint, lower(joint)), GLOO).memory["total"] <= limit
    assert any(all(p != B for p in node.op_layout.placements) for node in joint.nodes.values())
    assert estimated_step(joint) <= 1.001 * min(searched_step(compiled.bound, order)
                                                 for order in itertools.permutations(range(2)))


def test_the_search_decides_the_mesh_axes_in_every_order_and_compiles_the_fastest():
    """Compile runs every order of the axes and keeps the fastest plan, here also faster than the greedy
    completion. On the 3-D MLP, deciding l first found a plan estimated 1.7× slower (1.68 ms against
    0.99) while the programs priced a gradient bucket at its bytes alone: a plan that reduces no
    parameter's gradient on an axis saves the bucket's latency, and every order now finds the 0.99 ms plan."""
    compiled = compile_file("examples/tp_schemes/mlp_3d.par")
    steps = {order: searched_step(compiled.bound, order) for order in itertools.permutations(range(3))}
    assert estimate(compiled, GLOO).step_s == min(steps.values()) == max(steps.values())
    assert round(min(steps.values()) * 1e3, 2) == 0.99
    assert not any(n.code == "N004" for n in compiled.program.notes)


def test_a_compile_replaying_another_files_answers_is_told_they_differ(compile_par):
    """SolutionLog (how `pardsl.load` gives every rank rank 0's plan): replaying a compile's answers gives
    the same module without HiGHS; replayed on another file, the first program of another size stops it."""
    text = open("examples/mlp.par").read().split("layout {")[0] + "memory <= 30 %\nlayout {\n  x : ?\n}\n"
    with solver.SolutionLog() as log:
        recorded = compile_par(text)
    assert log.entries and not solver.SolutionLog.active
    with solver.SolutionLog(log.entries):
        assert compile_par(text).source == recorded.source
    other = open("examples/tp_schemes/layer_1d.par").read().split("layout {")[0]
    other += "memory <= 30 %\nlayout {\n  x : ?\n}\n"
    with pytest.raises(solver.LogMismatch, match="integer program 1 has"):
        with solver.SolutionLog(log.entries):
            compile_par(other)


def test_a_program_asked_again_is_answered_without_solving_it_again(compile_par, monkeypatch):
    """On a mesh whose axes are alike, with nothing written, both orders' first programs are the same
    program (on T5 under a bound it runs to its time limit): HiGHS solves it once. A change of the solver's
    limits is another question."""
    monkeypatch.setattr(solver, "_ANSWERS", {})
    asked, solved = [], []
    solve, ask = solver.IntegerProgram._solve, solver.IntegerProgram.solve
    monkeypatch.setattr(solver.IntegerProgram, "_solve", lambda self, *a: solved.append(1) or solve(self, *a))
    monkeypatch.setattr(solver.IntegerProgram, "solve", lambda self, *a, **k: asked.append(1) or ask(self, *a, **k))
    text = "mesh a = 2, b = 2\nmodel examples.models:MLP(d_model=16, d_ff=32)\ninput x : float32[8, 16]\nmemory <= 60 %\n"
    first = compile_par(text)
    assert len(solved) < len(asked)
    again = len(solved)
    assert compile_par(text).source == first.source and len(solved) == again  # every answer kept
    monkeypatch.setattr(solver, "MIP_GAP", 1e-2)
    compile_par(text)
    assert len(solved) > again


def test_a_descent_asks_no_program_whose_answer_it_has_and_lowers_each_plan_once(compile_par, monkeypatch):
    """An order's last program decides its axis with the others fixed as the plan has them; where it proves
    the plan optimal the plan is settled on that axis (TypedGraph.settled), and the descent does not
    decide that axis alone again from it: that program would find the plan again (shown here by asking
    it). On the 32-layer LLaMA of benchmarks/search.py that was two programs, 1.2 s. A move that returns its
    start plan is not lowered and rated again."""
    from pardsl import compiler
    from pardsl.planning import descent

    asked, lowered = [], []
    real_search, real_lower = descent.search, compiler.lower

    def searching(bound, machine, limit, order=None, start=None, **kwargs):
        typed = real_search(bound, machine, limit, order=order, start=start, **kwargs)
        if kwargs.get("fewer_buckets", True):  # not the second look where the plan saved buckets
            asked.append((order, start, typed, machine))
        return typed

    monkeypatch.setattr(descent, "search", searching)
    monkeypatch.setattr(compiler, "lower", lambda typed, *a: lowered.append(descent.layouts_of(typed)) or
                        real_lower(typed, *a))
    monkeypatch.setattr(descent, "recipe_plans", lambda *args, **kwargs: [])  # lowered apart from the search's
    text = "mesh a = 2, b = 2\nmodel examples.models:MLP(d_model=16, d_ff=32)\ninput x : float32[8, 16]\nmemory <= 60 %\n"
    compiled = compile_par(text)
    orders = {order: typed for order, start, typed, _ in asked if start is None}
    assert orders[(0, 1)].settled == {1} and orders[(1, 0)].settled == {0}
    moves = [(order, start) for order, start, _, _ in asked if start is not None]
    start = moves[0][1]
    assert descent.layouts_of(start) == descent.layouts_of(orders[(0, 1)])  # the better order's plan
    assert [order for order, _ in moves] == [(0,), ((0, 1),)]  # b, settled, is not decided alone again
    machine = asked[0][3]  # compile's: this machine's calibration, where it has one
    again = real_search(compiled.bound, machine, search.memory_limit(compiled.bound), order=(1,), start=start)
    assert descent.layouts_of(again) == descent.layouts_of(start)
    assert len(lowered) == len(set(lowered)) < len(asked)


def test_under_offload_the_search_counts_the_device_copies_alone(compile_par, monkeypatch):
    """`offload optimizer`: each parameter's shard, gradient and optimizer state live in host memory and
    the device holds a copy for compute. The search's memory row counts that copy alone, byte for byte as
    the estimate does, so a bound only the device copies meet is met (the search counted the host's
    state as the device's: four times the bytes, and no plan within the bound)."""
    from pardsl.passes.offload import offload_to_host

    text = open("examples/mlp.par").read().split("layout {")[0] + \
        "offload optimizer\nmemory <= 20 %\nlayout {\n  x : ?\n}\n"
    compiled = compile_par(text)
    limit = search.memory_limit(compiled.bound)
    solved = programs_solved(monkeypatch)
    moved = search.search(compiled.bound, GLOO, limit, order=(0,), start=compiled.typed)
    program, _, (status, solution) = solved[-1]
    assert status == "optimal"
    device = memory_per_rank(offload_to_host(lower(moved), compiled.bound.par.offload))
    assert round(memory_counted(program, solution, limit)) == device["total"] <= limit < device["host_total"]
    assert not [n for n in compiled.program.notes if n.code == "N003"]


SPLIT_REDUCTIONS = """mesh tp = 4
model examples.hf_models:HFLlama(layers=2, hidden=512, heads=8, kv_heads=4, ffn=1024, vocab=1024)
input input_ids : int64[4, 128] in [0, 1024)
memory <= 30 %
"""


def test_the_search_splits_reductions_where_it_pays_and_a_file_can_forbid_it(pools):
    """Nothing written but a bound: the search's plan reduce-scatters each block's partial sum where Megatron
    all-reduces it, computes the norms and residual adds on each rank's share and gathers them for the next
    projections (sequence parallelism's form, with the residual stream split by the batch's rows), found by
    the integer program's conversions rather than written by a recipe; it runs equal to serial on 4 ranks.
    `substitute split_reductions : off` forbids it, however short memory is: every partial sum of the
    search's is all-reduced, and Megatron's recipe is weighed without sequence parallelism."""
    from pardsl.planning.cost import default_machine
    from pardsl.tools.explain import report

    def explained(compiled) -> str:
        return report(compiled, estimate(CompletedPlan(compiled.typed, compiled.program), default_machine()))

    searched = compile_text(SPLIT_REDUCTIONS, "model.par")
    forward = searched.program.collective_counts()["forward"]
    assert (forward["all_reduce"], forward["reduce_scatter"]) == (0, 4)  # two a layer, none all-reduced
    assert not any(n.message.startswith("the best known recipe for this model and mesh, Megatron TP on tp with "
                                        "sequence parallelism, is compiled") for n in searched.program.notes)
    assert "substitutions: 4 partial sums reduce-scattered where an all-reduce would make them whole, chosen by " \
           "the compiler" in explained(searched)
    check(pools, searched, steps=1)

    # forbidden even where memory is short: at 15 % no plan meets the bound, and the one nearest it (which
    # reduce-scatters 10 sums where allowed) all-reduces them all
    tight = SPLIT_REDUCTIONS.replace("30 %", "15 %") + "substitute split_reductions : off\n"
    forbidden = compile_text(tight, "model.par")
    assert forbidden.program.collective_counts()["forward"]["reduce_scatter"] == 0
    assert any(n.code == "N003" for n in forbidden.program.notes)
    [note] = [n.message for n in forbidden.program.notes if n.code == "N009"]
    assert note.startswith("the best known recipe for this model and mesh, Megatron TP on tp,")
    assert "substitutions: reductions split off, as the file says" in explained(forbidden)


SEARCHED_LLAMA = """mesh   dp = 2, tp = 4
model  examples.hf_models:HFLlama(layers=2, hidden=256, heads=8, kv_heads=4, ffn=512, vocab=1024)
input  input_ids : int64[8, 64] in [0, 1024)
memory <= 25 %
layout {
    input_ids : ?
}
"""


@pytest.mark.slow
def test_the_search_counts_its_work_so_a_busy_machine_and_a_replaying_rank_stop_where_an_idle_one_does(
        monkeypatch):
    """The search's budget and its programs' limits count the work done (simplex iterations, HiGHS's calls
    back, programs written, plans lowered), not seconds: waiting or spinning moves nothing; a search the
    budget stops midway compiles to the same module, at the same count, with a process spinning beside
    it; and a rank replaying rank 0's answers, which skips HiGHS, stops where rank 0 did instead of asking
    for programs rank 0 never solved (a LogMismatch on a clock of seconds)."""
    import subprocess
    import sys
    import time

    from pardsl.planning import descent

    started = descent.search_clock()
    time.sleep(0.2)
    give_up = time.perf_counter() + 0.2
    while time.perf_counter() < give_up:
        pass
    assert descent.search_clock() == started

    monkeypatch.setattr(descent, "SEARCH_BUDGET_S", 2.0)

    def compiled(log=None):
        solver._ANSWERS.clear()  # solved again, not taken from the answers kept
        before = descent.search_clock()
        with log or solver.SolutionLog() as recorded:
            result = compile_text(SEARCHED_LLAMA, "model.par")
        return result, descent.search_clock() - before, recorded

    idle, idle_work, log = compiled()
    assert any(n.code == "N006" for n in idle.program.notes)  # the budget stopped it midway
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"])]
    try:
        busy, busy_work, _ = compiled()
    finally:
        for process in spinning:
            process.kill()
            process.wait()
    assert busy.source == idle.source and busy_work == pytest.approx(idle_work, rel=1e-12)
    assert [n.message for n in busy.program.notes] == [n.message for n in idle.program.notes]
    replayed, replayed_work, _ = compiled(solver.SolutionLog(log.entries))
    assert replayed.source == idle.source and replayed_work == pytest.approx(idle_work, rel=1e-12)
