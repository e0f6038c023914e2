"""In-place ops, handled once: each becomes its functional op, and what read the mutated tensor after it
reads the result instead.

torch.export's graph keeps in-place calls (`relu_`, `add_`, `index_put_`, …), and a later node may read
the tensor that was written through its old name. Rewriting `x.add_(y)` as `z = add(x, y)` and every
later read of `x` as a read of `z` gives the same values and gradients, and the rest of the compiler sees
functional ops only, with the rules it already has.

A write into a view (`buf[..., :8].copy_(k)` into a buffer made by `new_empty`, DeepSeek-V3's keys) is
rewritten the way torch's functionalization does it: the view's new value is the functional op's result,
and each tensor the view was taken from gets its new value by the view's scatter (`slice_scatter`,
`select_scatter`, the inverse permutation or reshape), up to the tensor that owns the memory. Later reads
of any of them read the new values; views taken after the write are taken from them.

Three cases stay as they are:
- a write into a graph input (a buffer such as batch norm's `num_batches_tracked`, or a user input):
  each rank updates its own local value, which is what the serial model does to its tensor;
- a write into a parameter through `.data` (traced as `detach`) that is elementwise with constant operands
  (PARAMETER_WRITES) and comes before every read of it: returned with the refused ones, for binding to
  take out of the graph and the compiled forward to make first (parameter_written_before_read);
- a write into a view of any other graph input, or one that another alias of the same memory, taken
  before the write and read after it, would see (its value is not rewritten), or a write through a view
  with no scatter (`expand`, `as_strided`, a part of `split`): reported (E062), since rewriting them would
  silently change the program.
"""

from __future__ import annotations

import operator

import torch

from pardsl.layouts.oprules import functional_overload

aten = torch.ops.aten


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


def _is_alias(node: torch.fx.Node) -> bool:
    """A view, or a part of one that returns a list (getitem of split): it shares its operand's memory."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return isinstance(node.args[0], torch.fx.Node) and is_view(node.args[0])
    return is_view(node)


def written_through_data(node: torch.fx.Node) -> bool:
    """Whether an in-place op writes into a graph input through an alias of all of it (`.data`, traced as
    `detach`): the parameter's own update in the serial model, which the compiled forward makes first
    where parameter_written_before_read says it can (a gather or a compute copy made before it would miss
    it), and which is refused with its own advice otherwise."""
    written, aliases = _through_aliases(node)
    return isinstance(written, torch.fx.Node) and written.op == "placeholder" and bool(aliases)


def _through_aliases(node: torch.fx.Node) -> tuple[object, list[torch.fx.Node]]:
    """What an in-place op writes into past the aliases of all of it (`detach`, `alias`), and those aliases."""
    written, aliases = node.args[0] if node.args else None, []
    while isinstance(written, torch.fx.Node) and written.op == "call_function" and \
            written.target in (aten.detach.default, aten.alias.default):
        aliases.append(written)
        written = written.args[0]
    return written, aliases


# Writes a forward may make into a parameter through `.data` that pardsl makes on each rank's part of the
# parameter before the step reads it: elementwise with constant operands, so the part's result is the
# whole's part whatever the layout; and the same when made again, as a pipeline stage makes it once per
# micro-batch where serial makes it once a step. Gemma 3n clamps its AltUp coefficients so in training.
PARAMETER_WRITES = {aten.clamp_.default: "clamp_", aten.clamp_min_.default: "clamp_min_",
                    aten.clamp_max_.default: "clamp_max_", aten.fill_.Scalar: "fill_", aten.zero_.default: "zero_",
                    aten.abs_.default: "abs_", aten.nan_to_num_.default: "nan_to_num_"}


def parameter_written_before_read(node: torch.fx.Node, parameters: set[str]) -> torch.fx.Node | None:
    """The parameter placeholder a write through `.data` (written_through_data) can be made on before the
    forward: one of PARAMETER_WRITES, its other operands constants, its result unread, the parameter read
    after it and not before (what serial reads after it is the written value, made first). None otherwise."""
    if node.target not in PARAMETER_WRITES or node.users or \
            any(isinstance(a, torch.fx.Node) for a in [*node.args[1:], *node.kwargs.values()]):
        return None
    written, aliases = _through_aliases(node)
    if not isinstance(written, torch.fx.Node) or written.name not in parameters:
        return None
    order = {n: index for index, n in enumerate(node.graph.nodes)}
    readers = [user for owner in (written, *aliases) for user in owner.users
               if user not in aliases and user is not node]
    # unread, no stage of a pipeline would hold the parameter to write it
    if not readers or any(order[reader] < order[node] for reader in readers):
        return None
    return written


def _memory_owner(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor whose memory `node` shares: the first one up its chain of views that is no view."""
    while _is_alias(node) and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _shape(node: torch.fx.Node) -> list | None:
    value = node.meta.get("val")
    return list(value.shape) if isinstance(value, torch.Tensor) else None


def _concrete(shape: list | None) -> bool:
    return shape is not None and all(type(size) is int for size in shape)


def _argument(view: torch.fx.Node, position: int, default):
    return view.args[position] if len(view.args) > position else view.kwargs.get(
        view.target._schema.arguments[position].name, default)


