"""`pardsl init`: a starting .par file for a Hugging Face model, its layouts read from the tensor-parallel
plan the model's own config carries (`config.base_model_tp_plan`), or, where it carries none, a search
request. The file is compiled before it is written, so what `init` writes is known to compile."""

from __future__ import annotations

import ast
import difflib
import functools
import importlib
import inspect
import json
import keyword
import math
import re
from dataclasses import dataclass, field

import torch

from pardsl.compiler import CompileError, compile_text
from pardsl.language.syntax import parse
from pardsl.model.binding import name_pattern
from pardsl.model.loading import build_model, parameters_on_meta
from pardsl.planning.recipes import fused_parameters

# Plan styles whose weights are split on their output features (a linear's weight is [..., out, in]).
COLUMN = {"colwise", "colwise_rep", "colwise_gather_output", "local_colwise"}
ROW = {"rowwise", "rowwise_rep", "rowwise_split_input", "local_rowwise"}
# Whole on every rank: a norm that reads this rank's heads, MLA's shared key projection, a scale. Their
# gradients are summed over the ranks where they are partial: the compiler finds where.
REPLICATED = {"replicated_with_grad_allreduce", "mla_kv_a_proj", "replicate"}
# Styles that lay out a module's output, its own parameters whole: a norm run on the sequence split over
# the ranks (Megatron's sequence parallelism), or a module whose partial sums are added up.
OUTPUTS = {"sequence_parallel": "S(1)", "all_reduce": "B", "gather": "B"}


class InitError(Exception):
    """Why no file can be made: the message says where and what to do."""


# A config class named instead of a factory is built small, so that compiling it is quick: one layer of each
# kind, fewer heads, experts and tokens than the class's defaults. A head's own sizes stay the defaults
# (head_dim, the rotary and latent dims), which families check against each other (rotary sections that sum
# to half a head). The names are the configs' own; the file's `model` line lists those set, to edit to the
# real sizes.
COUNTS = {
    "vocab_size": 256, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 128,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "num_local_experts": 4, "num_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "top_k_experts": 2, "n_shared_experts": 1, "n_group": 1,
    "topk_group": 1, "first_k_dense_replace": 0, "vocab_size_per_layer_input": 256, "num_kv_shared_layers": 0,
    "n_layer": 1, "n_head": 4,  # GPT-2's names
    # pardsl's fused attention takes no dropout (E060), and a starting plan has no key-value cache to return
    "attention_dropout": 0.0, "attn_pdrop": 0.0, "attention_probs_dropout_prob": 0.0, "use_cache": False,
}
# The codes of a model that refuses the inputs it is given: `forward` has no such argument, or fails traced
REFUSED_INPUTS = {"E034", "E035"}
# Token ids a config holds: past a small vocabulary they would index outside the embedding (padding_idx).
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def _small(cls: type) -> dict:
    """The settings that make a config class's model small, from its constructor's defaults: a count where
    the default is a count, or None where a count may be given (not a list: a size per layer)."""
    parameters = inspect.signature(cls).parameters
    defaults = {name: parameter.default for name, parameter in parameters.items()}
    settings = {name: value for name, value in COUNTS.items() if name in parameters
                and (type(parameters[name].default) is type(value) or parameters[name].default is None
                     and re.search(rf"(?<![\w\[]){type(value).__name__}\b", str(parameters[name].annotation)))}
    for hidden_name, heads_name in (("hidden_size", "num_attention_heads"), ("n_embd", "n_head")):
        heads = defaults.get(heads_name)
        if not (isinstance(heads, int) and isinstance(defaults.get(hidden_name), int)):
            continue
        head_dim = defaults.get("head_dim") or defaults[hidden_name] // heads
        settings[hidden_name] = settings[heads_name] * head_dim
        if "head_dim" in defaults:  # None: made from the hidden size, which changes here
            settings["head_dim"] = head_dim
        if "num_key_value_heads" in defaults:  # grouped where the family groups them (None: as many as queries)
            grouped = isinstance(defaults["num_key_value_heads"], int) and defaults["num_key_value_heads"] != heads
            settings["num_key_value_heads"] = 2 if grouped else settings[heads_name]
    if "layer_types" in defaults:  # one layer of each kind (sliding and full attention, linear, ...)
        try:
            kinds = list(dict.fromkeys(getattr(cls(), "layer_types", None) or []))
        except Exception:  # defaults the class itself refuses: its layers' kinds stay its own
            kinds = []
        if kinds:
            settings.update(num_hidden_layers=len(kinds), layer_types=kinds)
    if isinstance(defaults.get("expert_layer_period"), int):  # Jamba: experts every k-th layer, from an offset
        # two layers, the second with the experts (and attention, where that too comes every k-th): each kind
        # the plan names is in the model
        settings.update(num_hidden_layers=2, expert_layer_period=2, expert_layer_offset=1)
        if isinstance(defaults.get("attn_layer_period"), int):
            settings.update(attn_layer_period=2, attn_layer_offset=1)
    settings.update({name: 0 for name in TOKEN_IDS
                     if isinstance(defaults.get(name), int) and defaults[name] >= settings.get("vocab_size", 0)})
    return settings


