"""Reading chains of ops in a lowered program, for the passes that run a chain as one op of the runtime
(pardsl/passes/fused_norms.py, fused_rotary.py, fused_swiglu.py): who reads a value, whether a statement is
a given ATen op, a value's dtype, and what the fused op no longer keeps."""

from __future__ import annotations

from collections import Counter

from pardsl.program.ir import LoweredProgram, Statement, Var


def readers_and_makers(program: LoweredProgram) -> tuple[Counter, dict[str, int]]:
    """How many statements read each value, and the index of the statement that makes it."""
    reads = Counter(name for statement in program.statements for name in statement.instruction.reads())
    made_at = {name: i for i, statement in enumerate(program.statements) for name in statement.targets}
    return reads, made_at


def calls(statement: Statement, callee: str) -> bool:
    """The statement is the ATen op `callee` on local shards."""
    return statement.instruction.kind == "compute" and statement.instruction.callee == callee


def var_name(arg) -> str | None:
    return arg.name if isinstance(arg, Var) else None


def sole_reader(statements: list[Statement], name: str, reads: Counter, made_at: dict[str, int]) -> int | None:
    """The index of the one statement that reads `name`, where exactly one does (and the value is not an
    output: outputs are read by no statement, so they have no reader here)."""
    if reads[name] != 1 or name not in made_at:
        return None
    for index in range(made_at[name] + 1, len(statements)):
        if name in statements[index].instruction.reads():
            return index
    return None


def dtype_of(program: LoweredProgram, name: str) -> str | None:
    """A value's dtype ("float32"): a graph value's, a parameter's, buffer's or input's, or, for a
    gradient-sync wrapper (an identity) or a conversion, what it reads."""
    described = _described(program, name)
    return described[1].removeprefix("torch.") if described else None


def shape_of(program: LoweredProgram, name: str) -> tuple[int, ...] | None:
    """A value's global shape, found as its dtype is."""
    described = _described(program, name)
    return tuple(described[0]) if described else None


def _described(program: LoweredProgram, name: str):
    if name in program.values:
        return program.values[name]["shape"], program.values[name]["dtype"]
    for slot in program.parameters + program.buffers + program.inputs:
        if name in (slot.var, f"self.{slot.var}"):
            return slot.shape, slot.dtype
    for statement in program.statements:
        # an identity wrapper, or a conversion: what it reads has its dtype and global shape
        if statement.targets == (name,) and statement.instruction.kind in ("param_grad_sync", "grad_sync", "convert"):
            return _described(program, statement.instruction.reads()[0])
    return None


def kept_no_longer(values: dict[str, dict], name: str, replaced: set[str], kept) -> None:
    """Marks `name`'s storage as no longer held for backward by this program (`kept_here`), where nothing
    but the `replaced` ops (graph node names) kept it; the serial model still keeps it. `kept`:
    saved_for_backward.Kept."""
    storage = kept.owner.get(name, name)
    if values.get(storage, {}).get("kept_for_backward") and not kept.kept_by_others(name, replaced):
        values[storage] = {**values[storage], "kept_here": False}
