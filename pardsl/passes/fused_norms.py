"""A pass over the lowered program: a model's RMSNorm, written as seven ATen ops, runs as one.

Hugging Face's RMSNorms (LLaMA's, Mistral's, Qwen's) export as a chain of ops on the activation x and
the weight w:

    pow(x, 2) → mean(-1, keepdim) → add(eps) → rsqrt → mul(x, ·) [→ to(dtype)] → mul(w, ·)

Eager, autograd records a node for each op and runs about eleven ops over the activation backward. Here
the chain is one op of the runtime (`rt.rms_norm`), one autograd node, with a backward in closed form,
gx = r·(g·w − n·mean(g·w·n)) with n = x·r and r = rsqrt(mean(x²) + eps). Megatron fuses its norms the
same way. On a CPU in float32 or float64 the op is numba's kernels (pardsl/runtime/kernels.py), one pass per row
each way, within rounding of the chain; elsewhere (a GPU, half precision) the chain's own forward ops
(its bits) and the backward in seven ATen ops. On this machine one [4, 64, 512] norm's forward and
backward, from a cold cache, take 0.88 ms as the chain, 0.52 ms as the ATen ops and 0.30 ms as the
kernels.

The pass runs after lowering, on ops already placed, so it changes no layout and no collective. A chain
is fused only where the result is what the ops compute on each rank alone:
- no statement of the chain has a collective;
- x is not partial, and its last dim (the one the mean reduces) is not split;
- the weight is whole on every rank (B);
- every intermediate is read by the next op of the chain alone;
- the weight has the result's dtype, the one the `to` casts to (x's, or, for a half-precision model whose
  norm computes in float32, the model's: the fused op casts the same way).

The chain's pow and mul keep x for backward; the fused op keeps x·r and r, which the chain's own values
stand for already. Where nothing else keeps x (or its all-reduced copy, under tensor parallelism), a rank
holds one activation less per norm (for a half-precision model, the bf16 cast of x·r the weight's mul
kept), and the program's count of activations says so (`kept_here`); the serial model's count, the base
of a `memory <= N %` bound, is unchanged. The kernels keep x and r instead: where something else keeps x
too, they hold one activation less than that count says (it errs high). The cost model still prices the
chain's seven ops.

A half-precision model casts x to float32 first (`h.to(torch.float32)`). Where that cast is read by the
chain alone, the op makes it too and keeps h, in bf16, in place of the float32 x·r, which backward makes
again from h and r with the forward's ops: half the bytes a norm. An h that a pipeline stage receives is
counted with the stage's inputs (`inputs_kept`), where the pipeline search counts what a stage takes.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from pardsl.model.saved_for_backward import Kept
from pardsl.passes.chains import calls, dtype_of, kept_no_longer, readers_and_makers, sole_reader, var_name
from pardsl.program.ir import Instruction, LoweredProgram, Statement, Text, Var, torch_dtype

_CHAIN = ("aten.pow.Tensor_Scalar", "aten.mean.dim", "aten.add.Tensor", "aten.rsqrt.default", "aten.mul.Tensor")


def fuse_rms_norms(program: LoweredProgram, kept: Kept) -> LoweredProgram:
    """`kept`: what autograd keeps of the serial graph (saved_for_backward.Kept), for what the fused ops
    no longer keep."""
    reads, made_at = readers_and_makers(program)
    fused: dict[int, Statement] = {}  # index of the chain's last statement → the fused statement
    dropped: set[int] = set()
    unkept: list[str] = []  # per chain, the values the fused op keeps no longer
    narrow_kept: dict[str, str] = {}  # a norm's input it keeps in its own dtype → the float32 cast it stands for
    for index, statement in enumerate(program.statements):
        chain = _chain_from(program, index, reads, made_at)
        if chain is not None and not dropped.intersection(chain[0]):
            indices, replacement = chain
            dropped.update(indices[:-1])
            fused[indices[-1]] = replacement
            x, weight, eps, *cast = replacement.instruction.args
            if replacement.instruction.kwargs:  # it casts x itself: neither x's float32 cast nor x·r is kept
                widened = program.statements[indices[0]].target
                unkept.extend([widened, program.statements[indices[-2]].target])
                narrow_kept[x.name] = widened
            elif cast:  # x stands for the x·r the op keeps; the cast x·r the weight's mul kept is not kept
                unkept.append(program.statements[indices[-2]].target)
            else:  # the chain's own x·r stands for the op's
                unkept.append(x.name)
    if not fused:
        return program
    statements = [fused.get(i, statement) for i, statement in enumerate(program.statements) if i not in dropped]
    replaced = {program.statements[i].node for i in dropped | set(fused)}
    values, inputs_kept = _held_narrow(program, dict(program.values), narrow_kept, made_at)
    values = _kept_no_longer(program, values, statements, unkept, replaced, kept)
    return dataclasses.replace(program, statements=statements, values=values,
                               inputs_kept=program.inputs_kept | inputs_kept)


def _held_narrow(program: LoweredProgram, values: dict[str, dict], narrow_kept: dict[str, str],
                 made_at: dict[str, int]) -> tuple[dict[str, dict], frozenset[str]]:
    """The program's values with each norm input the fused op keeps in its own dtype held for backward: a
    value that autograd does not keep (a cast keeps nothing), or a converted copy no value records yet, at
    its cast's shape and layout; and those inputs the program takes rather than makes (a pipeline stage's
    first layer's), counted with its inputs."""
    inputs_kept = set()
    for narrow, wide in narrow_kept.items():
        if narrow in values:
            values[narrow] = {**values[narrow], "kept_here": True}
        elif narrow not in made_at:
            inputs_kept.add(narrow)
        elif wide in values:
            source = narrow
            while source in made_at and program.statements[made_at[source]].instruction.kind == "convert":
                source = var_name(program.statements[made_at[source]].instruction.args[0])
            described = values[wide]
            values[narrow] = {"kind": "copy", "of": source, "parameter": False,
                              **{key: described[key] for key in ("layout", "shape", "local_shape", "layer")
                                 if key in described},
                              "dtype": dtype_of(program, source) or described["dtype"], "kept_here": True}
    return values, frozenset(inputs_kept)


