"""Inputs a hostile user gives: each is a located diagnostic or a clear one-line error, never a traceback.
(Reproducers from the reliability issue.)"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pardsl import cli
from pardsl.language.diagnostics import CompileError
from pardsl.language.syntax import parse, parse_file

MLP = "mesh tp = 2\nmodel examples.models:MLP()\ninput x : float32[4, 256]\n"


def _codes(error: CompileError):
    return [(d.code, d.span.line, d.span.column) for d in error.diagnostics]


@pytest.mark.parametrize("data, where", [
    ("mesh tp = 2\nmodel m:f(a=\"caf\xe9\")\n".encode("latin-1"), (2, 17)),
    ("mesh tp = 2\n".encode("utf-16"), (1, 1)),
    (bytes(range(200, 256)) * 4, (1, 1)),
], ids=["latin-1", "utf-16", "random-bytes"])
def test_a_file_that_is_not_utf8_is_E008_at_the_first_bad_byte(tmp_path, data, where):
    path = tmp_path / "bad.par"
    path.write_bytes(data)
    with pytest.raises(CompileError) as caught:
        parse_file(str(path))
    assert _codes(caught.value) == [("E008", *where)]
    assert "not UTF-8" in caught.value.render()


def test_a_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.par"
    path.write_bytes(b"\xef\xbb\xbf" + MLP.encode())
    assert parse_file(str(path)).mesh.axes[0].name == "tp"


@pytest.mark.parametrize("separator", ["\f", "\v", "\u2028", "\x85", "\x1c"])
def test_only_newlines_end_lines(separator):
    with pytest.raises(CompileError) as caught:
        parse(f"mesh tp = 2{separator}x\nmodel m:f\n")
    (code, line, column), = _codes(caught.value)
    assert line == 1 and column == 12 + (separator == "\f")  # a form feed is blank space; the rest are not
    assert code in ("E001", "E002")


def test_strings_take_json_escapes_and_any_character():
    par = parse('mesh tp = 2\nmodel m:f(name="caf\u00e9 \\u00fc\\n\\\\")\n')
    assert dict(par.model.kwargs) == {"name": "café ü\n\\"}
    with pytest.raises(CompileError) as caught:
        parse('mesh tp = 2\nmodel m:f(path="C:\\Users\\new")\n')
    assert _codes(caught.value) == [("E009", 2, 16)]


def test_the_string_reaches_the_model_factory_as_written(compile_par):
    compiled = compile_par('mesh tp = 1\nmodel tests.zoo:named(name="caf\u00e9 \\u00fc\\n\\\\")\ninput input : float32[2, 4]\n')
    assert compiled.program.parameters


@pytest.mark.parametrize("factory, code", [("NoneOut()", "E036"), ("exits()", "E022")])
def test_model_mistakes_are_located(compile_par, factory, code):
    with pytest.raises(CompileError) as caught:
        compile_par(f"mesh tp = 1\nmodel tests.zoo:{factory}\ninput x : float32[2, 4]\n")
    assert _codes(caught.value) == [(code, 2, 1)]


@pytest.mark.slow  # a rank's run to the end: in make test-slow beside the other runs' output checks
def test_json_output_stays_json_when_the_model_prints(tmp_path):
    path = tmp_path / "chatty.par"
    path.write_text("mesh tp = 1\nmodel tests.zoo:Chatty()\ninput x : float32[2, 4]\n")
    for command in (["check", str(path), "--json"], ["run", str(path), "--nproc", "1", "--json"]):
        result = subprocess.run([sys.executable, "-m", "pardsl.cli", *command], capture_output=True, text=True,
                                timeout=120)
        assert json.loads(result.stdout)["ok"] is True, result.stdout
        assert "hello from the model" in result.stderr


@pytest.mark.parametrize("target", ["file", "/dev/null", ""])
def test_compile_to_a_place_that_is_no_folder_is_a_clear_error(tmp_path, capsys, target):
    if target == "file":
        target = str(tmp_path / "a_file")
        open(target, "w").close()
    assert cli.main(["compile", "examples/mlp.par", "-o", target]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pardsl: error: cannot write the outputs") and "Traceback" not in err


def test_outputs_replace_a_symlink_rather_than_write_through_it(tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(victim, out / "plan.json")
    assert cli.main(["compile", "examples/mlp.par", "-o", str(out)]) == 0
    assert victim.read_text() == "keep me"
    assert not os.path.islink(out / "plan.json") and json.loads((out / "plan.json").read_text())["world_size"] == 2
    assert sorted(os.listdir(out)) == ["pardsl_module.py", "plan.json"]  # no temporary file left


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_a_timeout_that_is_not_a_positive_finite_number_is_a_usage_error(capsys, value):
    with pytest.raises(SystemExit) as caught:
        cli.main(["run", "examples/mlp.par", "--nproc", "2", "--timeout", value])
    assert caught.value.code == 2
    assert "--timeout" in capsys.readouterr().err


def _children(pid: int) -> list[str]:
    return subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()


def _interruptible() -> None:
    """In the child: SIGINT as a terminal's foreground job has it. A shell without job control (a CI script
    run in the background) starts its children with SIGINT ignored, and Python then installs no
    KeyboardInterrupt handler: the run would ignore the test's Ctrl-C, as it should in such a job."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("when", ["compiling", "ranks-starting-json", "ranks-running"])
