"""A fuzzer of our own: generated `.par` files through `pardsl check --json`.

Three sources: the small examples mutated (characters and lines deleted, inserted, duplicated; numbers
and placements replaced; model arguments set to 0, 1 or huge; `pipeline` and `memory` statements added),
files assembled from the grammar's pieces with random names, sizes, layouts, meshes of up to ten axes
(with layouts or left to the search), pipelines, bounds and models up to hundreds of layers deep (most
ill-typed), and random bytes. Whatever comes in: the exit code is 0 or 1, stdout is one JSON object,
every error is located (line and column) with a known code, there is no traceback or internal error,
and each file takes under 30 s (`check --time-limit`: a model too deep to trace in time is E090, saying
how far its trace got; a search that runs out of its budget compiles the best plan found, N006).

The same again in one long-lived process (an editor's or a notebook's), with examples stopped midway by
a short time limit among them: no check may crash that process, break a later check or hang
(fuzz_in_process, in a child process under faulthandler).

`make test` runs a modest, derandomized number; `make fuzz` runs PARDSL_FUZZ_EXAMPLES (10,000) of each,
20,000 in all, and as many in one process, with a fresh seed and prints the figures.
"""

import contextlib
import glob
import io
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pardsl import cli
from pardsl.language.diagnostics import ERROR_CODES

EXAMPLES = int(os.environ.get("PARDSL_FUZZ_EXAMPLES", "60"))
# of each kind, checked one after another in one process (fuzz_in_process)
IN_PROCESS_EXAMPLES = int(os.environ.get("PARDSL_FUZZ_EXAMPLES", "100"))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEEDS = ["examples/mlp.par", "examples/mlp_dp.par", "examples/mlp_inferred.par", "examples/mlp_zero3.par",
         "examples/tp_schemes/mlp_2d.par", "examples/tp_schemes/mlp_3d.par", "examples/mlp_pp2.par"]
TEXTS = [Path(path).read_text(encoding="utf-8") for path in SEEDS]
ALPHABET = st.sampled_from(list("abcxyzSBP0123456789[](){}:=,@.*#-_ \n\t\"\\") +
                           ["\f", "\v", "\u2028", "\x85", "\ufeff", "é", "\x00", "𝔘"])
NUMBERS = ["0", "-1", "1", "3", "7", "1000", "99999999999999999999", "2.5"]
PLACEMENTS = ["B", "P", "S(0)", "S(1)", "S(2)", "S(-1)", "S(-3)", "S(0, blocks=2)", "S(1, blocks=0)", "[B, S(0)]",
              "S(0) @ tp", "S(1) @ dp, S(0) @ tp", "S(0) @ zz", "[S(0), S(0), B]"]
NAMES = ["x", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "output", "output[0]", "fc1()", "*.weight",
         "*.*", "norm.weight", "fc3.weight", "up.weight", "head.weight", "y", "enc.weight", "output.logits"]
MODELS = ["examples.models:MLP()", "examples.models:MLP(d_model=16, d_ff=32)", "examples.models:ResidualMLP()",
          "tests.zoo:DictOut()", "tests.zoo:NoneOut()", "tests.zoo:broken(a=1)", "examples.models:Nope()",
          "no_such_module:M()", 'examples.models:MLP(d_model="x")', "examples.models:MLP(d_model=0, d_ff=0)",
          "examples.models:MLP(d_model=1, d_ff=1)", "examples.models:MLP(d_model=16, d_ff=99999999999)",
          "examples.models:DeepMLP(depth=0, d_model=16, d_ff=32)", "examples.models:DeepMLP(depth=200, d_model=8, d_ff=8)",
          "examples.language_models:Llama(vocab_size=64, n_layer=1, n_head=2, n_kv_head=1, d_model=16, d_ff=32)",
          "examples.language_models:Llama(vocab_size=64, n_layer=0, n_head=2, n_kv_head=2, d_model=0, d_ff=0)"]
# a deep model, now and then: it must end within the time limit, traced or saying how far it got
DEEP_MODELS = ["examples.language_models:Llama(vocab_size=64, n_layer=1000, n_head=2, n_kv_head=1, d_model=16, "
               "d_ff=32)", "examples.models:DeepMLP(depth=3000, d_model=8, d_ff=8)"]
