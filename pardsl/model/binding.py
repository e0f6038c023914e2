"""Stage 2: syntax tree → bound plan. The model built (loading.py) and traced (export.py), its graph
rewritten, and every name the file writes bound to a tensor of the graph.

Names: parameters and buffers by state-dict name, inputs by forward() argument name,
`output` / `output.logits` / `output[0]` for the output or a part of it, `blocks.3.attn()` for a
submodule's output; `*` matches one name segment. Each layout written in the file is checked against
the tensor it names (rank, divisibility, no P on parameters and inputs) and bound to a graph node.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import re
import time
from dataclasses import dataclass, field, replace

import torch
from torch.utils import _pytree as pytree

from pardsl.language.diagnostics import MAX_PER_CODE, DiagnosticSink, Span
from pardsl.language.progress import modules_reported, report
from pardsl.language.syntax import LayoutEntry, LayoutSyntax, ParFile
from pardsl.layouts.algebra import B, Layout, Mesh, Placement, S
from pardsl.layouts.oprules import carries_gradient, concrete_size, op_name, rule_for
from pardsl.model.export import (called_at, constant_values, data_dependent_failure, python_random_seeded, source_line,
                                 trace)
from pardsl.model.grouped_query import fold_grouped_query_repeats, regroup_key_value_heads
from pardsl.model.in_place import (PARAMETER_WRITES, functionalize_in_place, parameter_written_before_read,
                                   written_through_data)
from pardsl.model.loading import DTYPES, build_model, import_paths, par_import_paths, parameters_on_meta
from pardsl.model.saved_for_backward import what_autograd_keeps
from pardsl.runtime.experts import ACTIVATIONS


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]  # sizes; where a dim varies (named in the .par), its example size
    dtype: torch.dtype
    # per dim, where it varies: a Python expression of the named dims giving its global size (`seq`,
    # `batch*seq`); None where it is fixed
    symbolic: tuple[str | None, ...] | None = None

    def size_expr(self, dim: int) -> str | None:
        return self.symbolic[dim] if self.symbolic else None

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def is_differentiable(self) -> bool:
        return carries_gradient(self.dtype)


@dataclass(frozen=True)
class Pin:
    """A layout the user wrote, bound to a tensor; it always stands: inference completes around it."""

    layout: Layout
    entry: LayoutEntry


@dataclass(frozen=True)
class ParameterWrite:
    """A write the forward makes into a parameter through `.data` (`w.data.clamp_(-c, c)`), taken out of the
    graph: the compiled forward makes it on each rank's part of the parameter before anything reads it."""

    parameter: str  # state-dict name
    method: str  # the tensor's in-place method: clamp_
    args: tuple  # its operands after the parameter: constants
    kwargs: tuple  # (name, constant) pairs
    where: str  # the module that makes it
    line: str | None  # `file:line: code` in the model's source


@dataclass
class BoundPlan:
    par: ParFile
    mesh: Mesh
    exported: torch.export.ExportedProgram
    tensors: dict[str, TensorInfo]  # graph node name → global shape and dtype
    parameters: dict[str, str]  # placeholder → state-dict name
    buffers: dict[str, str]  # placeholder → state-dict name (buffers and lifted constants)
    inputs: dict[str, str]  # placeholder → forward() argument name
    outputs: list[tuple[str, str]]  # flat outputs: (path such as "output[0]", graph node name)
    pins: dict[str, Pin]  # graph node name → user layout (params, buffers, inputs, submodule outputs)
    output_pins: dict[int, Pin]  # flat output index → user layout
    module_paths: dict[str, str] = field(default_factory=dict)  # node name → module path it came from
    seconds: dict[str, float] = field(default_factory=dict)  # model build, export, name binding
    # The real values of buffers and lifted constants (non-persistent ones, such as rotary tables, are in
    # no checkpoint), by every name; parameters were built on the meta device and have none.
    buffer_values: dict[str, torch.Tensor] = field(default_factory=dict)
    persistent_buffers: frozenset[str] = frozenset()
    tied: dict[str, tuple[str, ...]] = field(default_factory=dict)  # parameter name → every name it has
    signature: inspect.Signature | None = None  # the model's forward()
    # named dims: the variable the generated code holds each one's global size in, and the first input
    # dim it is read from (input name, dim)
    dims: dict[str, tuple[str, str, int]] = field(default_factory=dict)
    scalars: dict[str, str] = field(default_factory=dict)  # graph node → expression, for sizes (sym_size)
    searched: frozenset[str] = frozenset()  # graph nodes written `?`: their layouts are the search's to choose
    # parameters the model freezes (`requires_grad_(False)`: Whisper's sinusoidal positions, a fine-tune's
    # frozen layers), by every name: no gradient, no optimizer state, nothing to synchronise
    frozen: frozenset[str] = frozenset()
    names: tuple = ()  # what a layout's name may match (_Named), for binding the file on another mesh
    # key/value projections whose weights are repeated by heads (grouped_query.Regrouped, with the heads
    # and the ranks): a plan splits them over more ranks than there are heads
    regrouped: tuple = ()
    # what the stages after binding derive from the graph alone, kept for the next asker (inference.prepare);
    # a bound remade for another mesh or a recipe (dataclasses.replace) shares it with its graph
    derived: dict = field(default_factory=dict, repr=False, compare=False)
    parameter_writes: tuple[ParameterWrite, ...] = ()
    # attentions rewritten to read grouped-query key/value heads unrepeated (grouped_query.py)
    unrepeated_attentions: int = 0

    @property
    def trained_parameters(self) -> list[str]:
        """The parameter placeholders a gradient is computed for: not frozen, of a dtype that has one."""
        return [p for p, name in self.parameters.items()
                if name not in self.frozen and self.tensors[p].is_differentiable]

    @property
    def graph(self) -> torch.fx.Graph:
        return self.exported.graph_module.graph

    @property
    def constant_values(self) -> dict[str, torch.Tensor]:
        """The tensors the forward makes from Python data, lifted by export: in no state dict of the model."""
        names = (getattr(self.exported.graph_signature, "inputs_to_lifted_tensor_constants", None) or {}).values()
        return {name: self.buffer_values[name] for name in names if name in self.buffer_values}

    @functools.cached_property
    def flops(self) -> dict[str, int]:
        """FLOP per op node at global shapes (global_flops): counted once, read by every plan compile
        searches and rates."""
        return global_flops(self)

    @functools.cached_property
    def kept(self):
        """What autograd keeps from forward to backward (saved_for_backward.Kept): found once, read by the
        cost model and the search alike."""
        return what_autograd_keeps(self.graph, self.tensors.get, self.parameters)

    @functools.cached_property
    def kept_for_backward(self) -> frozenset[str]:
        """The op results autograd keeps from forward to backward, and the outputs: the serial model's
        activations (a plan may hold some of them converted, saved_for_backward.py)."""
        ops = {node.name for node in self.graph.nodes if node.op == "call_function"}
        return self.kept.values & ops

    @functools.cached_property
    def parameters_kept_for_backward(self) -> frozenset[str]:
        """The parameters (placeholders) some op keeps for backward, itself or through a view: a weight
        gathered for use and released after forward must be gathered again (reshard.py)."""
        return self.kept.values & set(self.parameters)


