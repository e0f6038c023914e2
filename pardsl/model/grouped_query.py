"""Grouped-query attention without the repeated keys and values.

A Hugging Face model computes attention with fewer key/value heads than query heads (GQA). Eagerly it
passes them to SDPA as they are (`enable_gqa`), but under torch.export it repeats them first
(`repeat_kv`: unsqueeze, expand, reshape), so the traced graph copies every layer's keys and values
rep times forward, keeps the copies for backward and sums them back there. This pass gives the graph
the eager form again: SDPA reads the key/value heads themselves with `enable_gqa=True` (query head i
reads key/value head i // rep, what the repeat computed), and the repeats go.

The attention rule splits the query heads and the key/value heads together, chunk r reading chunk r, so
the pass applies only where the mesh's rank count divides the key/value heads; elsewhere the repeated
heads may be the only ones a plan can split, and the graph stays as traced.
"""

from __future__ import annotations

import torch

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
    divides the key/value heads. Returns how many it rewrote."""
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
