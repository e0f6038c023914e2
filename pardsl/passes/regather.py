"""A pass over the lowered program: a sequence-parallel linear's input kept split for backward, and gathered
again there (Megatron-SP's own form).

Sequence parallelism gathers a layer's normalised input, split by tokens, before its column-parallel
linears; the linears keep the gathered input for their weights' gradients, so each rank holds the whole
of it, twice a transformer layer, from forward to backward. Megatron-LM keeps the split instead and
gathers it again in backward. Here, in either form lowering gives:
- one step with the linears (`rt.column_parallel_linears(..., gather_dim=d)`, weights used as stored):
  the step keeps its split (`regather=True`); backward starts the all-gather before computing the
  input's gradient, which it moves beside, then computes the weights' gradients from it;
- a gather (`rt.all_gather`) read only by linears (weights gathered first, as under FSDP): the split is
  kept (`rt.kept_split`), each linear keeps it rather than the whole (`rt.linear_of_gathered`), and the
  first backward that needs the whole gathers it again, for all of them.
A rank holds 1/n of that input until backward, for one all-gather more in backward.

Where: a file's `substitute regather_inputs : on` everywhere the form appears, `: off` nowhere; not
written, where the file bounds memory and the plan holds more than the bound without it (before the
compiler chooses layers to recompute, which costs more: a layer's forward and its collectives again);
with a pipeline, only where the file asks for it.
Only the program's own statements: a recomputed region's step runs again in backward, which gathers its
input anyway. What the rank no longer holds is the gathered copy (`kept_here`); it holds the split
instead, which as traced was freed once gathered. The program counts that split in both cases (as the
search counts a value its readers take converted), so the estimate gives the whole copy as the saving,
where a rank saves the copy less its split (docs/memory.md has both measured).

In the second form the gather is made in the first linear's backward, not beside its input's gradient,
and the collective-matmul pass no longer cuts that gather into chunks beside the first linear.
"""

from __future__ import annotations

import dataclasses

from pardsl.planning.cost import memory_per_rank
from pardsl.planning.inference import TypedGraph
from pardsl.planning.search import memory_limit
from pardsl.program.ir import Collective, Instruction, LoweredProgram, Statement, Text, Var


def regather_split_inputs(program: LoweredProgram, typed: TypedGraph) -> LoweredProgram:
    choice = typed.bound.par.substitution("regather_inputs")
    if choice == "off":
        return program
    if choice == "auto":
        if typed.bound.par.pipeline is not None:  # a stage's memory is its rank's only with those in flight
            return program
        limit = memory_limit(typed.bound)
        if limit is None or memory_per_rank(program)["total"] <= limit:
            return program
    values = dict(program.values)
    changed = False
    readers: dict[str, list[int]] = {}
    for index, statement in enumerate(program.statements):
        if statement.instruction.kind != "release":
            for name in statement.instruction.reads():
                readers.setdefault(name, []).append(index)
    statements = list(program.statements)
    after: dict[int, list[Statement]] = {}  # per statement's index, what follows it: a kept split, its release
    def trains_a_weight(linears: list[str]) -> bool:
        """Whether backward computes one of these linears' (graph ops') weight gradient: the only reader of
        the whole gathered again. Where none does (frozen weights), nothing is kept split."""
        return any(node.operands[1] in typed.requires_grad for node in map(typed.nodes.get, linears)
                   if node is not None and len(node.operands) > 1)

    for index, statement in enumerate(program.statements):
        gather = _held_gather(statement, values)
        if gather is not None and trains_a_weight(list(statement.targets)):
            values[gather.value] = {**values[gather.value], "kept_here": False}  # not held until backward
            statements[index] = _regathered(statement, gather)
            changed = True
            continue
        linears = _linears_of_a_gather(statement, values, readers.get(statement.target, []), program.statements)
        if linears is None or not trains_a_weight([program.statements[reader].node for reader in linears]):
            continue
        gather = statement.collectives[0]
        values[gather.value] = {**values[gather.value], "kept_here": False}
        changed = True
        kept = f"{statement.target}{_KEPT}"
        split = statement.instruction.args[0]
        again = dataclasses.replace(gather, phase="backward", reason=f"{gather.reason}: {_AGAIN}")
        after.setdefault(index, []).append(Statement(
            kept, Instruction("form", "rt.kept_split", (split, statement.instruction.args[1]),
                              tuple((k, v) for k, v in statement.instruction.kwargs if k != "backward")
                              + (("readers", Text(str(len(linears)))),)),
            f"{split.name} kept for the backward of the {len(linears)} linear(s) of its gather, in place of the "
            "whole: gathered again there", (again,), (), statement.node))
        # the holder is the linears' backward's from here: forward lets it go after the last of them
        after.setdefault(linears[-1], []).append(Statement("", Instruction("release", "del", (Var(kept),)), ""))
        for reader in linears:
            linear = statements[reader]
            args = linear.instruction.args + ((Text("None"),) if len(linear.instruction.args) == 2 else ())
            statements[reader] = dataclasses.replace(linear, instruction=Instruction(
                "compute", "rt.linear_of_gathered", (*args, Var(kept))))
    if not changed:
        return program
    statements = [s for index, statement in enumerate(statements) for s in (statement, *after.get(index, ()))]
    return dataclasses.replace(program, statements=statements, values=values)


