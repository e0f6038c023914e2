"""A pass over the lowered program: a partial mean loss's count of targets is all-reduced from the top of
the forward, not at the loss.

A mean loss over a split batch, returned partial (`output.loss : P`, DDP's loss per rank made exact: each
rank's summed losses over every rank's count of targets), needs one collective in forward: the count's
all-reduce. Made at the loss, it is a barrier at the end of the forward: a rank that gets there first
waits for the other to finish its forward before its backward can start, where DDP's ranks run on until
their gradient buckets. The count reads only the targets, and they are made from the forward's inputs
(a causal LM's shifted labels: pad, slice, view), so this pass moves those ops to the top of the forward
and starts the all-reduce right after them; the loss waits on it, long done by then.

Only ops of the forward's inputs move (pure ATen ops, none in place), and never above a size or check
statement before the loss (a shape argument may read a size by name). A loss whose targets come from
parameters or activations is left where it is. A pipelined plan's stages are passed over each on its own:
a stage's inputs are what it receives (the micro-batch's labels among them), so the last stage starts its
count before its first layer.
"""

from __future__ import annotations

import ast
import dataclasses

from pardsl.program.ir import Instruction, LoweredProgram, Statement, Text, Var, format_bytes

COUNT = "count of targets"  # what the count's collective carries (oprules: the `counts` form)


def start_counts_early(program: LoweredProgram) -> LoweredProgram:
    statements = list(program.statements)
    index = 0
    while index < len(statements):  # a loss moved down by one is met again, and then waits already
        statements = _early_count(program, statements, index) or statements
        index += 1
    return dataclasses.replace(program, statements=statements)


def _early_count(program: LoweredProgram, statements: list[Statement], index: int) -> list[Statement] | None:
    """The statements with the count of the loss at `index` started early, or None where it cannot be."""
    loss = statements[index]
    instruction = loss.instruction
    keywords = dict(instruction.kwargs)
    if instruction.callee != "rt.cross_entropy" or "counts" not in keywords or "count_started" in keywords:
        return None
    if _argument(instruction, 3, "reduction", "1") != "1" or not isinstance(instruction.args[1], Var):
        return None
    target = instruction.args[1].name
    axis = ast.literal_eval(keywords["counts"].text)[0]
    moved = [c for c in loss.collectives if c.phase == "forward" and c.axis == axis and c.reason.startswith(COUNT)]
    chain = _made_from_inputs(program, statements[:index], target)
    if chain is None or len(moved) != 1:
        return None
    # below every size, expression and check before the loss: a moved op's shape text may name a size
    top = max((i + 1 for i, s in enumerate(statements[:index])
               if s.instruction.kind in ("size", "expression", "check")), default=0)
    name = f"{loss.targets[0]}__count"
    what = f"all-reduce {format_bytes(moved[0].bytes)} over {axis} (forward): {COUNT}"
    started = Statement(name, Instruction("form", "rt.count_targets_started",
                                          (Var(target), Text(_argument(instruction, 4, "ignore_index", "-100")),
                                           Text(repr(axis)))),
                        f"{what} — started as soon as the targets are known, waited on at the loss",
                        tuple(moved), (), loss.node)
    waits = dataclasses.replace(instruction, kwargs=instruction.kwargs + (("count_started", Var(name)),))
    waiting = Statement(loss.target, waits,
                        loss.comment.replace(what, f"{COUNT} all-reduced since `{name}`"),
                        tuple(c for c in loss.collectives if c is not moved[0]), loss.layouts, loss.node)
    return (statements[:top] + [statements[i] for i in chain if i >= top] + [started]
            + [s for i, s in enumerate(statements[top:index], top) if i not in chain] + [waiting]
            + statements[index + 1:])


def _made_from_inputs(program: LoweredProgram, before: list[Statement], value: str) -> list[int] | None:
    """The indices (in order) of the statements that make `value` from the forward's inputs alone, or None
    where it reads anything else (a parameter, an activation) or an op that is not pure."""
    inputs = {slot.var for slot in program.inputs}
    made_by = {target: i for i, statement in enumerate(before) for target in statement.targets}
    chain, pending = set(), [value]
    while pending:
        name = pending.pop()
        if name in inputs:
            continue
        if name not in made_by:
            return None
        i = made_by[name]
        instruction = before[i].instruction
        if instruction.kind != "compute" or _in_place(instruction.callee):
            return None
        if i not in chain:
            chain.add(i)
            pending.extend(instruction.reads())
    return sorted(chain)


def _in_place(callee: str) -> bool:
    parts = callee.split(".")  # aten.add_.Tensor
    return len(parts) >= 2 and parts[1].endswith("_")


def _argument(instruction: Instruction, position: int, keyword: str, default: str) -> str:
    """An argument's Python spelling, given by position or keyword, else its default."""
    if position < len(instruction.args):
        return instruction.args[position].text
    return dict(instruction.kwargs).get(keyword, Text(default)).text
