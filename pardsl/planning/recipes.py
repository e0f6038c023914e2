"""The published recipes, written for the model at hand, as the search's candidates.

At real size the integer programs decide one mesh axis at a time within a time budget, and what they find
can lose to a plan any practitioner would write: Megatron's tensor parallelism inside a node, sequence
parallelism between its blocks, FSDP (ZeRO-3), HSDP (FSDP inside a node, data parallelism across) or
plain data parallelism across nodes. Those plans are
known, and cheap to write once the layers are recognised, so they compete with the search's plans
(descent.searched_or_greedy, and again as compiled: compiler._weighed_against_recipes), and the compile
never keeps a plan rated slower than one of them, nor one over the memory bound where one is within it.

A recipe here is a set of layouts (pins) added to those the file writes, which the greedy completion
(inference.infer) completes: the file's own layouts always stand, and a layout written on some mesh axes
only (`S(0) @ tp`) takes the recipe's placement on the others.

Megatron's layers are recognised from the graph alone, in each repeated block (`model.layers.3`): a
linear whose output reaches past its block (into the residual stream the next block reads) is a block's
last, row-parallel (its input features split, its output partial sums); a linear whose output reaches,
through no other linear, only such last linears is column-parallel (its output features split). A linear
before a column one (DeepSeek's low-rank query projection before its norm) stays whole. Outside the
blocks, a linear reading what they computed (the LM head) is column-parallel: its logits split over the
vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from pardsl.layouts.algebra import B, Layout, Placement, S, block_spec_units, is_blocked
from pardsl.layouts.oprules import call_arg, sliced_in_blocks
from pardsl.language.syntax import LayoutEntry, LayoutSyntax
from pardsl.model.binding import BoundPlan, Pin
from pardsl.planning.cost import Machine, repeated_layer
from pardsl.planning.inference import TypedGraph, infer
from pardsl.planning.search import weight_open_axes

aten = torch.ops.aten
# linear's weight is [out, in]; mm's and addmm's second operand is [in, out] (GPT-2's Conv1D)
_WEIGHT_OPERAND = {aten.linear.default: (1, 0), aten.mm.default: (1, 1), aten.addmm.default: (2, 1)}
_BIAS_OPERAND = {aten.linear.default: 2, aten.addmm.default: 0}


@dataclass(frozen=True)
class Recipe:
    """One known plan written for the model: its name as explain says it, and the layouts it adds."""

    name: str
    pins: dict[str, Pin]

    def bound(self, bound: BoundPlan) -> BoundPlan:
        """The file with the recipe's layouts added (the greedy completion's input)."""
        return replace(bound, pins={**bound.pins, **self.pins})


@dataclass(frozen=True)
class _Linear:
    node: str
    weight: str  # the parameter's placeholder
    out_dim: int  # the weight's dim of output features
    bias: str | None
    layer: str  # the repeated block it is in, else ""
    # a fused projection's parts (GPT-2's q, k and v), cut apart after it: S(d, blocks=k), or their sizes
    # where they differ (Phi-3's q, k and v under grouped-query attention)
    blocks: int | tuple[int, ...] = 1


def recipes(bound: BoundPlan, machine: Machine, kept: tuple[int, ...] = ()) -> list[Recipe]:
    """The recipes that fit the file's mesh: FSDP over every axis that is not `kept` (a pipeline's), HSDP,
    plain data parallelism over them, and for each axis whose ranks share a node and that the file does not
    split its inputs' tokens over, Megatron's tensor parallelism with sequence parallelism on it and FSDP,
    HSDP or data parallelism over the others; where the file splits the tokens over some axes (context
    parallelism), FSDP over the others beside them too."""
    mesh = bound.mesh
    axes = [a for a in range(mesh.ndim) if mesh.axis_sizes[a] > 1 and a not in kept]
    if not axes or not bound.trained_parameters:
        return []
    linears = _linears(bound)
    columns, rows = _megatron_layers(bound, linears)
    heads = _heads(bound, linears)
    context = _context_axes(bound, axes)
    found = []
    for sharded in _shardings(mesh, machine, axes, context):
        pins = _data_parallel(bound, axes, None, {}, sharded, context)
        if pins:
            found.append(Recipe(_data_name(mesh, axes, sharded, context), pins))
    for tp in axes:
        if not _inside_a_node(mesh, machine, tp) or tp in context:
            continue  # Megatron's collectives in every layer stay inside a node; a context axis splits tokens
        split = _tensor_parallel(bound, tp, columns, rows, heads)
        if not split:
            continue
        others = [a for a in axes if a != tp]
        for sharded in _shardings(mesh, machine, others, context) if others else ([],):
            pins = _data_parallel(bound, others, tp, split, sharded, context)
            # `substitute split_reductions : off`: Megatron's layers all-reduce their sums, as before SP
            # (nor where the file splits the tokens over another axis: the stream keeps the file's split)
            sequence = _sequence_parallel(bound, others, tp, rows) \
                if bound.par.substitution("split_reductions") != "off" and not context else {}
            pins.update(sequence)
            name = f"Megatron TP on {mesh.axis_names[tp]}" + (" with sequence parallelism" if sequence else "")
            if others:
                name += f", {_data_name(mesh, others, sharded, context)}"
            found.append(Recipe(name, pins))
    return found


def _inside_a_node(mesh, machine: Machine, axis: int) -> bool:
    return machine.span(mesh.axis_sizes[axis], mesh.axis_stride(axis))[1] == 1


def _shardings(mesh, machine: Machine, axes: list[int], context: list[int] = ()) -> list[list[int]]:
    """The data axes each data-parallel recipe shards the weights over: all of them (FSDP), none (data
    parallelism), where some axes stay inside a node and others cross nodes, those inside only (HSDP:
    the weights' all-gathers and reduce-scatters on the node's links, one all-reduce of gradients across),
    and where the file splits its inputs' sequence over some (`context`), the others only (Llama 3's long
    context: FSDP over the batch's ranks, the weights whole on each context-parallel rank, whose ring
    already crosses nodes; and in a pipeline, gathered for each micro-batch)."""
    inside = [a for a in axes if _inside_a_node(mesh, machine, a)]
    hybrid = [inside] if inside and len(inside) < len(axes) else []
    batch = [a for a in axes if a not in context]
    by_batch = [batch] if context and batch and batch not in (list(axes), *hybrid) else []
    return [list(axes), *hybrid, *by_batch, []]


def _context_axes(bound: BoundPlan, axes: list[int]) -> list[int]:
    """Of `axes`, those the file splits an input of tokens (integers: ids, labels) on along a dim other
    than the batch's: context parallelism, each rank a piece of every sequence."""
    found = set()
    for name in bound.inputs:
        pin = bound.pins.get(name)
        if pin is not None and not bound.tensors[name].dtype.is_floating_point:  # token ids, labels
            found |= {a for a, p in enumerate(pin.layout.placements) if a in axes and p.is_split and p.dim != 0}
    return sorted(found)


