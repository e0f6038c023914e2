"""A pass over the lowered program: a sequence-parallel linear's input kept split for backward, and gathered
again there (Megatron-SP's own form).

Sequence parallelism gathers a layer's normalised input, split by tokens, before its column-parallel
linears (`rt.column_parallel_linears(..., gather_dim=d)`); the linears keep the gathered input for their
weights' gradients, so each rank holds the whole of it, twice a transformer layer, from forward to backward.
Megatron-LM keeps the split instead and gathers it again in backward. Here the step keeps its split
(`regather=True`) and backward starts the all-gather before computing the input's gradient, which it moves
beside, then computes the weights' gradients from the gathered input: a rank holds 1/n of that input
until backward, for one all-gather more in backward.

Where: a file's `substitute regather_inputs : on` everywhere the form appears, `: off` nowhere; not
written, where the file bounds memory and the plan holds more than the bound without it (before the
compiler chooses layers to recompute, which costs more: a layer's forward and its collectives again);
with a pipeline, only where the file asks for it.
Only the program's own statements: a recomputed region's step runs again in backward, which gathers its
input anyway. The split is a value the program holds already (autograd keeps the norm's output, which
memory counts at its own layout); what the rank no longer holds is the gathered copy.
"""

from __future__ import annotations

import dataclasses

from pardsl.planning.cost import memory_per_rank
from pardsl.planning.inference import TypedGraph
from pardsl.planning.search import memory_limit
from pardsl.program.ir import Collective, LoweredProgram, Statement, Text


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
    statements = []
    for statement in program.statements:
        gather = _held_gather(statement, values)
        if gather is None:
            statements.append(statement)
            continue
        del values[gather.value]  # the whole input is no longer held until backward
        statements.append(_regathered(statement, gather))
    if len(values) == len(program.values):
        return program
    return dataclasses.replace(program, statements=statements, values=values)


def _held_gather(statement: Statement, values: dict[str, dict]) -> Collective | None:
    """The forward all-gather of a column-parallel step whose gathered input the program holds for backward."""
    instruction = statement.instruction
    if instruction.kind != "fused_linears" or not any(k == "gather_dim" for k, _ in instruction.kwargs) or \
            any(k == "regather" for k, _ in instruction.kwargs) or not statement.collectives:
        return None
    gather = statement.collectives[0]
    if gather.kind != "all_gather" or gather.phase != "forward" or values.get(gather.value, {}).get("kind") != "copy":
        return None
    return gather


def _regathered(statement: Statement, gather: Collective) -> Statement:
    again = dataclasses.replace(gather, phase="backward", chunks=1, beside=(),
                                reason=f"{gather.reason}: kept split until backward, gathered again there for "
                                       "the weights' gradients")
    instruction = statement.instruction
    return dataclasses.replace(
        statement,
        instruction=dataclasses.replace(instruction, kwargs=instruction.kwargs + (("regather", Text("True")),)),
        comment=f"{statement.comment}; kept split for backward and gathered again there",
        collectives=statement.collectives + (again,))
