"""The `pardsl` command: check, compile and run .par files.

Exit codes: 0 clean (and, for `run`, equivalent to serial), 1 errors in the user's input (or a run that
differs from serial), 2 bad command-line usage.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

from pardsl.language.diagnostics import CompileError

EXIT_OK, EXIT_INPUT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class _UsageError(SystemExit):
    def __init__(self, message: str):
        super().__init__(EXIT_USAGE)
        self.message = message


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own exit code is 2 as well; keep the message short
        self.print_usage(sys.stderr)
        print(f"pardsl: error: {message}", file=sys.stderr)
        raise _UsageError(message)


def _json_failure(kind: str, message: str) -> str:
    """The one JSON object of a command that failed other than by errors located in the .par file."""
    return json.dumps({"ok": False, "errors": [{"code": kind.replace(" ", "-"), "severity": "error",
                                                "message": message, "line": None, "column": None, "notes": []}]},
                      indent=2)


def _failed(args, kind: str, message: str, code: int) -> int:
    """Say on stderr what went wrong (`pardsl: KIND: MESSAGE`); under --json, stdout's one object says it
    too. `kind`: error (the command line or a file), run failed, dry run refused, internal compiler error,
    internal error."""
    print(f"pardsl: {kind}: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        print(_json_failure(kind, message))
    return code


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a timeout is a positive, finite number of seconds")
    return value


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default: a text that says it in words keeps its words, a flag is
    off unless given, and any other option shows argparse's value."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or action.required or "default" in text or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"

    def _fill_text(self, text, width, indent):
        # prose is wrapped to the terminal; an indented line (an example's command) is copied and pasted,
        # so it stays whole
        return "\n".join(line if line.startswith("  ") else super(_HelpFormatter, self)._fill_text(line, width, indent)
                         for line in text.splitlines())


def _examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def _command(commands, name: str, help: str, *examples: str) -> argparse.ArgumentParser:
    return commands.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".",
                               epilog=_examples(*examples), formatter_class=_HelpFormatter)


PAR_FILE_HELP = "the .par file: the mesh, the model, its inputs and the layouts"
JSON_HELP = "print one JSON object on stdout, whatever happens (errors included)"
QUIET_HELP = ("no status line (on a terminal, stderr's last line says what the command is doing and for how "
              "long; default: shown there, never in a pipe or with --json)")
TIME_LIMIT_HELP = "give up (error E090, saying how far it got) after this long (default: no limit)"
BACKEND_HELP = "the collectives' library (auto: NCCL where CUDA is available, else gloo)"


def _arguments() -> argparse.ArgumentParser:
    from pardsl import __version__

    parser = _Parser(prog="pardsl", description="A declarative model-parallel compiler for PyTorch.",
                     formatter_class=_HelpFormatter,
                     epilog=_examples("pardsl check examples/mlp.par", "pardsl run examples/mlp.par --steps 3",
                                      "pardsl explain examples/mlp.par") + "\n\n`pardsl COMMAND --help` says more "
                     "about each command.")
    parser.add_argument("--version", action="version", version=f"pardsl {__version__}",
                        help="print pardsl's version and exit")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    check = _command(commands, "check", "parse, bind and type-check a .par file",
                     "pardsl check examples/mlp.par", "pardsl check examples/mlp.par --json",
                     "pardsl check examples/mlp_inferred.par --time-limit 60")
    check.add_argument("file", help=PAR_FILE_HELP)
    check.add_argument("--json", action="store_true", help=JSON_HELP)
    check.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    check.add_argument("--time-limit", type=_positive_seconds, default=None, metavar="SECONDS", help=TIME_LIMIT_HELP)

    compile_ = _command(commands, "compile", "write the SPMD module and plan.json",
                        "pardsl compile examples/mlp.par -o out/mlp",
                        "pardsl compile examples/mlp_dp.par -o out/mlp_dp --bucket-mb 0 --json")
    compile_.add_argument("file", help=PAR_FILE_HELP)
    compile_.add_argument("-o", "--output", required=True, metavar="DIR",
                          help="the folder to write pardsl_module.py and plan.json into (required)")
    compile_.add_argument("--json", action="store_true", help=JSON_HELP)
    compile_.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    compile_.add_argument("--time-limit", type=_positive_seconds, default=None, metavar="SECONDS",
                          help=TIME_LIMIT_HELP)
    compile_.add_argument("--bucket-mb", type=_bucket_mb, default=None, metavar="MB",
                          help="size of the buckets parameter gradients are synchronised in (default: 25)")
    compile_.add_argument("--machine", "--calibration", dest="machine", metavar="NAME|FILE",
                          help=MACHINE_HELP)

    export = _command(commands, "export", "write a checkpoint's model tensors, whole, to one safetensors file",
                      "torchrun --nproc-per-node 2 examples/train.py --steps 60 --save-at 30 --checkpoint-dir ckpt",
                      "pardsl export ckpt/step-30 -o model.safetensors")
    export.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                        help="a checkpoint folder pardsl.save wrote (one step's, such as ckpt/step-30)")
    export.add_argument("-o", "--output", required=True, metavar="FILE",
                        help="the safetensors file to write (required)")
    export.add_argument("--no-verify", action="store_true",
                        help="read the files without checking their sha256 against the index (default: checked)")
    export.add_argument("--allow-shared-folder", action="store_true",
                        help="read a checkpoint from a folder other users can write, trusting them (default: "
                             "refused)")

    init = _command(commands, "init", "write a starting .par file for a Hugging Face model, its layouts from the "
                    "model's tensor-parallel plan (a search request where it has none), checked to compile",
                    'pardsl init Qwen3Config -o qwen3.par --mesh "dp = 2, tp = 2"',
                    'pardsl init "examples.hf_models:llama_causal_lm(layers=2)" -o "examples/my_llama.par"',
                    'pardsl init "examples.hf_models:gpt2_lm_head(layers=1)" -o "examples/my_gpt2.par" '
                    '--memory "50 %"')
    init.add_argument("model", metavar="MODEL",
                      help="a transformers config class's name (LlamaConfig: its model, built small), or the "
                           "model as the .par `model` line takes it: module:factory(literal kwargs), the factory "
                           "returning a transformers model (or a module holding one)")
    init.add_argument("-o", "--output", required=True, metavar="FILE",
                      help="the .par file to write; the model's module is imported as from its folder (required)")
    init.add_argument("--mesh", default="tp = 2", metavar="AXES", help="the `mesh` line's axes")
    init.add_argument("--seq", type=int, default=16, metavar="N", help="the example input's sequence length")
    init.add_argument("--batch", type=int, default=2, metavar="N", help="the example input's batch size")
    init.add_argument("--memory", default="40 %", metavar="BOUND",
                      help="the memory bound written where the model has no plan (a search request)")
    init.add_argument("--input", action="append", default=[], metavar="DECLARATION", dest="inputs",
                      help="an input the file declares, as after the .par's `input` keyword (--input \"t_cond : "
                           "float32[1, 512]\"); repeatable; given, these are the file's inputs in place of the "
                           "token ids, embeddings or image init would try")
    init.add_argument("--argument", action="append", default=[], metavar="NAME=VALUE", dest="arguments",
                      help="an argument of the model's forward that is no tensor, fixed to VALUE (a Python "
                           "literal: --argument num_patches=16); repeatable")
    init.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", dest="settings",
                      help="a config class's setting over init's small sizes and the class's defaults, VALUE a "
                           "Python literal (--set partial_rotary_factor=0.5); repeatable")

    _command(commands, "rules", "print every op's rule, one line per op, after a key to the words used",
             "pardsl rules", "pardsl rules | grep aten.linear")
    _command(commands, "codes", "print every error and note code with its meaning (Markdown)",
             "pardsl codes", "pardsl codes | grep E012")

    explain = _command(commands, "explain", "a summary (step, tokens/s, MFU, memory against the bound), then per "
                       "layer: layouts, collectives with bytes and estimated time; and plans you could write instead",
                       "pardsl explain examples/mlp.par",
                       "pardsl explain examples/gpt_dp2_tp2.par --op-choices",
                       "pardsl explain examples/mlp.par --html plan.html",
                       "pardsl explain examples/mlp.par --machine h100-nvlink-ib --optimizer sgd --json")
    explain.add_argument("file", help=PAR_FILE_HELP)
    explain.add_argument("--machine", "--calibration", dest="machine", metavar="NAME|FILE",
                         help=MACHINE_HELP)
    explain.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                         help=BACKEND_HELP + "; picks the calibration and defaults the estimate uses")
    explain.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default="adamw",
                         help="the optimizer whose state counts in memory")
    explain.add_argument("--bucket-mb", type=_bucket_mb, default=None, metavar="MB",
                         help="size of the buckets parameter gradients are synchronised in (default: 25)")
    explain.add_argument("--op-choices", action="store_true",
                         help="also list the other layouts single ops could take, closest in cost first "
                              "(default: off)")
    explain.add_argument("--html", metavar="FILE",
                         help="also write a self-contained HTML page (default: none written)")
    explain.add_argument("--json", action="store_true", help=JSON_HELP)
    explain.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    explain.add_argument("--time-limit", type=_positive_seconds, default=None, metavar="SECONDS",
                         help=TIME_LIMIT_HELP)

    calibrate = _command(commands, "calibrate", "measure α, β per collective, compute throughput and "
                         "bandwidth on this machine, for the cost model",
                         "pardsl calibrate --quick", "pardsl calibrate --nproc 2 -o calibration.json")
    calibrate.add_argument("--nproc", type=int, default=2, metavar="N",
                           help="ranks to measure the collectives between, at least 2")
    calibrate.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto", help=BACKEND_HELP)
    calibrate.add_argument("-o", "--output", metavar="FILE", help="where to write (default: the place compile "
                           "and explain read, ~/.cache/pardsl/calibration-BACKEND.json)")
    calibrate.add_argument("--quick", action="store_true", help="fewer sizes and repeats")

    run = _command(commands, "run", "run on local ranks, one per rank of the file's mesh, and check against "
                   "the serial model",
                   "pardsl run examples/mlp.par --steps 3",
                   "pardsl run examples/mlp_dp.par --optimizer adamw --json",
                   "pardsl run examples/mlp.par --nproc 2 --backend gloo -o out/mlp")
    run.add_argument("file", help=PAR_FILE_HELP)
    # the mesh already says how many ranks there are; --nproc only confirms it (another count is E012)
    run.add_argument("--nproc", type=int, default=None, metavar="N",
                     help="how many ranks to run (default: the number of ranks in the file's mesh); another "
                          "number than the mesh's is an error")
    run.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto", help=BACKEND_HELP)
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                     help="where each rank's tensors live (auto: CUDA under NCCL, else the CPU); gloo with "
                          "cuda runs several ranks on one GPU, which NCCL refuses")
    run.add_argument("--seed", type=int, default=0, help="seed of the parameters, inputs and output gradients")
    run.add_argument("--steps", type=int, default=1, metavar="K",
                     help="training steps, each compared with serial from the same parameters")
    run.add_argument("--lr", type=float, default=0.01, help="learning rate")
    run.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default="sgd",
                     help="the optimizer of each step")
    run.add_argument("--compile", action="store_true",
                     help="regional compilation: the forward's runs of ATen ops compiled by torch.compile, one "
                          "function per distinct run, shared by the repeated layers")
    run.add_argument("--collectives-in-graphs", choices=("yes", "no"), default=None,
                     help="with --compile: the conversions between the runs inside the compiled graphs, as "
                          "functional collectives (default: yes on NCCL, no on gloo)")
    run.add_argument("--compile-backend", default=None, metavar="NAME",
                     help="with --compile: torch.compile's backend (default: inductor; aot_eager runs the same "
                          "graphs' ATen ops as they are)")
    run.add_argument("--timeout", type=_positive_seconds, default=300.0, metavar="SECONDS",
                     help="collective timeout per rank (a hang fails instead of blocking)")
    run.add_argument("--stall-timeout", type=_positive_seconds, default=60.0, metavar="SECONDS",
                     help="end the run when no rank has made progress for this long, naming the one behind")
    run.add_argument("--time-limit", type=_positive_seconds, default=None, metavar="SECONDS",
                     help="give up after this long, compile and ranks together (a compile cut short is error E090; "
                          "ranks still running are ended) (default: no limit)")
    run.add_argument("--json", action="store_true", help=JSON_HELP)
    run.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    run.add_argument("-o", "--output", metavar="DIR",
                     help="also write the module and plan.json here (default: not written)")
    run.add_argument("--bucket-mb", type=_bucket_mb, default=None, metavar="MB",
                     help="size of the buckets parameter gradients are synchronised in (default: 25)")
    run.add_argument("--machine", metavar="NAME|FILE", help=MACHINE_HELP)

    dryrun = _command(commands, "dryrun", "one rank's program at its real size in this process, collectives "
                      "answered by a fake process group: measured memory, time and collectives beside the estimate",
                      "pardsl dryrun examples/mlp.par",
                      "pardsl dryrun examples/mlp_pp2.par --rank 1 --steps 2 --json")
    dryrun.add_argument("file", help=PAR_FILE_HELP)
    dryrun.add_argument("--rank", type=int, default=0, metavar="R", help="the rank whose program runs")
    dryrun.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the rank's tensors live")
    dryrun.add_argument("--steps", type=int, default=1, metavar="N", help="training steps")
    dryrun.add_argument("--machine", metavar="NAME|FILE", help=MACHINE_HELP + "; a plan its estimate says "
                        "exceeds the machine's device memory is refused before anything is allocated")
    dryrun.add_argument("--json", action="store_true", help=JSON_HELP)
    dryrun.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    dryrun.add_argument("--time-limit", type=_positive_seconds, default=None, metavar="SECONDS",
                        help="give up compiling (error E090) after this long (default: no limit)")
    return parser


MACHINE_HELP = ("the machine the plan is searched and estimated for: a preset (h100-nvlink-ib, a100-nvlink-ib, "
                "h800-nvlink-ib, cpu-gloo) or a file `pardsl calibrate` wrote (default: this machine's calibration "
                "for its backend, else the backend's defaults)")


def _bucket_mb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (0 <= value < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a size in MiB, 0 or more, not {text!r}")
    return value


def _report_errors(error: CompileError, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"ok": False, "errors": [d.to_json() for d in error.diagnostics]}, indent=2))
    else:
        print(error.render(), file=sys.stderr)
        count = len(error.diagnostics)
        print(f"\n{count} error{'s' if count != 1 else ''}", file=sys.stderr)
    return EXIT_INPUT_ERROR


def _out_of_time(path: str, limit: float, stage: str) -> CompileError:
    """E090 at the file's `model` line (where it parses; its first line where not)."""
    from pardsl.language.diagnostics import Diagnostic, Span
    from pardsl.language.syntax import parse_file

    span, source = Span(1, 1, 1, 2), None
    with contextlib.suppress(Exception):  # the file parsed before: this is only to find the line again
        par = parse_file(path)
        span, source = par.model.span, par.source
    return CompileError([Diagnostic("E090", f"the compile did not finish within its time limit of {limit:g} s; "
                                            f"it was {stage}", span,
                                    ("a larger --time-limit lets it finish; `pardsl check` on a terminal shows "
                                     "its progress",))], source)