def _data_name(mesh, axes: list[int], sharded: list[int], context: list[int] = ()) -> str:
    """The recipe's name over the data axes; an axis in `context` (the file splits the sequence on it) is
    named as context parallelism where the weights are whole on it."""
    whole = [a for a in axes if a in context and a not in sharded]
    batch = [a for a in axes if a not in whole]
    if whole:
        return (f"{_data_name(mesh, batch, sharded)}, " if batch else "") + \
            f"context parallelism over {_names(mesh, whole)}"
    if not sharded:
        return f"data parallelism over {_names(mesh, axes)}"
    if len(sharded) == len(axes):
        return f"FSDP over {_names(mesh, axes)}"
    replicated = [a for a in axes if a not in sharded]
    return f"HSDP: FSDP over {_names(mesh, sharded)}, data parallelism over {_names(mesh, replicated)}"


def completed_recipes(bound: BoundPlan, machine: Machine, kept: tuple[int, ...], limit: int | None,
                      pipeline_ranks: int = 1) -> list[tuple[str, TypedGraph]]:
    """Each recipe completed by the greedy inference around its layouts, typed against the file as written,
    but those that cannot fit the bound (`cannot_fit`). A recipe is a candidate the compile can do without:
    one the graph's recognition or the model's ops cannot take, whatever goes wrong, is left out."""
    try:
        candidates = recipes(bound, machine, kept)
    except Exception:  # noqa: BLE001 - see above
        return []
    found = []
    for recipe in candidates:
        try:
            typed = infer(recipe.bound(bound))
        except Exception:  # noqa: BLE001 - see above
            continue
        typed.bound = bound
        if not cannot_fit(typed, limit, pipeline_ranks):
            found.append((recipe.name, typed))
    return found