STATEMENTS = ["memory <= 60 %", "memory <= 1 KiB", "memory <= 0 %", "memory <= 99999 GiB", "memory <= 40 %",
              "pipeline pp : schedule 1F1B, microbatches 4, cut before fc2",
              "pipeline tp : schedule GPipe, microbatches 2, cut before fc1",
              "pipeline pp : schedule Interleaved1F1B, microbatches 3, cut before blocks.1, blocks.2",
              "pipeline pp : schedule ZB, microbatches 0, cut before nothing", "pipeline pp : schedule ?"]
AXES = ["tp", "dp", "sp", "pp", "zz", "a", "b", "c", "d", "e", "f", "g"]
TIME_LIMIT_S = 25  # check's own limit; the harness allows 30 s for start-up around it
DTYPES = ["float32", "float16", "bfloat16", "int64", "int8", "bool", "flaot32"]


@st.composite
def mutated_example(draw):
    text = draw(st.sampled_from(TEXTS))
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["delete", "insert", "line", "number", "placement", "argument", "statement"]))
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
        elif action == "argument":
            arguments = [i for i in range(len(text) - 1) if text[i] == "=" and text[i + 1].isdigit()]
            if arguments:
                at = draw(st.sampled_from(arguments)) + 1
                end = at
                while end < len(text) and text[end].isdigit():
                    end += 1
                text = text[:at] + draw(st.sampled_from(["0", "1", "2", "100000", "99999999999"])) + text[end:]
        elif action == "statement":
            text = text + "\n" + draw(st.sampled_from(STATEMENTS)) + "\n"
        else:
            for old in ("S(0)", "S(1)", ": B"):
                if old in text:
                    text = text.replace(old, draw(st.sampled_from(PLACEMENTS)) if old != ": B" else
                                        ": " + draw(st.sampled_from(PLACEMENTS)), 1)
                    break
    return text


@st.composite
def assembled(draw):
    many = draw(st.integers(0, 9)) == 0  # now and then a mesh of many axes, most of size 1 or 2
    axes = draw(st.lists(st.tuples(st.sampled_from(AXES), st.sampled_from([1, 2]) if many else st.integers(0, 5)),
                         min_size=0, max_size=10 if many else 3))
    lines = []
    if axes or draw(st.booleans()):
        lines.append("mesh " + ", ".join(f"{name} = {size}" for name, size in axes))
    deep = draw(st.integers(0, 999)) == 0
    lines.append("model " + draw(st.sampled_from(DEEP_MODELS if deep else MODELS)))
    for name in draw(st.lists(st.sampled_from(["x", "y", "z", "input_ids"]), max_size=3)):
        dims = draw(st.lists(st.sampled_from(["4", "16", "256", "8", "batch=4", "batch", "seq=1", "0"]), max_size=3))
        dtype = draw(st.sampled_from(DTYPES))
        span = draw(st.sampled_from(["", " in [0, 16)", " in [5, 2)", " in [0, 300)"]))
        lines.append(f"input {name} : {dtype}[{', '.join(dims)}]{span}")
    lines += draw(st.lists(st.sampled_from(STATEMENTS), max_size=2))
    entries = draw(st.lists(st.tuples(st.sampled_from(NAMES), st.sampled_from(PLACEMENTS)), max_size=6))
    if entries or draw(st.booleans()):  # an empty block asks the search for every layout
        lines.append("layout {")
        lines += [f"    {name} : {placement}" for name, placement in entries]
        lines.append("}")
    return "\n".join(lines) + "\n"


def check(tmp_path, data: bytes) -> None:
    problem = checked(str(tmp_path / "fuzz.par"), data)
    assert problem is None, problem


def checked(path: str, data: bytes, limit: float = TIME_LIMIT_S) -> str | None:
    """`data` written to `path` and checked in this process under `limit`: None, or what is wrong with the
    outcome."""
    with open(path, "wb") as file:
        file.write(data)
    out, err = io.StringIO(), io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["check", path, "--json", "--time-limit", str(limit)])
    seconds = time.perf_counter() - started
    if code not in (0, 1):
        return f"exit code {code} for {data!r}: {err.getvalue()[-3000:]}"
    if "Traceback" in err.getvalue() or "internal compiler error" in err.getvalue():
        return f"a traceback for {data!r}: {err.getvalue()[-3000:]}"
    try:
        report = json.loads(out.getvalue())
    except ValueError:
        return f"not one JSON object on stdout for {data!r}: {out.getvalue()[-3000:]!r}"
    if report["ok"] != (code == 0):
        return f"ok is {report['ok']} with exit code {code} for {data!r}"
    for error in report["errors"]:
        if error["code"] not in ERROR_CODES or not error["line"] or not error["column"]:
            return f"an unlocated or unknown error {error} for {data!r}"
    if seconds >= max(limit, TIME_LIMIT_S) + 5:
        return f"a hang: {seconds:.1f} s under a limit of {limit} s for {data!r}"
    return None


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