def _print_notes(compiled) -> None:
    for note in compiled.program.notes:
        print(note.render(compiled.par.source), file=sys.stderr)


def _summary(compiled) -> str:
    from pardsl.program.ir import format_bytes, named_layout

    program = compiled.program
    lines = [f"{program.source_path}: mesh {program.mesh} ({program.mesh.size} ranks), model {program.model}"]
    if compiled.mesh_shapes:
        lines.append(f"  mesh shape searched: the fastest of {len(compiled.mesh_shapes)} (`pardsl explain` prices each)")
    width = max([len(p.name) for p in program.parameters + program.inputs] + [len(o.path) for o in program.outputs] + [8])
    for slot in program.inputs + program.parameters:
        lines.append(f"  {slot.kind:<9} {slot.name:<{width}}  {named_layout(slot.layout, program.mesh):<18} "
                     f"{list(slot.shape)} local {list(slot.local_shape)}")
    for out in program.outputs:
        lines.append(f"  {'output':<9} {out.path:<{width}}  {named_layout(out.layout, program.mesh):<18} "
                     f"{list(out.shape)} local {list(out.local_shape)}")
    counts, totals = program.collective_counts(), program.collective_bytes()
    for phase in ("forward", "backward"):
        parts = [f"{n} {k.replace('_', '-')}" for k, n in counts[phase].items() if n]
        lines.append(f"  {phase:<9} {', '.join(parts) or 'no collectives'} ({format_bytes(totals[phase])} per rank)")
    memory = program.memory()
    lines.append(f"  memory    parameters {format_bytes(memory['parameters_per_rank'])} per rank "
                 f"(of {format_bytes(memory['parameters_total'])}), activations "
                 f"{format_bytes(memory['activations_per_rank'])} per rank (of {format_bytes(memory['activations_total'])})")
    if compiled.pipeline is not None:  # the lines above are one micro-batch through every stage
        from pardsl.planning.cost import pipelined_memory_per_rank

        held = pipelined_memory_per_rank(compiled.stages, compiled.pipeline)
        lines.append(f"  pipeline  the rank that holds most: {format_bytes(held['total'])} (its stages' parameters "
                     f"{format_bytes(held['parameters'])}, activations of the micro-batches in flight "
                     f"{format_bytes(held['activations'])}, torch's stage buffers {format_bytes(held['stage_buffers'])}), "
                     f"{format_bytes(held['peak'])} at its peak")
    return "\n".join(lines)


