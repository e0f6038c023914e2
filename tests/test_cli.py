"""The `pardsl` command end to end: compile writes files; run launches ranks with torch's launcher."""

import argparse
import json
import os
import re
import subprocess
import sys

import pytest

from pardsl import cli

from pardsl.planning import solver


def test_check_prints_ok(capsys):
    assert cli.main(["check", "examples/mlp.par"]) == 0
    assert capsys.readouterr().out.strip() == "examples/mlp.par: ok"


def test_check_json_on_errors(tmp_path, capsys):
    bad = tmp_path / "bad.par"
    bad.write_text("mesh tp = 2\nmodel examples.models:MLP()\ninput x : float32[4, 256]\nlayout {\n  x : P\n}\n")
    assert cli.main(["check", str(bad), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert [(e["code"], e["line"], e["column"]) for e in report["errors"]] == [("E055", 5, 7)]


def test_compile_writes_module_and_plan_and_a_summary(tmp_path, capsys):
    assert cli.main(["compile", "examples/mlp.par", "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "parameter fc2.weight  S(1)@tp" in out
    assert "forward   1 all-reduce (16.0 KiB per rank)" in out
    assert "backward  no collectives" in out
    assert (tmp_path / "pardsl_module.py").exists()
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["collective_counts"]["forward"]["all_reduce"] == 1


def test_bucket_size_is_an_option_of_compile(tmp_path, capsys):
    assert cli.main(["compile", "examples/mlp_dp.par", "-o", str(tmp_path), "--bucket-mb", "0"]) == 0
    assert "backward  4 all-reduce" in capsys.readouterr().out  # a bucket per gradient
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert [b["parameters"] for b in plan["gradient_buckets"]] == [["fc2_bias"], ["fc2_weight"], ["fc1_bias"], ["fc1_weight"]]
    with pytest.raises(SystemExit) as exit_:
        cli.main(["compile", "examples/mlp_dp.par", "-o", str(tmp_path), "--bucket-mb", "-1"])
    assert exit_.value.code == 2
    assert "--bucket-mb: expected a size in MiB, 0 or more, not '-1'" in capsys.readouterr().err


def test_generated_module_runs_on_its_own(tmp_path):
    """The module needs only torch and pardsl.runtime: load it like a user would, on one rank."""
    from pardsl.compiler import compile_text
    from pardsl.layouts.algebra import Mesh
    from pardsl.runtime.core import Runtime
    import importlib.util
    import torch

    text = open("examples/mlp.par").read().replace("tp = 2", "tp = 1")
    (tmp_path / "one.par").write_text(text)
    compiled = compile_text(text, str(tmp_path / "one.par"))
    (tmp_path / "mod.py").write_text(compiled.source)
    spec = importlib.util.spec_from_file_location("mod", tmp_path / "mod.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from examples.models import MLP

    torch.manual_seed(0)
    serial = MLP(256, 1024)
    model = module.CompiledModule(Runtime(Mesh(("tp",), (1,))))
    model.load_full_state_dict(serial.state_dict())
    x = torch.randn(16, 256)
    torch.testing.assert_close(model(x)[0], serial(x))


@pytest.mark.timeout(120)
def test_compile_json_of_a_searched_plan_is_json_alone(tmp_path):
    # HiGHS 1.16 prints a banner on stdout (below Python) when its first instance is made: it once came
    # before the JSON. A fresh process, so that the search makes its first instance here.
    par = tmp_path / "searched.par"
    par.write_text("mesh tp = 2\nmodel examples.models:MLP(d_model=16, d_ff=32)\ninput x : float32[4, 16]\n"
                   "memory <= 60 %\n")
    result = subprocess.run([sys.executable, "-m", "pardsl.cli", "compile", str(par), "-o", str(tmp_path / "out"),
                             "--json"], capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True and "HiGHS" not in result.stdout + result.stderr


def test_a_compile_reports_its_stages_and_each_integer_program_to_a_listener(compile_par):
    from pardsl.language.progress import reported_to

    heard = []
    with reported_to(heard.append):
        compile_par("mesh tp = 2\nmodel examples.models:MLP(d_model=16, d_ff=32)\ninput x : float32[4, 16]\n"
                    "memory <= 60 %\n")
    # a stage's progress within it ("searching the layouts: deciding tp…"; on a slow machine, how many module
    # calls the export has traced so far) is not a stage of its own
    stages = [m for m in dict.fromkeys(heard)
              if not m.startswith(("searching the layouts:", "exporting the model (torch.export):"))]
    assert stages == ["building the model on the meta device", "exporting the model (torch.export)",
                      "writing the known plans (Megatron, FSDP) for the model, to compare",
                      "completing the layouts greedily, to compare", "lowering to collectives",
                      "counting the activations the passes keep", "searching the layouts", "writing the module"]
    programs = [m for m in heard if m.startswith("searching the layouts: deciding tp")]
    limit = f"(up to {solver.TIME_LIMIT_S:.0f} s)"
    assert programs and all(" columns and " in m and limit in m for m in programs)


def test_a_searched_mesh_says_which_shape_each_stage_is_working_on(compile_par):
    from pardsl.language.progress import reported_to

    heard = []
    with reported_to(heard.append):
        compile_par("mesh dp, tp = 4\nmodel examples.models:MLP(d_model=16, d_ff=32)\ninput x : float32[8, 16]\n")
    shapes = [m for m in dict.fromkeys(heard) if re.fullmatch(r"mesh shape \d of \d \([^)]*\)", m)]
    # dp = 4, tp = 1 is dp = 1, tp = 4 with its axes renamed: not compiled again
    assert shapes == ["mesh shape 1 of 3 (dp = 1, tp = 4)", "mesh shape 2 of 3 (dp = 2, tp = 2)"]
    assert "mesh shape 2 of 3 (dp = 2, tp = 2): lowering to collectives" in heard or \
        "mesh shape 2 of 3 (dp = 2, tp = 2): searching the layouts" in heard


@pytest.mark.timeout(120)
def test_on_a_terminal_check_shows_what_the_compile_is_doing_on_stderr_and_clears_it(tmp_path):
    """A searched plan can take minutes: on a terminal a status line (rich) says what the compile is doing;
    piped, nothing is added (test_compile_json_of_a_searched_plan_is_json_alone)."""
    par = tmp_path / "searched.par"
    par.write_text("mesh tp = 2\nmodel examples.models:MLP(d_model=16, d_ff=32)\ninput x : float32[4, 16]\n"
                   "memory <= 60 %\n")
    result, shown = _on_a_terminal("check", str(par))
    assert result.returncode == 0 and result.stdout.strip() == f"{par}: ok"
    # the line is redrawn a dozen times a second, so a quick stage may never show; the last always does
    assert re.search(rb"searched.par: writing the module \(\d+ s\)", shown)


def _on_a_terminal(*argv: str):
    """`pardsl ARGV` with stderr on a terminal (stdout piped): its result, and what the terminal was sent.
    The terminal is read while the command runs: a terminal holds a few KiB unread, and a command whose
    status line is redrawn for longer than that would block writing it (a slow machine's run did)."""
    import pty
    import threading

    leader, follower = pty.openpty()
    chunks: list[bytes] = []

    def read_all() -> None:
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal's other end is closed: everything is read
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    try:
        result = subprocess.run([sys.executable, "-m", "pardsl.cli", *argv], stdout=subprocess.PIPE,
                                stderr=follower, text=True, timeout=200,
                                env={**os.environ, "TERM": "xterm", "COLUMNS": "200"})
    finally:
        os.close(follower)
        reader.join(timeout=30)
        os.close(leader)
    return result, b"".join(chunks)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_on_a_terminal_run_dryrun_and_explain_say_what_they_are_doing_and_for_how_long():
    result, shown = _on_a_terminal("run", "examples/mlp.par", "--steps", "300")
    assert result.returncode == 0, result.stderr
    # the ranks take seconds: the line says how far the one furthest behind has got, and the time so far
    assert re.search(rb"mlp.par: 2 of 2 ranks running; rank \d \(furthest behind\): step \d+: .* \(\d+ s\)", shown)
    result, shown = _on_a_terminal("dryrun", "examples/mlp.par")
    assert result.returncode == 0 and b"mlp.par: step 1 of 1: the optimizer's step" in shown
    result, shown = _on_a_terminal("explain", "examples/mlp.par")
    assert result.returncode == 0 and b"mlp.par: writing the report" in shown
    result, shown = _on_a_terminal("explain", "examples/mlp.par", "--quiet")
    assert result.returncode == 0 and b"mlp.par:" not in shown and result.stdout  # the report, on stdout


@pytest.mark.timeout(240)
def test_run_json_on_two_ranks(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pardsl.cli", "run", "examples/mlp.par", "--nproc", "2", "--steps", "2", "--json",
         "--backend", "gloo", "--timeout", "60", "-o", str(tmp_path)],
        capture_output=True, text=True, timeout=200, env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["world_size"] == 2 and report["mesh"] == {"tp": 2}
    assert report["max_abs_err"]["output"] < 1e-3 and report["max_abs_err"]["grad"] < 1e-3
    assert report["collectives"]["forward"] == {"all_reduce": 1, "all_gather": 0, "reduce_scatter": 0, "all_to_all": 0}
    assert report["collectives"]["backward"] == {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0, "all_to_all": 0}
    assert report["bytes"] == {"forward": 16384, "backward": 0}
    assert report["step_ms"]["compiled"] > 0 and report["step_ms"]["serial"] > 0
    # each rank's measured peak holds at least its parameter and gradient shards (2 × 1,051,648 bytes), and
    # the estimate of what a rank holds is within 15 % of it
    peaks, estimated = report["memory"]["peak_bytes"], report["memory"]["estimated_bytes"]
    assert len(peaks) == 2 and all(peak >= 2 * 1_051_648 for peak in peaks)
    assert all(abs(estimated / peak - 1) < 0.15 for peak in peaks), (peaks, estimated)
    assert (tmp_path / "plan.json").exists()
    # without --json, the same figures on a line of their own
    line = cli.measured_memory_line({"peak_bytes": [2_201_600, 2_150_400], "estimated_bytes": 2_103_296}, False)
    assert line == "  memory (measured, first step): peak 2.1 MiB, 2.1 MiB by rank; estimate 2.0 MiB"
    assert cli.measured_memory_line({"peak_bytes": [1024], "estimated_bytes": 2048}, True).endswith(
        "estimate 2.0 KiB (the rank that holds most)")


@pytest.mark.parametrize("options, message", [
    (["--device", "cuda"], "--device cuda needs a CUDA device; this machine has none"),
    (["--backend", "nccl", "--device", "cpu"], "--backend nccl moves CUDA tensors only"),
])
def test_run_says_which_device_or_backend_cannot_run_here(capsys, monkeypatch, options, message):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert cli.main(["run", "examples/mlp.par", "--nproc", "2", *options]) == cli.EXIT_USAGE
    assert message in capsys.readouterr().err


def test_nccl_needs_a_gpu_per_rank_and_gloo_shares_one(monkeypatch):
    """What the H100 machine showed: NCCL refuses two ranks on one GPU; gloo moves CUDA tensors there."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    assert "needs a GPU per rank, 2; this machine has 1" in cli._device_mistake("nccl", "cuda", 2)
    assert cli._device_mistake("gloo", "cuda", 2) is None and cli._device_mistake("nccl", "cuda", 1) is None


@pytest.mark.timeout(240)
def test_run_reports_a_failing_rank_and_exits_1(tmp_path):
    (tmp_path / "rank_models.py").write_text(
        "import torch, torch.distributed as dist\n"
        "class FailsOnRanks(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.lin = torch.nn.Linear(4, 4)\n"
        "        if dist.is_initialized():\n            raise RuntimeError('no weights on this rank')\n"
        "    def forward(self, x):\n        return self.lin(x)\n")
    par = tmp_path / "fails.par"
    par.write_text("mesh tp = 2\nmodel rank_models:FailsOnRanks()\ninput x : float32[2, 4]\n")
    result = subprocess.run([sys.executable, "-m", "pardsl.cli", "run", str(par), "--nproc", "2", "--timeout", "60"],
                            capture_output=True, text=True, timeout=200)
    assert result.returncode == 1
    assert "pardsl: run failed: rank " in result.stderr and "no weights on this rank" in result.stderr


def test_run_ten_steps_of_an_eight_layer_llama_is_equal_to_serial(pools):
    """Each step is compared from the same parameters, so rounding does not compound into a false alarm
    (`pardsl run`'s ranks, in the worker pool: the tests above run the command itself)."""
    from pardsl.compiler import compile_file
    from pardsl.tools.execution import job_for

    report = pools(2).run(job_for(compile_file("examples/hf_llama8_tp2.par"), steps=10, timeout_s=60))
    assert report["ok"], {k: v for k, v in report.items() if "collectives" not in k}
    assert report["steps"] == 10 and report["max_rel_err"]["grad"] < 1e-4


def test_an_injected_bug_still_fails(pools):
    """A plan with one forward all-reduce removed (its partial sums used as if finished) must DIFFER."""
    import dataclasses
    import re

    from pardsl.compiler import compile_file
    from pardsl.tools.execution import job_for

    compiled = compile_file("examples/hf_llama8_tp2.par")
    job = job_for(compiled, steps=3, timeout_s=60)
    first = re.search(r"^(\s*)(\w+) = rt\.all_reduce\((\w+), \"tp\"\)", job.module_source, re.M)
    broken = job.module_source.replace(first.group(0), f"{first.group(1)}{first.group(2)} = {first.group(3)}", 1)
    assert broken != job.module_source
    report = pools(2).run(dataclasses.replace(job, module_source=broken))
    assert not report["ok"] and report["max_rel_err"]["output"] > 1e-2


def test_export_of_a_folder_that_is_no_checkpoint_is_an_error(tmp_path, capsys):
    assert cli.main(["export", str(tmp_path), "-o", str(tmp_path / "m.safetensors")]) == 1
    assert "neither a pardsl checkpoint" in capsys.readouterr().err


def test_the_documented_explain_example_is_what_explain_prints(capsys):
    """docs/cli.md shows `pardsl explain examples/mlp.par` with the gloo defaults (conftest points the
    calibration folder at an empty one): its block must be the command's output, not an older one's. It was
    made on 2 cores; the defaults' ranks share the cores of the host at hand."""
    readme = open("docs/cli.md", encoding="utf-8").read()
    command = "$ pardsl explain examples/mlp.par          # no calibration file: the gloo defaults\n"
    shown = readme.split(command, 1)[1].split("\n```", 1)[0]
    shown = shown.replace("; ranks share 2 cores", f"; ranks share {os.cpu_count() or 1} cores")
    assert cli.main(["explain", "examples/mlp.par"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == shown


def _command_parsers():
    parser = cli._arguments()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return parser, commands.choices


def test_every_option_of_every_command_says_its_default_and_every_command_shows_examples(capsys):
    parser, commands = _command_parsers()
    for name, command in commands.items():
        formatter = command._get_formatter()
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            shown = formatter._expand_help(action) if action.help else ""
            assert shown, f"{name} {action.dest} has no help"
            if action.option_strings and not action.required:
                assert "default" in shown, f"{name} {action.option_strings[0]}: {shown}"
        assert "examples:\n  " in command.format_help() and "pardsl " in command.epilog, name
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "--help"])
    assert exit_.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    for words in ("--nproc N how many ranks to run (default: the number of ranks in the file's mesh)",
                  "--seed SEED seed of the parameters, inputs and output gradients (default: 0)",
                  "--optimizer {sgd,adam,adamw} the optimizer of each step (default: sgd)",
                  "--backend {auto,gloo,nccl}", "(default: auto)", "--json print one JSON object",
                  "(default: off)", "file the .par file", "examples: pardsl run examples/mlp.par --steps 3"):
        assert words in shown, words


def test_the_examples_in_each_commands_help_name_files_that_exist():
    for command in _command_parsers()[1].values():
        for line in command.epilog.splitlines()[1:]:
            words = [word.strip('"') for word in line.split()]
            # what a command writes (-o FILE) need not exist; what it reads must
            written = {words[i + 1] for i, word in enumerate(words[:-1]) if word in ("-o", "--output")}
            for word in words:
                if (word.endswith(".par") or word.endswith(".py")) and word not in written:
                    assert os.path.exists(word), line


def test_version_prints_the_package_version_and_exits_0(capsys):
    import pardsl

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"pardsl {pardsl.__version__}\n"


@pytest.mark.slow  # two ranks started and run: in make test-slow, beside `run --json` on two ranks
@pytest.mark.timeout(240)
def test_run_without_nproc_runs_as_many_ranks_as_the_mesh_has():
    result = subprocess.run([sys.executable, "-m", "pardsl.cli", "run", "examples/mlp.par", "--json",
                             "--backend", "gloo", "--timeout", "60"],
                            capture_output=True, text=True, timeout=200, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["world_size"] == 2


def test_run_with_an_nproc_other_than_the_meshs_is_a_located_error(capsys):
    assert cli.main(["run", "examples/mlp.par", "--nproc", "3", "--json"]) == cli.EXIT_INPUT_ERROR
    [error] = json.loads(capsys.readouterr().out)["errors"]
    assert error["code"] == "E012" and error["line"] == 2  # the `mesh` line, after the comment
    assert error["message"] == "the mesh (tp = 2) has 2 ranks but --nproc is 3"


def test_calibrate_keeps_its_own_nproc_default():
    args = cli._arguments().parse_args(["calibrate"])
    assert args.nproc == 2


def test_rules_start_with_a_key_and_speak_in_user_words(capsys):
    from pardsl.layouts.oprules import RULES

    assert cli.main(["rules"]) == 0
    out = capsys.readouterr().out
    key, table = out.split("\n\n", 1)
    for words in ("S(d)", "split: each rank holds one slice", "B         broadcast", "P         partial",
                  "split:", "partial:", "also:", "needs:", "note:", "einsum"):
        assert words in key, words
    lines = table.splitlines()
    assert len(lines) == len(RULES) and [line.split()[0] for line in lines] == sorted(line.split()[0] for line in lines)
    assert "dim_arg=" not in out and "linear=" not in out and "parallel_form" not in out and "project " not in out
    [add] = [line for line in lines if line.startswith("aten.add.Tensor ")]
    assert "partial: all P → P (partial sums add up across the split)" in add
    [linear] = [line for line in lines if line.startswith("aten.linear.default ")]
    assert "einsum `...k,nk,n->...n` over (input, weight, bias)" in linear
    assert "one P, others B → P: any one of input, weight (bias P with it)" in linear
    [softmax] = [line for line in lines if line.startswith("aten._softmax.default ")]
    assert "the dim it normalises along stays whole" in softmax and "partial: no" in softmax
