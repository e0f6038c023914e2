"""Stage 4: typed graph → lowered program: straight-line statements with collectives and local shapes.

Every conversion between layouts becomes calls of the runtime's autograd collectives, one mesh axis at a
time in the cheapest legal order (`layouts.plan_conversion`). Gradients follow the layouts' adjoints:

- each conversion's adjoint is built into its runtime function;
- a value that is B on an axis and feeds computation sharded on that axis (its consumer's result is S or
  P there) gets a partial gradient from each such consumer. Those consumers read it through one
  `grad_all_reduce` (Megatron's f: identity forward, all-reduce backward), once per value and not once
  per consumer;
- when the value was just all-gathered on that axis and every use of it is sharded there, the all-gather's
  adjoint becomes a reduce-scatter instead (Megatron-SP's g), and no all-reduce is needed.

A conversion is computed once per (value, layout) and shared by every consumer that needs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from dataclasses import dataclass

import torch

from pardsl.language.diagnostics import Diagnostic
from pardsl.layouts.algebra import (
    CONVERSION_OF_KIND,
    is_blocked,
    B,
    ConversionStep,
    Layout,
    Mesh,
    collective_bytes,
    one_group_gather,
    plan_conversion,
    step_collectives,
)
from pardsl.layouts.oprules import WHOLE, Signature, forms_taken, is_drawn_whole, op_name, rule_for, slice_bounds
from pardsl.model.export import called_at, source_line
from pardsl.planning.cost import DEFAULT_BUCKET_MB, FIRST_BUCKET_MB, parameter_unit, repeated_layer
from pardsl.planning.inference import TypedGraph
from pardsl.program.ir import (
    Arg,
    Collective,
    GatherGroup,
    GradientBucket,
    Instruction,
    Items,
    LoweredProgram,
    OutputSlot,
    ParameterGather,
    Slot,
    Statement,
    TensorSlot,
    Text,
    Var,
    format_bytes,
    named_layout,
    python_literal,
    python_name,
)
from pardsl.runtime.parallel_ops import PROJECTIONS


@dataclass(frozen=True)
class _GradientSync:
    """One parameter gradient bound for a bucket, before buckets are formed."""

    kind: str
    axes: tuple[str, ...]
    attr: str
    dim: int
    blocks: int | tuple[int, ...]  # a count of equal blocks, or unequal blocks' sizes
    nbytes: int
    dtype: str


@dataclass(frozen=True)
class LinearForm:
    """Where a linear-like op keeps its input, weight and bias among its operands; `op` names it to the
    runtime's column-parallel step (parallel_ops.PROJECTIONS, where the slots come from), which knows how the
    weight is stored."""
    op: str
    input: int
    weight: int
    bias: int | None

    def parameter_slots(self, operands: int) -> tuple[int, ...]:
        """The weight's slot, then the bias's where the op of `operands` operands has one."""
        return (self.weight,) + ((self.bias,) if self.bias is not None and self.bias < operands else ())


# The ops a column-parallel step computes for its readers of one input, keyed by their overloads: the
# runtime's list (parallel_ops.PROJECTIONS), so that the two cannot disagree
LINEAR_FORMS = {getattr(torch.ops.aten, op).default: LinearForm(op, p.input, p.weight, p.bias)
                for op, p in PROJECTIONS.items()}
_PLACEHOLDER = re.compile(r"@@(sync|bucket|gather|group)(\d+)@@")  # a bucket or group not yet formed


def _attr_name(name: str, taken: set[str]) -> str:
    base = python_name(name)
    if hasattr(torch.nn.Module, base) or base in ("rt", "forward"):
        base = "p_" + base
    attr, k = base, 1
    while attr in taken:
        k += 1
        attr = f"{base}_{k}"
    taken.add(attr)
    return attr


def local_sizes(info, layout: Layout, mesh: Mesh) -> list:
    """The local size of each dim as code: an int where the dim is fixed, else an expression over the
    named dims' variables (`seq // 2`), computed at run time from the inputs' sizes."""
    fixed = layout.local_shape(info.shape, mesh)
    sizes = []
    for dim, size in enumerate(fixed):
        expr = info.size_expr(dim)
        if expr is None:
            sizes.append(size)
        else:
            factor = layout.split_factor(dim, mesh)
            operand = expr if expr.isidentifier() else f"({expr})"
            sizes.append(_Code(expr if factor == 1 else f"{operand} // {factor}"))
    return sizes


class _Code(str):
    """Source text rendered as it is (a size expression), not as a string literal."""

    def __repr__(self) -> str:
        return str(self)


def _shape_text(info, layout: Layout | None = None, mesh: Mesh | None = None) -> str:
    sizes = local_sizes(info, layout, mesh) if layout is not None else \
        [info.size_expr(d) or s for d, s in enumerate(info.shape)]
    return "[" + ", ".join(str(s) for s in sizes) + "]"


def _tag(layout: Layout) -> str:
    """A layout as part of a Python name: `S0_B`, `S2blocks2` for `S(2, blocks=2)`, `S1zigzag`."""
    return "_".join(p.kind + (f"{p.dim}" if p.is_split else "") +
                    ("zigzag" if p.mirrored else "blocks" + "_".join(map(str, p.sizes)) if p.sizes else
                     f"blocks{p.blocks}" if p.blocks > 1 else "")
                    for p in layout.placements)


def _render(value) -> str:
    if isinstance(value, torch.device):
        return "rt.device"  # made where the rank runs, not where the model was traced
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.memory_format):
        return str(value)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_render(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return f"float('{value}')"
    return repr(value)


def step_call(step: ConversionStep, rs_backward: bool = False) -> tuple[str, dict]:
    """The runtime method and keyword arguments that carry out one conversion step (its axis aside), from
    its row of the catalogue; block counts only where there are blocks."""
    conversion = CONVERSION_OF_KIND[step.kind]
    kwargs = {keyword: getattr(step, field) for keyword, field in conversion.arguments
              if (keyword != "blocks" or is_blocked(getattr(step, field))) and (keyword != "mirrored" or getattr(step, field))}
    if step.kind == "all_gather":  # its adjoint: a slice, or a reduce-scatter (Megatron-SP's g)
        kwargs = {"dim": kwargs["dim"], "backward": "reduce_scatter" if rs_backward else "slice",
                  **{k: v for k, v in kwargs.items() if k != "dim"}}
    return conversion.kind, kwargs


@dataclass
class _Use:
    node: str
    slot: int
    partial_axes: frozenset[int]  # axes where this use gives a partial gradient


class _Lowerer:
    def __init__(self, typed: TypedGraph, bucket_mb: float = DEFAULT_BUCKET_MB):
        self.bucket_bytes = int(bucket_mb * (1 << 20))
        self.syncs: list[_GradientSync] = []  # parameter gradients bound for buckets, in forward order
        self.gathers: list[ParameterGather] = []
        self.typed = typed
        self.bound = typed.bound
        self.mesh = typed.mesh
        # a pipeline's axis holds its stages: no conversion moves a value over it
        pipeline = typed.bound.par.pipeline
        self.still = frozenset({self.mesh.axis_index(pipeline.axis)}) if pipeline is not None else frozenset()
        self.statements: list[Statement] = []
        self._values: dict[str, dict] | None = None  # values(), once the program is emitted
        self.notes: list[Diagnostic] = []
        self.var: dict[str, str] = {}  # graph name → variable holding its value layout
        self.emitted: set[str] = set()
        self.conversion_var: dict[tuple[str, Layout], str] = {}
        self.conversion_steps: dict[str, list[ConversionStep]] = {}
        self.uses: dict[str, list[_Use]] = {}  # conversion variable → its uses
        self.grad_wrapper: dict[tuple[str, frozenset[int]], str] = {}
        self.reduce_scatter_backward: set[tuple[str, int]] = set()  # (variable, axis)
        self.current_node = ""  # the op a collective emitted now is there for: whose value it moves, else its consumer
        self.exchanges: list[tuple[str, str, ConversionStep]] = []  # (consumer, value): all-to-alls not written

    # -- names ---------------------------------------------------------------------------------------

    def _base(self, name: str) -> str:
        var = self.var[name]
        return var.removeprefix("self.")

    def _conversion_target(self, name: str, layout: Layout) -> str:
        """The variable that will hold `name` in `layout` (computed once, however many consumers)."""
        if layout == self.typed.layout_of(name):
            return self.var[name]
        key = (name, layout)
        if key not in self.conversion_var:
            info = self.typed.info(name)
            steps = plan_conversion(self.typed.layout_of(name), layout, info.shape, info.itemsize, self.mesh,
                                    with_backward=name in self.typed.requires_grad, still=self.still)
            var = f"{self._base(name)}__{_tag(layout)}"
            self.conversion_var[key] = var
            self.conversion_steps[var] = steps
        return self.conversion_var[key]

    # -- pass 1: who needs what ----------------------------------------------------------------------

    def plan_uses(self) -> None:
        for node in self.typed.nodes.values():
            for slot, (operand, needed) in enumerate(zip(node.operands, node.operand_layouts)):
                var = self._conversion_target(operand, needed)
                partial = frozenset(
                    a for a in range(self.mesh.ndim)
                    if needed.placements[a] == B and node.op_layout.placements[a] != B
                    and operand in self.typed.requires_grad and node.name in self.typed.requires_grad
                )
                self.uses.setdefault(var, []).append(_Use(node.name, slot, partial))
        for (_, node_name), layout in zip(self.bound.outputs, self.typed.output_layouts):
            if node_name is not None:
                var = self._conversion_target(node_name, layout)
                self.uses.setdefault(var, []).append(_Use("output", -1, frozenset()))

        for var, uses in self.uses.items():
            partial_axes = frozenset().union(*(u.partial_axes for u in uses))
            if not partial_axes:
                continue
            every_use_partial = {a for a in partial_axes if all(a in u.partial_axes for u in uses)}
            steps = self.conversion_steps.get(var, [])
            for a in every_use_partial:
                last_on_axis = [s for s in steps if s.axis == a][-1:]
                if last_on_axis and last_on_axis[0].kind == "all_gather":
                    self.reduce_scatter_backward.add((var, a))
            for use in uses:
                use.partial_axes = frozenset(a for a in use.partial_axes if (var, a) not in self.reduce_scatter_backward)

        # A parameter gathered for use and read by computation split over further axes (a 2.5-D weight
        # replicated over depth; a 3-D weight gathered over j and l, the batch split over i): its gradient
        # is partial over those axes, and a bucket all-reduces it there as a shard, instead of an all-reduce
        # of the gathered gradient of its own on backward's path. Gathered over one axis where the gradient
        # is partial too, the bucket reduce-scatters it there first (`_emit_parameter_gather`); where it is
        # whole on every gathered axis, each gather's adjoint takes this rank's slice and the stored shard
        # joins an all-reduce bucket (`_shard_gradient_in_bucket`).
        self.partial_in_bucket: dict[str, frozenset[int]] = {}
        source = {var: name for (name, _), var in self.conversion_var.items()}
        for var, uses in self.uses.items():
            steps = self.conversion_steps.get(var, [])
            name = source.get(var)
            if name is None or not self._is_parameter(name) or not steps or \
                    any(s.kind != "all_gather" or self.mesh.axis_sizes[s.axis] == 1 for s in steps) or \
                    (len(steps) > 1 and any((var, s.axis) in self.reduce_scatter_backward for s in steps)):
                continue
            partial = {use.partial_axes for use in uses}
            if len(partial) == 1 and next(iter(partial)) and not {s.axis for s in steps} & next(iter(partial)):
                self.partial_in_bucket[var] = next(iter(partial))
                for use in uses:
                    use.partial_axes = frozenset()

    def plan_fused_linears(self) -> None:
        """Linears that read one value through Megatron's f (B, gradient all-reduced) or through SP's g (just
        all-gathered, gradient reduce-scattered), with weights and biases used as stored: one runtime step
        computes them, and in backward overlaps the input gradient's collective with the weights' gradients
        (`rt.column_parallel_linears`)."""
        self.fused: dict[str, tuple[str, tuple[int, ...], list[str], ConversionStep | None]] = {}
        self.fused_later: set[str] = set()
        for var, uses in self.uses.items():
            steps = self.conversion_steps.get(var, [])
            if len(steps) == 1 and steps[0].kind == "all_gather" and (var, steps[0].axis) in self.reduce_scatter_backward \
                    and not any(u.partial_axes for u in uses):
                names = [use.node for use in uses]
                if self.mesh.axis_sizes[steps[0].axis] > 1 and len(set(names)) == len(names) \
                        and self._fusable_linears(uses):
                    self.fused[names[0]] = (var, (steps[0].axis,), names, steps[0])
                    self.fused_later.update(names[1:])
                continue
            groups: dict[frozenset[int], list[_Use]] = {}
            for use in uses:
                if use.partial_axes:
                    groups.setdefault(use.partial_axes, []).append(use)
            for axes, group in groups.items():
                names = [use.node for use in group]
                if not any(self.mesh.axis_sizes[a] > 1 for a in axes) or len(set(names)) != len(names) \
                        or not self._fusable_linears(group):
                    continue
                self.fused[names[0]] = (var, tuple(sorted(axes)), names, None)
                self.fused_later.update(names[1:])

    def _linear_form(self, name: str) -> LinearForm | None:
        return LINEAR_FORMS.get(self._fx[name].target) if name in self._fx else None

    def _fusable_linears(self, uses: list[_Use]) -> bool:
        """Every use is the input of one linear-like op of the same form (they share a runtime step)."""
        return len({self._linear_form(use.node) for use in uses}) == 1 and all(self._fusable_linear(u) for u in uses)

    def _fusable_linear(self, use: _Use) -> bool:
        node = self.typed.nodes.get(use.node)
        form = self._linear_form(use.node)
        if node is None or form is None or use.slot != form.input or self._fx[use.node].kwargs \
                or node.value_layout != node.op_layout:
            return False
        parameters = form.parameter_slots(len(node.operands))
        if len(node.operands) != 1 + len(parameters) or len(self.typed.info(node.operands[form.weight]).shape) != 2:
            return False
        for slot in parameters:
            operand, needed = node.operands[slot], node.operand_layouts[slot]
            if needed != self.typed.layout_of(operand) or not self._is_parameter(operand):
                return False
            if any(u.partial_axes for u in self.uses.get(self.var[operand], []) if u.node == use.node and u.slot == slot):
                return False
        return True

    def _lower_fused_linears(self, first: str) -> None:
        var, axes, names, gather = self.fused[first]
        node = self.typed.nodes[first]
        form = self._linear_form(first)
        where = self.bound.module_paths.get(first)
        reason = f"{node.op.removeprefix('aten.')} {first}" + (f" in {where}" if where else "")
        source = node.operands[form.input]
        pairs = []
        for name in names:
            operands = self.typed.nodes[name].operands
            weight, *bias = (Var(self.var[operands[slot]]) for slot in form.parameter_slots(len(operands)))
            pairs.append(Items((weight, bias[0] if bias else Text("None")), "()"))
        axis_names = tuple(self.mesh.axis_names[a] for a in axes)
        op = (("op", Text(repr(form.op))),) if form.op != "linear" else ()
        if gather is None:  # f: x is B; its gradient, partial, is all-reduced
            x = self._ensure(source, node.operand_layouts[form.input], reason)
            info = self.typed.info(source)
            local = math.prod(node.operand_layouts[form.input].local_shape(info.shape, self.mesh)) * info.itemsize
            collectives = tuple(
                Collective("all_reduce", a, "backward", collective_bytes("all_reduce", local, n), x,
                           "gradient of a broadcast value read by sharded computation")
                for a, n in ((a, self.mesh.axis_sizes[self.mesh.axis_index(a)]) for a in axis_names) if n > 1)
            extra, what = op, "its gradient all-reduced once"
        else:  # SP's g: x is split; gathered here, its gradient reduce-scattered back
            x = self.var[source]
            self.emitted.add(var)
            collectives = (Collective("all_gather", axis_names[0], "forward", gather.forward_bytes, var, reason),
                           Collective("reduce_scatter", axis_names[0], "backward", gather.forward_bytes, var, reason))
            blocks = (("blocks", Text(repr(gather.src_blocks))),) if is_blocked(gather.src_blocks) else ()
            blocks += (("mirrored", Text("True")),) if gather.src_mirrored else ()
            extra, what = (("gather_dim", Text(str(gather.src_dim))),) + blocks + op, \
                "gathered first; its gradient reduce-scattered"
        moved = ", ".join(f"{c.kind.replace('_', '-')} {format_bytes(c.bytes)} ({c.phase})" for c in collectives)
        targets = ", ".join(names) + ("," if len(names) == 1 else "")
        comment = (f"{self._value_comment(node.op_layout, self.typed.info(first))}; {len(names)} {form.op}(s) of one "
                   f"input, {what} while the weights' gradients are computed ({moved})")
        with self._moving(source):
            self.emit(targets, Instruction("fused_linears", "rt.column_parallel_linears",
                                           (Var(x), Text(repr(axis_names)), *pairs), extra), comment, collectives,
                      tuple(self.typed.nodes[name].op_layout for name in names))
        for name in names:
            self.var[name] = name
            self.emitted.add(name)

    # -- pass 2: statements --------------------------------------------------------------------------

    def emit(self, target: str, instruction: Instruction, comment: str,
             collectives: tuple[Collective, ...] = (), layouts: tuple[Layout, ...] = ()) -> None:
        collectives = tuple(dataclasses.replace(c, node=self.current_node) for c in collectives)
        self.statements.append(Statement(target, instruction, comment, collectives, layouts, self.current_node))

    def _value_comment(self, layout: Layout, info) -> str:
        whole, local = _shape_text(info), _shape_text(info, layout, self.mesh)
        return f"{named_layout(layout, self.mesh)}  {whole}" + (f" local {local}" if local != whole else "")

    def _ensure(self, name: str, layout: Layout, reason: str) -> str:
        """Emit the conversion of `name` to `layout` if not yet emitted; return its variable."""
        var = self._conversion_target(name, layout)
        if var in self.emitted:
            return var
        consumer = self.current_node
        with self._moving(name):
            self._emit_conversion(name, layout, var, reason, consumer)
        return var

    @contextlib.contextmanager
    def _moving(self, name: str):
        """Collectives that move an op's result are there for that op (its layer), not for its consumer."""
        consumer = self.current_node
        self.current_node = name if name in self.typed.nodes else consumer
        try:
            yield
        finally:
            self.current_node = consumer

    def _emit_conversion(self, name: str, layout: Layout, var: str, reason: str, consumer: str) -> None:
        self.emitted.add(var)
        steps = self.conversion_steps[var]
        pin = self.bound.pins.get(name)
        gathered_for_use = self._gathered_in_group(name, var)
        if gathered_for_use:
            self._emit_parameter_gather(name, var, steps[0], reason)
        else:
            source = self._shard_gradient_in_bucket(name, var) if var in self.partial_in_bucket else self.var[name]
            self._emit_steps(steps, source, var, reason,
                             {a for (v, a) in self.reduce_scatter_backward if v == var}, name in self.typed.requires_grad)
            if pin is None:
                self.exchanges += [(consumer, name, s) for s in steps
                                   if s.kind == "all_to_all" and self.mesh.axis_sizes[s.axis] > 1]
        # gathering a stored parameter is ZeRO's meaning; slicing a value that needs no gradient out of what a
        # rank holds moves nothing either way (token ids split by tokens for an embedding): no note for either
        sliced = all(s.kind == "split" for s in steps) and name not in self.typed.requires_grad
        if pin is not None and steps and not gathered_for_use and not sliced:
            moved = sum(s.forward_bytes for s in steps)
            self.notes.append(Diagnostic(
                "N001", f"`{pin.entry.target}` is {pin.layout.render(self.mesh)} as written; {reason} needs "
                f"{layout.render(self.mesh)}: inserted {', '.join(s.kind for s in steps)} "
                f"({format_bytes(moved)} forward)", pin.entry.span, severity="note"))

    def _gathered_in_group(self, name: str, var: str) -> bool:
        return self._is_parameter(name) and one_group_gather(self.conversion_steps.get(var, []), self.mesh)

    def _is_parameter(self, name: str) -> bool:
        return name in self.bound.parameters and self.var[name].startswith("self.")

    def _sync(self, kind: str, axes: tuple[str, ...], name: str, dim: int, blocks: int | tuple[int, ...],
              nbytes: int) -> int:
        """Bind a parameter's gradient for a bucket; the bucket is chosen once all are known (`_buckets`)."""
        info = self.typed.info(name)
        self.syncs.append(_GradientSync(kind, axes, self.var[name].removeprefix("self."), dim, blocks, nbytes,
                                        str(info.dtype)))
        return len(self.syncs) - 1

    def _emit_parameter_gather(self, name: str, var: str, step: ConversionStep, reason: str) -> None:
        """A stored-split parameter gathered whole for its op: its group's all-gather is prefetched while
        the group before computes; where every use is sharded its gradient is partial, and reduce-scattered
        in a bucket."""
        axis = self.mesh.axis_names[step.axis]
        index = len(self.gathers)
        info = self.typed.info(name)
        whole = math.prod(step.target.local_shape(info.shape, self.mesh)) * info.itemsize
        unit = parameter_unit(self.bound.parameters[name])
        self.gathers.append(ParameterGather(self.var[name].removeprefix("self."), axis, step.src_dim, step.src_blocks,
                                            unit, str(info.dtype), whole))
        arrow = f"{step.source.placements[step.axis]}→B@{axis}"
        what = f"all-gathered in @@group{index}@@ (forward, prefetched)"
        args: tuple = (Var(self.var[name]), Slot("gather", index))
        further = self._further_axes(var)
        if (var, step.axis) in self.reduce_scatter_backward and name in self.typed.requires_grad:
            sync = self._sync("reduce_scatter", (axis, *further), name, step.src_dim, step.src_blocks, whole)
            args += (Slot("sync", sync),)
            also = f", then all-reduced over {', '.join(further)}," if further else ""
            what += f"; its gradient reduce-scattered{also} in @@bucket{sync}@@ (backward)"
        elif further:
            args = (Var(self._shard_gradient_in_bucket(name, var)),) + args[1:]
        self.emit(var, Instruction("param_gather", "sync.all_gather", args), f"{arrow}: {what} — {reason}",
                  layouts=(step.target,))

    def _further_axes(self, var: str) -> tuple[str, ...]:
        """The axes (of more than one rank) a gathered parameter's gradient is all-reduced over in its bucket."""
        return tuple(self.mesh.axis_names[a] for a in sorted(self.partial_in_bucket.get(var, ()))
                     if self.mesh.axis_sizes[a] > 1)

    def _shard_gradient_in_bucket(self, name: str, var: str) -> str:
        """The stored parameter, its gradient (partial over `partial_in_bucket[var]`, whole on the axes it
        is gathered over) all-reduced in a bucket: what the gathers start from, their adjoints slices."""
        further = self._further_axes(var)
        if not further or name not in self.typed.requires_grad:
            return self.var[name]
        layout, info = self.typed.layout_of(name), self.typed.info(name)
        shard = f"{self._base(name)}__shard__f"  # not `__f`: the parameter may be read as stored too
        sync = self._sync("all_reduce", further, name, 0, 1,
                          math.prod(layout.local_shape(info.shape, self.mesh)) * info.itemsize)
        gathered = ", ".join(self.mesh.axis_names[s.axis] for s in self.conversion_steps[var])
        self.emit(shard, Instruction("param_grad_sync", "sync.grad_all_reduce", (Var(self.var[name]), Slot("sync", sync))),
                  f"gathered over {gathered} for use by computation split over {', '.join(further)}: this rank's "
                  f"slice of its gradient all-reduced over {', '.join(further)} in @@bucket{sync}@@ (backward)",
                  layouts=(layout,))
        return shard

    def _gather_groups(self, chosen: list[int]) -> tuple[list[GatherGroup], dict[int, tuple[int, int]]]:
        """Consecutive gathers (of those `chosen`) of one layer (or of no layer), one axis and dtype: one
        all-gather each."""
        groups: list[list[int]] = []
        for index in chosen:
            gather = self.gathers[index]
            if groups:
                last = self.gathers[groups[-1][-1]]
                if (last.unit, last.axis, last.dtype) == (gather.unit, gather.axis, gather.dtype):
                    groups[-1].append(index)
                    continue
            groups.append([index])
        result, where = [], {}
        for number, indices in enumerate(groups):
            members = tuple(self.gathers[i] for i in indices)
            axis = members[0].axis
            n = self.mesh.axis_sizes[self.mesh.axis_index(axis)]
            shard_bytes = sum(m.nbytes for m in members) // n
            unit = members[0].unit or "outside the layers"
            collective = Collective("all_gather", axis, "forward", collective_bytes("all_gather", shard_bytes, n),
                                    f"group {number}", f"{len(members)} parameter(s) of {unit}, gathered for use")
            result.append(GatherGroup(axis, members, collective))
            where.update((i, (number, item)) for item, i in enumerate(indices))
        return result, where

    def _buckets(self, chosen: list[int]) -> tuple[list[GradientBucket], dict[int, tuple[int, int]]]:
        """Group the gradients (of those `chosen`) into buckets in the order backward produces them (the reverse of forward),
        one open bucket per collective, axes and dtype; a bucket closes past the bucket size (the first
        one past DDP's 1 MiB, so communication starts early). Returns the buckets, and where each
        gradient went: (bucket, member)."""
        opened: dict[tuple, int] = {}
        members: list[list[int]] = []
        sizes: list[int] = []
        where: dict[int, tuple[int, int]] = {}
        for index in reversed(chosen):
            sync = self.syncs[index]
            key = (sync.kind, sync.axes, sync.dtype)
            if key not in opened:
                opened[key] = len(members)
                members.append([])
                sizes.append(0)
            bucket = opened[key]
            where[index] = (bucket, len(members[bucket]))
            members[bucket].append(index)
            sizes[bucket] += sync.nbytes
            cap = min(self.bucket_bytes, int(FIRST_BUCKET_MB * (1 << 20))) if bucket == 0 else self.bucket_bytes
            if sizes[bucket] >= cap:
                del opened[key]
        buckets = []
        for bucket, indices in enumerate(members):
            first = self.syncs[indices[0]]
            sizes_by_axis = {a: self.mesh.axis_sizes[self.mesh.axis_index(a)] for a in first.axes}
            what = f"gradients of {len(indices)} parameter{'s' if len(indices) != 1 else ''}, bucket {bucket}"
            # the first axis's collective, then all-reduces over the further axes of what it left
            (axis, n), *further = sizes_by_axis.items()
            left = sizes[bucket] // n if first.kind == "reduce_scatter" else sizes[bucket]
            collectives = (Collective(first.kind, axis, "backward", collective_bytes(first.kind, sizes[bucket], n),
                                      f"bucket {bucket}", what),) + tuple(
                Collective("all_reduce", a, "backward", collective_bytes("all_reduce", left, m), f"bucket {bucket}", what)
                for a, m in further)
            buckets.append(GradientBucket(first.kind, first.axes,
                                          tuple((self.syncs[i].attr, self.syncs[i].dim, self.syncs[i].blocks)
                                                for i in indices), sizes[bucket], collectives))

        return buckets, where

    def _fill_placeholders(self, statements: list[Statement], in_bucket: dict[int, tuple[int, int]],
                           in_group: dict[int, tuple[int, int]]) -> list[Statement]:
        """Statements name buckets and gather groups by placeholders until both are formed: fill them in."""
        fills = {"sync": lambda i: "bucket={}, member={}".format(*in_bucket[i]),
                 "bucket": lambda i: f"bucket {in_bucket[i][0]}",
                 "gather": lambda i: "group={}, item={}".format(*in_group[i]),
                 "group": lambda i: f"group {in_group[i][0]}"}

        def fill(text: str) -> str:
            return _PLACEHOLDER.sub(lambda m: fills[m.group(1)](int(m.group(2))), text)

        def place(slot: Slot) -> Text:
            return Text(fills[slot.kind](slot.index))

        return [dataclasses.replace(s, instruction=s.instruction.replace_slots(place), comment=fill(s.comment))
                for s in statements]

    def _step_call(self, step: ConversionStep, source: str, axis: str, target: str, reason: str,
                   rs_backward: bool, needs_grad: bool) -> tuple[Instruction, tuple[Collective, ...]]:
        method, kwargs = step_call(step, rs_backward)
        expr = Instruction("convert", f"rt.{method}", (Var(source), Text(python_literal(axis))),
                           tuple((k, Text(python_literal(v) if isinstance(v, str) else repr(v))) for k, v in kwargs.items()))
        collectives = step_collectives(step)
        fwd = [kind for phase, kind, _ in collectives if phase == "forward"]
        bwd = [(kind, nbytes) for phase, kind, nbytes in collectives if phase == "backward"]
        if step.kind == "all_gather" and rs_backward:  # the adjoint reduce-scatters: T(n-1)/n both ways
            bwd = [("reduce_scatter", step.forward_bytes)]
        if self.mesh.axis_sizes[step.axis] == 1:  # every layout is the same on one rank: nothing moves
            return expr, ()
        collectives = tuple(Collective(k, axis, "forward", step.forward_bytes, target, reason) for k in fwd)
        if needs_grad:  # autograd runs no adjoint for a value that needs no gradient
            collectives += tuple(Collective(k, axis, "backward", b, target, reason) for k, b in bwd)
        return expr, collectives

    def _operand(self, node_name: str, slot: int, name: str, layout: Layout, reason: str) -> str:
        var = self._ensure(name, layout, reason)
        use = next(u for u in self.uses[var] if u.node == node_name and u.slot == slot)
        if not use.partial_axes:
            return var
        key = (var, use.partial_axes)
        if key not in self.grad_wrapper:
            axes = [self.mesh.axis_names[a] for a in sorted(use.partial_axes)]
            groups = {frozenset(u.partial_axes) for u in self.uses[var] if u.partial_axes}
            wrapper = f"{var.removeprefix('self.')}__f" + ("" if len(groups) == 1 else "_" + "_".join(axes))
            self.grad_wrapper[key] = wrapper
            info = self.typed.info(name)
            local = math.prod(layout.local_shape(info.shape, self.mesh)) * info.itemsize
            consumers = sum(1 for u in self.uses[var] if u.partial_axes == use.partial_axes)
            if self._is_parameter(name) and all(s.kind == "to_partial" for s in self.conversion_steps.get(var, [])):
                # the parameter itself, or its B → P (identity backward): its gradient is the parameter's
                sized = tuple(a for a in axes if self.mesh.axis_sizes[self.mesh.axis_index(a)] > 1)
                if not sized:  # nothing to synchronise over one rank
                    self.grad_wrapper[key] = var
                    return var
                sync = self._sync("all_reduce", sized, name, 0, 1, local)
                self.emit(wrapper, Instruction("param_grad_sync", "sync.grad_all_reduce", (Var(var), Slot("sync", sync))),
                          f"B read by {consumers} sharded consumer(s): its gradient all-reduced over "
                          f"{', '.join(sized)} in @@bucket{sync}@@ (backward)", layouts=(layout,))
                return wrapper
            collectives = tuple(
                Collective("all_reduce", axis, "backward",
                           collective_bytes("all_reduce", local, self.mesh.axis_sizes[self.mesh.axis_index(axis)]),
                           wrapper, "gradient of a broadcast value read by sharded computation")
                for axis in axes if self.mesh.axis_sizes[self.mesh.axis_index(axis)] > 1
            )
            moved = format_bytes(sum(c.bytes for c in collectives))
            with self._moving(name):
                self.emit(wrapper, Instruction("grad_sync", "rt.grad_all_reduce",
                                               (Var(var), *(Text(python_literal(a)) for a in axes))),
                          f"B read by {consumers} sharded consumer(s): all-reduce its gradient once "
                          f"({moved}, backward)", collectives, (layout,))
        return self.grad_wrapper[key]

    def lower_node(self, name: str) -> None:
        self.current_node = name
        if name in self.fused:
            self._lower_fused_linears(name)
            return
        if name in self.fused_later:  # computed with the first linear of its group
            return
        typed_node = self.typed.nodes[name]
        fx_node = self._fx[name]
        rule = rule_for(self._fx[name])
        where = self.bound.module_paths.get(name)
        reason = f"{typed_node.op.removeprefix('aten.')} {name}" + (f" in {where}" if where else "")
        operand_vars = [
            self._operand(name, slot, operand, layout, reason)
            for slot, (operand, layout) in enumerate(zip(typed_node.operands, typed_node.operand_layouts))
        ]
        info = self.typed.info(name)
        tensor_nodes = iter(operand_vars)
        args = [_node_arg(a, tensor_nodes, self.bound.scalars) for a in fx_node.args]
        local_code = local_sizes(info, typed_node.op_layout, self.mesh)
        if rule.shape_arg is not None and rule.shape_arg < len(args):
            args[rule.shape_arg] = Text(_render(local_code))
        if rule.size_arg is not None and typed_node.spec.cut is not None:
            # S(d, blocks=m) cut into m parts: each part is split, so each local part is smaller
            dim = typed_node.spec.output.index(typed_node.spec.cut[0])
            part = local_code[dim]
            sizes = fx_node.args[rule.size_arg]
            args[rule.size_arg] = Text(_render([part] * len(sizes) if isinstance(sizes, (list, tuple)) else part))
        if fx_node.target is torch.ops.aten.slice.Tensor and typed_node.spec.cut is not None:
            # one of the blocks: where S(d, blocks=...) holds a share of every block, in order, the local
            # block starts and ends at the global bounds over the split
            dim = typed_node.spec.output.index(typed_node.spec.cut[0])
            shape = self.typed.info(typed_node.operands[0]).shape
            start, end = slice_bounds(fx_node, dim, shape[dim])
            split = shape[dim] // typed_node.operand_layouts[0].local_shape(shape, self.mesh)[dim]
            args[2:4] = [Text(_render(start // split)), Text(_render(end // split))]
        if rule.training_arg is not None and rule.training_arg < len(args) and fx_node.args[rule.training_arg] is True:
            # traced in training: the op follows the module's mode, so `.eval()` works as it does on serial's
            args[rule.training_arg] = Text("self.training")
        if fx_node.target is torch.ops.aten.add_.Tensor and self._counts_batches(fx_node) and args[1] == Text("1"):
            # batch norm counts the batches it normalises in training only (`if self.training`, traced away)
            args[1] = Text("int(self.training)")
        kwargs = [(k, _node_arg(v, tensor_nodes, self.bound.scalars)) for k, v in fx_node.kwargs.items()]
        expr = Instruction("compute", typed_node.op, tuple(args), tuple(kwargs))
        vocab_axes = [self.mesh.axis_names[a] for a, p in enumerate(typed_node.operand_layouts[0].placements)
                      if p.is_split and p.dim == 0] if rule.masked_lookup else []
        parallel_forms = forms_taken(typed_node.spec, typed_node.operand_layouts, typed_node.op_layout) \
            if rule.parallel_form else {}
        inner: tuple[Collective, ...] = ()
        made: list[str] = []  # what the form's own collectives are, for the line's comment
        if rule.family == "project":
            expr = Instruction("project", "", (Var(operand_vars[0]), Text(str(fx_node.args[1]))))
        elif vocab_axes:
            # Each rank holds a slice of the vocabulary: look up the ids it holds, zeros for the rest (P).
            expr = Instruction("masked_lookup", "rt.masked_embedding", (Var(operand_vars[0]), Var(operand_vars[1]),
                                                                        *(Text(python_literal(a)) for a in vocab_axes)))
        elif rule.drawn_as:
            # random: every rank draws serial's whole tensor and keeps its part of it, so the values are serial's
            splits = tuple((self.mesh.axis_names[a], p.dim, p.arrangement[0]) + ((True,) if p.mirrored else ())
                           for a, p in enumerate(typed_node.op_layout.placements) if p.is_split)
            expr = Instruction("form", f"rt.{rule.drawn_as}", tuple(args), tuple(kwargs + [("splits", Text(repr(splits)))]))
        elif parallel_forms or rule.every_signature:
            # the rule's parallel form takes the op's own arguments, and per form the axes it is taken on
            forms = {}
            for axis, signature in parallel_forms.items():
                forms.setdefault(signature.name, []).append(self.mesh.axis_names[axis])
            form_kwargs = [(form, Text(repr(tuple(axes)))) for form, axes in forms.items()]
            expr = Instruction("form", f"rt.{rule.parallel_form}", tuple(args), tuple(kwargs + form_kwargs))
            inner, made = self._inner_collectives(typed_node, parallel_forms, reason)
        comment = self._value_comment(typed_node.op_layout, info)
        if made:
            comment += " — " + "; ".join(made)
        self.emit(name, expr, comment, inner, (typed_node.op_layout,))
        if rule.mean:
            self._rescale_mean(typed_node, fx_node, name)
        value_var = self.var[name]  # named before pass 1: where the value layout will live
        self.var[name] = name
        if typed_node.value_layout != typed_node.op_layout:
            self._convert_op_result(name, value_var)
        self.emitted.add(self.var[name])

    def _inner_collectives(self, typed_node, forms: dict[int, Signature],
                           reason: str) -> tuple[tuple[Collective, ...], list[str]]:
        """The collectives a parallel form makes (the vocabulary-parallel loss's, the count of targets), and
        each one in words."""
        operand = typed_node.operands[0]
        info = self.typed.info(operand)
        local = typed_node.operand_layouts[0].local_shape(info.shape, self.mesh)
        collectives, made = [], []
        for axis, signature in forms.items():
            placement = typed_node.operand_layouts[0].placements[axis]
            for inner in signature.inner_collectives:
                if not inner.made(operand in self.typed.requires_grad):
                    continue
                axis_name = self.mesh.axis_names[axis]
                moved = inner.volume(local, placement, info.itemsize, self.mesh.axis_sizes[axis])
                size = f"~{format_bytes(moved)} as routed" if inner.routed else format_bytes(moved)
                count = inner.messages(self.mesh.axis_sizes[axis])
                made.append(f"{f'{count} × ' if count > 1 else ''}{inner.kind.replace('_', '-')} {size} over "
                            f"{axis_name} ({inner.phase}): {inner.what}")
                collectives += [Collective(inner.kind, axis_name, inner.phase, moved, self.var[operand],
                                           f"{inner.what}, {signature.name} split — {reason}", routed=inner.routed,
                                           steps=self.mesh.axis_sizes[axis] if inner.beside_its_step else 0)
                                for _ in range(count)]
        return tuple(collectives), made

    def _intermediate_name(self, final: str, layout: Layout) -> str:
        """A step on the way to `final`, named by its own layout unless a conversion already uses that name."""
        name = f"{final.rsplit('__', 1)[0].removeprefix('self.')}__{_tag(layout)}"
        # membership in the dicts' views, not sets built of them: asked once per conversion step, and a
        # set of every name an 80-layer program has so far took a millisecond each time
        while name in self.emitted or name in self.conversion_var.values() or name in self.var.values():
            name += "_"
        self.emitted.add(name)
        return name

    def _convert_op_result(self, name: str, value_var: str) -> None:
        """The op computed `op_layout`; its value is held in another layout (the user wrote it, or it is a
        part of a list, taken in the list's layout): convert at once."""
        typed_node = self.typed.nodes[name]
        pin = self.bound.pins.get(name)
        info = self.typed.info(name)
        steps = plan_conversion(typed_node.op_layout, typed_node.value_layout, info.shape, info.itemsize,
                                self.mesh, with_backward=name in self.typed.requires_grad, still=self.still)
        reason = f"`{pin.entry.target}` written as {pin.layout.render(self.mesh)}" if pin is not None else \
            f"part {self._fx[name].args[1]} of {typed_node.operands[0]}, converted once taken"
        self._emit_steps(steps, name, value_var, reason, set(), name in self.typed.requires_grad)
        self.var[name] = value_var

    def _emit_steps(self, steps: list[ConversionStep], source: str, final: str, reason: str,
                    reduce_scatter_axes: set[int], needs_grad: bool) -> None:
        current = source
        for index, step in enumerate(steps):
            target = final if index == len(steps) - 1 else self._intermediate_name(final, step.target)
            axis = self.mesh.axis_names[step.axis]
            last_on_axis = all(later.axis != step.axis for later in steps[index + 1:])
            rs_backward = step.kind == "all_gather" and step.axis in reduce_scatter_axes and last_on_axis
            expr, collectives = self._step_call(step, current, axis, target, reason, rs_backward, needs_grad)
            arrow = f"{step.source.placements[step.axis]}→{step.target.placements[step.axis]}@{axis}"
            what = ", ".join(f"{c.kind.replace('_', '-')} {format_bytes(c.bytes)} ({c.phase})" for c in collectives)
            self.emit(target, expr, f"{arrow}: {what or 'local'} — {reason}", collectives, (step.target,))
            current = target

    def _emit_sizes(self, inputs: list[TensorSlot]) -> None:
        """The global size of each named dim, from the local size of the first input that has it; a
        check that it can be split as every tensor with that dim is; then the graph's size nodes."""
        slots = {slot.name: slot for slot in inputs}
        needed: dict[str, int] = {}  # named dim's variable → what every tensor's split of it needs
        for name, info in self.bound.tensors.items():
            node = self.typed.nodes.get(name)
            layouts = [node.value_layout, node.op_layout] if node else \
                [self.typed.placeholder_layouts[name]] if name in self.typed.placeholder_layouts else []
            for dim, expr in enumerate(info.symbolic or ()):
                if expr is not None and expr.isidentifier():
                    for layout in layouts:
                        needed[expr] = math.lcm(needed.get(expr, 1), layout.split_factor(dim, self.mesh))
        for dim_name, (var, input_name, index) in self.bound.dims.items():
            layout = slots[input_name].layout
            factor = layout.split_factor(index, self.mesh)
            split = f" × {factor} (split over {', '.join(self.mesh.axis_names[a] for a in layout.axes_splitting(index))})" \
                if factor > 1 else ""
            self.emit(var, Instruction("size", "", (Var(input_name), Text(str(index)))
                                       + ((Text(str(factor)),) if factor > 1 else ())),
                      f"dim `{dim_name}`: {input_name}'s dim {index}{split}")
            if factor % needed.get(var, 1):  # the input's own split does not guarantee it
                self.statements.append(Statement("", Instruction("check", "rt.require_divisible",
                                                                 (Var(var), Text(str(needed[var])), Text(python_literal(dim_name)))),
                                                 f"a tensor splits `{dim_name}` {needed[var]} ways"))
        for node_name, expr in self.bound.scalars.items():
            self.emit(node_name, Instruction("expression", "", (Text(expr),)), "a size, global")

    def _note_exchanges(self) -> None:
        """All-to-alls nobody wrote are a fallback (an op could not keep a split: 3 heads over tp = 2), often
        a costly one: say so once, with the first op that needed one, rather than leave it to be found."""
        if not self.exchanges:
            return
        consumer, value, step = self.exchanges[0]
        node = self.typed.nodes.get(consumer)
        where = self.bound.module_paths.get(consumer)
        what = f"`{node.op.removeprefix('aten.')}` ({consumer}{' in ' + where if where else ''})" if node else \
            f"output `{value}`"
        info = self.typed.info(value)
        shapes = ""
        if node is not None and rule_for(self._fx[consumer]).family == "reshape":
            shapes = f", which reshapes {list(info.shape)} to {list(self.typed.info(consumer).shape)}"
        axis = self.mesh.axis_names[step.axis]
        count = len(self.exchanges)
        forward = sum(s.forward_bytes for _, _, s in self.exchanges)
        hint = (f"a split dim that a reshape cuts into a size the axis does not divide (3 heads over {axis} = "
                f"{self.mesh.axis_sizes[step.axis]}) cannot stay split; write a layout that avoids it, or choose "
                "sizes the axis divides") if shapes else \
            ("an all-to-all moves a value from one split dim to another, the price of computing the op split "
             "another way (expert parallelism's token exchange is one such): check that it is what you meant")
        self.notes.append(Diagnostic(
            "N002", f"{count} value(s) are exchanged by all-to-all because an op could not take them as split "
            f"({format_bytes(forward)} forward, as much backward): the first is `{value}`, "
            f"{step.source.placements[step.axis]}@{axis}, which {what} needs as "
            f"{step.target.placements[step.axis]}@{axis}{shapes}", self.bound.par.mesh.span, (hint,),
            severity="note"))

    def _counts_batches(self, fx_node: torch.fx.Node) -> bool:
        """Whether the op updates a batch norm's `num_batches_tracked` buffer in place."""
        target = fx_node.args[0] if fx_node.args else None
        return (isinstance(target, torch.fx.Node) and target.name in self.bound.buffers
                and self.bound.buffers[target.name].rsplit(".", 1)[-1] == "num_batches_tracked")

    def _training_only(self) -> list[str]:
        """What the forward was traced doing in training mode that its eval mode may not do: random draws
        outside dropout, and writes into parameters through `.data` (Gemma 3n's clamp, made only in training)."""
        return [f"`{op_name(self._fx[name])}` in {self.bound.module_paths.get(name) or 'the forward'}"
                for name in self.typed.nodes if is_drawn_whole(self._fx[name])] + \
            [f"`{write.method}` through `.data` in {write.where}" for write in self.bound.parameter_writes]

    def _note_computed_whole(self) -> None:
        """N005: operators pardsl has no rule for, computed whole on every rank (oprules.WHOLE)."""
        places: dict[str, list[str]] = {}
        lines: list[str] = []
        for name in self.typed.nodes:
            node = self._fx[name]
            if rule_for(node) is WHOLE:
                places.setdefault(op_name(node), []).append(
                    self.bound.module_paths.get(name) or "the model's own forward()")
                lines.append(source_line(node))
        if not places:
            return
        by_place: dict[str, list[str]] = {}  # the ops used in the same modules, listed together
        for op, where in places.items():
            by_place.setdefault(", ".join(sorted(set(where))[:3]), []).append(f"`{op}`")
        ops = "; ".join(f"{', '.join(names)} in {where}" for where, names in by_place.items())
        hints = ["correct for any operator whose result depends only on its operands; where one reads a split "
                 "value, that costs a gather (and the rank's whole copy) which a rule in pardsl/layouts/oprules.py would "
                 "avoid"]
        if self._training_only():
            hints.append("a random one draws serial's values on every rank from the same generator state (seed "
                         "every rank alike); traced in training mode, the module raises in eval mode")
        self.notes.append(Diagnostic(
            "N005", f"{len(places)} operator(s) without a rule are computed whole on every rank, each tensor "
            f"they read made whole first (B): {ops}", self.bound.par.model.span, (*called_at(*lines), *hints),
            severity="note"))

    def _rescale_mean(self, typed_node, fx_node, name: str) -> None:
        operand_layout = typed_node.operand_layouts[0]
        info = self.typed.info(typed_node.operands[0])
        rank = len(info.shape)
        dims = fx_node.args[1] if len(fx_node.args) > 1 and fx_node.args[1] else list(range(rank))
        factor = math.prod(operand_layout.split_factor(d % rank, self.mesh) for d in dims)
        if factor > 1:
            self.emit(name, Instruction("compute", "aten.div.Tensor", (Var(name), Text(str(factor)))),
                      f"a mean over dims split {factor} ways: each rank's share, summed over ranks, is the mean",
                      layouts=(typed_node.op_layout,))

    def lower(self) -> LoweredProgram:
        self.emit_program()
        self._note_exchanges()
        self._note_computed_whole()
        return self.finish(self.statements, self.parameters, self.buffers, self.inputs, self.outputs)

    def emit_program(self) -> None:
        """Every statement, with the buckets and gather groups they will use left as Slots."""
        bound, typed, mesh = self.bound, self.typed, self.mesh
        self._fx = {n.name: n for n in bound.graph.nodes}
        taken: set[str] = set()
        parameters, buffers, inputs = [], [], []
        # a parameter is generated trainable as serial's is, whether or not a gradient reaches it in this graph
        trained = set(bound.trained_parameters)
        for placeholder in (n.name for n in bound.graph.nodes if n.op == "placeholder"):
            info = typed.info(placeholder)
            layout = typed.placeholder_layouts[placeholder]
            local = layout.local_shape(info.shape, mesh)
            if placeholder in bound.inputs:
                name = bound.inputs[placeholder]
                self.var[placeholder] = name
                inputs.append(TensorSlot(name, name, "input", info.shape, local, str(info.dtype), layout))
            elif placeholder in bound.parameters or placeholder in bound.buffers:
                is_param = placeholder in bound.parameters
                name = bound.parameters[placeholder] if is_param else bound.buffers[placeholder]
                attr = _attr_name(name, taken)
                self.var[placeholder] = f"self.{attr}"
                slot = TensorSlot(name, attr, "parameter" if is_param else "buffer", info.shape, local,
                                  str(info.dtype), layout, placeholder in trained)
                (parameters if is_param else buffers).append(slot)
            else:
                continue  # the unused name of a tied weight: the graph reads the other one
            self.emitted.add(self.var[placeholder])
        for name, node in self.typed.nodes.items():
            pinned_elsewhere = node.value_layout != node.op_layout
            self.var[name] = f"{name}__{_tag(node.value_layout)}" if pinned_elsewhere else name
        self.plan_uses()
        self.plan_fused_linears()
        self._emit_sizes(inputs)
        for name in self.typed.nodes:
            self.lower_node(name)
        self.current_node = ""
        outputs = []
        for (path, node_name), layout in zip(bound.outputs, typed.output_layouts):
            info = typed.info(node_name)
            var = self._ensure(node_name, layout, f"`{path}` is {named_layout(layout, mesh)}")
            outputs.append(OutputSlot(path, var, info.shape, layout.local_shape(info.shape, mesh), layout))
        self.parameters, self.buffers, self.inputs, self.outputs = parameters, buffers, inputs, outputs

    def values(self) -> dict[str, dict]:
        """Every graph tensor: its layout, global and local shape (for plan.json). Made once, after the
        program is emitted: a pipeline's stages are finished from the same lowering, and making it again
        per stage took a seventh of a 32-stage compile. Each program gets its own dict of them."""
        if self._values is None:
            self._values = self._made_values()
        return dict(self._values)

    def _made_values(self) -> dict[str, dict]:
        values = {}
        for name, info in self.bound.tensors.items():
            layout = self.typed.layout_of(name)
            activation = name in self.typed.nodes
            values[name] = {
                "kind": "activation" if activation else "placeholder",
                "layout": named_layout(layout, self.mesh),
                "shape": list(info.shape),
                "local_shape": list(layout.local_shape(info.shape, self.mesh)),
                "dtype": str(info.dtype).removeprefix("torch."),
            }
            if activation:  # held at its own layout wherever autograd keeps it (_copies_held_for_backward)
                values[name]["kept_for_backward"] = name in self.bound.kept_for_backward
                if layer := repeated_layer(self.bound.module_paths.get(name)):  # when backward frees it
                    values[name]["layer"] = layer
        for (name, layout), var in self._copies_held_for_backward().items():
            info = self.bound.tensors[name]
            values[var] = {
                "kind": "copy", "of": name, "parameter": name in self.bound.parameters,
                "layout": named_layout(layout, self.mesh),
                "shape": list(info.shape),
                "local_shape": list(layout.local_shape(info.shape, self.mesh)),
                "dtype": str(info.dtype).removeprefix("torch."),
            }
            if layer := repeated_layer(self.bound.module_paths.get(name)):
                values[var]["layer"] = layer
        return values

    def _copies_held_for_backward(self) -> dict[tuple[str, Layout], str]:
        """Besides each value autograd keeps, at its own layout, a rank holds the converted copy an op keeps
        where it reads a value converted (a linear reading the all-gather of a sequence-split activation
        keeps the whole copy); a parameter's copies likewise (a weight gathered over two axes, or moved to
        another split), except those gathered in a prefetched group, which memory counts a group at a time
        (reshard.py). The value itself is counted even where every op that keeps it reads it converted (the
        split value is then freed once converted): a little more than torch holds, in the integer
        program's own columns (search.py)."""
        kept = self.bound.kept
        copies = {}
        for name, node in self.typed.nodes.items():
            for operand, needed in zip(node.operands, node.operand_layouts):
                if (name, operand) not in kept.reads or needed == self.typed.layout_of(operand):
                    continue
                var = self._conversion_target(operand, needed)
                if not self._gathered_in_group(operand, var):
                    copies[operand, needed] = var
        return copies

    def finish(self, statements: list[Statement], parameters: list[TensorSlot], buffers: list[TensorSlot],
               inputs: list[TensorSlot], outputs: list[OutputSlot], part: bool = False) -> LoweredProgram:
        """A program of `statements`: the buckets and gather groups of the gradients and gathers they use,
        numbered from 0, filled in. A `part` of the program (a pipeline stage) lists the values its own
        statements compute, so its memory is its own."""
        used: dict[str, set[int]] = {"sync": set(), "gather": set()}

        def collect(slot: Slot) -> Slot:
            used[slot.kind].add(slot.index)
            return slot

        for statement in statements:
            statement.instruction.replace_slots(collect)
        buckets, in_bucket = self._buckets(sorted(used["sync"]))
        groups, in_group = self._gather_groups(sorted(used["gather"]))
        held: dict[int, list[str]] = {}
        for statement in statements:
            for arg in statement.instruction.args:
                if isinstance(arg, Slot) and arg.kind == "gather":
                    held.setdefault(in_group[arg.index][0], []).extend(statement.targets)
        groups = [dataclasses.replace(g, vars=tuple(held.get(number, ()))) for number, g in enumerate(groups)]
        values = self.values()
        if part:
            computed = {s.node for s in statements} | {t for s in statements for t in s.targets}
            values = {name: v for name, v in values.items() if v["kind"] == "placeholder" or name in computed}
        held = {slot.name: slot.var for slot in parameters}
        writes = [(f"self.{held[w.parameter]}", f"{w.method}("
                   + ", ".join([_render(a) for a in w.args] + [f"{k}={_render(v)}" for k, v in w.kwargs]) + ")",
                   f"{w.where}: {w.line or w.parameter + '.data.' + w.method}")
                  for w in self.bound.parameter_writes if w.parameter in held]
        return LoweredProgram(self.mesh, self.bound.par.source.path, self.bound.par.model.text, parameters, buffers,
                              inputs, self._fill_placeholders(statements, in_bucket, in_group), outputs,
                              values, self.notes, groups, buckets, self._training_only(), parameter_writes=writes)


def lower_in_stages(typed: TypedGraph, bucket_mb: float, split) -> tuple[LoweredProgram, list[LoweredProgram]]:
    """The whole program, and the programs a pass cuts it into: `split(statements, parameters, buffers,
    inputs, outputs)` returns, per part, those five for the part; each part gets its own buckets and gather
    groups (pipeline stages, pardsl/passes/pipeline.py)."""
    lowerer = _Lowerer(typed, bucket_mb)
    lowerer.emit_program()
    lowerer._note_exchanges()
    whole = lowerer.finish(lowerer.statements, lowerer.parameters, lowerer.buffers, lowerer.inputs, lowerer.outputs)
    parts = split(lowerer.statements, lowerer.parameters, lowerer.buffers, lowerer.inputs, lowerer.outputs)
    return whole, [lowerer.finish(*part, part=True) for part in parts]


def _node_arg(value, tensor_nodes, scalars) -> Arg:
    """An fx argument as the program's: an operand the next of `tensor_nodes` (its converted value), a size
    its global. A module function, not a closure: a recursive closure is a reference cycle per op lowered."""
    if isinstance(value, torch.fx.Node) and value.name in scalars:
        return Var(value.name)  # a size, global, computed at the top of forward()
    if isinstance(value, torch.fx.Node):
        return Var(next(tensor_nodes))
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.fx.Node) for v in value):
        return Items(tuple(_node_arg(v, tensor_nodes, scalars) for v in value))
    return Text(_render(value))


def lower(typed: TypedGraph, bucket_mb: float = DEFAULT_BUCKET_MB) -> LoweredProgram:
    """`bucket_mb`: the size of the buckets parameter gradients are synchronised in (DDP's 25 MiB)."""
    return _Lowerer(typed, bucket_mb).lower()
