"""The model traced: torch.export on meta tensors (by forward() argument name), transformers' experts as
one op (pardsl/model/moe.py), the values of constants a trace on meta cannot give, grad-mode regions
inlined into the graph, and where in the model's source each op was called."""

from __future__ import annotations

import contextlib
import io
import linecache
import logging
import os
import re
import sys
import traceback
import warnings

import torch

from pardsl.model.in_place import is_view
from pardsl.model.moe import experts_as_one_op

aten = torch.ops.aten


def trace(model: torch.nn.Module, example_inputs: dict[str, torch.Tensor],
          dynamic_shapes: dict | None = None) -> torch.export.ExportedProgram:
    """torch.export with the inputs by forward() argument name; the others keep their defaults. Dims
    named in `dynamic_shapes` ({input: {dim: torch.export.Dim}}) stay symbolic."""
    # torch logs a failing trace (with its traceback) through handlers of its own; the failure itself is
    # reported as E035, so the log is silenced for the duration
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()), experts_as_one_op(model), \
                _DataAsDetach(), _key_value_caches_dropped(model):
            warnings.simplefilter("ignore")
            exported = torch.export.export(model, (), dict(example_inputs), strict=False,
                                           dynamic_shapes=dynamic_shapes)
            if _has_vmap(exported.graph):
                exported = exported.run_decompositions({})
    finally:
        logging.disable(previous)
    inline_grad_mode_regions(exported.graph_module)
    make_fresh_tensors_from_nothing(exported.graph_module)
    return exported


def without_key_value_caches(output):
    """A forward's result with the transformers key-value caches among its outputs left out. A cache serves
    generation, one token after another; a training step has no use for it, and it is no tensor or container
    torch.export can trace (DiffusionGemma's encoder returns one whatever its settings). The serial model's
    result is compared with the plan's through this too."""
    cache = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
    if cache is None:  # transformers not imported: the model is none of its
        return output
    if isinstance(output, dict) and any(isinstance(value, cache) for value in output.values()):
        # made anew: a ModelOutput leaves out the fields given as None, where one set to None stays
        return type(output)(**{name: value for name, value in output.items() if not isinstance(value, cache)})
    if isinstance(output, tuple) and any(isinstance(value, cache) for value in output):
        return tuple(value for value in output if not isinstance(value, cache))  # a None is no output either
    return output


@contextlib.contextmanager
def _key_value_caches_dropped(model: torch.nn.Module):
    """While tracing: the model's result `without_key_value_caches`."""
    hook = model.register_forward_hook(lambda module, args, kwargs, output: without_key_value_caches(output),
                                       with_kwargs=True)
    try:
        yield
    finally:
        hook.remove()


class _DataAsDetach(torch.overrides.TorchFunctionMode):
    """`tensor.data` traced as `tensor.detach()`: the same memory without autograd, as `.data` is, but an op
    the trace records. `.data` itself is no op: what a forward writes through it (Gemma 3n clamps a
    parameter's values in training) became a constant holding the trace's fake value, and the export
    failed with torch's own message; traced, the write is located and refused (E062)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func.__name__ == "__get__" and getattr(func, "__self__", None) is torch.Tensor.data:
            return args[0].detach()
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def python_random_seeded(seed: int):
    """NumPy's (where installed) and Python's global generators seeded with `seed`, and given back their
    state after."""
    import random

    try:
        import numpy
    except ImportError:  # a model without NumPy draws nothing from it
        numpy = None
    states = random.getstate(), numpy.random.get_state() if numpy else None
    random.seed(seed)
    if numpy:
        numpy.random.seed(seed)
    try:
        yield
    finally:
        random.setstate(states[0])
        if numpy:
            numpy.random.set_state(states[1])


def constant_values(model: torch.nn.Module, example_inputs: dict[str, torch.Tensor], dynamic_shapes: dict | None,
                    constants: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The values of the tensors a forward makes from Python data (`x[..., [-2]]`, `torch.tensor([3.0],
    device=x.device)`), which export lifts as constants: traced on meta, those made on the input's device
    have none. The model is traced again on fake CPU tensors (nothing allocated), where such a tensor keeps
    its value, and each constant is taken by name from that trace; it must have the first trace's shape and
    dtype."""
    import copy

    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = copy.deepcopy(model)  # a meta model: nothing is copied but its structure
    with FakeTensorMode(allow_non_fake_inputs=True):  # meta tensors in, fake CPU ones out
        fake = fake.to_empty(device="cpu")
        inputs = {name: torch.empty(x.shape, dtype=x.dtype) for name, x in example_inputs.items()}
    real = trace(fake, inputs, dynamic_shapes).constants
    values = {}
    for name, meta in constants.items():
        value = real.get(name)
        if not isinstance(meta, torch.Tensor):
            values[name] = meta
        elif (not isinstance(value, torch.Tensor) or type(value) is not torch.Tensor
              or value.shape != meta.shape or value.dtype != meta.dtype):
            raise ValueError(f"constant `{name}` ({meta.dtype}{list(meta.shape)}) is not one in a trace on the CPU")
        else:
            values[name] = value.clone()  # a later trace may hand back the same tensor, refilled
    return values


