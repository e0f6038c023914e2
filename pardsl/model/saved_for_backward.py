"""What autograd keeps of a forward for its backward: the activations a rank holds at the end of forward.

Each op of the exported graph runs once on meta tensors of its global shapes, under saved-tensor hooks
that record which of its operands (or views of them) and whether its own result it saves. Autograd
decides that per op and not per layout, so one pass over the graph serves every plan: the cost model
and the search count an op result's bytes only where something keeps it, at the layout the plan gives it
(an upper bound was every op result). A view owns no storage: a kept view keeps its base, which is
counted instead. Ops that meta tensors cannot run, and tensors an op saves that are none of its operands
(a composite op's intermediates: attention run in its reference form), are taken to keep all of the op's
operands, and its result where the intermediate is as large as it, as a fused kernel does: what is
unknown errs on the side of more memory. The model's outputs are held too, by the caller. Repeated
layers ask the same question; it is answered once.

What a rank holds depends on the plan: an op that keeps an operand it reads converted (a linear reading
the all-gather of a sequence-split activation) keeps the converted copy. So the answer also says which
op keeps which of its operands (`reads`): the cost model and the search count those copies too.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from pardsl.layouts.oprules import carries_gradient


@dataclass(frozen=True)
class Saved:
    operands: frozenset[int]  # positions (among the op's tensor operands, flattened) it keeps for backward
    results: frozenset[int]  # positions of its own results it keeps
    view_of: int | None  # the operand whose storage its (one) result is a view of
    requires_grad: bool  # whether its results need a gradient


def probe(target, args, kwargs) -> Saved:
    """Run `target` on `args`/`kwargs` (meta tensors in place of the graph's values) and see what it saves."""
    operands = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    saved = []
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
            result = target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op meta tensors cannot run: taken to keep everything it reads and makes
        return Saved(frozenset(range(len(operands))), frozenset({0}), None, True)
    results = result if isinstance(result, (tuple, list)) else [result]

    def position(tensor, among) -> int | None:
        for i, t in enumerate(among):
            if isinstance(t, torch.Tensor) and (tensor is t or tensor._base is t or
                                                (t._base is not None and tensor._base is t._base)):
                return i
        return None

    kept_operands, kept_results = set(), set()
    for tensor in saved:
        mine, theirs = position(tensor, results), position(tensor, operands)
        if mine is not None:
            kept_results.add(mine)
        elif theirs is not None:
            kept_operands.add(theirs)
        else:
            # Something of its own, made from its operands: a composite op run as its decomposition on
            # meta tensors. Its kernel keeps its operands, and where the intermediate is as large as the
            # result (attention's weights in its reference form) the result too, as the fused kernel does;
            # row statistics (layer norm's mean and reciprocal deviation) are not the result.
            kept_operands.update(range(len(operands)))
            first = results[0] if results else None
            if not isinstance(first, torch.Tensor) or tensor.numel() >= first.numel():
                kept_results.add(0)
    # a view, or an operand itself given back (dropout with p = 0, a cast to its own dtype); not `contiguous`,
    # whose answer depends on strides the probe's operands do not have
    view_of = None
    given_back = target is not torch.ops.aten.contiguous.default and any(result is o for o in operands)
    if isinstance(result, torch.Tensor) and (result._base is not None or given_back):
        view_of = position(result, operands)
    return Saved(frozenset(kept_operands), frozenset(kept_results), view_of,
                 any(isinstance(r, torch.Tensor) and r.requires_grad for r in results))


@dataclass(frozen=True)
class Kept:
    """What autograd keeps of one forward (graph node names)."""
    values: frozenset[str]  # every value kept, by something, a view resolved to its owner (the serial model's)
    reads: frozenset[tuple[str, str]]  # (op, operand): the op keeps the operand as it reads it
    owner: dict[str, str]  # a value → the value whose storage it is (itself, unless a view)
    by_itself: frozenset[str]  # kept as an output, or by the op that makes it (its result)

    def kept_by_others(self, value: str, ops: set[str]) -> bool:
        """Whether the storage of `value` is kept by something other than `ops` (graph node names)."""
        storage = self.owner.get(value, value)
        return storage in self.by_itself or any(
            self.owner.get(operand, operand) == storage for op, operand in self.reads if op not in ops)


def what_autograd_keeps(graph: torch.fx.Graph, tensor_info, parameters) -> Kept:
    """What autograd keeps from forward to backward, and the model's outputs. `tensor_info(name)`: the
    value's global shape and dtype, or None where it is not one tensor; `parameters`: the placeholders
    that are trained."""
    requires_grad: dict[str, bool] = {}
    owner: dict[str, str] = {}  # a value → the value whose storage it is (itself, unless a view)
    saved_results: dict[str, frozenset[int]] = {}
    kept: set[str] = set()
    by_itself: set[str] = set()
    reads: set[tuple[str, str]] = set()
    answered: dict[tuple, Saved] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            info = tensor_info(node.name)
            requires_grad[node.name] = node.name in parameters and info is not None and carries_gradient(info.dtype)
            owner[node.name] = node.name
            continue
        if node.op == "output":
            for value in torch.utils._pytree.tree_leaves(node.args):
                if isinstance(value, torch.fx.Node):
                    kept.add(owner.get(value.name, value.name))
                    by_itself.add(owner.get(value.name, value.name))
            continue
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
            source, index = node.args
            requires_grad[node.name] = requires_grad.get(source.name, False)
            owner[node.name] = node.name
            if index in saved_results.get(source.name, ()):
                kept.add(node.name)
                by_itself.add(node.name)
            continue
        tensors: list[str] = []  # the node's tensor operands, in the order probe flattens them
        key: list = [node.target]

        def meta(arg):
            if isinstance(arg, (list, tuple)):
                return type(arg)(meta(a) for a in arg)
            if isinstance(arg, dict):
                return {k: meta(v) for k, v in arg.items()}
            if not isinstance(arg, torch.fx.Node):
                key.append(repr(arg))
                return arg
            value = arg.meta.get("val")
            if not isinstance(value, torch.Tensor):
                literal = int(value.node.hint) if isinstance(value, torch.SymInt) else value
                key.append(repr(literal))
                return literal
            info = tensor_info(arg.name)
            shape, dtype = (tuple(info.shape), info.dtype) if info is not None else (tuple(value.shape), value.dtype)
            gradient = requires_grad.get(arg.name, False) and carries_gradient(dtype)
            key.append((shape, dtype, gradient))
            tensors.append(arg.name)
            return torch.empty(shape, dtype=dtype, device="meta", requires_grad=gradient)

        args, kwargs = meta(node.args), meta(node.kwargs)
        if node.target is torch.ops.aten.dropout.default:  # as training runs it (rt.dropout): a new tensor
            args = (*args[:2], True)
        frozen = tuple(key)
        if frozen not in answered:
            answered[frozen] = probe(node.target, args, kwargs)
        saved = answered[frozen]
        requires_grad[node.name] = saved.requires_grad
        owner[node.name] = owner.get(tensors[saved.view_of], node.name) if saved.view_of is not None else node.name
        saved_results[node.name] = saved.results
        for position in saved.operands:
            kept.add(owner.get(tensors[position], tensors[position]))
            reads.add((node.name, tensors[position]))
        if saved.results and tensor_info(node.name) is not None:
            kept.add(owner[node.name])
            by_itself.add(owner[node.name])
    return Kept(frozenset(kept), frozenset(reads), owner, frozenset(by_itself))