def cannot_fit(typed, limit: int | None, pipeline_ranks: int = 1) -> bool:
    """Whether a plan's parameters alone, with their gradients and Adam's two moments (in the parameters'
    dtype, split as the plan has them, spread evenly over a pipeline's ranks), already hold more than
    `limit` a rank: less than any rank of it holds, so it need not be priced to be left out (data
    parallelism over a 405B model's ranks). Where states go to host memory (`offload`) nothing is said."""
    bound = typed.bound
    if limit is None or bound.par.offload is not None:
        return False
    mesh, trained = typed.mesh, set(bound.trained_parameters)
    held = sum(math.prod(typed.layout_of(name).local_shape(bound.tensors[name].shape, mesh)) *
               bound.tensors[name].itemsize * (4 if name in trained else 1) for name in bound.parameters)
    return held / pipeline_ranks > limit


def _names(mesh, axes) -> str:
    return " × ".join(mesh.axis_names[a] for a in axes)


def _linears(bound: BoundPlan) -> list[_Linear]:
    found = []
    for node in bound.graph.nodes:
        operands = _WEIGHT_OPERAND.get(node.target) if node.op == "call_function" else None
        if operands is None or len(node.args) <= operands[0]:
            continue
        weight = node.args[operands[0]]
        if getattr(weight, "name", None) not in bound.parameters or len(bound.tensors[weight.name].shape) != 2:
            continue
        bias_at = _BIAS_OPERAND.get(node.target)
        bias = node.args[bias_at] if bias_at is not None and len(node.args) > bias_at else None
        bias = bias.name if getattr(bias, "name", None) in bound.parameters else None
        found.append(_Linear(node.name, weight.name, operands[1], bias,
                             repeated_layer(bound.module_paths.get(node.name)), _parts(node)))
    return found


def fused_parameters(bound: BoundPlan) -> dict[str, tuple[int | tuple[int, ...], int]]:
    """Per state-dict path of a fused projection's weight or bias (GPT-2's q, k and v; Phi-3's q, k and v,
    or gate and up): (the parts its output features are cut into, the dim they lie on). Split in that many
    blocks there, each rank holds its share of every part and the cut takes none from another rank."""
    found = {}
    for linear in _linears(bound):
        if is_blocked(linear.blocks):
            found[bound.parameters[linear.weight]] = (linear.blocks, linear.out_dim)
            if linear.bias is not None:
                found[bound.parameters[linear.bias]] = (linear.blocks, 0)
    return found


_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _parts(node) -> int | tuple[int, ...]:
    """Into how many equal parts the output features of a linear are cut by what reads it (a fused q/k/v
    projection's split, chunk or slices, through its reshapes), or the sizes of unequal parts its slices
    take (Phi-3's q, k and v under grouped-query attention), else 1."""
    features = node.meta["val"].shape[-1] if "val" in node.meta else None
    last = len(node.meta["val"].shape) - 1 if "val" in node.meta else None
    if features is not None and (sliced := sliced_in_blocks(node, last)):
        return sliced  # Phi-3's q, k and v taken by slices
    for user in node.users:
        if user.op == "call_function" and user.target in _RESHAPES and "val" in user.meta and \
                user.meta["val"].shape[-1] == features:  # rows regrouped, the features as they were
            parts = _parts(user)
            if is_blocked(parts):
                return parts
            continue
        if user.op == "call_function" and user.target is aten.chunk.default and features is not None and \
                call_arg(user, 2, "dim", 0) in (-1, last) and call_arg(user, 1, "chunks") > 1 and \
                features % call_arg(user, 1, "chunks") == 0:
            return call_arg(user, 1, "chunks")  # gate and up of one projection: `.chunk(2, -1)`
        if user.op != "call_function" or user.target not in (aten.split.Tensor, aten.split_with_sizes.default):
            continue
        dim = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
        if features is None or dim not in (-1, len(node.meta["val"].shape) - 1):
            continue
        sizes = user.args[1]
        if isinstance(sizes, int) and features % sizes == 0:
            return features // sizes
        if isinstance(sizes, (list, tuple)) and len(set(sizes)) == 1 and len(sizes) > 1:
            return len(sizes)
    return 1


