"""In-place ops, handled once: each becomes its functional op, and what read the mutated tensor after it
reads the result instead.

torch.export's graph keeps in-place calls (`relu_`, `add_`, `index_put_`, …), and a later node may read
the tensor that was written through its old name. Rewriting `x.add_(y)` as `z = add(x, y)` and every
later read of `x` as a read of `z` gives the same values and gradients, and the rest of the compiler sees
functional ops only, with the rules it already has.

Two cases stay as they are:
- a write into a graph input (a buffer such as batch norm's `num_batches_tracked`, or a user input):
  each rank updates its own local value, which is what the serial model does to its tensor;
- a write into a view, or into a tensor a view of which is read, where a tensor sharing the memory (the
  view's base, another view of it) is read after the write: the write changes that tensor too. These are
  reported (E062), since rewriting them would silently change the program. Where nothing else sharing
  the memory is read after it (MobileNetV2's in-place dropout on the flattened pooling), the write is
  rewritten like any other.
"""

from __future__ import annotations

import operator

import torch

from pardsl.layouts.oprules import functional_overload


def _schema(node: torch.fx.Node):
    return getattr(node.target, "_schema", None) if node.op == "call_function" else None


def is_in_place(node: torch.fx.Node) -> bool:
    """An op that writes into its first argument and returns it (`add_`), not an `out=` variant."""
    schema = _schema(node)
    if schema is None or not schema.arguments or not schema.name.endswith("_"):
        return False
    written = schema.arguments[0].alias_info
    return written is not None and written.is_write


def is_view(node: torch.fx.Node) -> bool:
    """An op whose result aliases an operand without writing it (view, transpose, slice, split, …)."""
    schema = _schema(node)
    if schema is None or is_in_place(node):
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def functionalize_in_place(graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Rewrite the in-place ops of the graph as functional ones; return those that write into a view or
    into a viewed tensor (left as they are, for the caller to report)."""
    graph = graph_module.graph
    order = {node: index for index, node in enumerate(graph.nodes)}
    refused, rewritten = [], False
    for node in list(graph.nodes):
        if not is_in_place(node):
            continue
        written = node.args[0]
        functional = functional_overload(node.target)
        if not isinstance(written, torch.fx.Node) or written.op == "placeholder" or functional is None:
            continue  # an input's own update, or an op with no functional twin (E060 names it)
        if (is_view(written) or any(is_view(user) for user in written.users)) and \
                _shared_memory_read_after(written, node, order):
            refused.append(node)
            continue
        node.target, rewritten = functional, True
        for user in list(written.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(written, node)
    if rewritten:
        graph.lint()
        graph_module.recompile()
    return refused


def _shared_memory_read_after(written: torch.fx.Node, write: torch.fx.Node, order: dict) -> bool:
    """Whether a tensor sharing `written`'s memory (the base it is a view of, every view of that base)
    other than `written` itself is read after `write`, or the base is a graph input (whose update would
    outlive the forward)."""
    root = written
    while is_view(root) and isinstance(root.args[0], torch.fx.Node):
        root = root.args[0]
    if root.op == "placeholder":
        return True
    aliases, stack = {root}, [root]
    while stack:  # every view of the base, and the parts of a split (getitem of a view's list)
        for user in stack.pop().users:
            aliasing = is_view(user) or (user.op == "call_function" and user.target is operator.getitem)
            if aliasing and user not in aliases:
                aliases.add(user)
                stack.append(user)
    return any(order.get(user, -1) > order[write] for alias in aliases - {written}
               for user in alias.users if user is not write)