def hf_model(config: str, forward_arguments: dict | None = None, **settings) -> torch.nn.Module:
    """transformers' model for its config class named `config` ("LlamaConfig"), `settings` over the class's
    defaults: the causal language model where the family has one, its base model otherwise. Its forward
    takes `forward_arguments` as given, arguments that are no tensors (a count of patches)."""
    model = _hf_model(config, settings)
    if forward_arguments:
        model.forward = functools.partial(model.forward, **forward_arguments)
    return model


def _hf_model(config: str, settings: dict) -> torch.nn.Module:
    import transformers

    made = getattr(transformers, config)(**settings)
    model = _model_of(made)
    if model is not None:
        return model
    # A part that only a larger model builds (T5Gemma's encoder and decoder modules, whose classes are
    # typed with the whole model's config): that model, each of its parts of this kind made from `made`
    configuration = importlib.import_module(type(made).__module__)
    for whole in vars(configuration).values():
        slots = [slot for slot, part in (getattr(whole, "sub_configs", None) or {}).items() if part is type(made)] \
            if isinstance(whole, type) and issubclass(whole, transformers.PretrainedConfig) else []
        try:
            model = _model_of(whole(**{slot: made.to_dict() for slot in slots})) if slots else None
        except Exception:  # a class that does not take the part so: another may
            continue
        if model is not None:
            return model
    raise ValueError(f"no model class of transformers takes {config} (neither an Auto class nor "
                     f"{type(made).__module__.replace('.configuration_', '.modeling_')}), nor a config that has "
                     "it as a part")


def _model_of(made) -> torch.nn.Module | None:
    """The model transformers builds for config `made`: the causal language model where the family has one,
    its base model otherwise; None where no class takes it."""
    import transformers

    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        try:
            return auto.from_config(made)
        except ValueError:  # not this Auto class's (an encoder has no causal LM)
            continue
    # A part of a larger model (the text model of a vision-language one): no Auto class maps its config,
    # its family's modeling module has the class
    family = importlib.import_module(type(made).__module__.replace(".configuration_", ".modeling_"))
    classes = [cls for cls in vars(family).values() if isinstance(cls, type)
               and issubclass(cls, transformers.PreTrainedModel) and cls.config_class is type(made)
               and cls.forward is not torch.nn.Module.forward]  # not the family's abstract base
    classes.sort(key=lambda cls: (not cls.__name__.endswith("ForCausalLM"), not cls.__name__.endswith("Model")))
    return classes[0](made) if classes else None