def _megatron_layers(bound: BoundPlan, linears: list[_Linear]) -> tuple[list[_Linear], list[_Linear]]:
    """Column- and row-parallel linears of the repeated blocks (the module's docstring)."""
    by_node = {linear.node: linear for linear in linears}
    nodes = {node.name: node for node in bound.graph.nodes}
    reaches: dict[str, set[str]] = {}  # the linears a linear's output reaches through no other one
    leaves: set[str] = set()  # linears whose output reaches past their block: what the block adds to the stream
    for linear in linears:
        if not linear.layer:
            continue
        reached, frontier, seen = set(), [nodes[linear.node]], {linear.node}
        while frontier:
            for user in frontier.pop().users:
                if user.name in seen:
                    continue
                seen.add(user.name)
                if user.op == "output" or repeated_layer(bound.module_paths.get(user.name)) != linear.layer:
                    leaves.add(linear.node)
                elif user.name in by_node and by_node[user.name].weight != linear.weight:
                    reached.add(user.name)
                else:
                    frontier.append(user)
        reaches[linear.node] = reached
    columns = {name for name, reached in reaches.items() if reached and reached <= leaves and name not in leaves}
    rows = leaves & set().union(*(reaches[name] for name in columns))
    return [by_node[n] for n in by_node if n in columns], [by_node[n] for n in by_node if n in rows]


def _heads(bound: BoundPlan, linears: list[_Linear]) -> list[_Linear]:
    """Linears outside the blocks that read what the blocks computed: the LM head, column-parallel."""
    nodes = {node.name: node for node in bound.graph.nodes}
    in_blocks = {node.name for node in bound.graph.nodes if repeated_layer(bound.module_paths.get(node.name))}
    if not in_blocks:
        return []
    after = set(in_blocks)
    for node in bound.graph.nodes:
        if any(getattr(a, "name", None) in after for a in node.all_input_nodes):
            after.add(node.name)
    tied = {name for names in bound.tied.values() if len(names) > 1 for name in names}
    return [linear for linear in linears if not linear.layer and linear.node in after and
            bound.parameters[linear.weight] not in tied and nodes[linear.node].users]


def _entry(bound: BoundPlan) -> LayoutEntry:
    """Where a recipe's layout points, in a note: the file's search request (the bound, else its mesh)."""
    par = bound.par
    span = par.memory_bound.span if par.memory_bound is not None else par.mesh.span
    return LayoutEntry("recipe", LayoutSyntax("list", (), (), span), span, span)


def _placed(bound: BoundPlan, name: str, wanted: dict[int, Placement]) -> Pin | None:
    """The pin of `name` with the recipe's placement on each axis of `wanted` the file leaves open (every
    axis where it writes nothing): None where the file writes it whole, or the tensor does not divide."""
    mesh = bound.mesh
    written = bound.pins.get(name)
    open_axes = weight_open_axes(bound, name) if written is not None else frozenset(range(mesh.ndim))
    if not open_axes:
        return None
    placements = list(written.layout.placements) if written is not None else [B] * mesh.ndim
    for axis, placement in wanted.items():
        if axis in open_axes:
            placements[axis] = placement
    layout = Layout(tuple(placements))
    if written is not None and layout == written.layout or not layout.fits(bound.tensors[name].shape, mesh):
        return None
    return Pin(layout, _entry(bound))


def _tensor_parallel(bound: BoundPlan, tp: int, columns, rows, heads) -> dict[str, dict[int, Placement]]:
    """Per parameter, its placement on `tp`: column-parallel weights split by output features (and their
    biases), row-parallel ones by input features; empty where the layers do not divide."""
    n = bound.mesh.axis_sizes[tp]
    split: dict[str, dict[int, Placement]] = {}
    for linear in (*columns, *heads):
        if bound.tensors[linear.weight].shape[linear.out_dim] % (n * block_spec_units(linear.blocks)) == 0:
            split[linear.weight] = {tp: S(linear.out_dim, linear.blocks)}
            if linear.bias is not None:
                split[linear.bias] = {tp: S(0, linear.blocks)}
    for linear in rows:
        in_dim = 1 - linear.out_dim
        if bound.tensors[linear.weight].shape[in_dim] % n == 0:
            split[linear.weight] = {tp: S(in_dim)}
    if not any(linear.weight in split for linear in rows):
        return {}
    return split


