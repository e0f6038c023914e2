"""Grouped-query attention without the repeated keys and values.

A Hugging Face model computes attention with fewer key/value heads than query heads (GQA). Eagerly it
passes them to SDPA as they are (`enable_gqa`), but under torch.export it repeats them first
(`repeat_kv`: unsqueeze, expand, reshape), so the traced graph copies every layer's keys and values
rep times forward, keeps the copies for backward and sums them back there. This pass gives the graph
the eager form again: SDPA reads the key/value heads themselves with `enable_gqa=True` (query head i
reads key/value head i // rep, what the repeat computed), and the repeats go.

The attention rule splits the query heads and the key/value heads together, chunk r reading chunk r, so
the pass applies only where the ranks that may split heads divide the key/value heads: the mesh's, less
the pipeline's axis and the axes the file splits an input on (binding._ranks_that_may_split_heads).
Elsewhere the repeated heads may be the only ones a plan can split, and the graph stays as traced. Ring
attention gains most: over a sequence split on its own axis, each step passes the key/value heads, not
their repeats (Llama 3 405B's 128 query heads read 8: a sixteenth of the bytes).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def _repeated(node) -> tuple[torch.fx.Node, int] | None:
    """`reshape(expand(unsqueeze(x, 2), [b, h, rep, s, d]), [b, h * rep, s, d])`: (x, rep), else None."""
    if not isinstance(node, torch.fx.Node) or node.target not in _RESHAPES or len(node.users) != 1:
        return None
    expanded = node.args[0]
    if not isinstance(expanded, torch.fx.Node) or expanded.target is not aten.expand.default or \
            len(expanded.users) != 1:
        return None
    unsqueezed = expanded.args[0]
    if not isinstance(unsqueezed, torch.fx.Node) or unsqueezed.target is not aten.unsqueeze.default or \
            unsqueezed.args[1] != 2 or len(unsqueezed.users) != 1:
        return None
    source = unsqueezed.args[0]
    shape = tuple(source.meta["val"].shape) if isinstance(source, torch.fx.Node) and "val" in source.meta else ()
    sizes = tuple(expanded.args[1])
    if len(shape) != 4 or len(sizes) != 5 or not isinstance(sizes[2], int) or sizes[1] != shape[1]:
        return None
    rep = sizes[2]
    if tuple(node.meta["val"].shape) != (shape[0], shape[1] * rep, shape[2], shape[3]):
        return None
    return source, rep


def fold_grouped_query_repeats(graph_module: torch.fx.GraphModule, ranks: int) -> int:
    """Rewrite each SDPA that reads repeated key/value heads to read them with `enable_gqa`, where `ranks`
    (the most a plan may split heads over) divides the key/value heads. Returns how many it rewrote."""
    graph = graph_module.graph
    folded = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.scaled_dot_product_attention.default or \
                node.kwargs.get("enable_gqa") or len(node.args) < 3:
            continue
        key, value = _repeated(node.args[1]), _repeated(node.args[2])
        if key is None or value is None or key[1] != value[1] or key[1] < 2:
            continue
        heads = key[0].meta["val"].shape[1]
        if not isinstance(heads, int) or heads % ranks:
            continue
        repeats = [node.args[1], node.args[2]]
        node.args = (node.args[0], key[0], value[0], *node.args[3:])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        for reshaped in repeats:  # reshape, then its expand, then its unsqueeze: each now unread
            expanded = reshaped.args[0]
            unsqueezed = expanded.args[0]
            for dead in (reshaped, expanded, unsqueezed):
                graph.erase_node(dead)
        folded += 1
    if folded:
        graph.lint()
        graph_module.recompile()
    return folded


# Head regrouping: where a plan splits the key/value projections over more ranks than there are key/value
# heads (tp 8 over Qwen's 4), no rank can hold a head of its own: the traced graph splits a head's
# features across ranks, and every layer exchanges its keys and values by all-to-all to gather them. The
# ranks that share a head can instead each compute it: the projection's weight is repeated by rows
# (each key/value head `copies` times) before the linear, so that the projected heads are as many as the
# ranks, each rank computes one, and the repeat for the query heads that follows is `copies` times
# smaller. Between the projection and the repeat, the ops must treat every head alike (reshapes that cut
# the features into heads, transposes, the rotary embedding's elementwise ops and slices along the head's
# features, a per-head norm): a head repeated before them is the head they would have repeated after.

_ELEMENTWISE = {aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.neg.default,
                aten.pow.Tensor_Scalar, aten.rsqrt.default, aten.to.dtype, aten._to_copy.default,
                aten.contiguous.default, aten.clone.default, aten.alias.default}
_ALONG_A_DIM = {aten.slice.Tensor: 1, aten.mean.dim: 1, aten.cat.default: 1}  # the dim argument's position


def _projection_chain(source, heads: int):
    """The linear that projects `source`'s key/value heads ([b, heads, s, d] after the chain) and the chain
    of ops between them, each with the dim its result holds the heads in; None where an op does not
    treat every head alike or something outside the chain reads inside it."""
    chain: dict[torch.fx.Node, None] = {}
    linear, frontier = None, [source]
    while frontier:
        node = frontier.pop()
        if node in chain:
            continue
        if not isinstance(node, torch.fx.Node) or node.op != "call_function":
            return None
        if node.target is aten.linear.default:
            if linear not in (None, node):
                return None
            linear = node
            continue
        chain[node] = None
        for operand in node.all_input_nodes:
            if operand.op == "call_function" and _reaches(operand):
                frontier.append(operand)
    if linear is None or not chain or any(user not in chain for user in linear.users):
        return None
    order = [n for n in linear.graph.nodes if n in chain]
    head_dim = {linear: None}
    for node in order:
        value = node.meta.get("val")
        if value is None:
            return None
        chained = [o for o in node.all_input_nodes if o in head_dim]
        if not chained:
            return None
        inputs = {head_dim[o] for o in chained}
        if len(inputs) != 1:
            return None
        dim = inputs.pop()
        if not isinstance(value, torch.Tensor):
            return None
        if node.target in _RESHAPES:
            before = tuple(node.args[0].meta["val"].shape)
            after = tuple(value.shape)
            if dim is None:  # the features cut into heads: [..., heads * d] → [..., heads, d]
                if len(after) != len(before) + 1 or after[:-2] != before[:-1] or after[-2] != heads:
                    return None
                dim = len(after) - 2
            elif after != before:
                return None
        elif node.target is aten.transpose.int:
            if dim is None:  # a transpose before the features are cut into heads: not the form known here
                return None
            a, b = (d % value.dim() for d in node.args[1:3])
            dim = b if dim == a else a if dim == b else dim
        elif dim is None:
            return None
        elif node.target in _ELEMENTWISE or node.target in _ALONG_A_DIM:
            if node.target in _ALONG_A_DIM:
                along = node.args[_ALONG_A_DIM[node.target]] if len(node.args) > _ALONG_A_DIM[node.target] else 0
                along = along if isinstance(along, (list, tuple)) else [along]
                if any(d % value.dim() == dim for d in along):
                    return None
            for operand in _tensor_operands(node):
                if operand in head_dim:
                    continue
                if not isinstance(operand.meta.get("val"), torch.Tensor):
                    return None
                shape = tuple(operand.meta["val"].shape)
                offset = value.dim() - len(shape)
                if dim - offset >= 0 and shape[dim - offset] != 1:
                    return None
        else:
            return None
        if tuple(value.shape)[dim] != heads:
            return None
        head_dim[node] = dim
        outside = [user for user in node.users if user not in chain and node is not source and
                   not (user.target is aten._assert_tensor_metadata.default and "size" not in user.kwargs)]
        if outside:
            return None
    if head_dim.get(source) != 1:
        return None
    return linear, order, head_dim


def _tensor_operands(node) -> list:
    operands = []
    for argument in node.args:
        for item in argument if isinstance(argument, (list, tuple)) else [argument]:
            if isinstance(item, torch.fx.Node):
                operands.append(item)
    return operands


def _reaches(node) -> bool:
    """Whether `node` is computed from a linear: part of the chain, not one of its tables (the rotary
    embedding's cosines), which are made from positions alone."""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen or not isinstance(current, torch.fx.Node):
            continue
        seen.add(current)
        if current.op == "call_function" and current.target is aten.linear.default:
            return True
        if current.op == "call_function":
            stack.extend(current.all_input_nodes)
    return False


def _evaluated(target, args, kwargs, values: dict):
    """`target` run on fake values: a node's own (meta["val"]), or the one `values` gives it after a
    rewrite upstream."""
    def value(argument):
        if isinstance(argument, torch.fx.Node):
            return values[argument] if argument in values else argument.meta["val"]
        return argument

    args = torch.fx.node.map_aggregate(args, value)
    kwargs = torch.fx.node.map_aggregate(kwargs, value)
    mode = detect_fake_mode([leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)])
    with mode if mode is not None else contextlib.nullcontext():
        return target(*args, **kwargs)


