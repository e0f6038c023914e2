"""The model from its `model` line: its module imported from the .par file's folder (and only while its
code runs), its factory called, its parameters on the meta device where no values are needed; and the
serial model's full state and example inputs, for the ranks that shard them."""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.machinery
import os
import stat
import sys

import torch

from pardsl.language.diagnostics import DiagnosticSink
from pardsl.language.syntax import InputDecl, ModelDecl

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "float64": torch.float64, "double": torch.float64,
    "float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}


@contextlib.contextmanager
def import_paths(*paths: str):
    """`paths` importable while the model's code is imported and run, and only then; a folder any user may
    write to is never added (a module planted there would run as this user)."""
    added = [p for p in paths if p not in sys.path and not writable_by_anyone(p)]
    sys.path[:0] = added
    try:
        yield
    finally:
        for p in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(p)


def writable_by_anyone(folder: str) -> bool:
    try:
        return bool(os.stat(folder).st_mode & stat.S_IWOTH)
    except OSError:
        return False


def par_import_paths(par_path: str, module: str) -> tuple[str, ...]:
    """Where the model's module is imported from, beyond what is importable already: the .par file's folder,
    and where that folder lies inside the module's own package (`examples/mlp.par` naming
    `examples.models`), the folder that holds the package. Never the working directory."""
    folder = os.path.dirname(os.path.abspath(par_path))
    parts = folder.split(os.sep)
    packages = module.split(".")[:-1]
    for depth in range(len(packages), 0, -1):
        if parts[-depth:] == packages[:depth]:
            return folder, os.sep.join(parts[:-depth]) or os.sep
    return (folder,)


def load_factory(decl: ModelDecl, par_path: str, sink: DiagnosticSink | None = None):
    """The model factory named by `model module:callable(...)`, or None with a diagnostic."""
    paths = par_import_paths(par_path, decl.module)
    with import_paths(*paths):
        try:
            module = importlib.import_module(decl.module)
        except Exception as error:  # the user's module: any failure is their error to read
            top = decl.module.split(".")[0]
            refused = [p for p in paths if writable_by_anyone(p)
                       and importlib.machinery.PathFinder.find_spec(top, [p]) is not None]
            if refused and isinstance(error, ModuleNotFoundError):
                message = (f"model module `{decl.module}` is not imported from `{refused[0]}`: any user may write "
                           "to that folder, and a module planted there would run as you")
                if sink is None:
                    raise ImportError(message) from error
                sink.error("E023", message, decl.span, "move the .par file and the model's module to a folder of "
                           "your own (not /tmp)")
                return None
            if sink is None:
                raise
            sink.error("E020", f"cannot import model module `{decl.module}`", decl.span,
                       f"{type(error).__name__}: {error}", *_import_notes(decl.module, error, paths))
            return None
    factory = getattr(module, decl.factory, None)
    if not callable(factory):
        if sink is None:
            raise AttributeError(f"{decl.module} has no callable {decl.factory}")
        candidates = [n for n in dir(module) if callable(getattr(module, n, None)) and not n.startswith("_")]
        notes = [f"did you mean `{m}`?" for m in difflib.get_close_matches(decl.factory, candidates, 1)]
        sink.error("E021", f"module `{decl.module}` has no callable `{decl.factory}`", decl.factory_span, *notes)
        return None
    return factory


def _import_notes(module: str, error: Exception, paths: tuple[str, ...]) -> list[str]:
    """Where the module was looked for and how to make it importable, when it was not found (a module that
    was found but raised, or imports a package that is missing, says so in the error itself)."""
    missing = getattr(error, "name", None)
    if not isinstance(error, ModuleNotFoundError) or not missing or \
            not (module == missing or module.startswith(missing + ".")):
        return []
    searched = [f"`{p}`" + (" (skipped: any user may write to it)" if writable_by_anyone(p) else "") for p in paths]
    first = module.split(".")[0]
    where = f"`{first}/`" if "." in module else f"`{first}.py`"
    beside = f"the folder that holds {where}" + (f" or in `{first}/` itself" if "." in module else "")
    return [f"looked in {', '.join(searched)} (the .par file's folder"
            + (", and the folder holding its package" if len(paths) > 1 else "")
            + "), then in Python's own path: PYTHONPATH and the installed packages",
            f"to import it, put the .par file in {beside}, install its project (`pip install -e .` there), "
            f"or add the folder that holds {where} to PYTHONPATH"]


def build_model(decl: ModelDecl, par_path: str, sink: DiagnosticSink | None = None) -> torch.nn.Module | None:
    factory = load_factory(decl, par_path, sink)
    if factory is None:
        return None
    with import_paths(*par_import_paths(par_path, decl.module)):
        try:
            model = factory(**dict(decl.kwargs))
        except (Exception, SystemExit) as error:  # the user's code; sys.exit() there ends no compile
            if sink is None:
                raise
            sink.error("E022", f"`{decl.text}` raised {type(error).__name__}", decl.span, str(error))
            return None
    if not isinstance(model, torch.nn.Module):
        if sink is None:
            raise TypeError(f"{decl.text} returned {type(model).__name__}, not an nn.Module")
        sink.error("E022", f"`{decl.text}` returned {type(model).__name__}, not an nn.Module", decl.span)
        return None
    return model


@contextlib.contextmanager
def parameters_on_meta():
    """Parameters are created on the meta device (no memory, no values); buffers keep theirs.

    Every `nn.Module.register_parameter` (what `self.weight = nn.Parameter(...)` calls) moves the new
    parameter to meta, so a factory builds the model's structure while holding at most one real tensor at
    a time, and initialisers run on meta for nothing. Buffers stay real: some have no other source (rotary
    frequencies are computed in __init__ and are in no checkpoint).
    """
    original = torch.nn.Module.register_parameter

    def register(module, name, parameter):
        if parameter is not None and parameter.device.type != "meta":
            parameter = type(parameter)(parameter.to("meta"), requires_grad=parameter.requires_grad)
        original(module, name, parameter)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by every name: tied weights under each, non-persistent buffers
    (rotary frequencies) too; what `load_full_state_dict` of a generated module takes."""
    full = {name: t.detach() for name, t in model.named_parameters(remove_duplicate=False)}
    full.update((name, t.detach()) for name, t in model.named_buffers(remove_duplicate=False))
    return full


def make_inputs(decls: tuple[InputDecl, ...], generator: torch.Generator) -> list[torch.Tensor]:
    """Example inputs from the `input` declarations: normal floats, uniform integers in their range."""
    tensors = []
    for decl in decls:
        dtype = DTYPES[decl.dtype]
        if dtype.is_floating_point:
            tensors.append(torch.randn(decl.shape, generator=generator).to(dtype))
        elif dtype == torch.bool:
            tensors.append(torch.randint(0, 2, decl.shape, generator=generator).bool())
        else:
            low, high = decl.value_range
            tensors.append(torch.randint(low, high, decl.shape, generator=generator, dtype=dtype))
    return tensors
