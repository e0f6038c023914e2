"""A pass over the lowered program: a rotary position embedding, written as seven ATen ops, runs as one.

Hugging Face's LLaMA, Mistral, Qwen and GPT-NeoX rotate queries and keys as `x·cos + rotate_half(x)·sin`,
with rotate_half(x) = cat(−x₂, x₁) of x's halves along the last dim. They export as

    mul(x, cos); slice(x, last, 0, h); slice(x, last, h, end) → neg → cat([·, x₁], -1) → mul(·, sin); add

Eager, the cat and the neg make two new tensors forward, and backward runs seven ops over x's size, two
of them slice_backward's zero-filled tensors. Here the seven are one op of the runtime (`rt.rotary`), one
autograd node: forward x·cos, then x₂·sin₁ taken from its first half and x₁·sin₂ added to its second, in
place; backward the same shape of ops on the gradient. The products and sums are the chain's, each of two
terms (a sum of two floats is the same either way round, and a − b is a + (−b) exactly), so forward and
backward give the chain's bits. On a CPU, with tables that need no gradient, the op is numba's kernels
(pardsl/runtime/kernels.py), one pass each way with the same products and sums, so the same bits. On this machine
one [4, 4, 64, 64] rotation's forward and backward, from a cold cache, take 0.37 ms as the chain, 0.30 ms
as the ATen ops and 0.24 ms as the kernels.

The pass runs after lowering, on ops already placed, so it changes no layout and no collective. A chain is
fused only where it is what the ops compute on each rank alone:
- no statement of the chain has a collective;
- x's last dim (the one rotated) is whole on every rank, and so is cos's and sin's;
- every intermediate is read by the next op of the chain alone;
- x, cos, sin and the result have one dtype (the chain's muls would promote otherwise).

What the fused op keeps for backward is what the chain's muls keep: cos and sin, and x only where cos or
sin needs a gradient. The tables are constants in the models above, so the program's count of activations
is unchanged; where they are learned, the chain keeps x and the cat of its halves, the fused op x alone, and
the count is one activation high. The cost model still prices the chain's seven ops.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from pardsl.passes.chains import calls, dtype_of, readers_and_makers, shape_of, sole_reader, var_name
from pardsl.program.ir import Instruction, Items, LoweredProgram, Statement, Text, Var


def fuse_rotary_embeddings(program: LoweredProgram) -> LoweredProgram:
    reads, made_at = readers_and_makers(program)
    fused: dict[int, Statement] = {}  # index of the chain's add → the fused statement
    dropped: set[int] = set()
    for index, statement in enumerate(program.statements):
        if not calls(statement, "aten.neg.default"):
            continue
        chain = _chain_through(program, index, reads, made_at)
        if chain is not None and not dropped.intersection(chain[0]) and not set(fused).intersection(chain[0]):
            indices, replacement = chain
            dropped.update(indices[:-1])
            fused[indices[-1]] = replacement
    if not fused:
        return program
    statements = [fused.get(i, statement) for i, statement in enumerate(program.statements) if i not in dropped]
    return dataclasses.replace(program, statements=statements)


def _chain_through(program: LoweredProgram, neg_index: int, reads: Counter, made_at: dict[str, int]):
    """([the chain's statement indices, its add last], the fused statement) for the chain whose neg is at
    `neg_index`, or None."""
    statements = program.statements
    neg = statements[neg_index]
    second_half = var_name(neg.instruction.args[0]) if len(neg.instruction.args) == 1 else None
    if second_half not in made_at or sole_reader(statements, second_half, reads, made_at) != neg_index:
        return None
    x, rank, h = _half_of(program, statements[made_at[second_half]], first=False)
    if x is None:
        return None
    cat_index = sole_reader(statements, neg.target, reads, made_at)
    if cat_index is None or not calls(statements[cat_index], "aten.cat.default"):
        return None
    cat = statements[cat_index]
    parts, dim = cat.instruction.args[0], cat.instruction.args[1:]
    if not isinstance(parts, Items) or len(parts.items) != 2 or var_name(parts.items[0]) != neg.target \
            or not _is_last_dim(dim[0] if dim else Text("0"), rank) or cat.instruction.kwargs:
        return None
    first_half = var_name(parts.items[1])
    if first_half not in made_at or sole_reader(statements, first_half, reads, made_at) != cat_index \
            or _half_of(program, statements[made_at[first_half]], first=True) != (x, rank, h):
        return None
    times_sin_index = sole_reader(statements, cat.target, reads, made_at)
    sin = _other_factor(statements, times_sin_index, cat.target)
    if sin is None:
        return None
    add_index = sole_reader(statements, statements[times_sin_index].target, reads, made_at)
    if add_index is None or not calls(statements[add_index], "aten.add.Tensor"):
        return None
    add = statements[add_index]
    terms = add.instruction.reads()
    if len(add.instruction.args) != 2 or add.instruction.kwargs or len(terms) != 2:
        return None
    times_cos = next((t for t in terms if t != statements[times_sin_index].target), None)
    if times_cos not in made_at:
        return None
    times_cos_index = made_at[times_cos]
    cos = _other_factor(statements, times_cos_index, x)
    if cos is None or sole_reader(statements, times_cos, reads, made_at) != add_index:
        return None
    indices = sorted({made_at[second_half], made_at[first_half], neg_index, cat_index, times_sin_index,
                      times_cos_index}) + [add_index]
    chain = [statements[i] for i in indices]
    if any(s.collectives for s in chain) or not all(_last_dim_whole(program, v) for v in (x, cos, sin)):
        return None
    dtypes = {dtype_of(program, v) for v in (x, cos, sin, add.target)}
    if None in dtypes or len(dtypes) != 1:
        return None
    replacement = Statement(add.target, Instruction("form", "rt.rotary", (Var(x), Var(cos), Var(sin))),
                            f"{add.comment} — rotary embedding of {x}: its {len(indices)} ops as one", (), add.layouts, add.node)
    return indices, replacement


def _half_of(program: LoweredProgram, statement: Statement, first: bool):
    """(x, x's rank, h) where the statement is slice(x, last dim, 0, h) (`first`) or slice(x, last dim, h,
    end ≥ 2h) of an x whose last dim is 2h; else (None, None, None)."""
    args = statement.instruction.args
    if not calls(statement, "aten.slice.Tensor") or len(args) != 4 or statement.instruction.kwargs:
        return None, None, None
    x = var_name(args[0])
    value = program.values.get(x) if x else None
    if value is None or not all(isinstance(a, Text) for a in args[1:]):
        return None, None, None
    rank, size = len(value["shape"]), value["shape"][-1]
    try:
        start, end = int(args[2].text), int(args[3].text)
    except ValueError:
        return None, None, None
    if not _is_last_dim(args[1], rank) or size % 2:
        return None, None, None
    h = size // 2
    if (first and (start, end) == (0, h)) or (not first and start == h and end >= size):
        return x, rank, h
    return None, None, None


def _is_last_dim(arg, rank: int) -> bool:
    return isinstance(arg, Text) and arg.text.lstrip("-").isdigit() and int(arg.text) in (-1, rank - 1)


def _other_factor(statements: list[Statement], index: int | None, factor: str) -> str | None:
    """The other operand of the statement at `index`, where it is mul(factor, other) or mul(other, factor)."""
    if index is None or not calls(statements[index], "aten.mul.Tensor"):
        return None
    instruction = statements[index].instruction
    operands = [var_name(a) for a in instruction.args]
    if len(operands) != 2 or None in operands or instruction.kwargs or operands.count(factor) != 1:
        return None
    return operands[1 - operands.index(factor)]


def _last_dim_whole(program: LoweredProgram, name: str) -> bool:
    """The value's last dim is not split over any mesh axis (a broadcast table's size-1 dims included)."""
    layout, shape = program.layout_of(name), shape_of(program, name)
    return layout is not None and shape is not None and not layout.axes_splitting(len(shape) - 1)