def _kept_no_longer(program: LoweredProgram, values: dict[str, dict], statements: list[Statement],
                    unkept: list[str], replaced: set[str], kept: Kept) -> dict[str, dict]:
    """The program's values, with those in `unkept` not held for backward where nothing but the `replaced`
    ops (graph node names) kept them: a graph value's flag, or a converted copy (an all-reduced residual)
    not held at all, and the value it is a copy of. The fused op keeps x·r in x's dtype. Where the chain
    computes in x's dtype, its own x·r stands for that, and x is what is no longer kept. Where it casts (a
    half-precision model's norm in float32), x stands for it, and the cast x·r that the weight's mul kept
    is no longer kept; where the op casts x itself, x is not kept either (its narrow input is instead)."""
    for name in unkept:
        value = values.get(name, {})
        if value.get("kind") == "copy":
            storage = kept.owner.get(value["of"], value["of"])
            keeping = {op for op, operand in kept.reads if kept.owner.get(operand, operand) == storage} - replaced
            if not any(s.node in keeping for s in statements if name in s.instruction.reads()):
                del values[name]
            name = value["of"]  # and the value it is a copy of, which the chain's ops kept as well
        kept_no_longer(values, name, replaced, kept)
    return values


def _chain_from(program: LoweredProgram, start: int, reads: Counter, made_at: dict[str, int]):
    """([the chain's statement indices], the fused statement) for a chain whose pow is at `start`, or None."""
    statements = program.statements
    first = statements[start]
    if not calls(first, _CHAIN[0]) or first.instruction.args[1:] != (Text("2"),):
        return None
    x = var_name(first.instruction.args[0])
    indices, current = [start], first
    for callee in _CHAIN[1:]:
        following = sole_reader(statements, current.target, reads, made_at)
        if following is None or not calls(statements[following], callee):
            return None
        indices.append(following)
        current = statements[following]
    mean, add, rsqrt, scaled = (statements[i] for i in indices[1:])
    if mean.instruction.args[1:] != (Text("[-1]"), Text("True")) or len(add.instruction.args) != 2 \
            or not isinstance(add.instruction.args[1], Text) or add.instruction.kwargs:
        return None
    eps = add.instruction.args[1]
    if set(scaled.instruction.reads()) != {x, rsqrt.target}:
        return None  # x · rsqrt(…), the x the pow read
    following = sole_reader(statements, scaled.target, reads, made_at)
    if following is not None and calls(statements[following], "aten.to.dtype"):
        indices.append(following)
        following = sole_reader(statements, statements[following].target, reads, made_at)
    if following is None or not calls(statements[following], "aten.mul.Tensor"):
        return None
    indices.append(following)
    last = statements[following]
    weights = [name for name in last.instruction.reads() if name != statements[indices[-2]].target]
    if len(weights) != 1 or len(last.instruction.reads()) != 2:
        return None
    weight = weights[0]
    if not _local(program, [statements[i] for i in indices], x) or not _whole(program, weight):
        return None
    # x in the dtype the norm computes in; the result, and the weight, in the one the chain casts back to
    computed, result = dtype_of(program, x), dtype_of(program, last.target)
    cast = dtype_of(program, statements[indices[-2]].target)
    if None in (computed, result) or result != dtype_of(program, weight) or cast != result:
        return None
    arguments = (Var(x), Var(weight), eps) + ((Text(f"torch.{result}"),) if result != computed else ())
    keywords, name = (), x
    widening = made_at.get(x)
    if widening is not None and reads[x] == 2 and _widened(program, statements[widening], computed):
        # x, the norm's input cast to float32, is read by the chain alone: the op casts it, and keeps the
        # input in its own dtype for backward, where the chain's pow and mul kept the float32 copy
        name = var_name(statements[widening].instruction.args[0])
        arguments = (Var(name), *arguments[1:])
        keywords = (("compute", Text(f"torch.{computed}")),)
        indices = [widening, *indices]
    fused = Statement(last.target, Instruction("form", "rt.rms_norm", arguments, keywords),
                      f"{last.comment} — RMSNorm of {name}: its {len(indices)} ops as one, backward in closed form",
                      (), last.layouts, last.node)
    return indices, fused


