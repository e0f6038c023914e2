"""A pass over the lowered program: the submodules a file names with `recompute` are made again in backward.

`recompute model.layers.*` (full) keeps only the inputs of each such layer for backward: the statements
of the layer become one region, rendered as a local function that `rt.recompute` runs under
`torch.utils.checkpoint` (non-reentrant, the RNG state of its start restored, so dropout draws the
same masks). In backward the region runs forward again to give autograd what it would have kept, and
its collectives are issued again: each forward collective of the region counts once more in backward.
A product whose result nothing backward needs is not made again (`rt.made_once`: a stand-in of its
shape in the second run): a layer's down projection feeds only the residual add that ends it, which
keeps nothing, and its input, which autograd keeps for the weight's gradient, is made again all the same.

`recompute ... : selective` keeps what is costly to make again, as torchtitan's op-level policy does:
the results of products with a weight, of fused attention and of unfused attention's weighted values (a
product of two activations no larger than what it reads; each such statement marked `rt.kept`) and of
the region's collectives: the runtime keeps each one's result in forward and gives it back when the
region runs again, with no computation or communication. The rest — norms, rotary embeddings,
activations, residual adds, and unfused attention's scores and softmax, which grow with the square of
the sequence (Megatron's selective recomputation) — is made again. No collective is added. A product
whose result nothing backward needs is neither kept nor made again (`rt.made_once`), as under `full`;
with the residual stream summed partially over tensor parallelism, the attention's output projection is
such a product too: it feeds only that sum's all-reduce, whose result is kept, and a residual add.

A layer whose parameters are gathered before use (ZeRO-3) gathers its group again for its second run,
as a resharded group is gathered again for backward: where the group is resharded anyway that is the
same all-gather; otherwise one more, which the region counts.

Outputs and gradients are bit-equal to the program without recomputation: the same ops run on the
same inputs, in the same order. The program's memory counts what a region keeps (`held_here`, and what
it makes again: `recomputed`), so the memory bound and `explain` see the saving. Under a bound, with
nothing named, `recomputed_within` chooses the fewest layers to recompute.

A region is a run of consecutive statements whose ops come from one recomputed submodule, up to the last
that keeps something for backward: what follows it (a layer's residual add, and with Megatron's layers
the all-reduce of the residual sum) keeps nothing, so it runs once, outside the region. This runs last
among the passes, on the released program (pardsl/passes/liveness.py): a value a region makes and the
program reads after it is the region's result; a value made before it is an argument, released after
the region where the region read it last.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

from pardsl.language.diagnostics import Diagnostic, DiagnosticSink
from pardsl.language.syntax import RecomputeDecl
from pardsl.passes.regather import kept_whole
from pardsl.planning.cost import estimate, memory_per_rank, pipeline_rank_memory, repeated_layer
from pardsl.planning.descent import CompletedPlan
from pardsl.planning.inference import TypedGraph
from pardsl.program.ir import Collective, Instruction, LoweredProgram, Statement, Text, Var, format_bytes
from pardsl.runtime.schedules import stages_of_rank

# What a selective region keeps: the results of these statements (their calls), as well as every forward
# collective's. An ATen statement among them is marked `rt.kept`, the runtime's calls keep their own
# (pardsl/runtime/recompute.py).
_COSTLY_CALLS = ("aten.linear.", "aten.mm.", "aten.addmm.", "aten.scaled_dot_product_attention.",
                 "rt.column_parallel_linears", "rt.attention")


def recompute_layers(program: LoweredProgram, typed: TypedGraph,
                     decls: tuple[RecomputeDecl, ...] | None = None) -> LoweredProgram:
    """The program with each run of statements from a submodule recomputed made one region: those the file
    names, or `decls`."""
    decls = typed.bound.par.recomputes_written if decls is None else decls
    if not decls:
        return program
    unit_of = _units(program, typed, decls)
    statements, values, again = [], dict(program.values), set()
    outputs = {output.var for output in program.outputs}
    runs = _runs(program.statements, unit_of)
    names: dict[str, int] = {}
    last_read: dict[str, int] = {}  # per name, the last statement that reads it: what a region's results are
    for index, statement in enumerate(program.statements):
        for name in statement.instruction.reads():
            last_read[name] = index
    for start, end, (unit, decl) in runs:
        if decl is None:
            statements.extend(program.statements[start:end])
            continue
        stop = _region_end(program.statements, start, end, typed.bound.kept)
        # its forward runs again in backward, gathering its inputs there: none is kept split (regather.py)
        body, whole_again = kept_whole(program.statements[start:stop])
        region, after = _region(body, lambda name: last_read.get(name, -1) >= stop,
                                outputs, unit, decl, names) if stop > start else (None, [])
        if region is None:
            statements.extend(program.statements[start:end])
            continue
        for name in whole_again & set(values):
            values[name] = {k: v for k, v in values[name].items() if k != "kept_here"}
        region = _gathered_again(region, program, unit)
        region = _marked(region, typed.bound.kept, decl.policy, _small_products(region, typed))
        statements.extend([region, *after, *program.statements[stop:end]])
        _count_kept(region, unit, decl.policy, program, values, typed, outputs)
        # the ops made again, whose forward compute backward adds (a conversion's node is the op it serves,
        # which its own statement decides)
        again.update(statement.node for statement in region.body if statement.node and
                     statement.instruction.kind != "convert" and
                     not _is_made_once(statement) and not (decl.policy == "selective" and _costly(statement)))
    return dataclasses.replace(program, statements=statements, values=values, recomputed_ops=frozenset(again))


def _units(program: LoweredProgram, typed: TypedGraph, decls: tuple[RecomputeDecl, ...]) -> dict[int, tuple]:
    """Per statement, the recomputed submodule its op comes from and the declaration that names it."""
    paths = typed.bound.module_paths
    matchers = [(decl, re.compile(r"\.".join("[^.]+" if part == "*" else re.escape(part)
                                             for part in decl.pattern.split(".")) + r"(?=\.|$)")) for decl in decls]
    sink = DiagnosticSink(typed.bound.par.source)
    matched: dict[int, set[str]] = {id(decl): set() for decl in decls}
    units: dict[int, tuple] = {}
    twice: set[str] = set()
    for index, statement in enumerate(program.statements):
        path = paths.get(statement.node, "")
        found = [(decl, match.group(0)) for decl, matcher in matchers if (match := matcher.match(path))]
        for decl, unit in found:
            matched[id(decl)].add(unit)
        if len(found) > 1 and found[0][1] not in twice:
            twice.add(found[0][1])
            first, second = found[0][0], found[1][0]
            sink.error("E003", f"`{found[1][1]}` is recomputed twice: by `recompute {first.pattern}` and "
                       f"`recompute {second.pattern}`", second.pattern_span,
                       f"first named on line {first.span.line}; name each submodule once")
        if found:
            units[index] = found[0][1], found[0][0]
    _with_their_readers(program.statements, units)
    known = sorted({layer for layer in map(repeated_layer, paths.values()) if layer})
    hint = (f"recompute one of {', '.join(known[:4])}{', ...' if len(known) > 4 else ''}, or all of them: "
            f"`{re.sub(r'[0-9]+$', '*', known[0])}`" if known else
            "name a submodule by its path in the model (layers.0, or layers.* for every layer)")
    # whether the model's forward calls the submodule, not this program: a pipeline stage (or a stage of
    # the pipeline search's) may hold none of the layers a file recomputes, such as a first stage of the
    # embedding alone
    for decl, matcher in matchers:
        if not matched[id(decl)] and not any(matcher.match(paths.get(name, "")) for name in typed.nodes):
            sink.error("E081", f"`{decl.pattern}` names no submodule the model's forward calls", decl.pattern_span,
                       hint)
    sink.raise_if_any()
    return units


def _with_their_readers(statements: list[Statement], units: dict[int, tuple]) -> None:
    """A statement of no unit joins the unit of its first reader where it is a parameter's compute copy (a
    precision policy's cast, an offloaded master's fetch: placed just before that reader) or stands between
    two statements of that unit (a conversion of a value the layer takes in, for an op of the layer): so a
    layer stays one region, made again in backward with them, rather than one region per stretch."""
    previous = None  # the unit of the statement before, releases aside
    for index, statement in enumerate(statements):
        if statement.instruction.kind == "release":
            continue
        # what a stage makes once for every micro-batch (pardsl/passes/shared_constants.py) is made again by none
        if index not in units and statement.target and statement.instruction.kind != "constants":
            reader = next((later for later in range(index + 1, len(statements))
                           if set(statement.targets) & set(statements[later].instruction.reads())), None)
            copy = statement.instruction.callee in ("rt.cast", "sync.fetch") and \
                all(name.startswith("self.") for name in statement.instruction.reads())
            if reader in units and (copy or previous == units[reader]):
                units[index] = units[reader]
        previous = units.get(index)


def _runs(statements: list[Statement], unit_of: dict[int, tuple]) -> list[tuple[int, int, tuple]]:
    """The statements cut into runs of one unit (or of none); a release belongs with the line before it."""
    runs: list[list] = []
    for index, statement in enumerate(statements):
        if statement.instruction.kind == "release" and runs:
            runs[-1][1] = index + 1
            continue
        key = unit_of.get(index, (None, None))
        if runs and runs[-1][2] == key:
            runs[-1][1] = index + 1
        else:
            runs.append([index, index + 1, key])
    return [tuple(run) for run in runs]


def _region_end(statements: list[Statement], start: int, end: int, kept) -> int:
    """Where the region of the run `statements[start:end]` ends: after its last statement that keeps
    something for backward (and the releases that follow it). What comes after keeps nothing, so backward
    needs nothing of it made again: it runs once, in forward, outside the region, its collectives issued
    once (a layer's residual add, and with Megatron's layers the all-reduce of the residual sum that
    follows it)."""
    keepers = {op for op, _ in kept.reads}
    last = next((index for index in reversed(range(start, end)) if any(_keeps(statements[index], kept, keepers))),
                None)
    if last is None:
        return start
    stop = last + 1
    while stop < end and statements[stop].instruction.kind == "release":
        stop += 1
    return stop


def _keeps(statement: Statement, kept, keepers: set[str]) -> tuple[bool, bool]:
    """Whether the statement keeps for backward what it reads, and what it makes: an ATen op as autograd
    keeps for it (pardsl/model/saved_for_backward.py); conversions nothing (their adjoints are linear
    maps); the runtime's own calls are taken to keep all they read and make."""
    instruction = statement.instruction
    if instruction.kind in ("release", "convert", "project", "size", "expression"):
        return False, False
    if instruction.callee.startswith("aten.") and statement.node:
        return statement.node in keepers, kept.owner.get(statement.node, statement.node) in kept.by_itself
    return True, True