def _inputs_past_memory(compiled, ranks: int, local: bool = False):
    """A CompileError where the example inputs would not fit this machine's memory, said before anything is
    allocated: whole on each of `ranks` ranks (each rank of a run, and its serial reference, makes them
    all), or as one rank's shards (`local`: a dry run's one rank)."""
    from pardsl.language.diagnostics import Diagnostic
    from pardsl.model.loading import DTYPES

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for decl, slot in zip(compiled.par.inputs, compiled.program.inputs):
        nbytes = math.prod(slot.local_shape if local else decl.shape) * DTYPES[decl.dtype].itemsize
        if nbytes * ranks > memory // 2:
            whose = "this rank's shard of " if local else ""
            return CompileError([Diagnostic("E029", f"{whose}input `{decl.name}` takes {nbytes / 2**30:.1f} GiB on "
                                            f"each of {ranks} rank{'s' if ranks != 1 else ''}; this machine has "
                                            f"{memory / 2**30:.1f} GiB", decl.span)], compiled.par.source)
    return None


def _cannot_write(args, folder: str, error: OSError) -> int:
    reason = "it is not a folder" if os.path.exists(folder) and not os.path.isdir(folder) else error.strerror or str(error)
    return _failed(args, "error", f"cannot write the outputs to {folder!r}: {reason}", EXIT_INPUT_ERROR)


