"""A pass over the lowered program: collective matmuls, a collective and the matrix product beside it cut
into chunks, each chunk's transfer moving while another chunk's product is computed.

Sequence parallelism (Megatron-SP) gathers a layer's normalised input before its column-parallel linears
and reduce-scatters the row-parallel linears' partial sums after them. As lowered, each is one collective
the step waits for, then the product (or the other way round). Two forms are cut into `chunks` pieces along
a dim the collective does not move (the batch, where it has enough rows; the runtime chooses):

- an all-gather before linears of one input (`rt.column_parallel_linears(..., gather_dim=d)`): piece i's
  product is computed while piece i + 1 is gathered;
- a linear whose partial sums only a reduce-scatter reads (`aten.linear` then `rt.reduce_scatter`): one
  step, `rt.linear_reduce_scatter`, reduce-scattering piece i while piece i + 1's product is computed; its
  backward gathers the gradient piece by piece beside the input gradient's products.

The collectives are the same ones, with the same bytes (the runtime counts each once); the statement's
`Collective`s say which ops they now move beside, which the cost model prices (cost.chunked_saving_seconds).

Where: a file's `substitute collective_matmul : on` everywhere the forms appear, `: off` nowhere; not
written, where the cost model says the chunks save time on the machine the plan is compiled for (a latency
and an op's overhead per further chunk against what they hide). The search prices the same saving in the
conversions it weighs (search._conversion_seconds), so layouts that lead to these forms are chosen with it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from collections import Counter

from pardsl.layouts.algebra import collective_matmul_cut
from pardsl.passes.chains import calls, var_name
from pardsl.planning.cost import Machine, collective_matmul_saving, op_costs
from pardsl.planning.inference import TypedGraph
from pardsl.program.ir import (
    Collective,
    Instruction,
    LoweredProgram,
    Statement,
    Text,
    Var,
)


def chunked_collective_matmuls(program: LoweredProgram, typed: TypedGraph, machine: Machine) -> LoweredProgram:
    choice = typed.bound.par.substitution("collective_matmul")
    if choice == "off":
        return program
    mesh = program.mesh

    @functools.cache
    def forward_s() -> dict[str, float]:
        # priced only where a gather meets a product: most stage programs a pipeline search lowers have none
        return {o.node: o.forward_s for o in op_costs(typed, machine, machine.slowdown(mesh.size))}

    def pays(collectives: list[Collective], chunks: int) -> bool:
        return choice == "on" or sum(collective_matmul_saving(machine, mesh, c, forward_s(), chunks)
                                     for c in collectives) > 0

    statements = _chunked(program, list(program.statements), pays)
    return program if statements == program.statements else dataclasses.replace(program, statements=statements)


def _chunked(program: LoweredProgram, statements: list[Statement], pays) -> list[Statement]:
    """The statements with each form chunked where `pays` says so; a recomputed region's own statements
    too (its second run issues the same collectives, beside the same products)."""
    reads = Counter(name for statement in statements if statement.instruction.kind != "release"
                    for name in statement.instruction.reads())
    replaced: dict[int, Statement] = {}
    dropped: set[int] = set()
    merged: set[str] = set()  # linears' partial sums no statement holds any more
    deferred: dict[str, tuple[int, int]] = {}  # a value read later than it was: released after, not between
    for index, statement in enumerate(statements):
        if statement.body:
            # a selective region keeps its collectives' results in its first run and gives them back in its
            # second: the runtime does not cut those, so neither does the plan
            if statement.instruction.kind == "recompute" and statement.instruction.args[1] == Text(repr("selective")):
                continue
            body = _chunked(program, list(statement.body), pays)
            if body != list(statement.body):
                inside = {c for s in body for c in s.collectives}
                replaced[index] = dataclasses.replace(statement, body=tuple(body), collectives=tuple(
                    _same_in(c, inside) for c in statement.collectives))
        elif _gathers_for_linears(statement):
            gather = statement.collectives[0]
            chunks = _pieces(program, statement.instruction, "gather_dim", gather.axis)
            chunked = [dataclasses.replace(c, chunks=chunks, beside=tuple(statement.targets))
                       if c is gather else c for c in statement.collectives]
            if chunks > 1 and pays([chunked[0]], chunks):
                replaced[index] = _chunked_gather(statement, chunked, chunks)
        elif _gathers_whole(statement):
            reader = _first_reader(statements, index)
            if reader is None or not _plain_linear(statements[reader]) or \
                    var_name(statements[reader].instruction.args[0]) != statement.target or reader in replaced:
                continue
            linear = statements[reader]
            gather = statement.collectives[0]
            chunks = _pieces(program, statement.instruction, "dim", gather.axis)
            chunked = [dataclasses.replace(c, chunks=chunks, beside=(linear.node,)) if c is gather else c
                       for c in statement.collectives]
            if chunks > 1 and pays([chunked[0]], chunks):
                # in the linear's place, where its weight is at hand; what the gather read is released there
                replaced[reader] = _all_gather_linear(statement, linear, chunked, chunks)
                dropped.add(index)
                source = var_name(statement.instruction.args[0])
                deferred[source] = (index, reader)
        elif _plain_linear(statement) and reads[statement.target] == 1 and index not in replaced:
            reader = _first_reader(statements, index)
            if reader is None or reader in dropped or not _reduce_scatters(statements[reader], statement.target):
                continue
            scatter = statements[reader]
            chunks = _pieces(program, scatter.instruction, "dim", scatter.collectives[0].axis,
                             statement.instruction.args[0]) if scatter.collectives else 1
            chunked = [dataclasses.replace(c, chunks=chunks, beside=(statement.node,),
                                           beside_backward=c.phase == "backward") for c in scatter.collectives]
            if chunks > 1 and pays(chunked, chunks):
                # in the linear's place: what it reads is released after it, as after the linear
                replaced[index] = _linear_reduce_scatter(statement, scatter, chunked, chunks)
                dropped.add(reader)
                merged.add(statement.target)
    if not replaced:
        return statements
    result = []
    held_back: set[str] = set()  # releases moved from between a gather and its linear to after the linear
    for index, statement in enumerate(statements):
        if index in dropped:
            continue
        statement = replaced.get(index, statement)
        if statement.instruction.kind == "release":
            early = {name for name, (start, end) in deferred.items() if start <= index < end}
            held_back |= early & set(statement.instruction.reads())
            kept = tuple(arg for arg in statement.instruction.args if var_name(arg) not in merged | early)
            if not kept:
                continue
            statement = dataclasses.replace(statement, instruction=dataclasses.replace(statement.instruction,
                                                                                       args=kept))
        result.append(statement)
        late = [name for name, (_, end) in deferred.items() if end == index and name in held_back]
        if late:
            result.append(Statement("", Instruction("release", "del", tuple(Var(name) for name in late)), ""))
    return result


def _first_reader(statements: list[Statement], index: int) -> int | None:
    """The index of the first statement after `index` that reads what it makes (releases aside)."""
    target = statements[index].target
    return next((i for i in range(index + 1, len(statements))
                 if statements[i].instruction.kind != "release" and target in statements[i].instruction.reads()), None)


def _same_in(collective: Collective, chunked: set[Collective]) -> Collective:
    """A region's collective as its body now has it (chunked): one of the body's, or the copy the region
    issues again in backward (recompute.py), which moves what the body's forward one moves, beside the same
    products."""
    for c in chunked:
        if (c.kind, c.axis, c.bytes, c.value, c.node) == (collective.kind, collective.axis, collective.bytes,
                                                          collective.value, collective.node) and \
                (c.phase == collective.phase or c.phase == "forward"):
            return dataclasses.replace(collective, chunks=c.chunks, beside=c.beside, beside_backward=c.beside_backward)
    return collective


def _pieces(program: LoweredProgram, instruction: Instruction, dim_keyword: str, axis: str, cut=None) -> int:
    """How many pieces the runtime cuts a collective matmul into (layouts.collective_matmul_cut) of the
    local value `cut`, else of the instruction's first argument; 1 where no dim can be cut (a micro-batch
    of one sequence gathered by tokens): then it stays as it is."""
    n = program.mesh.axis_sizes[program.mesh.axis_index(axis)]
    shape = program.values.get(var_name(cut if cut is not None else instruction.args[0]) or "", {}).get("local_shape")
    dim = dict(instruction.kwargs).get(dim_keyword)
    if not shape or not isinstance(dim, Text):
        return 1
    cut = collective_matmul_cut(tuple(shape), int(dim.text), n)
    return 1 if cut is None else cut[1]


def _gathers_for_linears(statement: Statement) -> bool:
    instruction = statement.instruction
    return instruction.kind == "fused_linears" and any(k == "gather_dim" for k, _ in instruction.kwargs) \
        and bool(statement.collectives) and statement.collectives[0].kind == "all_gather" \
        and statement.collectives[0].phase == "forward"


def _plain_linear(statement: Statement) -> bool:
    """`aten.linear(x, weight)`: no bias, one result."""
    return calls(statement, "aten.linear.default") and len(statement.instruction.args) == 2 and \
        not statement.instruction.kwargs and len(statement.targets) == 1


def _gathers_whole(statement: Statement) -> bool:
    """A split value all-gathered over one axis, its gradient reduce-scattered back (sequence parallelism's
    gather before the column-parallel linears, where they are not one runtime step)."""
    instruction = statement.instruction
    kwargs = dict(instruction.kwargs)
    return instruction.kind == "convert" and instruction.callee == "rt.all_gather" and \
        len(instruction.args) == 2 and isinstance(kwargs.get("backward"), Text) and \
        kwargs["backward"].text == '"reduce_scatter"' and set(kwargs) <= {"dim", "blocks", "mirrored", "backward"} \
        and len(statement.targets) == 1 and [c.kind for c in statement.collectives if c.phase == "forward"] == \
        ["all_gather"] and statement.collectives[0].phase == "forward"


def _reduce_scatters(statement: Statement, value: str) -> bool:
    """`statement` reduce-scatters `value` (a partial sum) over one axis, and does nothing else."""
    instruction = statement.instruction
    return instruction.kind == "convert" and instruction.callee == "rt.reduce_scatter" and \
        len(instruction.args) == 2 and var_name(instruction.args[0]) == value and \
        all(k in ("dim", "blocks", "mirrored") for k, _ in instruction.kwargs)


def _chunked_gather(statement: Statement, collectives: list[Collective], chunks: int) -> Statement:
    instruction = statement.instruction
    chunked = Instruction(instruction.kind, instruction.callee, instruction.args,
                          instruction.kwargs + (("chunks", Text(str(chunks))),))
    comment = statement.comment + f"; gathered in {chunks} chunks, each beside the products of the one before"
    return dataclasses.replace(statement, instruction=chunked, comment=comment, collectives=tuple(collectives))


def _all_gather_linear(gather: Statement, linear: Statement, collectives: list[Collective],
                       chunks: int) -> Statement:
    x, axis = gather.instruction.args
    weight = linear.instruction.args[1]
    kwargs = tuple((k, v) for k, v in gather.instruction.kwargs if k != "backward")
    instruction = Instruction("collective_matmul", "rt.all_gather_linear", (x, weight, axis),
                              kwargs + (("chunks", Text(str(chunks))),))
    comment = (f"{gather.comment}; gathered in {chunks} chunks, each beside linear {linear.node}'s product of "
               f"the one before")
    return Statement(f"{gather.target}, {linear.target}", instruction, comment, tuple(collectives),
                     gather.layouts + linear.layouts, linear.node)


def _linear_reduce_scatter(linear: Statement, scatter: Statement, collectives: list[Collective],
                           chunks: int) -> Statement:
    x, weight = linear.instruction.args
    axis = scatter.instruction.args[1]
    instruction = Instruction("collective_matmul", "rt.linear_reduce_scatter", (x, weight, axis),
                              scatter.instruction.kwargs + (("chunks", Text(str(chunks))),))
    axis_name = ast.literal_eval(axis.text) if isinstance(axis, Text) else axis
    comment = (f"linear {linear.node}, its partial sums reduce-scattered over {axis_name} in {chunks} chunks, "
               f"each while the next one's product is computed — {scatter.comment}")
    return Statement(scatter.target, instruction, comment, tuple(collectives), scatter.layouts, linear.node)