# ---------------------------------------------------------------------------------------------------
# FLOP per op


_COUNTED_FAMILIES = ("einsum", "matmul", "attention", "conv", "experts")  # op rule families that do the arithmetic


def global_flops(bound) -> dict[str, int]:
    """FLOP of each op node of the exported graph at its global shapes, for the rule families that do
    arithmetic worth counting (matmuls, convolutions, attention); torch's own counter, on meta tensors."""
    from torch.utils.flop_counter import FlopCounterMode

    counts: dict[str, int] = {}
    for node in bound.graph.nodes:
        rule = rule_for(node) if node.op == "call_function" else None
        if rule is None or rule.family not in _COUNTED_FAMILIES:
            continue

        def meta(value):
            if isinstance(value, torch.fx.Node):
                info = bound.tensors.get(value.name)
                if info is not None:
                    return torch.empty(info.shape, dtype=info.dtype, device="meta")
                example = value.meta.get("val")
                return int(example) if isinstance(example, (int, torch.SymInt)) else example
            return value

        try:
            args, kwargs = torch.utils._pytree.tree_map(meta, (node.args, node.kwargs))
            with FlopCounterMode(display=False) as counter:
                node.target(*args, **kwargs)
            counts[node.name] = int(counter.get_total_flops())
        except Exception:  # an op the counter cannot run on meta tensors: priced by its bytes alone
            continue
    return counts