_AGAIN = "kept split until backward, gathered again there for the weights' gradients"
_KEPT = "__kept"  # the name of a gathered value's kept split
_SPLIT_COMMENT = "; kept split for backward and gathered again there"


def gathered_again(collective: Collective) -> bool:
    """Whether a collective is one this pass added: a kept split's all-gather, issued again in backward."""
    return collective.phase == "backward" and collective.reason.endswith(_AGAIN)


def _held(values: dict[str, dict], name: str) -> bool:
    """Whether the program holds the converted copy `name` for backward."""
    value = values.get(name, {})
    return value.get("kind") == "copy" and value.get("kept_here", True)


def _linears_of_a_gather(statement: Statement, values: dict[str, dict], readers: list[int],
                         statements: list[Statement]) -> list[int] | None:
    """Where `statement` all-gathers a split value forward (a conversion) and every statement that reads the
    gathered copy, which the program holds for backward, is `aten.linear` of it: those statements."""
    instruction = statement.instruction
    if instruction.kind != "convert" or instruction.callee != "rt.all_gather" or len(statement.collectives) < 1 \
            or statement.collectives[0].kind != "all_gather" or statement.collectives[0].phase != "forward" \
            or not _held(values, statement.target) or not readers:
        return None
    for reader in readers:
        read = statements[reader].instruction
        if read.callee != "aten.linear.default" or read.kwargs or len(read.args) not in (2, 3) or \
                read.args[0] != Var(statement.target) or Var(statement.target) in read.args[1:]:
            return None
    return readers


def _held_gather(statement: Statement, values: dict[str, dict]) -> Collective | None:
    """The forward all-gather of a column-parallel step whose gathered input the program holds for backward."""
    instruction = statement.instruction
    if instruction.kind != "fused_linears" or not any(k == "gather_dim" for k, _ in instruction.kwargs) or \
            any(k == "regather" for k, _ in instruction.kwargs) or not statement.collectives:
        return None
    gather = statement.collectives[0]
    if gather.kind != "all_gather" or gather.phase != "forward" or not _held(values, gather.value):
        return None
    return gather


def _regathered(statement: Statement, gather: Collective) -> Statement:
    again = dataclasses.replace(gather, phase="backward", chunks=1, beside=(),
                                reason=f"{gather.reason}: {_AGAIN}")
    instruction = statement.instruction
    return dataclasses.replace(
        statement,
        instruction=dataclasses.replace(instruction, kwargs=instruction.kwargs + (("regather", Text("True")),)),
        comment=f"{statement.comment}{_SPLIT_COMMENT}",
        collectives=statement.collectives + (again,))


def kept_whole(statements: list[Statement]) -> tuple[list[Statement], set[str]]:
    """The statements with their inputs kept whole again, and the gathered values they hold whole again: for
    a recomputed region (pardsl/passes/recompute.py), which keeps only its own inputs and runs its forward
    again in backward, gathering there anyway."""
    result, whole = [], set()
    for statement in statements:
        instruction = statement.instruction
        if instruction.callee == "rt.kept_split":
            whole.add(statement.target.removesuffix(_KEPT))
            continue
        if instruction.kind == "release" and any(name.endswith(_KEPT) for name in instruction.reads()):
            names = [name for name in instruction.reads() if not name.endswith(_KEPT)]
            if names:
                result.append(dataclasses.replace(statement, instruction=Instruction(
                    "release", "del", tuple(Var(name) for name in names))))
            continue
        if instruction.callee == "rt.linear_of_gathered":
            *args, _ = instruction.args
            if args[-1] == Text("None"):
                args.pop()
            statement = dataclasses.replace(statement, instruction=Instruction("compute", "aten.linear.default",
                                                                                tuple(args)))
        elif any(k == "regather" for k, _ in instruction.kwargs):
            whole.update(c.value for c in statement.collectives if gathered_again(c))
            statement = dataclasses.replace(
                statement,
                instruction=dataclasses.replace(instruction, kwargs=tuple(
                    (k, v) for k, v in instruction.kwargs if k != "regather")),
                comment=statement.comment.replace(_SPLIT_COMMENT, ""),
                collectives=tuple(c for c in statement.collectives if not gathered_again(c)))
        result.append(statement)
    return result, whole