def settings_given(pairs: list[str], option: str = "--set") -> dict:
    """`--set NAME=VALUE` (or --argument) pairs as a dict: VALUE a Python literal (0.5, "yarn", [8, 12, 12],
    {"rope_type": "default"}), or a bare word taken as a string (--set hidden_act=silu)."""
    settings = {}
    example = "--set partial_rotary_factor=0.5" if option == "--set" else f"{option} num_patches=16"
    for pair in pairs:
        name, equals, text = (part.strip() for part in pair.partition("="))
        if not equals or not (name.isascii() and name.isidentifier()) or keyword.iskeyword(name) \
                or name in ("config", "forward_arguments") or not text:
            raise InitError(f"{option} {pair!r}: give NAME=VALUE, the name one of the "
                            f"{'config' if option == '--set' else 'forward'}'s arguments ({example})")
        if re.fullmatch(r"[A-Za-z_][\w.\-]*", text) and text not in ("True", "False", "None"):
            value = text  # a bare word: a string, as a shell user writes it
        else:
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError, RecursionError, MemoryError) as error:
                raise InitError(f"{option} {pair!r}: {text!r} is no Python literal ({type(error).__name__}); "
                                f"quote a string in the shell: {option} 'NAME=\"text\"'") from None
        if not _writable(value):
            raise InitError(f"{option} {pair!r}: the model line takes numbers, strings, True, False, None, and "
                            "lists, tuples and dicts of them with string keys")
        settings[name] = value
    return settings


def _writable(value, depth: int = 0) -> bool:
    """Whether the .par `model` line can write `value` as it is."""
    if depth > 32:
        return False
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_writable(item, depth + 1) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _writable(item, depth + 1) for key, item in value.items())
    return False


def small_model_line(config: str, settings: dict | None = None,
                     arguments: dict | None = None) -> tuple[str, list[str]]:
    """The `model` line's factory call that builds transformers' config class `config` small (`_small`),
    `settings` over it (the real model's values for what the class's defaults leave out or get wrong), its
    forward taking `arguments`; and notes on settings the class does not know."""
    import transformers

    settings = settings or {}
    cls = getattr(transformers, config, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PretrainedConfig)):
        raise InitError(f"`{config}` is no config class of transformers {transformers.__version__}: give a config "
                        "class's name (LlamaConfig) or a factory, module:factory(kwargs)")
    # A multimodal model: each part (language, vision, audio) has a config class of its own, built small as
    # its settings; the model is then traced on text alone, its other parts' weights laid out unused
    parts = {name: _small_part(sub) for name, sub in (cls.sub_configs or {}).items()
             if isinstance(sub, type) and issubclass(sub, transformers.PretrainedConfig)}
    for name, value in settings.items():  # a part's settings go over its small sizes, not in their place
        if name in parts:
            parts[name] = {**parts[name], **value} if isinstance(value, dict) else value
    notes = [f"{name} is not a setting `{config}` reads: set as given (check its spelling)"
             for name in settings if name not in parts and not _known(cls, name, settings[name])]
    listed = [f'config="{config}"', *(f"{name}={_literal(value)}"
                                       for name, value in {**_small(cls), **settings, **parts}.items())]
    if arguments:
        listed.append(f"forward_arguments={_literal(arguments)}")
    return f"pardsl.tools.init:hf_model({', '.join(listed)})", notes


def _known(cls: type, name: str, value) -> bool:
    """Whether the config class reads setting `name`: a keyword of its constructor, an attribute of its
    defaults, or a value it folds into another (rope_theta into rope_parameters). A config keeps any
    keyword as an attribute, so a misspelt name would otherwise pass unseen."""
    if name in inspect.signature(cls).parameters:
        return True
    try:
        defaults = cls()
        given = cls(**{name: value}).to_dict()
    except Exception:  # defaults the class itself refuses: nothing to check the name against
        return True
    if hasattr(defaults, name):
        return True
    before = defaults.to_dict()
    return any(given.get(key) != before.get(key) for key in given if key != name)


def _small_part(cls: type) -> dict:
    """A multimodal model's part built small where its class takes init's sizes; its own defaults where they
    contradict its other settings (an audio encoder with a size per layer): the model is traced on text, so
    the other parts' sizes cost nothing."""
    settings = _small(cls)
    try:
        cls(**settings)
    except Exception:
        return {name: value for name, value in settings.items() if name in TOKEN_IDS}
    return settings


