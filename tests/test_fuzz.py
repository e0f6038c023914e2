"""A fuzzer of our own: generated `.par` files through `pardsl check --json`.

Three sources: the small examples mutated (characters and lines deleted, inserted, duplicated; numbers
and placements replaced), files assembled from the grammar's pieces with random names, sizes and
layouts (most ill-typed), and random bytes. Whatever comes in: the exit code is 0 or 1, stdout is one
JSON object, every error is located (line and column) with a known code, there is no traceback or
internal error, and each file takes bounded time.

`make test` runs a modest, derandomized number; `make fuzz` runs PARDSL_FUZZ_EXAMPLES (5,000) of each, 10,000 in all, with a
fresh seed and prints the figures.
"""

import contextlib
import io
import json
import os
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pardsl import cli
from pardsl.diagnostics import ERROR_CODES

EXAMPLES = int(os.environ.get("PARDSL_FUZZ_EXAMPLES", "60"))
SEEDS = ["examples/mlp.par", "examples/mlp_dp.par", "examples/mlp_inferred.par", "examples/mlp_zero3.par",
         "examples/tp_schemes/mlp_2d.par", "examples/tp_schemes/mlp_3d.par", "examples/mlp_pp2.par"]
TEXTS = [open(path, encoding="utf-8").read() for path in SEEDS]
ALPHABET = st.sampled_from(list("abcxyzSBP0123456789[](){}:=,@.*#-_ \n\t\"\\") +
                           ["\f", "\v", "\u2028", "\x85", "\ufeff", "é", "\x00", "𝔘"])
NUMBERS = ["0", "-1", "1", "3", "7", "1000", "99999999999999999999", "2.5"]
PLACEMENTS = ["B", "P", "S(0)", "S(1)", "S(2)", "S(-1)", "S(-3)", "S(0, blocks=2)", "S(1, blocks=0)", "[B, S(0)]",
              "S(0) @ tp", "S(1) @ dp, S(0) @ tp", "S(0) @ zz", "[S(0), S(0), B]"]
NAMES = ["x", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "output", "output[0]", "fc1()", "*.weight",
         "*.*", "norm.weight", "fc3.weight", "up.weight", "head.weight", "y", "enc.weight", "output.logits"]
MODELS = ["examples.models:MLP()", "examples.models:MLP(d_model=16, d_ff=32)", "examples.models:ResidualMLP()",
          "tests.zoo:DictOut()", "tests.zoo:NoneOut()", "tests.zoo:broken(a=1)", "examples.models:Nope()",
          "no_such_module:M()", 'examples.models:MLP(d_model="x")']
DTYPES = ["float32", "float16", "bfloat16", "int64", "int8", "bool", "flaot32"]


@st.composite
def mutated_example(draw):
    text = draw(st.sampled_from(TEXTS))
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["delete", "insert", "line", "number", "placement"]))
        if action == "delete" and text:
            start = draw(st.integers(0, len(text) - 1))
            text = text[:start] + text[start + draw(st.integers(1, 12)):]
        elif action == "insert":
            at = draw(st.integers(0, len(text)))
            text = text[:at] + draw(st.text(ALPHABET, min_size=1, max_size=6)) + text[at:]
        elif action == "line":
            lines = text.split("\n")
            index = draw(st.integers(0, len(lines) - 1))
            lines.insert(draw(st.integers(0, len(lines))), lines[index])
            text = "\n".join(lines)
        elif action == "number":
            digits = [i for i, c in enumerate(text) if c.isdigit()]
            if digits:
                at = draw(st.sampled_from(digits))
                text = text[:at] + draw(st.sampled_from(NUMBERS)) + text[at + 1:]
        else:
            for old in ("S(0)", "S(1)", ": B"):
                if old in text:
                    text = text.replace(old, draw(st.sampled_from(PLACEMENTS)) if old != ": B" else
                                        ": " + draw(st.sampled_from(PLACEMENTS)), 1)
                    break
    return text


@st.composite
def assembled(draw):
    axes = draw(st.lists(st.tuples(st.sampled_from(["tp", "dp", "sp", "zz", "tp"]), st.integers(0, 5)),
                         min_size=0, max_size=3))
    lines = []
    if axes or draw(st.booleans()):
        lines.append("mesh " + ", ".join(f"{name} = {size}" for name, size in axes))
    lines.append("model " + draw(st.sampled_from(MODELS)))
    for name in draw(st.lists(st.sampled_from(["x", "y", "z", "input_ids"]), max_size=3)):
        dims = draw(st.lists(st.sampled_from(["4", "16", "256", "8", "batch=4", "batch", "seq=1", "0"]), max_size=3))
        dtype = draw(st.sampled_from(DTYPES))
        span = draw(st.sampled_from(["", " in [0, 16)", " in [5, 2)", " in [0, 300)"]))
        lines.append(f"input {name} : {dtype}[{', '.join(dims)}]{span}")
    entries = draw(st.lists(st.tuples(st.sampled_from(NAMES), st.sampled_from(PLACEMENTS)), max_size=6))
    if entries or draw(st.booleans()):
        lines.append("layout {")
        lines += [f"    {name} : {placement}" for name, placement in entries]
        lines.append("}")
    return "\n".join(lines) + "\n"


def check(tmp_path, data: bytes) -> None:
    path = tmp_path / "fuzz.par"
    path.write_bytes(data)
    out, err = io.StringIO(), io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["check", str(path), "--json"])
    seconds = time.perf_counter() - started
    assert code in (0, 1), (code, data)
    assert "Traceback" not in err.getvalue() and "internal compiler error" not in err.getvalue(), \
        (data, err.getvalue()[-3000:])
    report = json.loads(out.getvalue())
    assert report["ok"] == (code == 0)
    for error in report["errors"]:
        assert error["code"] in ERROR_CODES and error["line"] and error["column"], (data, error)
    assert seconds < 60, (seconds, data)


FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize="PARDSL_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=list(HealthCheck), database=None)


@FUZZ
@given(st.one_of(mutated_example(), assembled()))
def test_generated_files_end_in_located_diagnostics_or_ok(tmp_path_factory, text):
    check(tmp_path_factory.mktemp("fuzz"), text.encode("utf-8", "surrogatepass"))


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_end_in_located_diagnostics(tmp_path_factory, data):
    check(tmp_path_factory.mktemp("fuzz"), data)