def _data_parallel(bound: BoundPlan, axes: list[int], tp: int | None, split: dict[str, dict[int, Placement]],
                   sharded: list[int], context: list[int] = ()) -> dict[str, Pin]:
    """The batch split over `axes` (but the `context` axes, which the file splits the tokens over), and
    each weight as `split` has it on `tp`; each weight of two or more dims also split over the `sharded`
    axes (FSDP, ZeRO-3), on a dim `tp` leaves whole, and whole on the others (data parallelism). A
    parameter of one dim (a norm's scale, a bias) is left to the completion."""
    mesh = bound.mesh
    pins: dict[str, Pin] = {}
    batch = [a for a in axes if a not in context]
    for name in bound.inputs:
        shape = bound.tensors[name].shape
        if batch and shape and shape[0] % math.prod(mesh.axis_sizes[a] for a in batch) == 0:
            pin = _placed(bound, name, {a: S(0) for a in batch})
            if pin is not None:
                pins[name] = pin
    for name in bound.trained_parameters:
        shape = bound.tensors[name].shape
        written = bound.pins.get(name)
        kept = [p for a, p in enumerate(written.layout.placements) if a not in weight_open_axes(bound, name)] \
            if written is not None else []
        wanted = {a: p for a, p in split.get(name, {}).items() if written is None or a in weight_open_axes(bound, name)}
        if len(shape) >= 2:
            taken = {p.dim for p in [*wanted.values(), *kept] if p.is_split}
            free = [d for d in range(len(shape)) if d not in taken and
                    shape[d] % math.prod(mesh.axis_sizes[a] for a in sharded) == 0]
            for axis in axes:
                wanted[axis] = S(free[0]) if axis in sharded and free else B
        elif not wanted:
            continue
        pin = _placed(bound, name, wanted)
        if pin is not None:
            pins[name] = pin
    return pins


def _sequence_parallel(bound: BoundPlan, data: list[int], tp: int, rows: list[_Linear]) -> dict[str, Pin]:
    """What each block adds to the residual stream (the row-parallel linears' outputs, as [batch, tokens,
    features]: GPT-2's Conv1D computes them on [batch · tokens, features] and views them back) and the
    token embedding's output, split by tokens on `tp` (dim 1) and by the batch on the data axes: each block
    then gathers its normalised input and reduce-scatters its sums, where Megatron without it all-reduces
    them and holds the stream whole on every rank. Empty where no block's output can be split so."""
    mesh = bound.mesh
    nodes = {node.name: node for node in bound.graph.nodes}
    layout = Layout(tuple(S(1) if a == tp else S(0) if a in data else B for a in range(mesh.ndim)))

    def as_tokens(name: str) -> str | None:
        """The node holding `name`'s value as [batch, tokens, features], if one does."""
        shape = bound.tensors[name].shape if name in bound.tensors else ()
        if len(shape) == 3:
            return name
        users = list(nodes[name].users)
        if len(shape) == 2 and len(users) == 1 and users[0].target in _RESHAPES and users[0].name in bound.tensors \
                and len(bound.tensors[users[0].name].shape) == 3:
            return users[0].name
        return None

    def pinned(names) -> dict[str, Pin]:
        found = {}
        for name in filter(None, names):
            if name not in bound.pins and layout.fits(bound.tensors[name].shape, mesh):
                found[name] = Pin(layout, _entry(bound))
        return found

    blocks = pinned(as_tokens(linear.node) for linear in rows)
    if not blocks:
        return {}
    def token_ids(node) -> bool:  # an input, or an input reshaped (GPT-2 views its ids first)
        while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _RESHAPES:
            node = node.args[0]
        return getattr(node, "name", None) in bound.inputs

    embeddings = [node.name for node in bound.graph.nodes if node.op == "call_function" and
                  node.target is aten.embedding.default and token_ids(node.args[1])]
    return {**blocks, **pinned(embeddings)}
