"""Outside text in the generated module: the .par file's name, submodule and parameter names, output paths
and the model's arguments reach it only escaped, so that none can end a comment or a string and start a
statement. Config-driven models key their heads by name (an nn.ModuleDict), and a name is any string.

The models here are referenced from the .par texts as `tests.test_codegen_escaping:...`.
"""

import ast
import builtins
import functools
import importlib.util
import io
import json
import keyword
import tokenize

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pardsl import cli
from pardsl.compiler import compile_text
from pardsl.program.ir import comment_text, python_literal


class Keyed(nn.Module):
    """A body and one head keyed by `key`, its output keyed alike."""

    def __init__(self, key: str = "head", d: int = 8):
        super().__init__()
        self.body = nn.Linear(d, d)
        self.heads = nn.ModuleDict({key: nn.Sequential(nn.Linear(d, d), nn.ReLU())})

    def forward(self, x):
        h = self.body(x)
        return {key: head(h) for key, head in self.heads.items()}


class KeyedLayers(nn.Module):
    """Two layers in a list keyed by `key`: a balanced pipeline cuts before the second, `layers.<key>.1`."""

    def __init__(self, key: str = "stack", d: int = 8):
        super().__init__()
        self.layers = nn.ModuleDict({key: nn.ModuleList([nn.Linear(d, d) for _ in range(2)])})

    def forward(self, x):
        for layer in next(iter(self.layers.values())):
            x = torch.relu(layer(x))
        return x


# every line break str.splitlines knows (Python's tokenizer ends a line at \n and \r alone; editors and
# other tools at the rest), and other characters a source file should not hold raw
BREAKS = ["\n", "\r", "\r\n", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]
CONTROLS = ["\x00", "\t", "\x1b", "\x7f", "\ufeff", "\x9b", "\ud800", "\udcff"]
INJECTED = 'setattr(__import__("builtins"), "PARDSL_INJECTED", 1)'
# the ways out of a comment, a string or a docstring, and a coding cookie (on the first two lines of a
# file it sets the encoding the file is read in: under utf-7, `+AAo-` is a line break)
PAYLOADS = ["\n" + INJECTED + "#", "\r" + INJECTED, "\r\n" + INJECTED, '"' + INJECTED + '#', "'", '"""', "\\",
            '\\"', "#", " -*- coding: utf-7 -*- ", "coding=utf_7 ", "+AAo-" + INJECTED, "é", "𝔘", "ﬁ", "²"]
PIECES = st.one_of(st.text(max_size=6), st.sampled_from(BREAKS + CONTROLS + PAYLOADS))
TEXT = st.lists(PIECES, max_size=5).map("".join)


def _key_usable(key: str) -> bool:
    """What nn.ModuleDict takes as a key."""
    return bool(key) and "." not in key and not hasattr(nn.ModuleDict(), key)


KEYS = st.lists(PIECES, min_size=1, max_size=5).map("".join).filter(_key_usable)


def _as_read(key: str) -> str:
    """The key as the model receives it from the .par file: JSON reads an escaped surrogate pair as one
    character."""
    return json.loads(json.dumps(key))


def _keyed(key: str) -> str:
    """Keyed over data and tensor parallelism: the head row-parallel, its ops' comments naming it, its
    gradients in a bucket, the head recomputed (a local function named after it); the key passed as a
    string argument (in JSON's escapes)."""
    return (f"mesh dp = 2, tp = 2\nmodel tests.test_codegen_escaping:Keyed(key={json.dumps(key)})\n"
            "input x : float32[8, 8]\nrecompute heads.*\n"
            "layout {\n  x : S(0) @ dp\n  body.weight : S(0) @ tp\n}\n")


def _shape(source: str) -> list[tuple]:
    """The module's tokens with names, strings and comments reduced to their kind: what a name changes."""
    shape = []
    for token in tokenize.tokenize(io.BytesIO(source.encode("utf-8")).readline):
        if token.type in (tokenize.COMMENT, tokenize.STRING):
            shape.append((token.type,))
        elif token.type == tokenize.NAME and not keyword.iskeyword(token.string):
            shape.append((token.type,))
        else:
            shape.append((token.type, token.string))
    return shape


def _run(source: str) -> dict:
    """The module executed as importing its file would: from its bytes, so that a coding cookie counts."""
    namespace = {"__name__": "pardsl_generated"}
    exec(compile(source.encode("utf-8"), "<generated>", "exec"), namespace)
    return namespace


def _assert_contained(source: str, plain: str) -> None:
    """`source` is `plain`'s module with other names: the same statements, nothing run beyond them."""
    assert not hasattr(builtins, "PARDSL_INJECTED")
    assert all(len(line.splitlines()) <= 1 for line in source.split("\n")), "a line break other than \\n"
    assert _shape(source) == _shape(plain)
    assert sorted(_run(source)) == sorted(_run(plain))
    assert not hasattr(builtins, "PARDSL_INJECTED")


@pytest.fixture(autouse=True)
def _no_injection_left():
    yield
    if hasattr(builtins, "PARDSL_INJECTED"):
        del builtins.PARDSL_INJECTED
        pytest.fail("generated code ran text from a name")


# ---- the escaping functions ------------------------------------------------------------------------------