def test_ctrl_c_exits_130_with_one_line_and_leaves_no_process(when):
    # steps enough that the run is still going when interrupted, however fast the machine (50 took under 8 s)
    as_json = ["--json"] if when.endswith("-json") else []
    process = subprocess.Popen([sys.executable, "-m", "pardsl.cli", "run", "examples/hf_llama8_tp2.par", "--nproc", "2",
                                "--steps", "100000", *as_json], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, preexec_fn=_interruptible, start_new_session=True)
    try:
        if when == "compiling":
            time.sleep(2)
        else:  # the launcher's first children appear when the ranks are being spawned, still importing torch
            deadline = time.monotonic() + 120
            while len(_children(process.pid)) < 2 and time.monotonic() < deadline and process.poll() is None:
                time.sleep(0.05)
            time.sleep(8 if when == "ranks-running" else 0)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
        assert process.returncode == 130
        assert err.strip().splitlines()[-1] == "pardsl: interrupted" and "Traceback" not in err
        if as_json:
            assert [e["code"] for e in json.loads(out)["errors"]] == ["interrupted"]
        leftovers = subprocess.run(["pgrep", "-f", "hf_llama8_tp2.par"], capture_output=True, text=True).stdout.split()
        assert leftovers == []
    finally:  # a failure above must not leave the launcher and its ranks running (its own session: its group)
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def test_nesting_500_deep_is_located():
    with pytest.raises(CompileError) as caught:
        parse("mesh tp = 2\nmodel m:f(a=" + "[" * 500 + "]" * 500 + ")\n")
    assert _codes(caught.value) == [("E009", 2, 1)]


@pytest.mark.parametrize("declaration, code, column", [
    ("input_ids : int8[2, 16] in [0, 1000)", "E037", 31),
    ("input_ids : int64[2, 16] in [0, 99999999999999999999)", "E037", 32),
    ("input_ids : int64[2, 16] in [0, 1000)", "E039", 32),  # the table has 256 rows
], ids=["int8", "past-int64", "past-the-table"])
def test_value_ranges_are_checked_against_the_dtype_and_the_embedding(compile_par, declaration, code, column):
    with pytest.raises(CompileError) as caught:
        compile_par(f"mesh tp = 2\nmodel examples.hf_models:llama_causal_lm(layers=1)\ninput {declaration}\n")
    assert _codes(caught.value) == [(code, 3, column)]