def _by_heads(heads: int, copies: int, features: int, inner: tuple) -> list[tuple]:
    """The ops that repeat a projection's weight (or bias) of `features` rows by heads, `copies` of each:
    [heads, 1, d, ...] → [heads, copies, d, ...] → [heads · copies · d, ...]."""
    d = features // heads
    return [(aten.view.default, [heads, 1, d, *inner], "by_head"),
            (aten.expand.default, [heads, copies, d, *inner], "copied"),
            (aten.reshape.default, [features * copies, *inner], "regrouped")]


def _regrouping(linear, order, head_dim, repeat, heads: int, copies: int, rep: int):
    """What regrouping changes, computed before the graph is touched, so that an op refusing it leaves
    the graph as traced: the tensors repeated by heads (the weight, the bias), each changed node's new
    arguments, and every changed node's new value. None where any of it fails."""
    unsqueezed, expand, reshaped = repeat
    stored = [linear.args[1]] + ([linear.args[2]] if len(linear.args) > 2 and
                                 isinstance(linear.args[2], torch.fx.Node) else [])
    try:
        repeated_values = []  # the weight's and the bias's, repeated by heads: what the linear reads
        for tensor in stored:
            value = tensor.meta["val"]
            for op, sizes, _ in _by_heads(heads, copies, value.shape[0], tuple(value.shape[1:])):
                value = _evaluated(op, (value, sizes), {}, {})
            repeated_values.append(value)
        values = {linear: _evaluated(linear.target, (linear.args[0], *repeated_values, *linear.args[len(stored) + 1:]),
                                     linear.kwargs, {})}
        arguments = {}
        for chained in order:  # a reshape that names the head count: the heads are `copies` times more
            args = chained.args
            if chained.target in _RESHAPES and list(args[1])[head_dim[chained]] != -1:
                sizes = list(args[1])
                sizes[head_dim[chained]] = heads * copies
                args = (args[0], sizes, *args[2:])
                arguments[chained] = args
            values[chained] = _evaluated(chained.target, args, chained.kwargs, values)
        sizes = list(expand.args[1])  # the repeat for the query heads: rep / copies of each projected head
        sizes[1], sizes[2] = heads * copies, rep // copies
        arguments[expand] = (unsqueezed, sizes, *expand.args[2:])
        for node in (unsqueezed, expand, reshaped):
            values[node] = _evaluated(node.target, arguments.get(node, node.args), node.kwargs, values)
    except Exception:  # noqa: BLE001 - an op that refuses the regrouped shapes: the graph stays as traced
        return None
    return stored, arguments, values