def _export(args) -> int:
    from pardsl.runtime.checkpoint import export_checkpoint

    try:
        names = export_checkpoint(args.checkpoint, args.output, verify=not args.no_verify,
                                  allow_shared_folder=args.allow_shared_folder)
    except (OSError, ValueError) as error:
        # the library's advice names its keywords; here they are this command's flags
        message = str(error).replace("pass verify=False", "pass --no-verify") \
            .replace("pass allow_shared_folder=True", "pass --allow-shared-folder")
        return _failed(args, "error", message, EXIT_INPUT_ERROR)
    print(f"wrote {len(names)} tensors to {args.output}")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """The command's exit code. Under --json, stdout carries exactly one JSON object whatever happens:
    the report, the errors located in the file, or what else failed (usage, a rank, an interrupt)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = _arguments().parse_args(argv)
    except _UsageError as usage:
        if "--json" in argv:
            print(_json_failure("usage", usage.message))
        raise
    try:
        if args.command == "export":
            return _export(args)
        if args.command == "calibrate":
            return _calibrate(args)
        if args.command == "init":
            return _init(args)
        if args.command == "codes":
            from pardsl.language.diagnostics import code_reference

            print(code_reference(), end="")
            return EXIT_OK
        if args.command == "rules":
            from pardsl.layouts.oprules import rules_in_words

            print("\n".join(rules_in_words()))
            return EXIT_OK
        # In JSON mode stdout carries one JSON object: whatever the user's model prints goes to stderr.
        quiet = contextlib.redirect_stdout(sys.stderr) if getattr(args, "json", False) else contextlib.nullcontext()
        return _main(args, quiet)
    except KeyboardInterrupt:
        print("pardsl: interrupted", file=sys.stderr)
        if getattr(args, "json", False):
            print(_json_failure("interrupted", "interrupted (Ctrl-C or SIGINT)"))
        return EXIT_INTERRUPTED
    except Exception:  # not the user's mistake: say so, with what a bug report needs
        import traceback

        return _failed(args, "internal error", f"a bug in pardsl, please report it with the command line:\n"
                       f"{traceback.format_exc()}", EXIT_INPUT_ERROR)


def _init(args) -> int:
    from pardsl.language.files import write_atomically
    from pardsl.tools.init import InitError, generate, settings_given

    if args.seq < 1 or args.batch < 1:
        return _failed(args, "error", "--seq and --batch must be at least 1", EXIT_USAGE)
    try:
        generated = generate(args.model, args.output, args.mesh, args.seq, args.batch, args.memory,
                             settings_given(args.settings), args.inputs, settings_given(args.arguments, "--argument"))
    except InitError as error:
        return _failed(args, "error", str(error), EXIT_INPUT_ERROR)
    except CompileError as error:  # located in the text init made: nothing is written
        print(f"pardsl: error: the file made for {args.output} does not compile, so it was not written; change "
              "the model or the options, or write the file by hand from what follows", file=sys.stderr)
        return _report_errors(error, False)
    try:
        write_atomically(args.output, generated.text)
    except OSError as error:
        return _failed(args, "error", f"cannot write {args.output}: {error.strerror}", EXIT_INPUT_ERROR)
    for note in generated.notes:
        print(f"pardsl: note: {note}", file=sys.stderr)
    kind = "layouts from the model's tensor-parallel plan" if generated.planned else \
        "a search request: the model has no tensor-parallel plan"
    print(f"wrote {args.output} ({kind}); next: pardsl explain {args.output}")
    return EXIT_OK


def _calibrate(args) -> int:
    from pardsl.planning.cost import calibration_path
    from pardsl.runtime.devices import resolve_backend
    from pardsl.tools.calibrate import calibrate, write
    from pardsl.tools.explain import seconds_text

    backend = resolve_backend(args.backend)
    if args.nproc < 2:
        return _failed(args, "error", "--nproc must be at least 2 (collectives are measured between ranks)", EXIT_USAGE)
    machine, raw = calibrate(args.nproc, backend, quick=args.quick)
    path = args.output or calibration_path(backend)
    try:
        write(machine, raw, path)
    except OSError as error:
        return _failed(args, "error", f"cannot write {path}: {error.strerror}", EXIT_INPUT_ERROR)
    print(f"{backend} on {args.nproc} ranks:")
    for kind, link in machine.collectives.items():
        print(f"  {kind.replace('_', '-'):<14} α {seconds_text(link.alpha_s):>9} per ring step, β {link.beta_s_per_byte * 1e9:.3g} ns/B")
    print(f"  compute        {machine.flops_per_s / 1e9:.3g} GFLOP/s, {machine.bytes_per_s / 1e9:.3g} GB/s, "
          f"{seconds_text(machine.op_overhead_s)} per op; {machine.overlap:.0%} of a collective hides behind compute")
    print(f"wrote {path}")
    return EXIT_OK


def _explain(args, compiled, machine, started: float) -> int:
    from pardsl.language.progress import tell
    from pardsl.planning.cost import estimate
    from pardsl.planning.cost import DEFAULT_BUCKET_MB
    from pardsl.tools.alternatives import plan_alternatives
    from pardsl.tools.explain import report
    from pardsl.tools.explain_html import html_page

    with _status_on_terminal(args, started):
        tell("pricing the plan on the machine")
        result = estimate(compiled, machine, args.optimizer)
        bound = compiled.memory_bound
        others = plan_alternatives(compiled, machine,
                                   DEFAULT_BUCKET_MB if args.bucket_mb is None else args.bucket_mb, args.optimizer)
        tell("writing the report")
        page = html_page(compiled, result, bound, others, args.op_choices) if args.html else None
        text = None if args.json else report(compiled, result, bound, others, args.op_choices)
    if args.html:
        from pardsl.language.files import write_atomically

        try:
            write_atomically(args.html, page)
        except OSError as error:
            return _failed(args, "error", f"cannot write {args.html}: {error.strerror}", EXIT_INPUT_ERROR)
    if args.json:
        print(json.dumps({"ok": True, **result.to_json(), "memory_bound": bound,
                          "alternatives": [other.to_json() for other in others],
                          "notes": [n.to_json() for n in compiled.program.notes]}, indent=2))
    else:
        print(text)
        if args.html:
            print(f"wrote {args.html}")
    return EXIT_OK


def _dryrun(args, compiled, machine, started: float) -> int:
    from pardsl.program.ir import format_bytes
    from pardsl.tools.dryrun import DryRunRefused, dry_run

    if args.steps < 1:
        return _failed(args, "error", "--steps must be at least 1", EXIT_USAGE)
    too_big = _inputs_past_memory(compiled, 1, local=True) if args.device == "cpu" else None
    if too_big is not None:
        return _report_errors(too_big, args.json)
    try:
        with _status_on_terminal(args, started):
            result = dry_run(compiled, args.rank, args.device, args.steps, machine)
    except DryRunRefused as refused:
        return _failed(args, "dry run refused", str(refused), EXIT_INPUT_ERROR)
    if args.json:
        print(json.dumps({"ok": result.collectives_match and result.fits is not False, **result.to_json()}, indent=2))
        return EXIT_OK
    seconds = ", ".join(f"{phase} {value * 1000:.1f} ms" for phase, value in result.seconds.items())
    after = ", ".join(f"{phase} {format_bytes(b)}" for phase, b in result.peak_after.items())
    print(f"{args.file}: rank {result.rank} of {compiled.program.mesh} on {result.device}, {result.steps} step(s), "
          "collectives answered by a fake process group")
    print(f"  memory    peak {format_bytes(result.peak_bytes)} (estimate {format_bytes(result.estimated_bytes)}, "
          f"{result.peak_bytes / max(result.estimated_bytes, 1):.2f} of it); set-up {format_bytes(result.set_up_bytes)}; "
          f"peak by the end of {after}")
    if result.device_memory_bytes:
        print(f"  device    {format_bytes(result.device_memory_bytes)}: "
              + ("fits" if result.fits else "DOES NOT FIT"))
    print(f"  time      {seconds} (this device's)")
    for phase in ("forward", "backward"):
        issued = ", ".join(f"{n} {key}" for key, n in result.issued[phase].items()) or "none"
        print(f"  {phase:<9} {issued}")
    print(f"  collectives {'as planned' if result.collectives_match else 'DIFFER from the plan: ' + json.dumps(result.planned)}")
    for note in result.notes:
        print(f"  note: {note}")
    return EXIT_OK


@contextlib.contextmanager
def _status_on_terminal(args, started: float):
    """On a terminal, one status line on stderr says what the command is doing and for how long so far
    (`started`: its time.monotonic() at the start), redrawn each second and gone when the block ends: a
    searched plan, a dry run at real size or a run's ranks can take minutes. Elsewhere (a pipe, a file,
    --json, --quiet) nothing is written."""
    if getattr(args, "json", False) or getattr(args, "quiet", False) or not sys.stderr.isatty():
        yield
        return
    import threading

    from rich.console import Console

    from pardsl.language.progress import reported_to

    name = os.path.basename(args.file)  # one line on a narrow terminal
    said, stop = ["parsing" if args.command != "run" else "compiling"], threading.Event()

    def line() -> str:
        return f"{name}: {said[0]} ({time.monotonic() - started:.0f} s)"

    def hear(message: str) -> None:
        said[0] = message
        status.update(line())

    def tick() -> None:  # the time so far moves on between stages
        while not stop.wait(1.0):
            status.update(line())

    with Console(stderr=True).status(line(), spinner="dots") as status:
        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            with reported_to(hear):
                yield
        finally:
            stop.set()
            ticker.join()


def _main(args, quiet) -> int:
    from pardsl.compiler import compile_file, plan_json, write_outputs
    from pardsl.language.progress import OutOfTime, time_limit

    limit = getattr(args, "time_limit", None)
    machine = None
    if hasattr(args, "machine"):  # the search plans for it, the estimate prices on it
        from pardsl.planning.cost import CalibrationError, machine_named
        from pardsl.runtime.devices import resolve_backend

        try:
            machine = machine_named(args.machine, resolve_backend(getattr(args, "backend", "auto")))
        except CalibrationError as error:
            return _failed(args, "error", str(error), EXIT_USAGE)
    started = time.monotonic()
    try:
        with quiet, _status_on_terminal(args, started), time_limit(limit):
            bucket_mb = getattr(args, "bucket_mb", None)
            compiled = compile_file(args.file, machine=machine,
                                    **({"bucket_mb": bucket_mb} if bucket_mb is not None else {}))
    except OutOfTime as stage:
        return _report_errors(_out_of_time(args.file, limit, str(stage)), args.json)
    except FileNotFoundError as error:
        return _failed(args, "error", str(error), EXIT_USAGE)
    except CompileError as error:
        return _report_errors(error, args.json)
    except Exception:  # not the user's mistake: say so, with what a bug report needs
        import traceback

        return _failed(args, "internal compiler error", f"while compiling {args.file} (a bug in pardsl, please "
                       f"report it with this .par file):\n{traceback.format_exc()}", EXIT_INPUT_ERROR)

    if args.command == "check":
        if args.json:
            print(json.dumps({"ok": True, "errors": [], "notes": [n.to_json() for n in compiled.program.notes]}))
        else:
            _print_notes(compiled)
            print(f"{args.file}: ok")
        return EXIT_OK

    if args.command == "explain":
        return _explain(args, compiled, machine, started)

    if args.command == "dryrun":
        return _dryrun(args, compiled, machine, started)

    if args.command == "compile":
        try:
            module_path, plan_path = write_outputs(compiled, args.output, machine)
        except OSError as error:
            return _cannot_write(args, args.output, error)
        if args.json:
            print(json.dumps({"ok": True, "module": module_path, "plan": plan_path, **plan_json(compiled, machine)},
                             indent=2))
        else:
            _print_notes(compiled)
            print(_summary(compiled))
            print(f"wrote {module_path} and {plan_path}")
        return EXIT_OK

    # run
    from pardsl.planning.cost import estimate
    from pardsl.program.codegen import cannot_compile
    from pardsl.runtime.devices import resolve_backend, resolve_device
    from pardsl.runtime.pieces import check_backend
    from pardsl.tools.execution import RunFailed, job_for, launch

    mesh = compiled.program.mesh
    if args.nproc is not None and args.nproc != mesh.size:
        span = compiled.par.mesh.span
        from pardsl.language.diagnostics import Diagnostic, Span

        error = CompileError([Diagnostic("E012", f"the mesh ({mesh}) has {mesh.size} ranks but --nproc is "
                                         f"{args.nproc}", Span(span.line, span.column, span.line, span.column + 4))],
                             compiled.par.source)
        return _report_errors(error, args.json)
    if args.output:
        try:
            write_outputs(compiled, args.output)
        except OSError as error:
            return _cannot_write(args, args.output, error)
    if args.steps < 1:
        return _failed(args, "error", "--steps must be at least 1", EXIT_USAGE)
    too_big = _inputs_past_memory(compiled, mesh.size)
    if too_big is not None:
        return _report_errors(too_big, args.json)
    backend = resolve_backend(args.backend)
    device = resolve_device(args.device, backend)
    usage = _device_mistake(backend, device, mesh.size) or \
        (cannot_compile(compiled.programs) if args.compile else None) or \
        ("--collectives-in-graphs needs --compile" if args.collectives_in_graphs and not args.compile else None) or \
        ("--compile-backend needs --compile" if args.compile_backend and not args.compile else None) or \
        (check_backend(args.compile_backend) if args.compile_backend else None)
    if usage:
        return _failed(args, "error", usage, EXIT_USAGE)
    job = job_for(compiled, seed=args.seed, steps=args.steps, backend=backend, device=device, timeout_s=args.timeout,
                  lr=args.lr, optimizer=args.optimizer, stdout_to_stderr=args.json, compile=args.compile,
                  collectives_in_graphs=None if args.collectives_in_graphs is None else
                  args.collectives_in_graphs == "yes", compile_backend=args.compile_backend or "inductor")
    try:
        with _status_on_terminal(args, started):
            report = launch(job, stall_s=args.stall_timeout,
                            time_limit_s=None if limit is None else max(limit - (time.monotonic() - started), 0.0))
    except RunFailed as error:  # a rank failed or stalled: which and why, without the launcher's traceback
        return _failed(args, "run failed", str(error).strip()[:4000], EXIT_INPUT_ERROR)
    report["compile_s"] = sum(compiled.seconds.values())
    if "memory" in report:  # what the plan's estimate says a rank holds, beside what each measured
        memory = estimate(compiled, machine, args.optimizer).memory
        estimated = memory["peak"]
        if device == "cpu" and "host_total" in memory:
            # on CPU ranks host and device memory are one: the peak measured holds the offloaded tensors too,
            # and a device copy in the master's own dtype is the master itself
            estimated += memory["host_total"] - (memory["compute_copies"] if compiled.program.precision is None else 0)
        report["memory"]["estimated_bytes"] = estimated
        if "host_total" in memory:
            report["memory"]["estimated_host_bytes"] = memory["host_total"]
    report["errors"] = []
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_notes(compiled)
        print(_summary(compiled))
        verdict = "equivalent to serial" if report["ok"] else "DIFFERS from serial" if report["serial_finite"] \
            else "not comparable: the serial model itself gives non-finite values (lower --lr?)"
        print(f"ran {report['steps']} step(s) on {report['world_size']} ranks ({report['backend']}"
              f"{', CUDA tensors' if report['device'] == 'cuda' else ''}): {verdict}")
        print(f"  max |compiled - serial|: output {report['max_abs_err']['output']:.3g}, "
              f"gradients {report['max_abs_err']['grad']:.3g}; relative {report['max_rel_err']['output']:.3g} and "
              f"{report['max_rel_err']['grad']:.3g} (tolerance {report['tolerance']:g}, each step from the same "
              f"parameters, {report['optimizer']})")
        for phase in ("forward", "backward"):
            parts = [f"{n} {k.replace('_', '-')}" for k, n in report["collectives"][phase].items() if n]
            routed = ""
            if "routed_bytes" in report:  # a mixture's all-to-alls move what the routing sends
                by_rank = ", ".join(str(r[phase]) for r in report["routed_bytes"])
                routed = (f"; all-to-alls as routed: {by_rank} bytes by rank (planned "
                          f"{compiled.program.routed_bytes()[phase]} for a balanced routing)")
            print(f"  {phase} collectives (measured): {', '.join(parts) or 'none'}, {report['bytes'][phase]} bytes{routed}")
        if "sends" in report:
            between = "between stages" if compiled.pipeline is not None else "between neighbours (halos, ring attention)"
            print(f"  point-to-point sends {between}, all ranks (measured): {report['sends']['forward']} forward, "
                  f"{report['sends']['backward']} backward")
        print(f"  step time: compiled {report['step_ms']['compiled']:.2f} ms, serial {report['step_ms']['serial']:.2f} ms")
        if "memory" in report:
            print(measured_memory_line(report["memory"], pipelined=compiled.pipeline is not None))
    return EXIT_OK if report["ok"] else EXIT_INPUT_ERROR


def measured_memory_line(memory: dict, pipelined: bool) -> str:
    """`pardsl run`'s line for the memory its ranks held at their peak, beside the plan's estimate."""
    from pardsl.program.ir import format_bytes

    whose = " (the rank that holds most)" if pipelined else ""
    return (f"  memory (measured, first step): peak {', '.join(map(format_bytes, memory['peak_bytes']))} by rank; "
            f"estimate {format_bytes(memory['estimated_bytes'])}{whose}")


def _device_mistake(backend: str, device: str, nproc: int) -> str | None:
    """What is wrong with running `nproc` ranks on this backend and device here, if anything."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and gpus == 0:
        return "--device cuda needs a CUDA device; this machine has none"
    if backend == "nccl" and device != "cuda":
        return "--backend nccl moves CUDA tensors only: use --device cuda (or auto)"
    if backend == "nccl" and gpus < nproc:
        return (f"--backend nccl needs a GPU per rank, {nproc}; this machine has {gpus} (NCCL refuses two ranks "
                f"on one GPU: --backend gloo --device cuda runs them there)")
    return None


def entry() -> None:
    """The `pardsl` command. After Ctrl-C, exits 130 at once: CPython remembers a KeyboardInterrupt that
    crossed C code (torch's imports run some) even once caught, and would end the process by SIGINT
    (status -2) instead of the 130 main returned; every child is already gone by then."""
    code = main()
    if code == EXIT_INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
