"""The GPU check, for a machine with one NVIDIA GPU: `make gpu-check` (under 8 minutes on an H100).

Each step is a command of the project's own, run with a time limit, its outcome printed as it ends; the
summary at the end is what goes into benchmarks/README.md with the date and the card:

1. the device: torch's CUDA build, the card, its memory, NCCL's version;
2. every example family against serial on one rank over NCCL (its mesh cut to one rank), and on two
   gloo ranks with CUDA tensors (the GPU shared), with the mixed-precision policy and offload on one
   of them (pinned host memory, copies to and from the device);
3. compiled layers (`run --compile`, inductor on CUDA) with the collectives inside the graphs as functional
   ones, on two gloo ranks with CUDA tensors, against serial;
4. the dry run of the Llama 3.1 8B shape's tensor-parallel rank (tp 8) on the GPU, its measured peak
   against the estimate and its collectives against the plan's;
5. `benchmarks/vs_torch.py --device cuda`: pardsl against DDP, FSDP2 and DTensor on the GPU.

    python benchmarks/gpu_check.py [--quick]      # --quick: one family per step, no vs_torch
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ["mlp.par", "gpt_tp2.par", "hf_gpt2_tp2.par", "hf_llama_tp2.par", "hf_bert_tp2.par", "hf_t5_tp2.par",
            "hf_vit_tp2.par", "hf_resnet_dp2.par", "hf_mixtral_ep2.par", "llama_zero3.par", "hf_llama_pp2.par"]
COMPILED_FAMILIES = ["hf_llama_tp2.par", "gpt_sp_tp2.par"]
MEMORY_LINES = {"precision": "precision params bf16, reduce fp32",
                "precision and offload": "precision params bf16, reduce fp32\noffload optimizer"}


def step(title: str, command: list[str], timeout_s: float) -> tuple[bool, str]:
    """Run one command of the check; (passed, its last lines)."""
    start = time.perf_counter()
    try:
        result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=timeout_s,
                                env={**os.environ, "PYTHONPATH": ROOT})
        passed, output = result.returncode == 0, (result.stdout + result.stderr).strip()
    except subprocess.TimeoutExpired:
        passed, output = False, f"timed out after {timeout_s:.0f} s"
    print(f"[{'ok' if passed else 'FAILED'}] {title} ({time.perf_counter() - start:.0f} s)", flush=True)
    return passed, output


def one_rank(text: str) -> str:
    """The file with its mesh cut to one rank (every axis of size 1) and no pipeline: layouts stay valid."""
    text = re.sub(r"^(mesh\s+)(.*)$", lambda m: m.group(1) + re.sub(r"=\s*\d+", "= 1", m.group(2)), text, flags=re.M)
    return re.sub(r"^pipeline .*$", "", text, flags=re.M)


def run_report(output: str) -> str:
    """One line from `pardsl run --json`: equal to serial, errors, step times and memory."""
    try:
        report = json.loads(output[output.index("{"):])
    except (ValueError, json.JSONDecodeError):
        return output.splitlines()[-1][:200] if output else "no output"
    memory = report.get("memory", {})
    peak = max(memory.get("peak_bytes", [0]) or [0])
    return (f"equal to serial: {report.get('ok')}, relative error {report.get('max_rel_err')}, step "
            f"{report.get('step_ms')} ms, peak {peak / 2**20:.1f} MiB, estimate "
            f"{memory.get('estimated_bytes', 0) / 2**20:.1f} MiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    families = FAMILIES[:2] if args.quick else FAMILIES
    summary, failed = [], 0
    python = sys.executable

    passed, output = step("the device", [python, "-c", (
        "import torch, json; assert torch.cuda.is_available(), 'no CUDA device'; p = torch.cuda.get_device_properties(0); "
        "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, 'card': p.name, "
        "'memory_gib': round(p.total_memory / 2**30, 1), 'nccl': '.'.join(map(str, torch.cuda.nccl.version()))}))")], 60)
    summary.append(f"device: {output.splitlines()[-1] if output else ''}")
    if not passed:
        print(output)
        return 1

    with tempfile.TemporaryDirectory() as folder:
        for family in families:
            path = os.path.join(folder, f"one_rank_{family}")
            with open(os.path.join(ROOT, "examples", family)) as source, open(path, "w") as handle:
                handle.write(one_rank(source.read()))
            ok, output = step(f"{family} on 1 rank, NCCL", [python, "-m", "pardsl.cli", "run", path, "--nproc", "1",
                                                            "--backend", "nccl", "--device", "cuda", "--steps", "2",
                                                            "--json"], 120)
            failed += not ok
            summary.append(f"{family}, 1 rank NCCL: {run_report(output)}")
            ok, output = step(f"{family} on 2 gloo ranks, CUDA tensors",
                              [python, "-m", "pardsl.cli", "run", os.path.join("examples", family), "--nproc", "2",
                               "--backend", "gloo", "--device", "cuda", "--steps", "2", "--json"], 120)
            failed += not ok
            summary.append(f"{family}, 2 gloo ranks on CUDA: {run_report(output)}")
        for name, lines in MEMORY_LINES.items():
            path = os.path.join(folder, f"llama_zero3_{name.replace(' ', '_')}.par")
            with open(os.path.join(ROOT, "examples", "llama_zero3.par")) as source, open(path, "w") as handle:
                handle.write(source.read().replace("layout {", lines + "\n\nlayout {", 1))
            ok, output = step(f"llama_zero3 with {name}, 2 gloo ranks on CUDA",
                              [python, "-m", "pardsl.cli", "run", path, "--nproc", "2", "--backend", "gloo",
                               "--device", "cuda", "--steps", "3", "--optimizer", "adamw", "--json"], 120)
            failed += not ok
            summary.append(f"llama_zero3 with {name}: {run_report(output)}")

    for family in COMPILED_FAMILIES[:1] if args.quick else COMPILED_FAMILIES:
        ok, output = step(f"{family} compiled, collectives in the graphs, 2 gloo ranks on CUDA",
                          [python, "-m", "pardsl.cli", "run", os.path.join("examples", family), "--nproc", "2",
                           "--backend", "gloo", "--device", "cuda", "--steps", "3", "--compile",
                           "--collectives-in-graphs", "yes", "--json"], 240)
        failed += not ok
        summary.append(f"{family} compiled, collectives in graphs, 2 gloo ranks on CUDA: {run_report(output)}")

    ok, output = step("dry run of the 8B shape's tp 8 rank on the GPU",
                      [python, "-m", "pardsl.cli", "dryrun", "examples/scale/llama3_8b_tp8.par", "--device", "cuda",
                       "--machine", "h100-nvlink-ib", "--json"], 240)
    failed += not ok
    try:
        dry = json.loads(output[output.index("{"):])
        summary.append(f"dry run, 8B tp 8 rank 0: peak {dry['peak_bytes'] / 2**30:.2f} GiB, estimate "
                       f"{dry['estimated_bytes'] / 2**30:.2f} GiB, collectives as planned: {dry['collectives_match']}, "
                       f"seconds {json.dumps({k: round(v, 3) for k, v in dry['seconds'].items()})}")
    except (ValueError, KeyError, json.JSONDecodeError):
        summary.append(f"dry run, 8B tp 8: {output[-300:]}")

    if not args.quick:
        ok, output = step("benchmarks/vs_torch.py --device cuda", [python, "benchmarks/vs_torch.py", "--device", "cuda",
                                                                    "--steps", "5"], 240)
        failed += not ok
        summary.append("vs_torch.py --device cuda:\n" + "\n".join(output.splitlines()[-16:]))

    print("\n" + "\n".join(summary))
    print(f"\n{failed} step(s) failed" if failed else "\nevery step passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