def _scatter(view: torch.fx.Node):
    """(target, arguments after the base and the view's new value) of the op that puts a new value of
    `view` into the tensor it was taken from; or (target, arguments after the new value) for views that
    cover all of it, where the new value of the base is the inverse view of the new value alone. None
    where there is no such op."""
    target, base = view.target, view.args[0]
    rank = len(_shape(base) or ())
    if target is aten.slice.Tensor:
        return "into", aten.slice_scatter.default, (_argument(view, 1, 0), _argument(view, 2, None),
                                                    _argument(view, 3, None), _argument(view, 4, 1))
    if target is aten.select.int:
        return "into", aten.select_scatter.default, (view.args[1], view.args[2])
    if target is aten.diagonal.default:
        return "into", aten.diagonal_scatter.default, (_argument(view, 1, 0), _argument(view, 2, 0),
                                                       _argument(view, 3, 1))
    if target in (aten.alias.default, aten.t.default):
        return "whole", target, ()
    if target is aten.transpose.int:
        return "whole", target, (view.args[1], view.args[2])
    if target is aten.permute.default:
        order = [d % rank for d in view.args[1]]
        return "whole", target, ([order.index(d) for d in range(rank)],)
    if target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
                  aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints,
                  aten.unflatten.int) and _concrete(_shape(base)):
        return "whole", aten.view.default, (_shape(base),)
    return None


def functionalize_in_place(graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Rewrite the in-place ops of the graph as functional ones; return those that write into memory
    another alias reads afterwards without seeing the write (left as they are, for the caller to report)."""
    graph = graph_module.graph
    refused, rewritten = [], False
    order = {n: index for index, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if not is_in_place(node):
            continue
        written = node.args[0]
        functional = functional_overload(node.target)
        if not isinstance(written, torch.fx.Node) or functional is None:
            continue  # an op with no functional twin (E060 names it)
        owner = _memory_owner(written)
        if owner.op == "placeholder":
            if written is not owner:
                refused.append(node)
            continue  # an input's own update, made on each rank's local value
        aliases = _aliases(owner)
        # where nothing else sharing the memory is read after the write, the view's new value is all there is
        chain = _chain(written, owner) if _read_after(aliases - {written}, node, order) else [written]
        if chain is None or _read_after(aliases - set(chain), node, order) or \
                not _make_functional(graph, node, functional):
            refused.append(node)
            continue
        rewritten = True
        _write_back(graph, node, chain, order)
        if not written.users and _is_alias(written):  # copy_'s view, which its functional form does not read
            graph.erase_node(written)
        if len(chain) > 1:  # scatters were added: later writes are ordered among them
            order = {n: index for index, n in enumerate(graph.nodes)}
    if rewritten:
        graph.lint()
        graph_module.recompile()
    return refused


def _make_functional(graph: torch.fx.Graph, write: torch.fx.Node, functional) -> bool:
    """Turn `write` into its functional op, in place in the graph. `copy_(view, src)` becomes src as the
    view's value (broadcast to its shape, in its dtype), since aten.copy has no derivative; False where
    that shape is not known before run time."""
    if write.target is not aten.copy_.default:
        write.target = functional
        return True
    view, source = write.args[0], write.args[1]
    view_value, source_value = view.meta.get("val"), source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if not isinstance(source_value, torch.Tensor) or not isinstance(view_value, torch.Tensor):
        return False
    if list(source_value.shape) != list(view_value.shape):
        if not _concrete(list(view_value.shape)):
            return False
        with graph.inserting_before(write):
            source = graph.call_function(aten.expand.default, (source, list(view_value.shape)))
        source.meta.update(write.meta)
        source.meta["val"] = source_value.expand(view_value.shape)
    if source_value.dtype == view_value.dtype:
        write.target, write.args, write.kwargs = aten.clone.default, (source,), {}
    else:
        write.target, write.args, write.kwargs = aten._to_copy.default, (source,), {"dtype": view_value.dtype}
    return True


def _chain(written: torch.fx.Node, owner: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The tensors from the written one up to the memory's owner, each a view of the next; None where
    one of the views has no scatter to put a new value back with."""
    chain = [written]
    while chain[-1] is not owner:
        if _scatter(chain[-1]) is None:
            return None
        chain.append(chain[-1].args[0])
    return chain


def _write_back(graph: torch.fx.Graph, write: torch.fx.Node, chain: list[torch.fx.Node], order: dict) -> None:
    """After `write` (now functional: the written view's new value), each tensor of the chain gets its
    new value from the one below, and what reads one of them after the write reads its new value."""
    new_values = {chain[0]: write}
    anchor = write
    for view, base in zip(chain, chain[1:]):
        kind, target, arguments = _scatter(view)
        with graph.inserting_after(anchor):
            operands = (base, new_values[view], *arguments) if kind == "into" else (new_values[view], *arguments)
            anchor = graph.call_function(target, operands)
        anchor.meta.update({key: value for key, value in write.meta.items() if key != "val"})
        anchor.meta["val"] = base.meta.get("val")
        new_values[base] = anchor
    made = set(new_values.values())
    for old, new in new_values.items():
        for user in list(old.users):
            if user not in made and order.get(user, -1) > order[write]:
                user.replace_input_with(old, new)


def _aliases(owner: torch.fx.Node) -> set[torch.fx.Node]:
    """The owner and every tensor sharing its memory: its views, their views, the parts of a split."""
    aliases, stack = {owner}, [owner]
    while stack:
        for user in stack.pop().users:
            if _is_alias(user) and user not in aliases:
                aliases.add(user)
                stack.append(user)
    return aliases


def _read_after(aliases: set[torch.fx.Node], write: torch.fx.Node, order: dict) -> bool:
    """Whether a tensor of `aliases` taken before `write` is read after it (one taken after is taken
    from the new value: functionalized, the graph makes it so)."""
    # (a node the rewrite inserted before an earlier write, copy_'s expand, has no order: it is before)
    return any(order.get(alias, -1) < order[write] and any(order.get(user, -1) > order[write] and user is not write
                                                    for user in alias.users)
               for alias in aliases)
