"""A pass over a pipeline stage's program: what it builds from buffers and constants alone is built once and
shared by every micro-batch.

A stage's forward runs once per micro-batch, and what it makes from positions alone (a causal mask, the
rotary tables) comes out the same each time. Made anew per micro-batch, each copy is kept for backward
by the attention that reads it, so a rank holds one per micro-batch in flight: at Llama 3 405B's 131,072
tokens, context parallel 16, the mask rows alone were 1 GiB a stage per micro-batch, 32 GiB on the first
rank. Here those statements move into one local function that `rt.made_from_constants` runs on the first
micro-batch and again only when a buffer it reads has changed (a loaded checkpoint writes the buffers in
place, which torch counts in each tensor's version); every later micro-batch, and every attention that
keeps the mask, reads the same tensors, so a rank holds them once per stage.

Taken are the statements that read nothing but buffers and what such statements make: no parameter (its
value changes each step and carries a gradient), no input or size (a micro-batch's), no random draw, no
collective (every rank must issue the same ones each time), nothing that reads the module's mode or the
step's parameter sync, no buffer an op writes in place, no in-place op, and no value the program returns:
a shared value must not change under the micro-batches that read it. The region goes first in the stage,
before any layer, whose recomputed region would otherwise take it in.
"""

from __future__ import annotations

import dataclasses

from pardsl.program.ir import Instruction, Items, LoweredProgram, Statement, Text, Var, made_from_constants

FUNCTION = "made_from_constants"


def share_constants_between_micro_batches(program: LoweredProgram, drawn: frozenset[str]) -> LoweredProgram:
    """The program with what it makes from buffers and constants alone made once, in one region statement
    (kind "constants") that `rt.made_from_constants` runs; the program unchanged where it makes none that
    the rest reads. `drawn`: the graph ops that draw random numbers."""
    statements = program.statements
    parameters = {f"self.{slot.var}" for slot in program.parameters}
    # a buffer an op writes in place (a counter, running statistics) changes under the values read from it
    written = {statement.instruction.reads()[0] for statement in statements
               if _in_place(statement.instruction) and statement.instruction.reads()}
    outputs = {slot.var for slot in program.outputs}
    candidates = made_from_constants(statements, drawn)
    shared: set[int] = set()
    made: set[str] = set()
    for index, statement in enumerate(statements):
        if index in candidates and _only_reads_buffers(statement, parameters, made, written) and \
                not (outputs | written) & set(statement.targets):
            shared.add(index)
            made.update(statement.targets)
    if not shared:
        return program
    rest = [s for i, s in enumerate(statements) if i not in shared]
    read_by_rest = {name for statement in rest for name in _reads(statement)}
    results = [name for index in sorted(shared) for name in statements[index].targets if name in read_by_rest]
    if not results:
        return program
    body = tuple(statements[index] for index in sorted(shared))
    layouts = {name: layout for statement in body for name, layout in zip(statement.targets, statement.layouts)}
    buffers = sorted({name for statement in body for name in statement.instruction.reads() if name.startswith("self.")})
    region = Statement(
        ", ".join(results),
        Instruction("constants", "rt.made_from_constants", (Text("self"), Text(FUNCTION), *(Var(b) for b in buffers))),
        f"made from {'buffers and ' if buffers else ''}constants alone: once for every micro-batch",
        layouts=tuple(layouts[name] for name in results) if all(name in layouts for name in results) else (),
        body=body)
    # first, before any layer: it reads nothing the program makes, and in a layer a recomputed region
    # would take it in and make it again
    values = {name: ({**value, "shared_by_micro_batches": True} if name in made else value)
              for name, value in program.values.items()}
    return dataclasses.replace(program, statements=[region] + rest, values=values)


def _only_reads_buffers(statement: Statement, parameters: set[str], made: set[str], written: set[str]) -> bool:
    instruction = statement.instruction
    if statement.body or statement.collectives or instruction.kind not in ("compute", "convert") or \
            _in_place(instruction):
        return False
    if any(name in parameters or name in written or not name.startswith("self.") and name not in made
           for name in instruction.reads()):
        return False
    return not any("self." in text or "sync." in text for text in _texts(instruction))


def _texts(instruction: Instruction) -> list[str]:
    found: list[str] = []
    for arg in instruction.args + tuple(value for _, value in instruction.kwargs):
        _collect_texts(arg, found)
    return found


# a module function, not a recursive closure (a reference cycle per call): the pipeline search runs this
# pass on every stage of every option it prices
def _collect_texts(arg, found: list[str]) -> None:
    if isinstance(arg, Text):
        found.append(arg.text)
    elif isinstance(arg, Items):
        for item in arg.items:
            _collect_texts(item, found)


def _reads(statement: Statement) -> list[str]:
    return statement.instruction.reads() + [name for inside in statement.body for name in _reads(inside)]


def _in_place(instruction: Instruction) -> bool:
    """An ATen op that writes its first operand (`aten.add_.Tensor`, `aten.copy_.default`)."""
    parts = instruction.callee.split(".")
    return len(parts) >= 2 and parts[0] == "aten" and parts[1].endswith("_") and not parts[1].startswith("_")