def test_an_input_dtype_the_model_does_not_compute_in_is_located(compile_par):
    with pytest.raises(CompileError) as caught:
        compile_par("mesh tp = 2\nmodel examples.models:MLP()\ninput x : bfloat16[4, 256]\n")
    assert _codes(caught.value) == [("E038", 3, 11)]
    assert "the model's parameters it meets are float32" in caught.value.render()


def test_the_vocabulary_parallel_lookup_fails_on_an_id_outside_the_table_as_serial_does():
    import torch

    from pardsl.layouts.algebra import Mesh
    from pardsl.runtime.core import Runtime

    rt = Runtime(Mesh(("tp",), (1,)))
    weight = torch.randn(8, 4)
    assert torch.equal(rt.masked_embedding(weight, torch.tensor([0, 7]), "tp"), weight[[0, 7]])
    for bad in (8, -1):
        with pytest.raises(RuntimeError, match="outside the embedding table of 8 rows"):
            rt.masked_embedding(weight, torch.tensor([1, bad]), "tp")


def test_diagnostics_are_capped_per_code_with_a_count_of_the_rest(compile_par):
    entries = "".join(f"  nope{i}.weight : B\n" for i in range(500))
    with pytest.raises(CompileError) as caught:
        compile_par(MLP + "layout {\n" + entries + "}\n")
    diagnostics = caught.value.diagnostics
    assert [d.code for d in diagnostics] == ["E040"] * 20
    assert diagnostics[-1].notes[-1] == "480 more error[E040] not shown"


def test_a_legal_three_axis_layout_compiles_with_every_requirement_fitting(compile_par):
    """An op's needs on earlier axes count when a later axis is chosen: dim 0 (size 4) of a value must not
    be required split 2 × 4 ways (the reproducer ended in an internal AssertionError)."""
    compiled = compile_par("""mesh dp = 4, sp = 2, c = 4
model examples.language_models:GPT(vocab_size=64, block_size=8, n_layer=1, n_head=4, d_model=32)
input idx : int64[4, 8] in [0, 64)
layout {
    h.0.ln_1() : S(1) @ dp, S(2) @ c
    wte() : S(2) @ sp, S(1) @ c
}
""")
    typed, mesh = compiled.typed, compiled.program.mesh
    for node in typed.nodes.values():
        assert node.op_layout.fits(typed.info(node.name).shape, mesh), node.name
        for operand, layout in zip(node.operands, node.operand_layouts):
            assert layout.fits(typed.info(operand).shape, mesh), (node.name, operand)


def test_sizes_past_what_a_tensor_holds_are_located(compile_par):
    with pytest.raises(CompileError) as caught:
        compile_par("mesh tp = 2\nmodel examples.models:MLP()\ninput x : float32[999999999999999999996, 256]\n")
    assert _codes(caught.value) == [("E029", 3, 1)]


def test_run_says_when_the_inputs_do_not_fit_this_machine_before_allocating(tmp_path, capsys):
    path = tmp_path / "big.par"
    path.write_text("mesh tp = 2\nmodel examples.models:MLP()\ninput x : float32[100000000, 256]\n")
    assert cli.main(["check", str(path)]) == 0  # traced on the meta device: nothing allocated
    assert cli.main(["run", str(path), "--nproc", "2"]) == 1
    assert "error[E029]: input `x` takes 95.4 GiB on each of 2 ranks" in capsys.readouterr().err


def _run_faulty(tmp_path, kind: str, *extra: str):
    path = tmp_path / f"{kind}.par"
    model = "tests.zoo:NoSuchModel()" if kind == "bad-model" else f'tests.zoo:Faulty(kind="{kind}", rank=1)'
    path.write_text(f'mesh tp = 2\nmodel {model}\ninput x : float32[2, 4]\n'
                    "layout {\n  lin.weight : S(0)\n}\n")
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "pardsl.cli", "run", str(path), "--nproc", "2", *extra],
                            capture_output=True, text=True, timeout=240)
    return result, time.perf_counter() - started