@pytest.mark.parametrize("character", BREAKS + CONTROLS)
def test_a_comment_holds_no_line_break_nor_control_character(character):
    text = comment_text(f"a{character}b")
    assert text.isprintable() and len(text.splitlines()) == 1
    assert text == "a" + "".join(repr(c)[1:-1] for c in character) + "b"  # visible as its escape
    source = f"# {text}\nX = 1\n"
    tokens = [t for t in tokenize.tokenize(io.BytesIO(source.encode("utf-8")).readline)
              if t.type == tokenize.COMMENT]
    assert len(tokens) == 1 and [type(s) for s in ast.parse(source).body] == [ast.Assign]


@pytest.mark.parametrize("character", BREAKS + CONTROLS + ['"', "'", "\\", '"""'])
def test_a_literal_is_the_string_and_one_line(character):
    text = f"a{character}b"
    literal = python_literal(text)
    assert literal.isprintable() and ast.literal_eval(literal) == text


def test_plain_text_is_unchanged():
    assert comment_text("`model.layers.3` is S(0)@tp  [16, 256]") == "`model.layers.3` is S(0)@tp  [16, 256]"
    assert comment_text("examples/é/𝔘.par") == "examples/é/𝔘.par"  # printable text stays as it is
    assert python_literal("model.layers.3.weight") == json.dumps("model.layers.3.weight")
    assert python_literal("tête.𝔘") == '"tête.𝔘"'


def test_a_coding_cookie_in_a_comment_is_no_cookie():
    text = comment_text("from x -*- coding: utf-7 -*- and encoding=latin-1")
    source = f"# {text}\nX = '+AAo-Y = 1'\n"
    namespace = {}
    exec(compile(source.encode("utf-8"), "<cookie>", "exec"), namespace)
    assert namespace["X"] == "+AAo-Y = 1" and "Y" not in namespace


@settings(max_examples=200, deadline=None, derandomize=True)
@given(TEXT)
def test_any_text_escapes_to_one_comment_and_to_a_literal_of_itself(text):
    comment = comment_text(text)
    assert comment.isprintable() and comment_text(comment) == comment
    assert "coding:" not in comment and "coding=" not in comment
    literal = python_literal(text)
    assert literal.isprintable() and ast.literal_eval(literal) == text


# ---- compiled modules ------------------------------------------------------------------------------------

@functools.cache
def _plain() -> tuple[str, str]:
    """Keyed's module, and its module with pieces, for plain names (a function, not a fixture: Hypothesis
    would print a fixture's whole value with each failing example)."""
    compiled = compile_text(_keyed("head"), "plain.par")
    return compiled.source, compiled.source_with_pieces()


def test_a_par_file_name_and_a_head_name_that_hold_code_stay_in_their_comments_and_strings():
    plain = _plain()
    key = "a\n" + INJECTED + "#"
    compiled = compile_text(_keyed(key), "evil\n" + INJECTED + "#.par")
    _assert_contained(compiled.source, plain[0])
    _assert_contained(compiled.source_with_pieces(), plain[1])
    # the names the module declares are the model's: a state dict loads into it
    module = _run(compiled.source)
    assert set(module["PARAMETERS"]) == set(Keyed(key).state_dict())
    assert [path for path, *_ in module["OUTPUTS"]] == [f"output[{key!r}]"]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(path=TEXT, key=KEYS)
def test_any_file_name_head_name_and_argument_give_the_plain_modules_statements(path, key):
    compiled = compile_text(_keyed(key), path + ".par")
    _assert_contained(compiled.source, _plain()[0])
    _assert_contained(compiled.source_with_pieces(), _plain()[1])
    module = _run(compiled.source)
    assert set(module["PARAMETERS"]) == set(Keyed(_as_read(key)).state_dict())


def _pipelined(key: str) -> str:
    return (f"mesh pp = 2\nmodel tests.test_codegen_escaping:KeyedLayers(key={json.dumps(key)})\n"
            "input x : float32[8, 8]\npipeline pp : schedule GPipe, microbatches 2, cut balanced\n")


@functools.cache
def _plain_pipeline() -> str:
    return compile_text(_pipelined("stack"), "plain.par").source


@settings(max_examples=30, deadline=None, derandomize=True)
@given(path=TEXT, key=KEYS.filter(lambda key: not key.isdigit()))  # a number would be a layer's index itself
def test_a_pipeline_cut_before_any_layer_name_gives_the_plain_modules_statements(path, key):
    compiled = compile_text(_pipelined(key), path + ".par")
    _assert_contained(compiled.source, _plain_pipeline())
    assert _run(compiled.source)["PIPELINE"]["cut_before"] == [f"layers.{_as_read(key)}.1"]


def test_compile_writes_a_module_that_imports_without_running_a_names_code(tmp_path):
    """Through the command line, from a real file whose name holds a line break, a coding declaration and
    code; the module written imported from its file."""
    key = "h\r\n" + INJECTED + "#"
    par = tmp_path / ("plan -*- coding: utf-7 -*-\n" + INJECTED + "#.par")
    par.write_text(_keyed(key), encoding="utf-8")
    assert cli.main(["compile", str(par), "-o", str(tmp_path / "out")]) == 0
    written = tmp_path / "out" / "pardsl_module.py"
    _assert_contained(written.read_text(encoding="utf-8"), _plain()[0])
    spec = importlib.util.spec_from_file_location("pardsl_module_escaping", written)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert set(module.PARAMETERS) == set(Keyed(key).state_dict())
    assert not hasattr(builtins, "PARDSL_INJECTED")
