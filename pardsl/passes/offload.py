"""A pass over the lowered program: parameters and optimizer in host memory (`offload optimizer`,
`offload parameters`), as DeepSpeed's ZeRO-Offload and FSDP2's `CPUOffloadPolicy` keep them.

The module's parameters become masters in host memory: the optimizer the user makes over
`model.parameters()` holds its state there and steps there (a fused or `foreach` step, not one loop per
tensor). What the forward reads of a parameter is its device copy, `sync.fetch(self.w)`, placed where the
parameter is first read; a gather group's all-gather sends the device copies of its shards
(pardsl/runtime/parameter_sync.py). Under a mixed-precision policy the precision pass's cast becomes the
fetch in the compute dtype: the device holds bf16 copies, the host float32 masters, as ZeRO-Offload does.

- `offload optimizer`: a device copy stays between steps, written again once the optimizer has changed
  its master; the device is spared the masters (under a policy), gradients and optimizer state.
- `offload parameters`: a device copy is made for each use: for each forward, and, for a layer
  recomputed in backward or a resharded group, again there. The device is spared the parameters too.

Gradients go to the masters on the host: a bucket's reduced result is copied out at the end of
backward, any other gradient by the fetch's backward.
"""

from __future__ import annotations

import dataclasses

from pardsl.program.ir import Instruction, LoweredProgram, Statement, Var, torch_dtype

FETCH = "sync.fetch"
WHY = {"optimizer": "its device copy (the master and the optimizer's state are in host memory)",
       "parameters": "copied to the device for this use (it is kept in host memory)"}


def offload_to_host(program: LoweredProgram, offload) -> LoweredProgram:
    """The program with its parameters in host memory (`offload`: a syntax.OffloadDecl), or as it is
    without one."""
    if offload is None:
        return program
    floating = {slot.var: slot for slot in program.parameters if torch_dtype(slot.dtype).is_floating_point}
    fetched: dict[str, str] = {}  # parameter variable → its device copy
    statements: list[Statement] = []
    for statement in program.statements:
        instruction = statement.instruction
        if instruction.kind == "param_gather":  # ParameterSync gathers from the device copies
            statements.append(statement)
            continue
        source = _cast_parameter(instruction, floating)
        if source is not None and source not in fetched:  # the precision pass's compute copy: fetched in its dtype
            fetched[source] = statement.target
            statements.append(dataclasses.replace(
                statement, instruction=Instruction("compute", FETCH, instruction.args),
                comment=f"{statement.comment}; {WHY[offload.target]}"))
            continue
        read = [name.removeprefix("self.") for name in instruction.reads()
                if name.startswith("self.") and name.removeprefix("self.") in floating]
        for var in read:
            if var not in fetched:
                fetched[var] = f"{var}__device"
                statements.append(Statement(fetched[var], Instruction("compute", FETCH, (Var(f"self.{var}"),)),
                                            f"{floating[var].name}: {WHY[offload.target]}",
                                            layouts=(floating[var].layout,)))
        if read:
            statement = dataclasses.replace(statement, instruction=instruction.renamed(
                {f"self.{var}": fetched[var] for var in read}))
        statements.append(statement)
    return dataclasses.replace(program, statements=statements, offload=offload.target)


def _cast_parameter(instruction: Instruction, floating: dict) -> str | None:
    """The parameter a precision cast reads (`rt.cast(self.w, dtype)`), else None."""
    if instruction.callee != "rt.cast" or not isinstance(instruction.args[0], Var):
        return None
    name = instruction.args[0].name
    return name.removeprefix("self.") if name.startswith("self.") and name.removeprefix("self.") in floating else None