@pytest.mark.parametrize("kind, first_line", [
    ("exit", "pardsl: run failed: rank 1: exited with code 7"),
    ("raise", "pardsl: run failed: rank 1: RuntimeError: this rank's model failed"),
])
def test_a_rank_that_exits_or_raises_is_named_with_its_code_or_error(tmp_path, kind, first_line):
    result, _ = _run_faulty(tmp_path, kind)
    assert result.returncode == 1
    assert result.stderr.splitlines()[0] == first_line


# a stalled rank's case waits out its timeout: in make test-slow, beside the other run that stops making progress
@pytest.mark.parametrize("kind, code", [("exit", "run-failed"), pytest.param("sleep", "run-failed", marks=pytest.mark.slow),
                                        ("bad-model", "E021")])
def test_run_json_prints_one_object_when_a_rank_crashes_stalls_or_the_file_is_wrong(tmp_path, kind, code):
    result, _ = _run_faulty(tmp_path, kind, "--json", "--stall-timeout", "15")
    assert result.returncode == 1
    report = json.loads(result.stdout)  # the whole of stdout: one object
    assert report["ok"] is False and [e["code"] for e in report["errors"]] == [code], report


def test_json_usage_errors_are_one_object_too(capsys):
    for argv in (["run", "examples/mlp.par", "--nproc", "2", "--steps", "0", "--json"],
                 ["run", "examples/mlp.par", "--nproc", "2", "--json", "--timeout", "-1"],
                 ["check", "no/such/file.par", "--json"]):
        with contextlib.suppress(SystemExit):
            assert cli.main(argv) == 2
        out = capsys.readouterr().out
        assert json.loads(out)["ok"] is False, argv


def test_run_gives_up_at_its_time_limit_ending_the_ranks(tmp_path):
    result, seconds = _run_faulty(tmp_path, "sleep", "--time-limit", "10", "--stall-timeout", "600", "--json")
    assert result.returncode == 1
    (error,) = json.loads(result.stdout)["errors"]
    assert error["code"] == "run-failed" and "did not finish within its time limit of" in error["message"]
    assert seconds < 60
    assert subprocess.run(["pgrep", "-f", "Faulty"], capture_output=True).stdout == b""


def test_a_time_limit_that_ends_before_the_ranks_have_started_still_ends_them(compile_par):
    from pardsl.tools.execution import RunFailed, job_for, launch

    job = job_for(compile_par(MLP), steps=100000)
    with pytest.raises(RunFailed, match="did not finish within its time limit of 0.01 s"):
        launch(job, time_limit_s=0.01)


def test_dryrun_says_when_one_ranks_inputs_do_not_fit_this_machine_before_allocating(tmp_path, capsys):
    path = tmp_path / "big.par"
    path.write_text("mesh tp = 2\nmodel examples.models:MLP()\ninput x : float32[67108864, 256]\n")
    assert cli.main(["dryrun", str(path)]) == 1
    assert "error[E029]: this rank's shard of input `x` takes 64.0 GiB on each of 1 rank" in capsys.readouterr().err


@pytest.mark.slow
def test_a_rank_that_stops_making_progress_is_named_soon_after(tmp_path):
    # 15 s: on a busy machine, building the serial model could outlast a 5 s stall timeout
    result, seconds = _run_faulty(tmp_path, "sleep", "--stall-timeout", "15")
    assert result.returncode == 1
    assert result.stderr.startswith("pardsl: run failed: rank 1 stopped making progress: its last step was "
                                    "'step 1: the serial model'"), result.stderr
    assert seconds < 100  # start-up, compile, then 15 s without progress (the collective timeout is 300 s)
    assert subprocess.run(["pgrep", "-f", "Faulty"], capture_output=True).stdout == b""


def test_error_recovery_does_not_parse_the_file_again_per_error(monkeypatch):
    """A long file with errors near its end: each error resumes the parse after its line, so what is
    parsed in all is the file once plus the short rest after each error (it was the whole file per error)."""
    from pardsl.language import syntax

    body = "mesh tp = 2\nmodel m:f()\ninput x : float32[4, 16]\nlayout {\n" + "  fc1.weight : S(0)\n" * 2000 + "}\n"
    tail = "mesh $$\n" * 5 + "layout {\n  x : S(\n  y : B\n}\n"
    text = body + tail
    parsed = []
    real = syntax._parser()

    class Counting:
        def parse(self, source):
            parsed.append(len(source))
            return real.parse(source)

    monkeypatch.setattr(syntax, "_parser", lambda: Counting())
    with pytest.raises(CompileError) as caught:
        parse(text)
    # the five bad mesh lines (2006-2010), and the bad entry inside the block after them (2012), whose
    # next entry parses: the block is reopened after it
    assert [(d.code, d.span.line) for d in caught.value.diagnostics] == [("E002", 2006 + i) for i in range(5)] + [("E001", 2012)]
    assert parsed[0] == len(text) and sum(parsed[1:]) <= 6 * len(tail)  # the long part once


def test_the_tolerance_follows_the_dtypes_the_program_computes_in():
    import torch

    from pardsl.tools.execution import tolerance_for

    assert tolerance_for({torch.float32, torch.int64}) == 1e-4
    assert tolerance_for({torch.float16, torch.int64}) == 1e-2
    assert tolerance_for({torch.bfloat16, torch.float32}) == 5e-2  # the loosest dtype computed in decides
    assert tolerance_for({torch.int64}) == 1e-4


def test_a_serial_model_that_is_itself_non_finite_is_not_comparable_rather_than_different(tmp_path, capsys):
    par = tmp_path / "inf.par"
    par.write_text("mesh dp = 2\nmodel tests.zoo:Overflowing()\ninput x : float32[4, 4]\n"
                   "layout {\n  x : S(0)\n}\n")
    assert cli.main(["run", str(par), "--nproc", "2", "--timeout", "60"]) == 1
    out = capsys.readouterr().out
    assert "not comparable: the serial model itself gives non-finite values" in out
    assert "DIFFERS" not in out


_SLOW_SPAWN_LAUNCHER = """
import multiprocessing.util, sys, time
spawn = multiprocessing.util.spawnv_passfds
def spawn_then_wait(*args, **kwargs):  # widens the window between starting a process and writing it its data
    pid = spawn(*args, **kwargs)
    time.sleep(1.0)
    return pid
multiprocessing.util.spawnv_passfds = spawn_then_wait
from pardsl.cli import entry
sys.argv = ["pardsl"] + sys.argv[1:]
entry()
"""


def test_ctrl_c_while_a_rank_is_being_spawned_waits_until_all_are_started_then_ends_them(tmp_path):
    # Taken at once, it left the last rank multiprocessing's EOFError traceback and the first one started
    # and never ended. This launcher pauses 1 s after starting each process: the Ctrl-C lands in the last
    # rank's window.
    launcher = tmp_path / "slow_spawn_launcher.py"
    launcher.write_text(_SLOW_SPAWN_LAUNCHER)
    process = subprocess.Popen([sys.executable, str(launcher), "run", "examples/hf_llama8_tp2.par", "--nproc", "2",
                                "--steps", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=_interruptible, start_new_session=True)

    def ranks() -> list[str]:
        return subprocess.run(["pgrep", "-s", str(process.pid), "-f", "spawn_main"], capture_output=True,
                              text=True).stdout.split()

    try:
        deadline = time.monotonic() + 120
        while len(ranks()) < 2 and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
        assert len(ranks()) == 2
        time.sleep(0.3)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
        assert process.returncode == 130
        assert err.strip().splitlines() == ["pardsl: interrupted"]
        assert ranks() == []
    finally:  # a failure above must not leave the launcher and its ranks running
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