def _widened(program: LoweredProgram, statement: Statement, computed: str) -> bool:
    """`statement` is `x = h.to(computed)` of a narrower floating h at x's layout."""
    args = statement.instruction.args
    if not calls(statement, "aten.to.dtype") or len(args) != 2 or statement.instruction.kwargs \
            or args[1] != Text(f"torch.{computed}") or var_name(args[0]) is None:
        return False
    narrow = dtype_of(program, args[0].name)
    if narrow is None or not statement.layouts or program.layout_of(args[0].name) != statement.layouts[0]:
        return False
    narrow, wide = torch_dtype(narrow), torch_dtype(computed)
    return narrow.is_floating_point and narrow.itemsize < wide.itemsize


def _local(program: LoweredProgram, chain: list[Statement], x: str) -> bool:
    """No collective in the chain; x, and every value it makes, neither partial nor split on the last dim."""
    if any(statement.collectives for statement in chain):
        return False
    value = program.values.get(x)
    layout = program.layout_of(x)
    if value is None or layout is None:
        return False
    last_dim = len(value["shape"]) - 1
    layouts = [layout] + [l for statement in chain for l in statement.layouts]
    return all(not l.has_partial and not l.axes_splitting(last_dim) for l in layouts)


def _whole(program: LoweredProgram, name: str) -> bool:
    layout = program.layout_of(name)
    return layout is not None and all(p.kind == "B" for p in layout.placements)
