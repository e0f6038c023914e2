"""A pass over the lowered program: a mixed-precision policy (`precision params bf16, reduce fp32`).

The model was traced with its floating parameters, buffers and inputs in the compute dtype
(model/binding.py), so every op, activation and collective of the program is already in it. What this pass changes is where parameters
live and how their gradients are reduced, as FSDP2's `MixedPrecisionPolicy` does:

- each floating parameter is held float32 on its shard (the master the optimizer steps, with float32
  state); the forward casts it to the compute dtype where it is first read (`rt.cast`, whose backward
  casts the gradient back), and a gathered parameter is cast before its gather, so ZeRO-3's all-gathers
  move the compute dtype's bytes (ParameterSync);
- gradient buckets are reduced in the `reduce` dtype and added to the float32 `.grad`: their bytes are
  that dtype's;
- a floating input is taken in its declared dtype and cast on entry, as FSDP2 casts forward inputs;
- with `output fp32`, the floating outputs are cast to it at the end.
"""

from __future__ import annotations

import dataclasses


from pardsl.model.loading import DTYPES
from pardsl.program.ir import Collective, Instruction, LoweredProgram, Statement, Text, Var, torch_dtype

MASTER = "torch.float32"


def apply_precision(program: LoweredProgram, precision, inputs=()) -> LoweredProgram:
    """The program under `precision` (a syntax.PrecisionDecl), or as it is without one; `inputs`: the
    file's input declarations, whose floating dtypes the forward takes and casts on entry."""
    if precision is None:
        return program
    compute = f"torch.{precision.params}"
    floating = {slot.var: slot for slot in program.parameters if torch_dtype(slot.dtype).is_floating_point}
    cast_of: dict[str, str] = {}  # parameter variable → its compute-dtype copy
    # a floating input is given as declared and cast on entry (it was traced in the compute dtype)
    declared = {decl.name: str(DTYPES[decl.dtype]) for decl in inputs}
    statements: list[Statement] = [
        Statement(slot.var, Instruction("compute", "rt.cast", (Var(slot.var), Text(compute))),
                  f"input `{slot.name}` in {precision.params} for compute", layouts=(slot.layout,))
        for slot in program.inputs if slot.dtype == compute and declared.get(slot.name, compute) != compute]
    for statement in program.statements:
        read = [name.removeprefix("self.") for name in statement.instruction.reads()
                if name.startswith("self.") and name.removeprefix("self.") in floating]
        if statement.instruction.kind == "param_gather":  # ParameterSync casts the shard before its gather
            statements.append(statement)
            continue
        for var in read:
            if var not in cast_of:
                cast_of[var] = f"{var}__{precision.params}"
                statements.append(Statement(
                    cast_of[var], Instruction("compute", "rt.cast", (Var(f"self.{var}"), Text(compute))),
                    f"{floating[var].name} in {precision.params} for compute (its float32 master stays on the shard)",
                    layouts=(floating[var].layout,)))
        if read:
            mapping = {f"self.{var}": cast_of[var] for var in read}
            statement = dataclasses.replace(statement, instruction=statement.instruction.renamed(mapping))
        statements.append(statement)
    outputs = program.outputs
    if precision.output is not None:
        statements, outputs = _outputs_cast(statements, outputs, program, f"torch.{precision.output}")
    ratio = (_itemsize(f"torch.{precision.reduce}"), _itemsize(compute))
    return dataclasses.replace(
        program, statements=statements, outputs=outputs,
        inputs=[dataclasses.replace(slot, dtype=declared[slot.name]) if slot.name in declared else slot
                for slot in program.inputs],
        parameters=[dataclasses.replace(slot, dtype=MASTER) if slot.var in floating else slot
                    for slot in program.parameters],
        buckets=[dataclasses.replace(bucket, nbytes=bucket.nbytes * ratio[0] // ratio[1],
                                     collectives=tuple(_scaled(c, ratio) for c in bucket.collectives))
                 for bucket in program.buckets],
        precision=(precision.params, precision.reduce))


def _outputs_cast(statements, outputs, program: LoweredProgram, dtype: str):
    """Each floating output cast to `dtype` at the end of the forward."""
    floating = {name for name, value in program.values.items() if torch_dtype(value["dtype"]).is_floating_point}
    statements, cast = list(statements), []
    for output in outputs:
        # an output converted on its way out is a variable named after its value (`x__B`)
        if output.var not in floating and output.var.split("__")[0] not in floating:
            cast.append(output)
            continue
        var = f"{output.var}__out"
        statements.append(Statement(var, Instruction("compute", "rt.cast", (Var(output.var), Text(dtype))),
                                    f"output `{output.path}` in {dtype.removeprefix('torch.')}", layouts=(output.layout,)))
        cast.append(dataclasses.replace(output, var=var))
    return statements, cast


def _scaled(collective: Collective, ratio: tuple[int, int]) -> Collective:
    return dataclasses.replace(collective, bytes=collective.bytes * ratio[0] // ratio[1],
                               reason=f"{collective.reason}, reduced in {ratio[0] * 8}-bit floats")


def _itemsize(name: str) -> int:
    return torch_dtype(name).itemsize