@pytest.mark.slow
def test_a_model_too_deep_to_trace_in_time_says_how_far_it_got(tmp_path):
    """A 1,000-layer LLaMA: `check --time-limit 12` ends in E090 at the model line within seconds of the
    limit (more where the suite's other worker is busy beside it), with the trace's progress, not after
    minutes."""
    text = Path("examples/llama_tp2.par").read_text(encoding="utf-8").replace("n_layer=2", "n_layer=1000")
    path = tmp_path / "deep.par"
    path.write_text(text)
    out = io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(["check", str(path), "--json", "--time-limit", "12"])
    assert code == 1 and time.perf_counter() - started < 40
    (error,) = json.loads(out.getvalue())["errors"]
    assert (error["code"], error["line"], error["column"]) == ("E090", 6, 1)
    assert "did not finish within its time limit of 12 s; it was exporting the model (torch.export): " in error["message"]
    assert "module calls traced (the model has 12005 modules)" in error["message"]


def test_the_search_on_a_mesh_of_ten_axes_ends_in_seconds(tmp_path):
    """An empty layout block on ten axes, five of size 2 (minutes before): the orders tried are bounded
    (2n past three axes) and conversions move only the axes they must."""
    path = tmp_path / "axes.par"
    path.write_text("mesh a = 2, b = 2, c = 2, d = 1, e = 2, f = 1, g = 2, h = 1, i = 1, j = 1\n"
                    "model examples.models:MLP(d_model=16, d_ff=32)\ninput x : float32[32, 16]\nlayout {\n}\n")
    started = time.perf_counter()
    check(tmp_path, path.read_bytes())
    assert time.perf_counter() - started < 30


def test_a_search_past_its_budget_compiles_the_best_plan_found_and_says_so(compile_par, monkeypatch):
    from pardsl.planning import descent

    monkeypatch.setattr(descent, "SEARCH_BUDGET_S", 0.0)
    compiled = compile_par("mesh dp = 2, tp = 2\nmodel examples.models:MLP(d_model=16, d_ff=32)\n"
                           "input x : float32[8, 16]\nlayout {\n}\n")
    (note,) = [n for n in compiled.program.notes if n.code == "N006"]
    assert note.message == ("the layout search stopped at its time budget of 0 s, after 1 of 2 orders of the mesh "
                            "axes: the best plan found so far is compiled")
    assert (note.span.line, note.span.column) == (1, 1)  # the mesh the search lays the layouts over


def test_the_time_limit_waits_out_torchs_own_code_and_stops_the_compile_soon_after():
    """The alarm that ends a check at its time limit went off in torch.export's code, called from C++ that
    cannot take an exception, and the process ended (SIGABRT, "terminate called after throwing an
    instance of 'python_error'"). Here the alarm's handler is called in a module's forward pre-hook, torch's
    code below it, as a pending alarm would be: it raises nothing there, and OutOfTime comes in the test's
    own code soon after; report() raises it too, once the limit has passed."""
    import signal

    import torch

    from pardsl.language.progress import OutOfTime, report, time_limit

    returned = []

    def alarm_here(module, args):
        signal.getsignal(signal.SIGALRM)(signal.SIGALRM, sys._getframe())
        returned.append(True)

    layer = torch.nn.Identity()
    layer.register_forward_pre_hook(alarm_here)
    with pytest.raises(OutOfTime) as stopped:
        with time_limit(0.01):
            signal.setitimer(signal.ITIMER_REAL, 0)  # the alarm goes off in the hook below, and only there
            time.sleep(0.02)
            layer(torch.ones(1))
            assert returned == [True]
            while True:
                time.sleep(0.001)
    assert stopped.traceback[-3].name == "test_the_time_limit_waits_out_torchs_own_code_and_stops_the_compile_soon_after"

    with pytest.raises(OutOfTime, match="searching the layouts"):
        with time_limit(0.01):
            signal.setitimer(signal.ITIMER_REAL, 0)
            time.sleep(0.02)
            report("searching the layouts")


# Files compiled whole in a second or two, checked under limits that stop them anywhere: in parsing, the
# model's import and build, torch.export, the search, HiGHS
INTERRUPTED = [path for path in sorted(glob.glob(os.path.join(REPO, "examples", "*.par")))
               if not os.path.basename(path).startswith("hf_")]