def _has_vmap(graph: torch.fx.Graph) -> bool:
    """Whether the trace kept a `torch.vmap` (transformers builds a mask with a custom overlay so) as the
    nesting and batching calls of functorch's pre-dispatch trace, which are no ATen ops: the program's
    decomposition retraces them into the batched ATen ops they run."""
    return any(node.op == "call_function" and getattr(node.target, "__module__", "") == "torch._functorch.predispatch"
               for node in graph.nodes)


def inline_grad_mode_regions(graph_module: torch.fx.GraphModule) -> None:
    """Replace each `wrap_with_set_grad_enabled(enabled, body, *args)` by the body's own nodes.

    Export wraps code run under `torch.no_grad()` (HF's rotary embedding) in this higher-order op. A
    region with gradients off is, for values and gradients, the same ops with their results detached,
    which is what the inlined graph computes; so the rest of the compiler sees plain ATen ops.
    """
    graph = graph_module.graph
    regions = [n for n in graph.nodes if n.op == "call_function"
               and getattr(n.target, "__name__", "") == "wrap_with_set_grad_enabled"]
    for region in regions:
        enabled, body_ref, *args = region.args
        body = getattr(graph_module, body_ref.target).graph
        placeholders = [n for n in body.nodes if n.op == "placeholder"]
        with graph.inserting_before(region):
            results = graph.graph_copy(body, dict(zip(placeholders, args)))
            if not isinstance(results, (list, tuple)):
                results = (results,)
            if not enabled:
                results = [_detached(graph, r) for r in results]
        for user in list(region.users):  # getitem(region, i)
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(region)
        if not body_ref.users:
            graph.erase_node(body_ref)
    if regions:
        graph.lint()
        graph_module.recompile()


_FROM_NOTHING = {aten.new_empty.default: (aten.empty.memory_format, 0), aten.new_zeros.default: (aten.zeros.default, 0),
                 aten.new_ones.default: (aten.ones.default, 0), aten.new_full.default: (aten.full.default, 1)}


def make_fresh_tensors_from_nothing(graph_module: torch.fx.GraphModule) -> None:
    """`x.new_empty(shape)` (new_zeros, new_ones, new_full) as `torch.empty(shape, dtype=x.dtype)`: x lends
    only its dtype and device, and as an operand it would have to be made whole on every rank first
    (its layout is that of a tensor the op reads)."""
    graph = graph_module.graph
    changed = False
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _FROM_NOTHING:
            continue
        target, values = _FROM_NOTHING[node.target]
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        operand = node.args[0]
        node.target, changed = target, True
        node.args = tuple(node.args[1:2 + values])
        node.kwargs = {**{k: v for k, v in node.kwargs.items() if k == "pin_memory"},
                       "dtype": value.dtype, "device": value.device}
        if isinstance(operand, torch.fx.Node) and not operand.users and is_view(operand):
            graph.erase_node(operand)
    if changed:
        graph.lint()
        graph_module.recompile()


def _detached(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    detached = graph.call_function(torch.ops.aten.detach.default, (node,))
    detached.meta = {**node.meta, "val": node.meta["val"].detach()}
    return detached


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in \S+\n[ \t]*(?P<code>[^\n]*)')


def source_line(node: torch.fx.Node) -> str | None:
    """`file:line: code` of the model's source line that made the op: the innermost forward() frame
    torch.export recorded for it (it keeps the frames of forward methods only, so an op made in a helper
    the forward calls is placed at that call). Files under an installed package are named from the
    package, others from the working directory where they lie under it."""
    frames = list(_FRAME.finditer(node.meta.get("stack_trace") or ""))
    if not frames:
        return None
    frame = frames[-1]
    return f"{_short_path(frame['file'])}:{frame['line']}: {frame['code'].strip()}"


def data_dependent_failure(error: BaseException, model: torch.nn.Module) -> tuple[str, str | None] | None:
    """Where a failed trace stopped on a size known only from the data (a branch on `len(nonzero(...))`,
    a loop over `where(mask)`'s tokens): the model's innermost module whose forward was running, by path,
    and `file:line: code` there; None for any other failure."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    kinds = (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)
    if not isinstance(error, kinds) and not isinstance(error.__cause__, kinds):
        return None
    paths = {id(module): path for path, module in model.named_modules()}
    where = None
    for frame, line in traceback.walk_tb(error.__traceback__):
        module = frame.f_locals.get("self")
        if id(module) in paths and frame.f_code.co_name == "forward":
            code = linecache.getline(frame.f_code.co_filename, line).strip()
            where = (paths[id(module)] or "the model's own forward()",
                     f"{_short_path(frame.f_code.co_filename)}:{line}: {code}")
    return where or ("the model's own forward()", None)


def called_at(*lines: str | None) -> list[str]:
    """Diagnostic notes naming the model's source lines an op was called at (the first three known)."""
    known = list(dict.fromkeys(line for line in lines if line))
    return [f"at {line}" for line in known[:3]]


def _short_path(path: str) -> str:
    for root in sorted((p for p in sys.path if p and os.path.isdir(p)), key=len, reverse=True):
        if "-packages" in root and path.startswith(root.rstrip(os.sep) + os.sep):
            return os.path.relpath(path, root)
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative
