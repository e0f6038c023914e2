"""A pass over the lowered program: a value cast to a wider dtype only to be converted is converted first,
in its own dtype, and cast after.

A half-precision model's norm casts its input to float32 before the ops that need it whole (LLaMA's
RMSNorm: `h.to(torch.float32).pow(2)`). Under tensor parallelism h is a partial sum, or split by tokens
under sequence parallelism. Lowering converts a value where its first reader needs another layout, here
after the cast, so the all-reduce or all-gather moved float32: twice the bytes of bf16, where Megatron
all-reduces the bf16 activation.

A cast is elementwise, so it commutes with every conversion: a gather or a slice of the narrow value,
cast, is the cast value's gather, bit for bit; a reduction adds in the narrow dtype, as Megatron's does,
and the gradient comes back through the cast in the narrow dtype too. The pass moves a conversion only
where the cast's result is read by that conversion alone, so nothing else changes: the cast now reads the
converted value and makes the name its readers already read.
"""

from __future__ import annotations

import dataclasses

import torch

from pardsl.passes.chains import calls, dtype_of, readers_and_makers, var_name
from pardsl.program.ir import Instruction, LoweredProgram, Statement, Text, Var, format_bytes, named_layout, torch_dtype


def convert_before_widening_casts(program: LoweredProgram) -> LoweredProgram:
    reads, _ = readers_and_makers(program)
    taken = {target for statement in program.statements for target in statement.targets}
    dtypes: dict[str, torch.dtype] = {}  # the values this pass makes: their dtypes, which no slot records
    layouts = {target: layout for statement in program.statements
               for target, layout in zip(statement.targets, statement.layouts)}
    statements: list[Statement | None] = []
    casts: dict[str, int] = {}  # a widening cast's result that one statement reads → its index in `statements`
    for statement in program.statements:
        source = var_name(statement.instruction.args[0]) if statement.instruction.kind == "convert" else None
        if source in casts and "__" in statement.target:
            at = casts.pop(source)
            cast = statements[at]
            narrow = var_name(cast.instruction.args[0])
            converted = f"{narrow}__{statement.target.rsplit('__', 1)[1]}"
            if converted not in taken:
                taken.add(converted)
                dtypes[converted] = _dtype(program, narrow, dtypes)
                layouts[converted] = statement.layouts[0]
                statements[at] = None  # the cast moves after the conversion, to read what it makes
                statements.append(_conversion_of(statement, converted, dtypes[converted], cast))
                layout, _, shape = cast.comment.partition("  ")
                statement = Statement(statement.target, Instruction("compute", "aten.to.dtype", (
                    Var(converted), cast.instruction.args[1])),
                    f"{named_layout(statement.layouts[0], program.mesh)}  {shape} — cast after its conversion, "
                    "which moved the narrower dtype", (), statement.layouts, cast.node)
        statements.append(statement)
        if statement.targets and reads[statement.target] == 1 and _widening_cast(program, statement, dtypes, layouts):
            casts[statement.target] = len(statements) - 1
    if len(statements) == len(program.statements):
        return program
    return dataclasses.replace(program, statements=[s for s in statements if s is not None])


def _dtype(program: LoweredProgram, name: str, dtypes: dict[str, torch.dtype]) -> torch.dtype | None:
    if name in dtypes:
        return dtypes[name]
    found = dtype_of(program, name)
    return torch_dtype(found) if found else None


def _widening_cast(program: LoweredProgram, statement: Statement, dtypes: dict[str, torch.dtype],
                   layouts: dict) -> bool:
    """`y = x.to(dtype)` to a floating dtype wider than x's, y at x's layout."""
    instruction = statement.instruction
    if not calls(statement, "aten.to.dtype") or len(instruction.args) != 2 or instruction.kwargs \
            or not isinstance(instruction.args[1], Text) or not instruction.args[1].text.startswith("torch."):
        return False
    narrow = var_name(instruction.args[0])
    if narrow is None or not statement.layouts:
        return False
    if (layouts[narrow] if narrow in layouts else program.layout_of(narrow)) != statement.layouts[0]:
        return False
    before, after = _dtype(program, narrow, dtypes), getattr(torch, instruction.args[1].text.removeprefix("torch."), None)
    return isinstance(before, torch.dtype) and isinstance(after, torch.dtype) and before.is_floating_point \
        and after.is_floating_point and before.itemsize < after.itemsize


def _conversion_of(statement: Statement, converted: str, dtype: torch.dtype, cast: Statement) -> Statement:
    """The conversion `statement`, of the cast's input in place of its result: its collectives move that
    dtype's bytes, forward and backward (the gradient comes back through the cast in the narrow dtype)."""
    wide = getattr(torch, cast.instruction.args[1].text.removeprefix("torch."))
    collectives = tuple(dataclasses.replace(c, bytes=c.bytes * dtype.itemsize // wide.itemsize, value=converted)
                        for c in statement.collectives)
    arrow, _, rest = statement.comment.partition(": ")
    reason = rest.split(" — ", 1)[1] if " — " in rest else ""
    what = ", ".join(f"{c.kind.replace('_', '-')} {format_bytes(c.bytes)} ({c.phase})" for c in collectives)
    instruction = statement.instruction
    return Statement(converted, Instruction(instruction.kind, instruction.callee,
                                            (cast.instruction.args[0], *instruction.args[1:]), instruction.kwargs),
                     f"{arrow}: {what or 'local'} in {str(dtype).removeprefix('torch.')}, before its cast"
                     f"{' — ' + reason if reason else ''}", collectives, statement.layouts, statement.node)