def _region(body: list[Statement], read_later: Callable[[str], bool], outputs: set[str], unit: str,
            decl: RecomputeDecl, names: dict[str, int]) -> tuple[Statement | None, list[Statement]]:
    """The region statement for `body`, and the releases the program makes after it; None where the region
    makes nothing the program reads after it (there is nothing to recompute). `read_later(name)`: whether
    a statement after the region reads it."""
    made: list[str] = []
    arguments: list[str] = []
    for statement in body:
        for name in statement.instruction.reads():
            if name not in made and name not in arguments and not name.startswith("self."):
                arguments.append(name)
        if statement.instruction.kind != "release":
            made.extend(statement.targets)
    results = [name for name in made if read_later(name) or name in outputs]
    if not results:
        return None, []
    inside, released_after = [], []
    for statement in body:  # an argument's last read inside: released after the call, in the program's scope
        if statement.instruction.kind == "release":
            names_freed = statement.instruction.reads()
            mine = [n for n in names_freed if n not in arguments]
            theirs = [n for n in names_freed if n in arguments]
            released_after.extend(theirs)
            if mine:
                inside.append(dataclasses.replace(statement, instruction=Instruction(
                    "release", "del", tuple(Var(n) for n in mine))))
            continue
        inside.append(statement)
    function = re.sub(r"\W", "_", unit)
    names[function] = names.get(function, 0) + 1
    if names[function] > 1:
        function = f"{function}_{names[function]}"
    layouts = {name: layout for statement in body for name, layout in zip(statement.targets, statement.layouts)}
    forward = [c for statement in body for c in statement.collectives if c.phase == "forward"]
    again = tuple(Collective(c.kind, c.axis, "backward", c.bytes, c.value, f"made again in backward: {c.reason}",
                             c.node) for c in forward) if decl.policy == "full" else ()
    kept = "only its inputs kept" if decl.policy == "full" else \
        "linear layers', fused attention's and collectives' results kept"
    issued = (f"its {len(forward)} forward collective{'s' if len(forward) != 1 else ''} issued again there"
              if again else "no collective issued again")
    region = Statement(
        ", ".join(results),
        Instruction("recompute", "rt.recompute", (Text(function), Text(repr(decl.policy)),
                                                  *(Var(name) for name in arguments))),
        f"{unit} made again in backward ({decl.policy}: {kept}; {issued})",
        tuple(c for statement in body for c in statement.collectives) + again,
        tuple(layouts[name] for name in results if name in layouts) if all(name in layouts for name in results) else (),
        body=tuple(inside))
    after = [Statement("", Instruction("release", "del", tuple(Var(n) for n in released_after)), "")] \
        if released_after else []
    return region, after


