"""`pardsl init`: a starting .par file for a Hugging Face model, its layouts read from the tensor-parallel
plan the model's own config carries (`config.base_model_tp_plan`), or, where it carries none, a search
request. The file is compiled before it is written, so what `init` writes is known to compile."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pardsl.compiler import compile_text
from pardsl.language.syntax import parse
from pardsl.model.binding import name_pattern
from pardsl.model.loading import build_model

# Plan styles whose weights are split on their output features (a linear's weight is [..., out, in]).
COLUMN = {"colwise", "colwise_rep", "colwise_gather_output", "local_colwise"}
ROW = {"rowwise", "rowwise_rep", "local_rowwise"}
# Whole on every rank, gradients summed: what an unsplit parameter is here already.
REPLICATED = {"replicated_with_grad_allreduce"}


class InitError(Exception):
    """Why no file can be made: the message says where and what to do."""


@dataclass
class Generated:
    text: str
    planned: bool  # layouts from the model's plan; False: a search request


def generate(model: str, path: str, mesh: str = "tp = 2", seq: int = 16, batch: int = 2,
             memory: str = "40 %") -> Generated:
    """The .par text for `model` (a `module:factory(kwargs)` as the `model` line takes it), to be written
    at `path` (the model's module is imported as it will be from there). Raises InitError, or CompileError
    located in the generated text."""
    head = f"mesh   {mesh}\nmodel  {model}\n"
    declared = parse(head, path)
    axes = [axis.name for axis in declared.meshes[0].axes]
    try:
        module = build_model(declared.models[0], path)
    except Exception as error:  # the user's factory: any failure is theirs to read
        raise InitError(f"cannot build the model `{model}`: {type(error).__name__}: {error}; check that the "
                        "module imports from the output file's folder and that the factory's arguments are "
                        "right") from error
    if module is None or not isinstance(module, torch.nn.Module):
        raise InitError(f"`{model}` did not return a torch.nn.Module: give a factory that returns the model")

    base_path, base = _base_model(module)
    config = getattr(base, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        raise InitError(f"`{model}` has no config with an integer vocab_size: init writes a token-id input "
                        "and needs one; write the .par by hand for this model (see docs/language.md)")
    plan = getattr(config, "base_model_tp_plan", None) or {}

    lines = [f"# Written by `pardsl init {model}`: a starting point to edit, checked to compile."]
    if plan:
        lines.append(f"# Layouts from the model's tensor-parallel plan (config.base_model_tp_plan, {len(plan)} "
                     "entries); what it leaves out is replicated.")
    else:
        lines.append("# The model has no tensor-parallel plan (config.base_model_tp_plan): this is a search "
                     "request, the compiler chooses every layout within the memory bound.")
    lines.append(head.rstrip("\n"))
    lines.append(f"input  input_ids : int64[{batch}, {seq}] in [0, {vocab})")
    if not plan:
        lines += [f"memory <= {memory}", "", "layout {}"]
        return _checked("\n".join(lines) + "\n", path, planned=False)

    axis = "tp" if "tp" in axes else axes[-1]
    on_axis = f" @ {axis}" if len(axes) > 1 else ""
    entries, comments = _layouts(module, base_path, plan)
    width = max((len(name) for name in entries), default=0)
    lines += ["", "layout {"]
    lines += [f"    # {comment}" for comment in comments]
    lines += [f"    {name:<{width}} : {layout}{on_axis}" for name, layout in entries.items()]
    lines += [f"    {'output':<{width}} : B{on_axis}", "}"]
    return _checked("\n".join(lines) + "\n", path, planned=True)


def _checked(text: str, path: str, planned: bool) -> Generated:
    compile_text(text, path)  # raises CompileError located in `text`
    return Generated(text, planned)


def _base_model(module: torch.nn.Module) -> tuple[str, torch.nn.Module]:
    """The transformers base model (LlamaModel inside LlamaForCausalLM, inside any wrapper) and its path:
    the plan's keys are relative to it."""
    import transformers

    for name, sub in module.named_modules():
        if isinstance(sub, transformers.PreTrainedModel):
            base = sub.base_model
            for inner, candidate in module.named_modules():
                if candidate is base:
                    return inner, base
    raise InitError("the model holds no transformers PreTrainedModel: init reads the tensor-parallel plan from "
                    "one; give a factory that builds a Hugging Face model, or write the .par by hand")


def _matches(pattern: str, name: str) -> bool:
    """Whether a plan key (`*` for a layer's index) names `name`, as the same name in a layout does."""
    return name_pattern(pattern).fullmatch(name) is not None


def _layouts(module: torch.nn.Module, base_path: str, plan: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """Each plan entry's parameters with their layouts (names with `*` as the plan has them), and a comment
    for each entry with no layout equivalent."""
    prefix = f"{base_path}." if base_path else ""
    modules = dict(module.named_modules())
    parameters = dict(module.named_parameters())
    entries: dict[str, str] = {}
    comments: list[str] = []
    for key, style in plan.items():
        pattern = prefix + key
        found = [name for name in parameters if _matches(pattern, name)]
        if found:  # the key names a parameter itself (a mixture of experts' stacked weights)
            weights = {"": parameters[found[0]]}
            owner = None
        else:
            owners = [name for name in modules if _matches(pattern, name)]
            if not owners:
                comments.append(f"{pattern}: {style} (matches nothing in the model)")
                continue
            owner = modules[owners[0]]
            weights = dict(owner.named_parameters(recurse=False))
            if not weights:
                comments.append(f"{pattern}: {style} (no parameters of its own: its parameters' entries lay it out)")
                continue
        for leaf, tensor in weights.items():
            layout = _layout(style, leaf, tensor, owner)
            if layout is None:
                named = any(prefix + other == f"{pattern}.{leaf}" for other in plan)
                comments.append(f"{pattern}: {style}" + (" (its weights' own entries lay them out)" if named else
                                                         " has no layout equivalent; left to the compiler"))
                break
            entries[f"{pattern}.{leaf}" if leaf else pattern] = layout
    return entries, comments


def _layout(style: str, leaf: str, tensor: torch.Tensor, owner: torch.nn.Module | None) -> str | None:
    """The layout of one parameter under a plan style, or None where pardsl has no equivalent."""
    if style in REPLICATED:
        return "B"
    bias = leaf == "bias"
    if isinstance(owner, torch.nn.Embedding):  # [vocabulary, features]: its "columns" are the features
        return {"colwise": "S(1)", "rowwise": "S(0)", "embedding_rowwise": "S(0)"}.get(style)
    if owner is not None and not isinstance(owner, torch.nn.Linear):
        return None  # a weight of another form (GPT-2's Conv1D is [in, out]): the compiler chooses
    last = tensor.dim() - 1
    if style in COLUMN:
        return "S(0)" if bias else f"S({last - 1})"
    if style in ROW:
        return "B" if bias else f"S({last})"
    if style == "packed_colwise":  # gate and up stacked on the output features: each rank its half of both
        return "S(0, blocks=2)" if bias else f"S({last - 1}, blocks=2)"
    if style == "packed_rowwise":
        return "B" if bias else f"S({last}, blocks=2)"
    return None