def _check_inputs(par: ParFile, model: torch.nn.Module | None, sink: DiagnosticSink) -> bool:
    ok = True
    for decl in par.inputs:
        dtype = DTYPES.get(decl.dtype)
        if math.prod(decl.shape) * 8 >= 2 ** 63 or any(size >= 2 ** 62 for size in decl.shape):
            sink.error("E029", f"input `{decl.name}` of shape {list(decl.shape)} has more elements than a tensor "
                       "can hold", decl.span)
            ok = False
        if dtype is None:
            notes = [f"did you mean `{m}`?" for m in difflib.get_close_matches(decl.dtype, DTYPES, 1)]
            sink.error("E030", f"unknown dtype `{decl.dtype}`", decl.dtype_span, *notes)
            ok = False
        elif dtype.is_floating_point and decl.value_range is not None:
            sink.error("E031", f"input `{decl.name}` is {decl.dtype}: a value range is for integer inputs",
                       decl.range_span)
            ok = False
        elif not dtype.is_floating_point and dtype != torch.bool:
            if decl.value_range is None:
                sink.error("E032", f"integer input `{decl.name}` needs a value range",
                           decl.dtype_span, f"write `{decl.name} : {decl.dtype}[...] in [0, N)`")
                ok = False
            elif decl.value_range[0] >= decl.value_range[1]:
                sink.error("E033", f"value range [{decl.value_range[0]}, {decl.value_range[1]}) is empty",
                           decl.range_span)
                ok = False
            elif decl.value_range[0] < torch.iinfo(dtype).min or decl.value_range[1] - 1 > torch.iinfo(dtype).max:
                info = torch.iinfo(dtype)
                sink.error("E037", f"value range [{decl.value_range[0]}, {decl.value_range[1]}) does not fit "
                           f"{decl.dtype} ([{info.min}, {info.max}])", decl.range_span)
                ok = False
    if model is None:
        return False
    arguments = inspect.signature(model.forward).parameters
    names = [n for n, p in arguments.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    declared = {decl.name for decl in par.inputs}
    required = [n for n in names if n not in declared and arguments[n].default is inspect.Parameter.empty]
    # a forward that takes **kwargs passes them on (transformers' layers read their conditioning so): a name
    # outside its own arguments is taken there, and refused after the trace if nothing read it
    open_ended = any(p.kind == p.VAR_KEYWORD for p in arguments.values())
    misnamed = False
    for decl in par.inputs:
        # a name all but one of the forward's own (`input_id`) is a misspelling, not what **kwargs takes
        if decl.name not in names and (not open_ended or difflib.get_close_matches(decl.name, names, 1, 0.8)):
            misnamed = True
            close = difflib.get_close_matches(decl.name, required or names, 1)
            notes = [f"did you mean `{close[0]}`?"] if close else \
                [f"`{', '.join(required)}` {'is' if len(required) == 1 else 'are'} not declared"] if required else []
            sink.error("E034", f"`forward` has no argument `{decl.name}`", decl.span,
                       f"forward({', '.join(names)})", *notes)
            ok = False
    for name in names:
        if not misnamed and name in required:  # a misnamed input is reported once, above
            span = par.inputs[-1].span if par.inputs else par.model.span
            sink.error("E034", f"forward's argument `{name}` has no default and no `input` declaration",
                       span, f"forward({', '.join(names)})")
            ok = False
    return ok


def _erase_with_unread_aliases(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Take a write made before the forward out of the graph, with the `.data` aliases only it read."""
    written = node.args[0]
    graph.erase_node(node)
    while isinstance(written, torch.fx.Node) and written.op == "call_function" and not written.users:
        operand = written.args[0]
        graph.erase_node(written)
        written = operand


def _check_inputs_read(par: ParFile, model: torch.nn.Module, exported: torch.export.ExportedProgram,
                       sink: DiagnosticSink) -> None:
    """An input declared outside forward()'s own arguments went into its **kwargs: one nothing read there is
    a name the model does not know (a misspelt argument), not an input."""
    arguments = inspect.signature(model.forward).parameters
    read = {name for placeholder, name in _user_input_names(exported).items()
            if exported.graph.find_nodes(op="placeholder", target=placeholder)[0].users}
    names = [n for n, p in arguments.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    rest = next((name for name, p in arguments.items() if p.kind == p.VAR_KEYWORD), "kwargs")
    unread = [decl for decl in par.inputs if decl.name not in arguments and decl.name not in read]
    for decl in unread:
        close = difflib.get_close_matches(decl.name, names, 1)
        sink.error("E034", f"`forward` has no argument `{decl.name}`, and nothing reads it from **{rest}",
                   decl.span, f"forward({', '.join(names)}, **{rest})",
                   *([f"did you mean `{close[0]}`?"] if close else []))
    if unread:
        sink.raise_if_any()


# ---------------------------------------------------------------------------------------------------
# Layouts as written → Layout


def layout_from_syntax(syntax: LayoutSyntax, mesh: Mesh, sink: DiagnosticSink) -> Layout | None:
    bad_blocks = [p for p in syntax.placements if p.kind == "S" and (p.blocks < 1 or p.sizes and min(p.sizes) < 1)]
    for p in bad_blocks:
        written = f"[{', '.join(map(str, p.sizes))}]" if p.sizes else p.blocks
        sink.error("E057", f"S({p.dim}, blocks={written}): blocks must be at least 1"
                   + (", and each block's size" if p.sizes else ""), p.span)
    if bad_blocks:
        return None

    def placement(p) -> Placement:
        if p.kind != "S":
            return Placement(p.kind)
        return S(p.dim, p.sizes) if p.sizes else Placement("S", p.dim, max(1, p.blocks), p.zigzag)

    if syntax.form == "searched":
        return None  # no layout: binding records the name as searched

    if syntax.form == "bare":
        if mesh.ndim != 1:
            sink.error("E050", f"a layout on the {mesh.ndim}-axis mesh ({mesh}) needs one value per axis",
                       syntax.span, "write `[S(0), B]` or `S(0) @ axis`")
            return None
        return Layout((placement(syntax.placements[0]),))
    if syntax.form == "list":
        if len(syntax.placements) != mesh.ndim:
            sink.error("E050", f"{len(syntax.placements)} value(s) for a {mesh.ndim}-axis mesh ({mesh})",
                       syntax.span)
            return None
        return Layout(tuple(placement(p) for p in syntax.placements))
    placements = [B] * mesh.ndim
    seen: dict[str, Span] = {}
    ok = True
    for p, (axis, axis_span) in zip(syntax.placements, syntax.axis_names):
        if axis not in mesh.axis_names:
            sink.error("E051", f"unknown mesh axis `{axis}`", axis_span, f"the mesh has {mesh}")
            ok = False
        elif axis in seen:
            sink.error("E052", f"mesh axis `{axis}` named twice in one layout", axis_span,
                       f"first named at column {seen[axis].column}")
            ok = False
        else:
            seen[axis] = axis_span
            placements[mesh.axis_index(axis)] = placement(p)
    return Layout(tuple(placements)) if ok else None


def check_layout_fits(layout: Layout, entry: LayoutEntry, name: str, info: TensorInfo, mesh: Mesh,
                      sink: DiagnosticSink) -> Layout | None:
    """Normalise negative split dims, then check range and divisibility against the tensor."""
    rank = len(info.shape)
    normalized = []
    placement_spans = _placement_spans(entry.layout, mesh)
    ok = True
    for axis, p in enumerate(layout.placements):
        if p.is_split:
            dim = p.dim + rank if p.dim < 0 else p.dim
            if not 0 <= dim < rank:
                sink.error("E053", f"S({p.dim}) is out of range for `{name}` of rank {rank} "
                           f"(shape {list(info.shape)})", placement_spans[axis])
                ok = False
                normalized.append(p)
                continue
            normalized.append(replace(p, dim=dim))
        else:
            normalized.append(p)
    if not ok:
        return None
    result = Layout(tuple(normalized))
    for dim in result.blocks_on_shared_dims():
        axes = result.axes_splitting(dim)
        sink.error("E056", f"dim {dim} of `{name}` is split in blocks by {len(axes)} mesh axes",
                   placement_spans[axes[-1]], "a dim split in blocks is split by one mesh axis")
        return None
    for dim in result.indivisible_dims(info.shape, mesh):
        axes = result.axes_splitting(dim)
        by = " × ".join(f"{mesh.axis_names[a]} = {mesh.axis_sizes[a]}" for a in axes)
        blocks, units = result.block_spec_of(dim), result.units_of(dim)
        if isinstance(blocks, tuple):
            by += f" × {units} (blocks sized {list(blocks)})"
        elif blocks > 1:
            by += f" × {blocks} blocks"
        sink.error("E054", f"dim {dim} of `{name}` has size {info.shape[dim]}, not divisible by {by}",
                   placement_spans[axes[-1]], f"shape {list(info.shape)}",
                   *_divisible_notes(info.shape[dim], [mesh.axis_sizes[a] for a in axes], units,
                                     mesh.axis_names[axes[-1]] if len(axes) == 1 else None))
        ok = False
    return result if ok else None


def _divisible_notes(size: int, axis_sizes: list[int], blocks: int, axis: str | None) -> list[str]:
    """The sizes nearest `size` that the axes (and blocks) would divide, and, for a dim split by one axis,
    the sizes of that axis that would divide `size`."""
    by = math.prod(axis_sizes) * blocks
    below, above = size - size % by, size - size % by + by
    nearest = f"{below} or {above}" if below > 0 else f"{above}"
    notes = [f"{size} is not divisible by {by}; {nearest} would be"]
    if axis is not None:
        # axis sizes near the one written, as many ranks or fewer than a few times it
        fitting = [d for d in range(2, 2 * axis_sizes[0] + 3) if size % (d * blocks) == 0]
        fitting = sorted(sorted(fitting, key=lambda d: abs(d - axis_sizes[0]))[:4])
        if fitting:
            listed = ", ".join(map(str, fitting[:-1])) + (" or " if len(fitting) > 1 else "") + str(fitting[-1])
            notes.append(f"{axis} = {listed} would divide {size}" + (f" in {blocks} blocks" if blocks > 1 else ""))
    return notes


def _placement_spans(syntax: LayoutSyntax, mesh: Mesh) -> list[Span]:
    """The span of the value written for each mesh axis (the whole layout where it was left implicit)."""
    if syntax.form == "bare":
        return [syntax.placements[0].span]
    if syntax.form == "list":
        return [p.span for p in syntax.placements]
    spans = [syntax.span] * mesh.ndim
    for p, (axis, _) in zip(syntax.placements, syntax.axis_names):
        if axis in mesh.axis_names:
            spans[mesh.axis_index(axis)] = p.span
    return spans


# ---------------------------------------------------------------------------------------------------
# Names


@dataclass(frozen=True)
class _Named:
    kind: str  # parameter, buffer, input, output, module output
    name: str  # as the user writes it
    node: str | None  # graph node it denotes (None: not a single tensor)
    output_index: int | None = None
    problem: str | None = None  # why it does not denote one tensor


def _output_path(path) -> str:
    text = "output"
    for key in path:
        if isinstance(key, pytree.SequenceKey):
            text += f"[{key.idx}]"
        elif isinstance(key, pytree.MappingKey):
            text += f".{key.key}" if isinstance(key.key, str) and key.key.isidentifier() else f"[{key.key!r}]"
        elif isinstance(key, pytree.GetAttrKey):
            text += f".{key.name}"
        else:
            text += f"[{key}]"
    return text


def _flat_outputs(exported: torch.export.ExportedProgram) -> list[tuple[str, str | None]]:
    """(path, graph node) per flat output, in the order the graph returns them."""
    spec = exported.call_spec.out_spec
    leaves = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(spec.num_leaves)), spec))[0]
    output_node = next(n for n in exported.graph.nodes if n.op == "output")
    flat_nodes = output_node.args[0]
    result = []
    for path, index in leaves:
        node = flat_nodes[index]
        result.append((_output_path(path), node.name if isinstance(node, torch.fx.Node) else None))
    return result


def _module_outputs(exported: torch.export.ExportedProgram) -> dict[str, list[list[str]]]:
    """Module path → its calls, each the list of nodes computed inside the call and used outside it."""
    calls: dict[str, dict[str, list[torch.fx.Node]]] = {}
    call_of: dict[torch.fx.Node, set[str]] = {}
    for node in exported.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        keys = set()
        for key, (path, _) in stack.items():
            if path:
                calls.setdefault(path, {}).setdefault(key, []).append(node)
                keys.add(key)
        call_of[node] = keys
    result: dict[str, list[list[str]]] = {}
    for path, by_call in calls.items():
        result[path] = []
        for key, nodes in by_call.items():
            outside = [n for n in nodes if any(key not in call_of.get(u, set()) for u in n.users)]
            result[path].append([n.name for n in outside])
    return result


def _name_table(exported: torch.export.ExportedProgram, inputs: dict[str, str],
                parameters: dict[str, str], buffers: dict[str, str]) -> list[_Named]:
    table = [_Named("parameter", name, node) for node, name in parameters.items()]
    table += [_Named("buffer", name, node) for node, name in buffers.items()]
    table += [_Named("input", name, node) for node, name in inputs.items()]
    for index, (path, node) in enumerate(_flat_outputs(exported)):
        problem = None if node is not None else "is not a tensor"
        table.append(_Named("output", path, node, index, problem))
    for path, calls in _module_outputs(exported).items():
        if len(calls) != 1:
            table.append(_Named("module output", f"{path}()", None,
                                problem=f"is called {len(calls)} times; name one call's result by what "
                                "consumes it"))
        elif len(calls[0]) != 1:
            table.append(_Named("module output", f"{path}()", None,
                                problem=f"returns {len(calls[0])} tensors ({', '.join(calls[0][:4])})"))
        else:
            table.append(_Named("module output", f"{path}()", calls[0][0]))
    return table


@functools.lru_cache(maxsize=256)
def name_pattern(target: str) -> re.Pattern:
    """A layout target's names as a regex: `*` stands for one segment of a name (no `.`, brackets or calls)."""
    parts = re.split(r"(\*)", target)
    return re.compile("".join("[^.\\[\\]()]+" if p == "*" else re.escape(p) for p in parts))


class _NameIndex:
    """The name table, with literal names looked up in a dict: a file with many names stays linear."""

    def __init__(self, table: list[_Named]):
        self.table = table
        self.by_name: dict[str, list[_Named]] = {}
        for named in table:
            self.by_name.setdefault(named.name, []).append(named)
        self._sorted_names: list[str] | None = None

    def matching(self, target: str) -> list[_Named]:
        if "*" not in target:
            return list(self.by_name.get(target, ()))
        pattern = name_pattern(target)
        return [n for n in self.table if pattern.fullmatch(n.name)]

    def sorted_names(self) -> list[str]:
        if self._sorted_names is None:
            self._sorted_names = sorted(self.by_name)
        return self._sorted_names


def _close_names(target: str, index: _NameIndex) -> list[str]:
    """The names nearest an unknown one. A pattern is offered patterns: each name with the same number of
    parts, its parts where the target has a `*` written as the target has them, so that
    `layers.*.attn.q_prj.weight` is offered `layers.*.attn.q_proj.weight`, not one layer's name."""
    names = index.sorted_names()
    if "*" in target:
        parts = target.split(".")
        names = sorted({".".join(t if "*" in t else n for t, n in zip(parts, name.split(".")))
                        for name in names if name.count(".") == len(parts) - 1}) or names
    return difflib.get_close_matches(target, names, 3)


def _resolve(entry: LayoutEntry, index: _NameIndex, sink: DiagnosticSink) -> list[_Named]:
    target = entry.target
    table = index.table
    matches = index.matching(target)
    if target == "output" or (not matches and target.startswith("output")):
        # `output` and `output.x` name every flat output below them.
        matches = [n for n in table if n.kind == "output" and
                   (n.name == target or n.name.startswith(target + ".") or n.name.startswith(target + "["))]
    if not matches:
        # suggestions cost a search over every name: only for the errors that will be shown
        close = _close_names(target, index) if sink.count("E040") < MAX_PER_CODE else []
        notes = ["did you mean " + " or ".join(f"`{m}`" for m in close) + "?"] if close else []
        what = "matches no tensor" if "*" in target else "is not a parameter, buffer, input, output or submodule"
        sink.error("E040", f"`{target}` {what}", entry.target_span, *notes)
        return []
    if "*" not in target and len({n.kind for n in matches}) > 1:
        kinds = " and ".join(sorted({f"a {n.kind}" for n in matches}))
        sink.error("E041", f"`{target}` is ambiguous: it names {kinds}", entry.target_span)
        return []
    problems = [n for n in matches if n.problem]
    for named in problems:
        sink.error("E044", f"`{named.name}` {named.problem}", entry.target_span)
    return [n for n in matches if not n.problem]


# ---------------------------------------------------------------------------------------------------


def _tied_aliases(model: torch.nn.Module, exported, parameters: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Tied weights (a GPT's embedding and LM head): one tensor under several state-dict names. The graph
    reads one placeholder; the others are aliases of it. Returns unused placeholder → (its name, used one)."""
    groups: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    placeholder_of = {name: node for node, name in parameters.items()}
    users = {n.name: len(n.users) for n in exported.graph.nodes if n.op == "placeholder"}
    aliases = {}
    for names in groups.values():
        nodes = [placeholder_of[n] for n in names if n in placeholder_of]
        used = [n for n in nodes if users.get(n)]
        if len(nodes) > 1 and len(used) == 1:
            for node in nodes:
                if node != used[0]:
                    aliases[node] = (parameters[node], used[0])
    return aliases


def _check_mesh(par: ParFile, sink: DiagnosticSink) -> Mesh | None:
    if par.mesh.searched:  # the compiler binds each of its shapes (pardsl/compiler.py)
        raise ValueError("a searched mesh is bound one shape at a time")
    seen: dict[str, int] = {}
    ok = True
    for axis in par.mesh.axes:
        if axis.name in seen:
            sink.error("E010", f"mesh axis `{axis.name}` named twice", axis.span,
                       f"first named at column {seen[axis.name]}")
            ok = False
        seen.setdefault(axis.name, axis.span.column)
        if axis.size < 1:
            sink.error("E011", f"mesh axis `{axis.name}` has size {axis.size}", axis.span)
            ok = False
    if not ok:
        return None
    return Mesh(tuple(a.name for a in par.mesh.axes), tuple(a.size for a in par.mesh.axes))


# where a mixture of experts routes tokens with data-dependent shapes
MOE_HINT = ("experts written with transformers' experts interface are traced with static shapes: as one op "
            "(pardsl::experts) where their gate is one the op knows (act(gate) · up with act one of "
            f"{', '.join(ACTIVATIONS)}; GPT-OSS's clamped SwiGLU; an activation alone: GATES in "
            "pardsl/runtime/experts.py), as grouped matmuls (pardsl::grouped_mm) around their own gate otherwise; "
            "these are not (or transformers has already split them over its own expert-parallel ranks). For "
            "SiLU-gated experts, `pardsl.model.moe.use_static_capacity(config, groups)` is another form")


def _computed_as(dtype: torch.dtype, par: ParFile) -> torch.dtype:
    """A floating input's dtype as the file's precision computes it (the forward casts it on entry)."""
    return getattr(torch, par.precision.params) if par.precision is not None and dtype.is_floating_point else dtype


def _in_compute_dtype(model: torch.nn.Module, par: ParFile) -> torch.nn.Module:
    """The model as the file's precision computes it: floating parameters and buffers in its `params`
    dtype, as `model.to(dtype)` leaves them (the parameters' master copies stay float32 in the generated
    module: pardsl/passes/precision.py)."""
    return model.to(getattr(torch, par.precision.params)) if par.precision is not None else model


def _integer_input_meant_floating(par: ParFile, model: torch.nn.Module, example: dict[str, torch.Tensor]):
    """After a failed trace: the integer input that, given the dtype of the model's floating parameters
    instead, makes the trace succeed (an int64 `x` reaching a float32 `mean` or `linear`), with that
    dtype's name; None where there is none. Traced again to know: torch's own error names an op, not the
    input, and the same refusal comes from a model's real bugs."""
    floating = [p.dtype for p in model.parameters() if p.dtype.is_floating_point]
    integer = [decl for decl in par.inputs if _is_integer(DTYPES[decl.dtype])]
    if not floating or not integer:
        return None
    wanted = floating[0]
    for decl in integer:
        retyped = {**example, decl.name: torch.empty(decl.shape, dtype=_computed_as(wanted, par), device="meta")}
        try:
            with import_paths(*par_import_paths(par.source.path, par.model.module)):
                trace(_in_compute_dtype(model.to("meta"), par), retyped, _dynamic_shapes(par))
        except Exception:  # noqa: BLE001 - this input's dtype is not (alone) what the trace refused
            continue
        return decl, str(wanted).removeprefix("torch.")
    return None


def bind(par: ParFile, regroup_heads: bool = True) -> BoundPlan:
    """Build and trace the model, then bind every layout the file writes to a tensor of the graph."""
    sink = DiagnosticSink(par.source)
    clock = time.perf_counter()
    mesh = _check_mesh(par, sink)
    written = [(entry, layout_from_syntax(entry.layout, mesh, sink) if mesh else None) for entry in par.layouts]
    # No full model on any rank: the structure is built with parameters on the meta device, and traced
    # on meta with meta inputs; only buffers (small, and sometimes computed in __init__) hold values.
    report("building the model on the meta device")
    with parameters_on_meta():
        model = build_model(par.model, par.source.path, sink)
    seconds = {"build": time.perf_counter() - clock}
    if not _check_inputs(par, model, sink):
        sink.raise_if_any()
    # A bad mesh does not stop tracing: names are still checked, so one run reports more.

    # copies: moving the model to meta for tracing may move the buffers' own storage
    buffer_values = {name: b.detach().clone() for name, b in model.named_buffers(remove_duplicate=False)}
    persistent = frozenset(model.state_dict(keep_vars=True)) & frozenset(buffer_values)
    tied: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(parameter), []).append(name)
    frozen = frozenset(name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad)
    signature = inspect.signature(model.forward)
    example = {decl.name: torch.empty(decl.shape, dtype=_computed_as(DTYPES[decl.dtype], par), device="meta")
               for decl in par.inputs}
    clock = time.perf_counter()
    report("exporting the model (torch.export)")
    try:
        with import_paths(*par_import_paths(par.source.path, par.model.module)), \
                modules_reported("exporting the model (torch.export)", model):
            exported = trace(_in_compute_dtype(model.to("meta"), par), example, _dynamic_shapes(par))
    except Exception as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        stopped = data_dependent_failure(error, model)
        if stopped is not None:
            where, line = stopped
            sink.error("E061", "the forward uses a size that depends on the data (a branch or a loop on it)",
                       par.model.span, f"used in {where}", *called_at(line),
                       "pardsl lays out tensors of static shape: select with masks (where, masked_fill) instead",
                       *([MOE_HINT] if "expert" in where else []), f"torch: {type(error).__name__}: {message}")
            sink.raise_if_any()
        wrong = _integer_input_meant_floating(par, model, example)
        if wrong is not None:
            decl, wanted = wrong
            sink.error("E038", f"input `{decl.name}` is {decl.dtype} but the model computes in {wanted}",
                       decl.dtype_span, f"declare it `{decl.name} : {wanted}{list(decl.shape)}`",
                       f"traced as {decl.dtype}, torch refused: {type(error).__name__}: {message}")
            sink.raise_if_any()
        span = par.inputs[0].span if par.inputs else par.model.span
        shapes = ", ".join(f"{d.name}: {d.dtype}{list(d.shape)}" for d in par.inputs)
        sink.error("E035", f"`{par.model.text}` cannot be traced with inputs ({shapes})", span,
                   f"{type(error).__name__}: {message}")
        sink.raise_if_any()

    seconds["export"] = time.perf_counter() - clock
    _check_inputs_read(par, model, exported, sink)
    parameter_writes = []
    parameter_names = exported.graph_signature.inputs_to_parameters
    for node in functionalize_in_place(exported.graph_module):
        where = (list((node.meta.get("nn_module_stack") or {}).values())[-1:] or [("the model's own forward()",)])[0][0]
        through_data = written_through_data(node)
        parameter = parameter_written_before_read(node, set(parameter_names)) if through_data else None
        # one write a parameter: two in turn (a clamp, then abs_) need not give the same when made again
        if parameter is not None and parameter_names[parameter.name] not in {w.parameter for w in parameter_writes}:
            parameter_writes.append(ParameterWrite(
                parameter_names[parameter.name], PARAMETER_WRITES[node.target], tuple(node.args[1:]),
                tuple(node.kwargs.items()), where, source_line(node)))
            _erase_with_unread_aliases(exported.graph_module.graph, node)
            continue
        if through_data:
            sink.error("E062", f"in-place `{op_name(node)}` writes into a parameter or input through `.data`",
                       par.model.span, f"used in {where}", *called_at(source_line(node)),
                       "into a parameter, pardsl makes such a write before the forward on each rank's part, where "
                       "it is the parameter's one write, elementwise with constant operands (clamp_, fill_, zero_, "
                       "...), and the parameter is read after it and not before: otherwise use the value out of "
                       "place (`w.clamp(-c, c)` where it is read), or change the parameter in the training loop")
            continue
        sink.error("E062", f"in-place `{op_name(node)}` writes into a view, or into a tensor a view of which is read",
                   par.model.span, f"used in {where}", *called_at(source_line(node)),
                   "another tensor sharing its memory, taken before the write and read after it, or a graph input "
                   "would see the write: write the op out of place (`x = x + y`, `torch.cat` for parts)")
    if parameter_writes:
        exported.graph_module.recompile()
    regrouped = regroup_key_value_heads(exported.graph_module, _features_split_over(par, mesh, exported)) \
        if mesh is not None and regroup_heads and par.substitution("regroup_heads") != "off" else []
    unrepeated = 0
    if mesh is not None:
        # a searched mesh's shapes share this trace (bound_on_mesh): there any axis may split the heads
        unrepeated = fold_grouped_query_repeats(
            exported.graph_module, _ranks_that_may_split_heads(par, mesh) if regroup_heads else mesh.size)
    clock = time.perf_counter()
    graph_signature = exported.graph_signature
    parameters = dict(graph_signature.inputs_to_parameters)
    buffers = dict(graph_signature.inputs_to_buffers)
    buffers.update(getattr(graph_signature, "inputs_to_lifted_tensor_constants", {}) or {})
    aliases = _tied_aliases(model, exported, parameters)
    for unused in aliases:
        parameters.pop(unused, None)
    inputs = _user_input_names(exported)
    # tensors the forward makes from constants, lifted by export (non-persistent buffers are there too,
    # traced on meta: the values built above stand)
    constants = {k: v for k, v in exported.constants.items() if k not in buffer_values}
    if any(isinstance(v, torch.Tensor) for v in constants.values()):
        try:
            with import_paths(*par_import_paths(par.source.path, par.model.module)):
                # Traced on meta, a constant may have no value: it is taken from traces on fake CPU tensors.
                # Twice, NumPy's and Python's generators seeded apart: a value made from their random
                # numbers (Wav2Vec2's SpecAugment mask) differs between the traces, where a constant does not.
                traced = []
                for seed in (0, 1):
                    with python_random_seeded(seed):
                        traced.append(constant_values(model, example, _dynamic_shapes(par), constants))
        except Exception as error:  # noqa: BLE001 - reported with the model's line, as a failed trace is
            sink.error("E035", f"`{par.model.text}` cannot be traced for the values of its constants",
                       par.model.span, f"{type(error).__name__}: {str(error).strip().splitlines()[0]}")
            sink.raise_if_any()
        drawn = [name for name, value in traced[0].items()
                 if isinstance(value, torch.Tensor) and not torch.equal(value, traced[1][name])]
        if drawn:
            value = traced[0][drawn[0]]
            sink.error("E063", f"the forward makes `{drawn[0]}` ({str(value.dtype).removeprefix('torch.')}"
                       f"{list(value.shape)}) from values that change from call to call outside torch",
                       par.model.span, f"used in {drawn[0].rsplit('.', 1)[0] or 'the model'}",
                       "NumPy's or Python's random numbers (Wav2Vec2's SpecAugment masks) are fixed to one draw "
                       "when the forward is traced, where serial draws anew each call: turn them off in the "
                       "model (`mask_time_prob=0`), or draw them with torch, whose draws pardsl makes as serial")
            sink.raise_if_any()
        constants = traced[0]
    buffer_values.update(constants)

    tensors: dict[str, TensorInfo] = {}
    module_paths: dict[str, str] = {}
    data_dependent: dict[str, set[str]] = {}  # op → module paths, for the ops where such shapes arise
    dynamic_nodes: set[str] = set()
    dims, symbol_text = _named_dims(exported, inputs, par)
    scalars: dict[str, str] = {}
    for node in exported.graph.nodes:
        value = node.meta.get("val")
        stack = node.meta.get("nn_module_stack") or {}
        if stack:
            module_paths[node.name] = list(stack.values())[-1][0]
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
            value = value[0]  # a split's parts: its getitem nodes carry each part's own shape
        if isinstance(value, torch.SymInt) and node.op == "call_function":
            text = _size_text(value, symbol_text)
            if text is not None:
                scalars[node.name] = text
                continue
        if not isinstance(value, torch.Tensor):
            continue
        symbolic = tuple(_size_text(size, symbol_text) if isinstance(size, torch.SymInt) else None
                         for size in value.shape)
        if any(isinstance(size, torch.SymInt) and text is None for size, text in zip(value.shape, symbolic)):
            # x[mask], nonzero: sizes known only at run time, from the data
            dynamic_nodes.add(node.name)
            if not any(operand.name in dynamic_nodes for operand in node.all_input_nodes):
                where = module_paths.get(node.name) or "the model's own forward()"
                data_dependent.setdefault(op_name(node), {}).setdefault(where, source_line(node))
            continue
        tensors[node.name] = TensorInfo(tuple(concrete_size(s) for s in value.shape), value.dtype,
                                        symbolic if any(symbolic) else None)
    for op, places in data_dependent.items():
        sink.error("E061", f"operation `{op}` gives a result whose shape depends on the data", par.model.span,
                   f"used in {', '.join(sorted(places)[:3])}", *called_at(*places.values()),
                   "pardsl lays out tensors of static shape: select with masks (where, masked_fill) instead",
                   *([MOE_HINT] if any("expert" in place for place in places) else []))
    if data_dependent:
        sink.raise_if_any()

    _check_input_values(par, exported, inputs, sink)
    flat_outputs = _flat_outputs(exported)
    if not flat_outputs:
        sink.error("E036", f"`{par.model.text}`'s forward returns no tensor", par.model.span,
                   "pardsl compiles models whose outputs are tensors (or dicts, tuples, ModelOutputs of them)")
    for path, node in flat_outputs:
        if node is None:
            sink.error("E036", f"`{path}` of `{par.model.text}`'s result is not a tensor", par.model.span,
                       "pardsl compiles models whose outputs are tensors (or dicts, tuples, ModelOutputs of them)")
    if not flat_outputs or any(node is None for _, node in flat_outputs):
        sink.raise_if_any()  # names cannot be bound to an output that is not there

    table = _name_table(exported, inputs, parameters, buffers)
    table += [_Named("parameter", name, used) for name, used in aliases.values()]
    outputs = [(path, node) for path, node in _flat_outputs(exported)]
    pins, output_pins, searched = _bound_layouts(written, _NameIndex(table), tensors, mesh, sink)
    sink.raise_if_any()
    pins = _regrouped_pins(pins, regrouped, tensors, mesh, _data_axes(par, mesh)) if regrouped else pins
    seconds["bind"] = time.perf_counter() - clock
    return BoundPlan(par, mesh, exported, tensors, parameters, buffers, inputs, outputs, pins, output_pins,
                     module_paths, seconds, buffer_values, persistent,
                     {name: tuple(names) for names in tied.values() for name in names}, signature, dims, scalars,
                     frozenset(searched - set(pins)), frozen, tuple(table), tuple(regrouped),
                     parameter_writes=tuple(parameter_writes), unrepeated_attentions=unrepeated)


def _regrouped_pins(pins: dict[str, Pin], regrouped, tensors: dict[str, TensorInfo], mesh: Mesh,
                    data: frozenset[int]) -> dict[str, Pin]:
    """A regrouped key/value projection (grouped_query.py) is split by heads where the file splits its
    weight: the weight repeated by heads takes the written split, on the axes that split its output
    features and are not `data` axes (_data_axes), and the weight itself is held whole on those axes, each
    rank taking the head its query heads read. Its gradient comes back whole from the ranks that share a
    head. Where the repeated weight does not divide so (the same trace bound on another mesh shape), the
    pins stay as written: the graph computes the same either way."""
    pins = dict(pins)
    for projection in regrouped:
        for stored, repeated in ((projection.weight, projection.repeated_weight),
                                 (projection.bias, projection.repeated_bias)):
            pin = pins.get(stored)
            if pin is None:
                continue
            split = [p.is_split and p.dim == 0 and a not in data for a, p in enumerate(pin.layout.placements)]
            heads = Layout(tuple(p if s else B for s, p in zip(split, pin.layout.placements)))
            if not any(split) or not heads.fits(tensors[repeated].shape, mesh):
                continue
            pins[stored] = Pin(Layout(tuple(B if s else p for s, p in zip(split, pin.layout.placements))), pin.entry)
            pins[repeated] = Pin(heads, pin.entry)
    return pins


def _data_axes(par: ParFile, mesh: Mesh) -> frozenset[int]:
    """The mesh axes where a weight split is stored split and gathered for use (FSDP), not computed in
    parts, so that it regroups no heads: those the file splits an input on (the batch's, a sequence's), and
    those it splits nothing on by a tensor's dim 1 (a row-parallel weight, an activation's tokens), which a
    Megatron axis always does and an axis of ZeRO-3's `S(0)` weights alone never."""
    quiet = DiagnosticSink(par.source)
    inputs = {decl.name for decl in par.inputs}
    split_inputs, split_by_columns = set(), set()
    for entry in par.layouts:
        layout = layout_from_syntax(entry.layout, mesh, quiet)
        for axis, placement in enumerate(layout.placements if layout is not None else ()):
            if placement.is_split and entry.target in inputs:
                split_inputs.add(axis)
            elif placement.is_split and placement.dim == 1:
                split_by_columns.add(axis)
    return frozenset(split_inputs | (set(range(mesh.ndim)) - split_by_columns))


def _ranks_that_may_split_heads(par: ParFile, mesh: Mesh) -> int:
    """The most ranks a plan of the file may split attention heads over: the product of every axis but the
    pipeline's (which splits no tensor) and those the file splits an input on (the batch's, a sequence's:
    tokens there stay apart through the layers, and attention runs on a split sequence as a ring)."""
    quiet = DiagnosticSink(par.source)
    inputs = {decl.name for decl in par.inputs}
    not_heads = {mesh.axis_index(par.pipeline.axis)} if par.pipeline and par.pipeline.axis in mesh.axis_names else set()
    for entry in par.layouts:
        if entry.target in inputs and entry.layout.form != "searched":
            layout = layout_from_syntax(entry.layout, mesh, quiet)
            not_heads |= {axis for axis, placement in enumerate(layout.placements if layout else ())
                          if placement.is_split}
    return math.prod(size for axis, size in enumerate(mesh.axis_sizes) if axis not in not_heads)


def _features_split_over(par: ParFile, mesh: Mesh, exported):
    """Per parameter placeholder, over how many ranks the file computes its dim 0 (a linear's output
    features) in parts: the axes that split it and are not data axes (_data_axes), 1 where there are none.
    Read before the names are bound (grouped_query's regrouping needs it while the graph is still being
    shaped): the first entry naming the parameter with a layout stands, as when the names are bound, and a
    layout written wrong here is reported then."""
    names = exported.graph_signature.inputs_to_parameters
    quiet = DiagnosticSink(par.source)
    data = _data_axes(par, mesh)

    def split_over(placeholder: str) -> int:
        for entry in par.layouts:
            if entry.layout.form != "searched" and names.get(placeholder) and \
                    name_pattern(entry.target).fullmatch(names[placeholder]):
                layout = layout_from_syntax(entry.layout, mesh, quiet)
                if layout is None:
                    return 1
                return math.prod(mesh.axis_sizes[a] for a, p in enumerate(layout.placements)
                                 if p.is_split and p.dim == 0 and a not in data)
        return 1

    return split_over


def bound_on_mesh(bound: BoundPlan, par: ParFile) -> BoundPlan:
    """`bound`'s traced model with `par`'s layouts bound on `par`'s mesh: the same file with another mesh
    shape. A searched mesh's shapes are one trace (bound with `regroup_heads=False`, only their rank count,
    the same for all, reaches it); elsewhere bound_for says whether the trace serves."""
    sink = DiagnosticSink(par.source)
    mesh = _check_mesh(par, sink)
    written = [(entry, layout_from_syntax(entry.layout, mesh, sink) if mesh else None) for entry in par.layouts]
    pins, output_pins, searched = _bound_layouts(written, _NameIndex(list(bound.names)), bound.tensors, mesh, sink)
    sink.raise_if_any()
    if bound.regrouped:
        pins = _regrouped_pins(pins, bound.regrouped, bound.tensors, mesh, _data_axes(par, mesh))
    return replace(bound, par=par, mesh=mesh, pins=pins, output_pins=output_pins,
                   searched=frozenset(searched - set(pins)), seconds={"bind": 0.0})


def bound_for(bound: BoundPlan, par: ParFile) -> BoundPlan:
    """`par`, the same model and inputs as `bound`'s file on another mesh shape, bound on `bound`'s trace
    where that trace is the one binding `par` would make, else traced again: folding grouped-query repeats
    reads which axes may split heads, and regrouping key/value heads reads the axes' sizes."""
    mesh = _check_mesh(par, DiagnosticSink(par.source))
    if mesh is not None and bound.mesh is not None and not bound.regrouped and \
            _ranks_that_may_split_heads(par, mesh) == _ranks_that_may_split_heads(bound.par, bound.mesh):
        return bound_on_mesh(bound, par)
    return bind(par)


def _bound_layouts(written: list, index: "_NameIndex", tensors: dict[str, TensorInfo], mesh: Mesh | None,
                   sink: DiagnosticSink) -> tuple[dict[str, Pin], dict[int, Pin], set[str]]:
    """Each layout the file writes, bound to the tensors its name matches and checked on the mesh: the
    pins of graph nodes, of outputs, and the nodes written `?`."""
    pins: dict[str, Pin] = {}
    output_pins: dict[int, Pin] = {}
    searched: set[str] = set()
    for entry, layout in written:
        reported = len(sink.diagnostics)
        for named in _resolve(entry, index, sink):
            if entry.layout.form == "searched":
                if named.kind != "output":
                    searched.add(named.node)
                continue
            if layout is None or mesh is None:
                continue
            info = tensors.get(named.node)
            if info is None:
                sink.error("E044", f"`{named.name}` is not a tensor", entry.target_span)
                continue
            fitted = check_layout_fits(layout, entry, named.name, info, mesh, sink)
            if fitted is None:
                continue
            if fitted.has_partial and named.kind in ("parameter", "buffer", "input"):
                axis = next(a for a, p in enumerate(fitted.placements) if p.kind == "P")
                article = "an" if named.kind[0] in "aeiou" else "a"
                sink.error("E055", f"`{named.name}` is {article} {named.kind}: it cannot be a partial sum",
                           _placement_spans(entry.layout, mesh)[axis],
                           "a partial sum is the result of a computation; parameters and inputs are B or S(d)")
                continue
            if fitted.mirrored_dims() and named.kind in ("parameter", "buffer"):
                axis = next(a for a, p in enumerate(fitted.placements) if p.mirrored)
                sink.error("E058", f"`{named.name}` is a {named.kind}: a zig-zag split is for a sequence of "
                           f"activations", _placement_spans(entry.layout, mesh)[axis],
                           "split a parameter plainly (`S(d)`) or in blocks (`S(d, blocks=k)`)")
                continue
            pin = Pin(fitted, entry)
            store, key = (output_pins, named.output_index) if named.kind == "output" else (pins, named.node)
            previous = store.get(key)
            if previous is not None and previous.layout != fitted:
                sink.error("E043", f"`{named.name}` is given two layouts: {previous.layout.render(mesh)} and "
                           f"{fitted.render(mesh)}", entry.span,
                           f"first given on line {previous.entry.span.line}: `{previous.entry.target}`")
                continue
            store.setdefault(key, pin)
        sink.one_per_place_since(reported)
    return pins, output_pins, searched


# Ops whose operands must share one dtype when run (an integer input and a floating weight raise), though a
# trace on meta lets them through
_SAME_DTYPE_OPS = frozenset({
    torch.ops.aten.linear.default, torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
    torch.ops.aten.matmul.default, torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default,
    torch.ops.aten.conv1d.default, torch.ops.aten.conv2d.default, torch.ops.aten.conv3d.default,
    torch.ops.aten.convolution.default, torch.ops.aten.layer_norm.default, torch.ops.aten.group_norm.default,
})


def _is_integer(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and dtype != torch.bool


def _check_input_values(par: ParFile, exported, inputs: dict[str, str], sink: DiagnosticSink) -> None:
    """What the graph says of the inputs: ids an embedding reads directly must lie in its table, a
    floating input must have a dtype the model computes in, and an integer one must not meet a floating
    weight in an op that takes one dtype."""
    decls = {decl.name: decl for decl in par.inputs}
    parameters = set(exported.graph_signature.inputs_to_parameters)
    for node in exported.graph.nodes:
        if node.op == "placeholder" and node.name in inputs and _is_integer(DTYPES[decls[inputs[node.name]].dtype]):
            decl = decls[inputs[node.name]]
            # traced on meta, `linear(int64 x, float32 weight)` gives a float32 result; run, it raises
            met = {operand.meta["val"].dtype for user in node.users if user.target in _SAME_DTYPE_OPS
                   for operand in user.all_input_nodes
                   if operand.name in parameters and operand.meta["val"].dtype.is_floating_point}
            if met:
                wanted = str(sorted(met, key=str)[0]).removeprefix("torch.")
                sink.error("E038", f"input `{decl.name}` is {decl.dtype} but the model's parameters it meets are "
                           f"{wanted}", decl.dtype_span, f"declare it `{decl.name} : {wanted}{list(decl.shape)}`")
        if node.op == "placeholder" and node.name in inputs and DTYPES[decls[inputs[node.name]].dtype].is_floating_point:
            decl = decls[inputs[node.name]]
            # an op that takes the input and a parameter of another floating dtype (a model that casts its
            # input first is fine)
            met = {operand.meta["val"].dtype for user in node.users for operand in user.all_input_nodes
                   if operand.name in parameters and operand.meta["val"].dtype.is_floating_point}
            met.discard(_computed_as(DTYPES[decl.dtype], par))  # under a precision policy, cast on entry
            if met:
                wanted = str(sorted(met, key=str)[0]).removeprefix("torch.")
                sink.error("E038", f"input `{decl.name}` is {decl.dtype} but the model's parameters it meets are "
                           f"{wanted}", decl.dtype_span, f"declare it `{decl.name} : {wanted}[...]`")
        if node.op == "call_function" and node.target is torch.ops.aten.embedding.default:
            weight, ids = node.args[0], node.args[1]
            decl = decls.get(inputs.get(getattr(ids, "name", None)))
            rows = concrete_size(weight.meta["val"].shape[0])
            if decl is not None and decl.value_range and (decl.value_range[0] < 0 or decl.value_range[1] > rows):
                sink.error("E039", f"input `{decl.name}` takes values in [{decl.value_range[0]}, "
                           f"{decl.value_range[1]}), but the embedding it indexes has {rows} rows",
                           decl.range_span, f"write `in [0, {rows})` or less")


def _dynamic_shapes(par: ParFile) -> dict | None:
    """torch.export's dynamic_shapes for the dims the .par file names: one Dim per name."""
    dims: dict[str, torch.export.Dim] = {}
    spec = {decl.name: {index: dims.setdefault(name, torch.export.Dim(name))
                        for index, name in enumerate(decl.dim_names) if name}
            for decl in par.inputs}
    return {name: (dims_of or None) for name, dims_of in spec.items()} if dims else None


_RESERVED = {"self", "rt", "aten", "torch", "nn", "MESH", "PARAMETERS", "BUFFERS", "INPUTS", "OUTPUTS"}


def _named_dims(exported, inputs: dict[str, str], par: ParFile):
    """Named dims: name → (variable, input, dim); and each size symbol's text (its variable)."""
    taken = _RESERVED | {n.name for n in exported.graph.nodes} | set(inputs.values())
    placeholders = {n.name: n for n in exported.graph.nodes if n.op == "placeholder"}
    by_input = {name: placeholder for placeholder, name in inputs.items()}
    dims, symbol_text = {}, {}
    for decl in par.inputs:
        value = placeholders[by_input[decl.name]].meta["val"]
        for index, name in enumerate(decl.dim_names):
            if not name or name in dims:
                continue
            size = value.shape[index]
            var = name if name not in taken else f"dim_{name}"
            dims[name] = (var, decl.name, index)
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                symbol_text[size.node.expr] = var
    return dims, symbol_text


def _size_text(size: torch.SymInt, symbol_text: dict) -> str | None:
    """A size as Python over the named dims' variables; None where it involves anything else."""
    import sympy
    from torch.utils._sympy.printers import PythonPrinter

    expr = size.node.expr
    if expr.is_number:
        return str(int(expr))
    if not expr.free_symbols <= set(symbol_text):
        return None
    return PythonPrinter().doprint(expr.xreplace({s: sympy.Symbol(t, integer=True) for s, t in symbol_text.items()}))


def _user_input_names(exported: torch.export.ExportedProgram) -> dict[str, str]:
    """Placeholder → forward() argument name, for the tensor inputs export was given by name."""
    spec = exported.call_spec.in_spec
    leaves = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(spec.num_leaves)), spec))[0]
    by_index = {index: path[-1].key for path, index in leaves if isinstance(path[-1], pytree.MappingKey)}
    user = [s.arg.name for s in exported.graph_signature.input_specs
            if s.kind == torch.export.graph_signature.InputKind.USER_INPUT]
    flat_user = [i for i in range(spec.num_leaves) if i in by_index]
    return {placeholder: by_index[index] for placeholder, index in zip(user, flat_user)}