def _literal(value) -> str:
    """`value` as the `model` line writes it: strings in double quotes, lists in brackets."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_literal(item) for item in value) + "]"
    if isinstance(value, tuple):
        return "(" + "".join(f"{_literal(item)}, " for item in value).rstrip(" ") + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(key))}: {_literal(item)}" for key, item in value.items()) + "}"
    return repr(value)


@dataclass
class Generated:
    text: str
    planned: bool  # layouts from the model's plan; False: a search request
    notes: list[str] = field(default_factory=list)  # what the user should know about the file written


def generate(model: str, path: str, mesh: str = "tp = 2", seq: int = 16, batch: int = 2,
             memory: str = "40 %", settings: dict | None = None, inputs: list[str] | None = None,
             arguments: dict | None = None) -> Generated:
    """The .par text for `model` (a `module:factory(kwargs)` as the `model` line takes it, or the name of a
    transformers config class, built small by `hf_model`), to be written at `path` (the model's module is
    imported as it will be from there). `inputs` (`NAME : DTYPE[SIZES]`, as after an `input` keyword) are
    the inputs the file declares, in place of those init would try; `arguments`, the forward's arguments
    that are no tensors, fixed (a config class's model only). Raises InitError, or CompileError located in
    the generated text."""
    asked = model
    notes: list[str] = []
    if ":" not in model and model.isidentifier():  # a config class's name: its model, built small
        model, notes = small_model_line(model, settings, arguments)
    elif settings or arguments:
        raise InitError(f"--set and --argument are for a config class's model; `{model}` is a factory: give the "
                        "settings as its arguments, and fix the forward's in the module it returns")
    head = f"mesh   {mesh}\nmodel  {model}\n"
    declared = parse(head, path)
    axes = [axis.name for axis in declared.meshes[0].axes]
    try:
        with parameters_on_meta():  # names and shapes are all init reads: a model of any size costs nothing
            module = build_model(declared.models[0], path)
    except Exception as error:  # the user's factory, or transformers' own classes: any failure is theirs to read
        advice = (f"transformers does not build `{asked}` from its defaults with init's small sizes; give your "
                  "model's values for the settings it names with --set NAME=VALUE (or a factory that builds "
                  "it)") if asked != model else \
            "check that the module imports from the output file's folder and that the factory's arguments are right"
        raise InitError(f"cannot build the model `{model}`: {type(error).__name__}: {error}; {advice}") from error
    if module is None or not isinstance(module, torch.nn.Module):
        raise InitError(f"`{model}` did not return a torch.nn.Module: give a factory that returns the model")

    given = _given_inputs(inputs or [], head, path)
    _check_arguments(module, arguments or {}, {decl.name for decl in given})
    base_path, base = _base_model(module)
    config = getattr(base, "config", None)
    try:  # a multimodal model's language part, where it has one
        text_config = config.get_text_config()
    except Exception:  # no config, or several text parts (an encoder's and a decoder's): the model's own
        text_config = config
    forms = [[f"input  {' '.join(text.split())}" for text in inputs]] if given else \
        _input_forms(module, config, text_config, batch, seq)
    if not forms:
        accepted = ", ".join(inspect.signature(module.forward).parameters)
        raise InitError(f"`{model}` takes none of the inputs init writes (token ids with the config's integer "
                        "vocab_size, embeddings [batch, tokens, hidden_size], an image [batch, num_channels, "
                        f"image_size, image_size]): its forward takes ({accepted}); give the inputs it takes "
                        "with --input, one each: --input \"NAME : float32[2, 16, 512]\" (see docs/language.md)")
    plans, unplaced = _plans(module, base_path, config)
    plan = {key: style for _, part_plan in plans for key, style in part_plan.items()}

    lines = [f"# Written by `pardsl init {asked}`: a starting point to edit, checked to compile."]
    if plan:
        lines.append(f"# Layouts from the model's tensor-parallel plan (config.base_model_tp_plan, {len(plan)} "
                     "entries); the compiler lays out what it leaves out.")
    else:
        lines.append("# The model has no tensor-parallel plan (config.base_model_tp_plan): this is a search "
                     "request, the compiler chooses every layout within the memory bound.")
    lines += [f"# {part}" for part in unplaced]
    lines.append(head.rstrip("\n"))
    before_inputs, lines = lines, []
    if not plan:
        lines += [f"memory <= {memory}", "", "layout {}"]
        return _checked(before_inputs, lines, path, forms, planned=False, notes=notes)

    axis = "tp" if "tp" in axes else axes[-1]
    on_axis = f" @ {axis}" if len(axes) > 1 else ""
    entries, comments = {}, []
    for root, part_plan in plans:
        part_entries, part_comments = _layouts(module, root, part_plan)
        entries.update(part_entries)
        comments += part_comments

    def block_lines(entries: dict[str, str], comments: list[str]) -> list[str]:
        width = max((len(name) for name in entries), default=0)
        return [*lines, "", "layout {", *(f"    # {comment}" for comment in comments),
                *(f"    {name:<{width}} : {layout}{on_axis}" for name, layout in entries.items()),
                f"    {'output':<{width}} : B{on_axis}", "}"]

    generated, compiled = _checked_compiled(before_inputs, block_lines(entries, comments), path, forms, True, notes)
    blocked = _in_blocks(compiled.bound, entries)
    if not blocked:
        return generated
    comments.append("split in blocks where the model cuts a projection's output into parts (fused q, k and "
                    "v; gate and up), so that each rank holds its share of every part: "
                    + ", ".join(name.rsplit(".", 1)[0].rsplit(".", 1)[-1] for name in dict.fromkeys(
                        name for name in blocked if not name.endswith("bias"))))
    entries = {name: _blocked_layout(layout, blocked[name]) if name in blocked else layout
               for name, layout in entries.items()}
    try:
        return _checked(before_inputs, block_lines(entries, comments), path, forms, planned=True, notes=notes)
    except CompileError:  # the blocks do not divide over the mesh (say): the plain split compiled
        return generated


def _in_blocks(bound, entries: dict[str, str]) -> dict[str, int | tuple[int, ...]]:
    """The entries written plainly split along the output features of a fused projection (a column-parallel
    weight or bias whose output the model cuts into parts: q, k and v; gate and up), with the parts (a
    count of equal ones, or the sizes of unequal ones: q, k and v under grouped-query attention):
    split plainly, each rank held parts of other ranks' q, k or v, and the cut exchanged them (all-to-all)."""
    fused = fused_parameters(bound)
    found = {}
    for name, layout in entries.items():
        split = re.fullmatch(r"S\((\d+)\)", layout)
        matched = [fused[path] for path in fused if _matches(name, path)] if split else []
        if matched and all(part == matched[0] for part in matched) and int(split.group(1)) == matched[0][1]:
            found[name] = matched[0][0]
    return found


def _blocked_layout(layout: str, parts: int | tuple[int, ...]) -> str:
    return layout[:-1] + (f", blocks=[{', '.join(map(str, parts))}])" if isinstance(parts, tuple) else f", blocks={parts})")


def _check_arguments(module: torch.nn.Module, arguments: dict, inputs: set[str]) -> None:
    """Each --argument names one of the forward's own arguments, and no input: given to a forward that
    takes **kwargs, a misspelt name would pass unread, and the model run with the argument's default."""
    forward = module.forward.func if isinstance(module.forward, functools.partial) else module.forward
    parameters = inspect.signature(forward).parameters
    names = [name for name, p in parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    for name in arguments:
        if name in inputs:
            raise InitError(f"--argument {name}: is declared as an input too")
        if name not in names:
            close = difflib.get_close_matches(name, names, 1)
            raise InitError(f"--argument {name}: is not an argument of the model's forward({', '.join(names)})"
                            + (f"; did you mean {close[0]}?" if close else ""))


def _given_inputs(inputs: list[str], head: str, path: str) -> list:
    """The --input texts' declarations, each text checked to be one input as the .par declares it after
    `input` (parsed below the file's `mesh` and `model` lines, which a file must have)."""
    given = []
    for text in inputs:
        try:
            declared = parse(f"{head}input  {text}\n", path).inputs
        except CompileError:
            declared = []
        if len(declared) != 1 or "\n" in text:
            raise InitError(f"--input {text!r}: give one input as the .par declares it after `input`: NAME : "
                            "DTYPE[SIZES], and `in [LO, HI)` for integers (--input \"t_cond : float32[1, 512]\")")
        given += declared
    return given


def _input_forms(module: torch.nn.Module, config, text_config, batch: int, seq: int) -> list[list[str]]:
    """The input lines a model may take, in the order init tries them: token ids; the encoder's and the
    decoder's token ids for an encoder-decoder model; embeddings where the forward takes them (a model fed
    by another's hidden states: a speech model's talker); token ids with the encoder's states for a decoder
    built alone; an image for a vision encoder."""
    accepted = inspect.signature(module.forward).parameters
    vocab = getattr(text_config, "vocab_size", None)
    hidden = getattr(text_config, "hidden_size", None)
    tokens = f"input  input_ids : int64[{batch}, {seq}] in [0, {vocab})"
    forms = []
    if isinstance(vocab, int) and "input_ids" in accepted:
        forms.append([tokens])
    if isinstance(vocab, int) and "input_ids" in accepted and "decoder_input_ids" in accepted:
        forms.append([tokens, f"input  decoder_input_ids : int64[{batch}, {seq}] in [0, {vocab})"])
    if isinstance(hidden, int) and "inputs_embeds" in accepted:
        forms.append([f"input  inputs_embeds : float32[{batch}, {seq}, {hidden}]"])
    if isinstance(vocab, int) and isinstance(hidden, int) and "encoder_hidden_states" in accepted:
        forms.append([tokens, f"input  encoder_hidden_states : float32[{batch}, {seq}, {hidden}]"])
    size, channels = getattr(config, "image_size", None), getattr(config, "num_channels", None)
    if isinstance(size, int) and isinstance(channels, int) and "pixel_values" in accepted:
        forms.append([f"input  pixel_values : float32[{batch}, {channels}, {size}, {size}]"])
    return forms


def _checked(before: list[str], after: list[str], path: str, forms: list[list[str]], planned: bool,
             notes: list[str]) -> Generated:
    """The file's lines with the first input form the model is traced with between them (_checked_compiled)."""
    return _checked_compiled(before, after, path, forms, planned, notes)[0]


def _checked_compiled(before: list[str], after: list[str], path: str, forms: list[list[str]], planned: bool,
                      notes: list[str]):
    """The file's lines with the first input form the model is traced with between them, and its compile.
    Only a form the forward refuses (no such argument, a failure while traced) moves on to the next: any
    other error is the plan's, and is raised. Where a later form is kept, the file and a note say what the
    first one met."""
    first_error = None
    for form in forms:
        text = "\n".join([*before, *form, *after]) + "\n"
        try:
            compiled = compile_text(text, path)  # raises CompileError located in `text`
        except CompileError as error:
            if not all(diagnostic.code in REFUSED_INPUTS for diagnostic in error.diagnostics):
                raise
            first_error = first_error or error
            continue
        if first_error is not None:
            refused = first_error.diagnostics[0]
            detail = " ".join((refused.notes[-1] if refused.notes else refused.message).split())
            detail = detail if len(detail) <= 160 else detail[:157] + "..."
            why = f"{forms[0][0].split(':')[0].split()[-1]} refused ({refused.code}: {detail})"
            note = f"{why}; the file declares the first input the model takes instead"
            text = "\n".join([*before, f"# {note}", *form, *after]) + "\n"
            notes = [*notes, note]
        return Generated(text, planned, notes), compiled
    raise first_error


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


def _plans(module: torch.nn.Module, base_path: str, config) -> tuple[list[tuple[str, dict[str, str]]], list[str]]:
    """Each tensor-parallel plan in the model with the module path its keys are relative to: the model's own,
    then each part's (a multimodal model's language model carries its plan in its own config); and a line
    for each part's plan that no Hugging Face model inside it carries, which the file says it leaves out."""
    plans = [(_plan_root(module, base_path, own), own)] if (own := getattr(config, "base_model_tp_plan", None)) \
        else []
    unplaced = []
    import transformers

    for name in getattr(config, "sub_configs", {}) or {}:
        part = getattr(config, name, None)
        part_plan = getattr(part, "base_model_tp_plan", None)
        if not part_plan:
            continue
        holders = [path for path, sub in module.named_modules()
                   if isinstance(sub, transformers.PreTrainedModel) and sub.config is part]
        if not holders:
            unplaced.append(f"The plan of `{name}` ({type(part).__name__}, {len(part_plan)} entries) is left out: "
                            "no Hugging Face model inside it carries that config to put its entries under.")
            continue
        holder = min(holders, key=lambda path: path.count("."))  # the part itself, not a model inside it
        plans.append((_plan_root(module, holder, part_plan), part_plan))
    return plans, unplaced


def _plan_root(module: torch.nn.Module, base_path: str, plan: dict[str, str]) -> str:
    """The module path the plan's keys are relative to: the base model's, unless its keys match more under
    a submodule of it (Llama 4's causal LM is its own base model; its plan's `layers.*` are under `model`)."""
    names = [name for name, _ in module.named_modules()] + [name for name, _ in module.named_parameters()]
    depth = base_path.count(".") + 1 if base_path else 0
    candidates = [base_path] + [name for name, _ in module.named_modules()
                                if name.startswith(f"{base_path}." if base_path else "") and name
                                and name.count(".") + 1 - depth <= 2]

    def matched(root: str) -> int:
        prefix = f"{root}." if root else ""
        return sum(any(_matches(prefix + key, name) for name in names) for key in plan)

    return max(candidates, key=matched)  # the first of the best: the base model's own path on a tie


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
            if style in OUTPUTS:
                entries[f"{pattern}()"] = OUTPUTS[style]
            if not weights and style in OUTPUTS:
                continue
            if not weights:
                comments.append(f"{pattern}: {style} (no parameters of its own: its parameters' entries lay it out)")
                continue
        for leaf, tensor in weights.items():
            bias = leaf == "bias" or not leaf and pattern.endswith("bias")  # a bias stacked per expert: [E, out]
            layout = _layout(style, bias, tensor, owner)
            if layout is None:
                named = any(prefix + other == f"{pattern}.{leaf}" for other in plan)
                comments.append(f"{pattern}: {style}" + (" (its weights' own entries lay them out)" if named else
                                                         " has no layout equivalent; left to the compiler"))
                break
            entries[f"{pattern}.{leaf}" if leaf else pattern] = layout
    return entries, comments


def _layout(style: str, bias: bool, tensor: torch.Tensor, owner: torch.nn.Module | None) -> str | None:
    """The layout of one parameter (a weight [..., out, in] or a bias [..., out]) under a plan style, or None
    where pardsl has no equivalent."""
    if style in REPLICATED or style in OUTPUTS:
        return "B"
    if isinstance(owner, torch.nn.Embedding):  # [vocabulary, features]: its "columns" are the features
        return {"colwise": "S(1)", "rowwise": "S(0)", "embedding_colwise": "S(1)", "embedding_rowwise": "S(0)"}.get(style)
    if owner is not None and not isinstance(owner, torch.nn.Linear):
        return None  # a weight of another form (GPT-2's Conv1D is [in, out]): the compiler chooses
    last = tensor.dim() - 1
    if style in COLUMN:
        return f"S({last})" if bias else f"S({last - 1})"
    if style in ROW:
        return "B" if bias else f"S({last})"
    if style == "packed_colwise":  # gate and up stacked on the output features: each rank its half of both
        return f"S({last}, blocks=2)" if bias else f"S({last - 1}, blocks=2)"
    if style == "packed_rowwise":
        return "B" if bias else f"S({last}, blocks=2)"
    return None