@dataclass(frozen=True)
class Regrouped:
    """A key/value projection regrouped: its weight (and bias) placeholders, and the nodes that repeat them
    by heads, which the linear now reads."""

    weight: str
    repeated_weight: str
    heads: int  # the key/value heads the model projects
    ranks: int  # the ranks the plan splits them over: each head computed on ranks // heads of them
    bias: str | None = None
    repeated_bias: str | None = None


def regroup_key_value_heads(graph_module: torch.fx.GraphModule, split_over) -> list[Regrouped]:
    """Repeat the key/value projections' weights by heads where `split_over(weight)` (the ranks the plan
    splits that parameter placeholder's output features over) exceeds the heads they project and is a
    multiple of them (see above). Returns the projections it rewrote."""
    graph = graph_module.graph
    rewritten = []
    for node in list(graph.nodes):
        repeated = _repeated(node)
        if repeated is None:
            continue
        source, rep = repeated
        unsqueezed = node.args[0].args[0]
        if set(source.users) != {unsqueezed}:  # another reader would be handed the regrouped heads
            continue
        heads = source.meta["val"].shape[1]
        if not isinstance(heads, int):
            continue
        try:
            found = _projection_chain(source, heads)
        except (AttributeError, IndexError, KeyError, TypeError):  # a form the chain's reading does not know
            found = None
        if found is None:
            continue
        linear, order, head_dim = found
        weight = linear.args[1]
        ranks = split_over(weight.name) if isinstance(weight, torch.fx.Node) else 1
        if ranks <= heads or ranks % heads or (heads * rep) % ranks:
            continue
        copies = ranks // heads
        expand = node.args[0]
        found = _regrouping(linear, order, head_dim, (unsqueezed, expand, node), heads, copies, rep)
        if found is None:
            continue
        stored, arguments, values = found
        stack = linear.meta.get("nn_module_stack")
        repeated = []
        with graph.inserting_before(linear):
            for tensor in stored:
                made = tensor
                for op, sizes, suffix in _by_heads(heads, copies, tensor.meta["val"].shape[0],
                                                   tuple(tensor.meta["val"].shape[1:])):
                    made = graph.create_node("call_function", op, (made, sizes),
                                             name=f"{tensor.name.removeprefix('p_')}_{suffix}")
                    made.meta["val"] = _evaluated(op, (made.args[0], sizes), {}, {})
                    if stack is not None:
                        made.meta["nn_module_stack"] = stack
                repeated.append(made)
        linear.args = (linear.args[0], *repeated, *linear.args[len(stored) + 1:])
        for changed, args in arguments.items():
            changed.args = args
        for changed, value in values.items():
            changed.meta["val"] = value
        weight, repeated_weight = stored[0], repeated[0]
        bias, repeated_bias = (stored[1], repeated[1]) if len(stored) > 1 else (None, None)
        rewritten.append(Regrouped(weight.name, repeated_weight.name, heads, ranks,
                                   bias.name if bias is not None else None,
                                   repeated_bias.name if repeated_bias is not None else None))
    if rewritten:
        graph.lint()
        graph_module.recompile()
    return rewritten