INTERRUPTED_LIMIT_MS = (5, 500)


@pytest.mark.timeout(300 + 3 * IN_PROCESS_EXAMPLES)
def test_checks_in_one_long_lived_process_end_without_crash_traceback_or_hang(tmp_path):
    """An editor or a notebook calls check again and again in one process: what one check leaves behind
    (a time limit's alarm, torch's state, the solver's threads) must not crash, break or slow a later one.
    Generated files and random bytes as above, and now and then an example under a limit that stops it
    midway (a tenth as many). The checks run in a child process, so that a crash is this test's failure
    with every thread's stack (faulthandler) and the input that caused it, not a dead pytest worker."""
    seed = None if "PARDSL_FUZZ_EXAMPLES" not in os.environ else random.randrange(2 ** 32)
    interrupted = max(1, IN_PROCESS_EXAMPLES // 10)
    child = subprocess.run([sys.executable, "-m", "tests.test_fuzz", str(IN_PROCESS_EXAMPLES), str(IN_PROCESS_EXAMPLES),
                            str(interrupted), "-" if seed is None else str(seed), str(tmp_path)],
                           cwd=REPO, capture_output=True, text=True)
    last = tmp_path / "last.par"
    assert child.returncode == 0, (f"the process ended with {child.returncode} (seed {seed}) checking "
                                   f"{last.read_bytes() if last.exists() else None!r}:\n{child.stderr[-20000:]}")
    counts = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"in one process (seed {seed}): {counts}")
    assert counts["inputs"] == 2 * IN_PROCESS_EXAMPLES + interrupted
    assert counts["problems"] == 0, child.stderr[-20000:]


def fuzz_in_process(generated: int, random_bytes: int, interrupted: int, seed: int | None, folder: str) -> dict:
    """`generated` files, `random_bytes` byte strings and `interrupted` examples under a short limit through
    `check`, all in this one process: the counts of inputs, problems and seconds. Each input is written to
    `folder`/last.par before its check, so that a crash (which ends the process) leaves the input that
    caused it behind; a check that takes far past its limit dumps every thread's stack and ends the
    process."""
    import faulthandler

    from hypothesis import seed as hypothesis_seed

    faulthandler.enable()
    path = os.path.join(folder, "last.par")
    counts = {"inputs": 0, "problems": 0, "slowest_s": 0.0, "most_past_limit_s": 0.0}

    def one(data: bytes, limit: float = TIME_LIMIT_S) -> None:
        faulthandler.dump_traceback_later(TIME_LIMIT_S + 35, exit=True)  # a hang, past checked()'s 30 s
        started = time.perf_counter()
        problem = checked(path, data, limit)
        faulthandler.cancel_dump_traceback_later()
        seconds = time.perf_counter() - started
        counts["inputs"] += 1
        counts["slowest_s"] = max(counts["slowest_s"], seconds)
        counts["most_past_limit_s"] = max(counts["most_past_limit_s"], seconds - limit)
        if problem is not None:
            counts["problems"] += 1
            print(f"PROBLEM {problem}", file=sys.stderr, flush=True)
        if counts["inputs"] % 1000 == 0:
            print(f"{counts['inputs']} inputs in {time.perf_counter() - begun:.0f} s", file=sys.stderr, flush=True)

    def interrupt(example):
        path, limit_ms = example
        with open(path, "rb") as file:
            one(file.read(), limit_ms / 1000)

    begun = time.perf_counter()
    for source, count, test in (
            (st.one_of(mutated_example(), assembled()), generated, lambda text: one(text.encode("utf-8", "surrogatepass"))),
            (st.binary(max_size=300), random_bytes, lambda data: one(data)),
            # milliseconds, not floats: hypothesis draws a float's bounds so often that most checks stopped at once
            (st.tuples(st.sampled_from(INTERRUPTED), st.integers(*INTERRUPTED_LIMIT_MS)), interrupted, interrupt)):
        if not count:
            continue
        run = settings(max_examples=count, deadline=None, derandomize=seed is None, database=None,
                       suppress_health_check=list(HealthCheck))(given(source)(test))
        if seed is not None:
            run = hypothesis_seed(seed)(run)
        run()
    counts["seconds"] = time.perf_counter() - begun
    return counts


if __name__ == "__main__":
    generated, random_bytes, interrupted, seed, folder = sys.argv[1:6]
    print(json.dumps(fuzz_in_process(int(generated), int(random_bytes), int(interrupted),
                                     None if seed == "-" else int(seed), folder)))