def _marked(region: Statement, kept, policy: str, small_products: frozenset[str] = frozenset()) -> Statement:
    """The region with each product (a linear, a matrix product, attention) whose result nothing backward
    needs marked `rt.made_once`: made in forward, a stand-in of its shape when the region runs again (in
    any layer the down projection, which only the residual add after the region reads). Under `selective`
    every other product is marked `rt.kept`: its products' results kept for backward and given back when
    the region runs again (the runtime's column-parallel linears and attention keep theirs themselves,
    unmarked). Backward needs what an op of the region keeps (an operand, its own result) and, of a value
    the second run makes, what makes it; under `selective` a kept result (a costly op's, a collective's
    given back) needs nothing of what it is made from. `small_products`: the nodes of products of two
    activations taken as products too (`_small_products`)."""
    selective = policy == "selective"
    keepers = {op for op, _ in kept.reads}
    needed: set[str] = set()
    marked: dict[int, str] = {}
    for index in reversed(range(len(region.body))):
        statement = region.body[index]
        if selective and _communicates(statement):
            continue
        keeps_operands, keeps_result = _keeps(statement, kept, keepers)
        result_needed = keeps_result or bool(needed & set(statement.targets))
        product = statement.instruction.kind != "convert" and (_costly(statement) or statement.node in small_products)
        if product and statement.instruction.callee.startswith("aten.") and (selective or not result_needed):
            marked[index] = "rt.kept" if result_needed else "rt.made_once"
        given_back = product and selective  # its result kept: what makes it is not made again
        if keeps_operands or (result_needed and not given_back):
            needed.update(statement.instruction.reads())
    if not marked:
        return region
    suffix = {"rt.kept": "its products' results kept for backward",
              "rt.made_once": "made once: backward needs nothing of it"}
    body = tuple(dataclasses.replace(
        statement, comment=f"{statement.comment} — {suffix[marked[index]]}",
        instruction=Instruction(statement.instruction.kind, marked[index],
                                (Text(statement.instruction.callee), *statement.instruction.args),
                                statement.instruction.kwargs)) if index in marked else statement
        for index, statement in enumerate(region.body))
    return dataclasses.replace(region, body=body)


