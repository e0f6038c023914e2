"""A pass over the lowered program: a gated MLP's SwiGLU, silu(gate) · up, runs as one op that keeps less.

LLaMA's, Mistral's, Qwen's and most MoE experts' MLPs compute `down(silu(gate(x)) · up(x))`. Eager,
autograd keeps three activations of the MLP's width for the two ops: silu keeps its input (gate), the
product keeps both its operands (silu's result and up). Silu's result is made again from gate in one
pass, so the runtime's `rt.swiglu` keeps gate and up alone and remakes silu(gate) in backward, as
Megatron's fused SwiGLU does: one activation of the MLP's width less per layer (on Llama 3 405B's layer
at 8,192 tokens under TP 8, 104 MiB of 1.19 GiB a micro-batch). Forward and backward are the ops autograd
runs (silu, mul; mul by the other operand, silu_backward), on the same operands, so the same bits.

The pass runs after lowering, on ops already placed, so it changes no layout and no collective. A pair is
fused only where the result is what the ops compute on each rank alone:
- neither statement has a collective (the product's operands arrive as it reads them);
- silu's result is read by the product alone;
- gate, up and the result have one shape and one dtype (no broadcast, no promotion).

The program's count of activations drops silu's result where nothing else keeps it (`kept_here`); the
serial model's count, the base of a `memory <= N %` bound, is unchanged. The cost model prices the two
ops as before, and the search counts what they kept (it errs high by that activation).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from pardsl.model.saved_for_backward import Kept
from pardsl.passes.chains import calls, dtype_of, kept_no_longer, readers_and_makers, shape_of, sole_reader, var_name
from pardsl.program.ir import Instruction, LoweredProgram, Statement, Var


def fuse_swiglus(program: LoweredProgram, kept: Kept) -> LoweredProgram:
    """`kept`: what autograd keeps of the serial graph (saved_for_backward.Kept), for what the fused op
    no longer keeps."""
    reads, made_at = readers_and_makers(program)
    fused: dict[int, Statement] = {}  # index of the product → the fused statement
    dropped: set[int] = set()
    unkept: list[tuple[str, set[str]]] = []  # silu's result, and the graph nodes that kept it
    for index, statement in enumerate(program.statements):
        if not calls(statement, "aten.silu.default"):
            continue
        pair = _pair_from(program, index, reads, made_at)
        if pair is not None:
            product, replacement = pair
            dropped.add(index)
            fused[product] = replacement
            unkept.append((statement.target, {statement.node, program.statements[product].node}))
    if not fused:
        return program
    statements = [fused.get(i, statement) for i, statement in enumerate(program.statements) if i not in dropped]
    values = dict(program.values)
    for name, replaced in unkept:
        kept_no_longer(values, name, replaced, kept)
    return dataclasses.replace(program, statements=statements, values=values)


def _pair_from(program: LoweredProgram, silu_index: int, reads: Counter, made_at: dict[str, int]):
    """(the product's index, the fused statement) for silu at `silu_index` and the product reading it, or
    None."""
    statements = program.statements
    silu = statements[silu_index]
    if len(silu.instruction.args) != 1 or silu.instruction.kwargs:
        return None
    gate = var_name(silu.instruction.args[0])
    product_index = sole_reader(statements, silu.target, reads, made_at)
    if any(output.var == silu.target for output in program.outputs):
        return None  # the model returns silu's result: it is made
    if gate is None or product_index is None or not calls(statements[product_index], "aten.mul.Tensor"):
        return None
    product = statements[product_index]
    operands = [var_name(a) for a in product.instruction.args]
    if len(operands) != 2 or None in operands or product.instruction.kwargs or operands.count(silu.target) != 1:
        return None
    up = operands[1 - operands.index(silu.target)]
    if silu.collectives or product.collectives:
        return None
    shapes = {shape_of(program, v) for v in (gate, up, product.target)}
    dtypes = {dtype_of(program, v) for v in (gate, up, product.target)}
    if None in shapes or None in dtypes or len(shapes) != 1 or len(dtypes) != 1:
        return None
    replacement = Statement(product.target, Instruction("form", "rt.swiglu", (Var(gate), Var(up))),
                            f"{product.comment} — silu({gate}) · {up} as one op, silu made again in backward",
                            (), product.layouts, product.node)
    return product_index, replacement