def _communicates(statement: Statement) -> bool:
    """A conversion that communicates in forward: in a selective region's second run its result is given
    back, whatever it reads."""
    return statement.instruction.kind == "convert" and any(c.phase == "forward" for c in statement.collectives)


def _is_made_once(statement: Statement) -> bool:
    return statement.instruction.callee == "rt.made_once"


def _gathered_again(region: Statement, program: LoweredProgram, unit: str) -> Statement:
    """The region with the all-gathers its second run makes: each gather group its statements take a
    parameter from is gathered again in backward (ParameterSync, as for a resharded group). A group
    resharded and gathered again for backward anyway (pardsl/passes/reshard.py) adds nothing: that gather
    is the one the region takes."""
    made = {target for statement in region.body if statement.instruction.kind == "param_gather"
            for target in statement.targets}
    again = tuple(Collective("all_gather", group.axis, "backward", group.collective.bytes, f"group {number}",
                             f"gathered again to make {unit} again in backward")
                  for number, group in enumerate(program.gathers)
                  if group.regather is None and made & set(group.vars))
    return dataclasses.replace(region, collectives=region.collectives + again) if again else region


def _count_kept(region: Statement, unit: str, policy: str, program: LoweredProgram, values: dict[str, dict],
                typed: TypedGraph, outputs: set[str]) -> None:
    """What the region keeps for backward, in the program's count of activations: its arguments
    (`held_here`); under `selective`, what its costly statements and collectives make too; of the rest
    the unit makes (its statements' values, and the graph's values a pass fused into them), only what an
    op outside it keeps, or an output (the others `recomputed`, by the region's name: backward holds one
    region's again at a time)."""
    kept, paths = typed.bound.kept, typed.bound.module_paths
    shared = {target for statement in program.statements if statement.instruction.kind == "constants"
                 for target in statement.targets}

    def held_copy(name: str, made: Statement) -> None:
        """A converted value that is no graph value: held here, at the layout the statement makes it (once
        for every micro-batch, where the stage makes it from constants: pardsl/passes/shared_constants.py)."""
        whole = values[made.node]
        layout = made.layouts[made.targets.index(name)]
        values[name] = {"kind": "copy", "parameter": False, "shape": whole["shape"], "dtype": whole["dtype"],
                        "local_shape": list(layout.local_shape(tuple(whole["shape"]), program.mesh)),
                        "layout": str(layout), "held_here": True,
                        **({"layer": whole["layer"]} if "layer" in whole else {}),
                        **({"shared_by_micro_batches": True} if name in shared else {})}

    for name in region.instruction.reads():
        if name in values:
            name = _storage(name, program, kept.owner)  # a view read holds its base: counted once, there
            if values[name].get("kind") != "placeholder":
                values[name] = {**values[name], "held_here": True}
        elif (made := _made(program, name)) is not None and made.node in values and made.layouts:
            held_copy(name, made)
    if policy == "selective":  # every collective's result is kept, whether or not autograd would keep it
        for statement in region.body:  # (a local conversion, a slice or a cast, is made again like any cheap op)
            if _communicates(statement) and statement.node in values and statement.layouts:
                for name in statement.targets:
                    if name not in values:
                        held_copy(name, statement)
    statements = {t: statement for statement in region.body for t in statement.targets}
    inside = {statement.node for statement in region.body} | set(statements) | \
        {name for name, path in paths.items() if path == unit or path.startswith(unit + ".")}
    outside_keeps = {kept.owner.get(operand, operand) for reader, operand in kept.reads if reader not in inside}
    for name in inside:
        if name not in values or values[name].get("kind") == "placeholder" or values[name].get("held_here"):
            continue
        statement = statements.get(name)
        if policy == "selective" and statement is not None and _costly(statement):
            values[name] = {**values[name], "held_here": True}
        elif statement is not None and _is_made_once(statement):
            continue  # nothing of it is kept, nor made again
        elif name not in outputs and kept.owner.get(name, name) not in outside_keeps:
            values[name] = {**values[name], "recomputed": region.instruction.args[0].text}


def _costly(statement: Statement) -> bool:
    """Whether a selective region keeps what the statement makes: a forward collective, a matrix product,
    attention."""
    return _communicates(statement) or statement.instruction.callee == "rt.kept" or \
        statement.instruction.callee.startswith(_COSTLY_CALLS)


def _small_products(region: Statement, typed: TypedGraph) -> frozenset[str]:
    """The region's products of two activations whose results are no larger than what they read: unfused
    attention's weighted values, kept under `selective` as a weight's product is (its result is the size of a
    linear layer's), where its scores, which grow with the square of the sequence, are made again."""
    def size(name: str) -> int:
        return math.prod(typed.info(name).shape)
    return frozenset(statement.node for statement in region.body
                     if statement.instruction.callee.startswith(("aten.matmul.", "aten.bmm."))
                     and statement.node in typed.nodes and typed.nodes[statement.node].operands
                     and size(statement.node) <= max(map(size, typed.nodes[statement.node].operands)))


def _made(program: LoweredProgram, name: str) -> Statement | None:
    """The statement that makes `name`: in the program, or in what it makes from constants once
    (pardsl/passes/shared_constants.py), where the statement that makes it is one of the region's."""
    for statement in program.statements:
        if name in statement.targets:
            if statement.instruction.kind == "constants":
                return next(inside for inside in statement.body if name in inside.targets)
            return statement
    return None


def _storage(name: str, program: LoweredProgram, owner: dict[str, str]) -> str:
    """The value whose storage `name` is: the owner of a view (an expanded mask is its unexpanded
    tensor), where the program makes each view in the chain from the one before as it is (no conversion
    between makes a copy); else `name` itself."""
    root, current = owner.get(name, name), name
    while current != root:
        made = _made(program, current)
        read = next((r for r in made.instruction.reads() if r == root or owner.get(r) == root), None) \
            if made is not None else None
        if read is None:
            return name
        current = read
    return root


def repeated_units(program: LoweredProgram, typed: TypedGraph) -> list[str]:
    """The repeated layers the program runs (model.layers.0, .1, …), in order: what recomputation under a
    bound chooses among."""
    return list(dict.fromkeys(layer for layer in (repeated_layer(typed.bound.module_paths.get(s.node))
                                                  for s in program.statements) if layer))


def activations_recomputing_all(program: LoweredProgram, typed: TypedGraph, span) -> int:
    """The bytes of activations a rank holds with every repeated layer of the program recomputed (`full`):
    the least that recomputation can bring them to on this plan."""
    units = repeated_units(program, typed)
    if not units:
        return memory_per_rank(program)["activations"]
    again = recompute_layers(program, typed, tuple(RecomputeDecl(unit, "full", span, span) for unit in units))
    return memory_per_rank(again)["activations"]


def recomputed_within(program: LoweredProgram, typed: TypedGraph, limit: int, machine,
                      optimizer: str = "adamw") -> LoweredProgram:
    """Where the file bounds memory and names nothing to recompute, and the plan holds more than `limit`
    bytes per rank: the plan with the fewest repeated layers recomputed that holds to it, `full` or
    `selective`, whichever the cost model rates faster; note N007 says which. A rank's memory falls as
    layers are added (one region is made again at a time) and its step grows, so per policy the fewest
    layers that fit are the fastest, found by bisection. Where no number of layers fits, the plan that
    holds least (N003 says by how much it is over)."""
    if memory_per_rank(program, optimizer)["total"] <= limit:
        return program
    units = repeated_units(program, typed)
    bound = typed.bound.par.memory_bound
    candidates = []
    for policy in ("selective", "full"):
        def with_layers(count: int):
            decls = tuple(RecomputeDecl(unit, policy, bound.span, bound.span) for unit in units[:count])
            again = recompute_layers(program, typed, decls)
            rated = estimate(CompletedPlan(typed, again), machine, optimizer)
            return again, rated.memory["total"], rated.step_s, count, policy

        low, high, fitting = 1, len(units), None
        while low <= high:  # the fewest layers whose plan fits
            middle = (low + high) // 2
            found = with_layers(middle)
            if found[1] <= limit:
                fitting, high = found, middle - 1
            else:
                low = middle + 1
        if fitting is not None:
            candidates.append(fitting)
        elif units:
            candidates.append(with_layers(len(units)))
    if not candidates:
        return program
    fits = [c for c in candidates if c[1] <= limit]
    again, held, step_s, count, policy = min(fits, key=lambda c: c[2]) if fits else min(candidates, key=lambda c: c[1])
    named = units[0] if count == 1 else f"{units[0]} to {units[count - 1]}"
    again.notes.append(Diagnostic(
        "N007", f"recomputes {named} ({count} of {len(units)} layers, {policy}) in backward to hold to the "
        f"bound: {format_bytes(held)} per rank, estimated {step_s * 1e3:.3g} ms a step", bound.span,
        ("write `recompute` lines to choose otherwise; `pardsl explain` shows what each layer keeps",),
        severity="note"))
    return again


def recomputed_stages_within(stages: list[LoweredProgram], plan, typed: TypedGraph, limit: int, machine,
                             optimizer: str = "adamw") -> tuple[list[LoweredProgram], Diagnostic | None]:
    """A pipeline's recomputed_within: where the rank that holds most (`plan`, its PipelinePlan) holds more
    than `limit`, the stages with repeated layers recomputed, one layer at a time on the rank that holds
    most, its stages' layers in order, until every rank holds to the bound (under 1F1B the first rank
    holds the most micro-batches' activations, so its layers go first); `full` or `selective`, whichever
    leaves the slowest rank's stages faster, as the slowest rank paces the pipeline. Returns the stages
    and note N007 saying which layers (None where nothing repeats)."""
    mesh = stages[0].mesh
    ranks = mesh.axis_sizes[mesh.axis_index(plan.axis)]
    units = [repeated_units(stage, typed) for stage in stages]
    if not any(units):
        return stages, None
    span = typed.bound.par.memory_bound.span

    def rank_stages(rank: int) -> list[int]:
        return stages_of_rank(rank, ranks, len(stages), plan.schedule)

    candidates = []
    for policy in ("selective", "full"):
        counts, current = [0] * len(stages), list(stages)
        while True:
            held = [pipeline_rank_memory(current, plan, rank, optimizer)["total"] for rank in range(ranks)]
            most = max(range(ranks), key=held.__getitem__)
            stage = next((s for s in rank_stages(most) if counts[s] < len(units[s])), None)
            if held[most] <= limit or stage is None:
                break
            counts[stage] += 1
            current[stage] = recompute_layers(stages[stage], typed, tuple(
                RecomputeDecl(unit, policy, span, span) for unit in units[stage][:counts[stage]]))
        slowest = max(sum(estimate(CompletedPlan(typed, current[s]), machine, optimizer).step_s for s in rank_stages(rank))
                      for rank in range(ranks))
        candidates.append((max(held), slowest, current, counts, policy))
    fits = [c for c in candidates if c[0] <= limit]
    held, _, current, counts, policy = min(fits, key=lambda c: c[1]) if fits else min(candidates, key=lambda c: c[0])
    named = ", ".join(units[s][0] if count == 1 else f"{units[s][0]} to {units[s][count - 1]}"
                      for s, count in enumerate(counts) if count)
    note = Diagnostic(
        "N007", f"recomputes {named} ({sum(counts)} of {sum(map(len, units))} layers, {policy}) in backward to "
        f"hold to the bound: {format_bytes(held)} on the rank that holds most", span,
        ("write `recompute` lines to choose otherwise; `pardsl explain` shows what each layer keeps",),
        severity="note")
    return current, note
