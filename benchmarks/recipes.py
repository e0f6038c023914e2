"""Published training configurations, written as their authors ran them (examples/recipes/*.par), priced on
their machine's preset beside the published figure; and each file with its layouts (and its pipeline's
options) left to the search under the memory the recipe holds, priced beside it.

Each row: the compile and estimate's time and peak RSS on this machine; the memory a rank holds against
the card's; the collectives' kinds against what the recipe has (a dense recipe has no all-to-all); the
estimate against the published figure, in the publisher's own unit (tokens/s per GPU, or TFLOP/s per
GPU by the publisher's formula); and the searched plan's step against the recipe's.

    python benchmarks/recipes.py [--only NAME ...] [--skip-search] [--depth-scale]

Each configuration compiles in a process of its own (its peak RSS is its own). `--layers N` traces N
layers instead of the recipe's depth; the table says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import resource
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
FOLDER = os.path.join(ROOT, "examples", "recipes")
H100_BF16_PEAK = 989e12  # dense bf16 matmul peak of an H100 SXM, which MFU figures divide by


@dataclass(frozen=True)
class Recipe:
    name: str
    file: str
    machine: str
    published: float  # in `unit`
    unit: str  # "tokens/s" per GPU, or "TFLOP/s" per GPU by the publisher's formula ("megatron", "6N")
    source: str
    differences: str  # what the run had that the plan does not price


RECIPES = [
    Recipe("Llama 3.1 8B, FSDP 8", "llama31_8b_fsdp8.par", "h100-nvlink-ib", 5762, "tokens/s",
           "torchtitan, H100 benchmarks (2024-12), table 1", "96 GB HBM2e cards at 500 W"),
    Recipe("Llama 3.1 70B, FSDP 32 × TP 8", "llama31_70b_fsdp32_tp8.par", "h100-nvlink-ib", 829, "tokens/s",
           "torchtitan, H100 benchmarks (2024-12), table 4", "torch.compile and Float8 matmuls"),
    Recipe("Llama 3.1 405B, FSDP 8 × TP 8 × PP 8 (1F1B)", "llama31_405b_fsdp8_tp8_pp8.par", "h100-nvlink-ib", 100,
           "tokens/s", "torchtitan, H100 benchmarks (2024-12), table 5", "torch.compile, Float8, async TP"),
    Recipe("Llama 3 405B, DP 128 × PP 16 × TP 8, seq 8,192", "llama3_405b_dp128_pp16_tp8.par", "h100-nvlink-ib",
           400, "TFLOP/s 6N", "Llama 3 paper, table 4 (41% MFU)", ""),
    Recipe("Llama 3 405B, DP 8 × PP 16 × CP 16 × TP 8, seq 131,072", "llama3_405b_dp8_pp16_cp16_tp8.par",
           "h100-nvlink-ib", 380, "TFLOP/s 6N", "Llama 3 paper, table 4 (38% MFU)", ""),
    Recipe("GPT-3 175B, DP 8 × PP 16 × TP 8", "gpt3_175b_dp8_pp16_tp8.par", "a100-nvlink-ib", 140,
           "TFLOP/s megatron", "Megatron-LM paper (2021), 1,024 A100s", "fp16 with loss scaling"),
    Recipe("DeepSeek-V3 shape, DP 2 × PP 16 × EP 64", "deepseek_v3_dp2_pp16_ep64.par", "h800-nvlink-ib", 1543,
           "tokens/s", "DeepSeek-V3 report: 2.664 M GPU-hours, 14.8 T tokens",
           "FP8 matmuls, DualPipe's overlap of all-to-alls, ZeRO-1, multi-token prediction"),
]

DENSE_KINDS = {"all_reduce", "all_gather", "reduce_scatter", "send"}


def searched_text(text: str, memory_gib: float) -> str:
    """The recipe with its layouts left to the search (the inputs' as written: the data's layout), its
    pipeline's schedule, micro-batches and cuts too, under a bound of the memory the recipe holds."""
    inputs = set(re.findall(r"^input\s+(\w+)\s*:", text, re.MULTILINE))
    lines, inside = [], False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("layout"):
            inside = True
        if inside:
            written = re.match(r"(\w+)\s*:", stripped)
            if written and written.group(1) in inputs or stripped.startswith("layout") or stripped == "}":
                lines.append(line)
            inside = stripped != "}"
            continue
        if stripped.startswith("pipeline"):
            axis = stripped.split()[1]
            line = f"pipeline  {axis} : schedule ?, microbatches ?, cut ?"
        lines.append(line)
    # rounded up: the recipe itself within its bound (55.44 GiB written 55.4 put the recipe's own balanced
    # cut over it, and the search's pipeline was cut for memory instead of time)
    bound_gib = math.ceil(memory_gib * 10) / 10
    lines.insert(next(i for i, l in enumerate(lines) if l.startswith("layout")), f"memory    <= {bound_gib:.1f} GiB")
    return "\n".join(lines) + "\n"


def with_layers(text: str, layers: int) -> str:
    return re.sub(r"\blayers=\d+", f"layers={layers}", text, count=1)


def price(text: str, machine_name: str) -> dict:
    """Compile and estimate one plan in this process: what a row reads."""
    from pardsl.compiler import compile_text
    from pardsl.planning.cost import PRESETS, estimate
    from pardsl.planning.pipeline_search import pipelined_step_seconds

    machine = PRESETS[machine_name]
    start = time.perf_counter()
    compiled = compile_text(text, os.path.join(FOLDER, "plan.par"), machine=machine)
    result = estimate(compiled, machine)
    seconds = time.perf_counter() - start
    bound, mesh = compiled.bound, compiled.program.mesh
    pipeline = compiled.pipeline
    step = pipelined_step_seconds(compiled, machine) if pipeline else result.step_s
    tokens = math.prod(bound.par.inputs[0].shape) * (pipeline.microbatches if pipeline else 1)
    parameters = sum(math.prod(bound.tensors[name].shape) for name in bound.parameters)
    layers = {c.layer for c in result.collectives if c.layer and re.search(r"\.\d+$", c.layer)}  # repeated layers
    first = min(layers, key=lambda layer: [int(n) if n.isdigit() else n for n in re.split(r"(\d+)", layer)]) \
        if layers else None
    per_layer: dict[str, int] = {}
    for c in result.collectives:
        if c.layer == first and not c.bucket:
            per_layer[f"{c.kind}@{c.axis}"] = per_layer.get(f"{c.kind}@{c.axis}", 0) + 1
    return {
        "seconds": seconds, "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "step_s": step, "tokens": tokens, "ranks": mesh.size, "parameters": parameters,
        "mesh": dict(zip(mesh.axis_names, mesh.axis_sizes)),
        "memory_gib": result.memory["total"] / 2**30, "peak_gib": result.memory["peak"] / 2**30,
        "card_gib": machine.device_memory_bytes / 2**30,
        "kinds": sorted({c.kind for c in result.collectives}),
        "per_layer": per_layer, "first_layer": first,
        "all_to_all_bytes": sum(c.bytes for c in result.collectives if c.kind == "all_to_all"),
        "pipeline": None if pipeline is None else
        f"{pipeline.schedule} × {pipeline.microbatches}" + (f", {pipeline.stages_per_rank} a rank" if pipeline.stages_per_rank > 1 else ""),
        "terms": {k: round(v, 4) for k, v in result.seconds.items() if k in (
            "compute_forward", "compute_backward", "communication_forward", "communication_backward",
            "overlapped_exposed")},
        "notes": sorted({d.code for d in compiled.program.notes}),
    }


def figure(row: dict, recipe: Recipe, text: str) -> float:
    """The estimate in the published figure's unit."""
    tokens_per_gpu = row["tokens"] / row["ranks"] / row["step_s"]
    if recipe.unit == "tokens/s":
        return tokens_per_gpu
    layers, hidden = _shape(text)
    seq = row["seq"]
    if recipe.unit == "TFLOP/s 6N":  # PaLM's model FLOPs per token: 6N + 12·layers·hidden·sequence
        return tokens_per_gpu * (6 * row["parameters"] + 12 * layers * hidden * seq) / 1e12
    # Megatron-LM's: 96·B·s·l·h²·(1 + s/6h + V/16lh) per iteration, recomputation's forward counted
    vocab = int(re.search(r"vocab=(\d+)", text).group(1))
    per_token = 96 * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    return tokens_per_gpu * per_token / 1e12


def _shape(text: str) -> tuple[int, int | None]:
    """The model's depth and hidden size as the file writes them (a factory's default hidden: None)."""
    hidden = re.search(r"hidden=(\d+)", text)
    return int(re.search(r"\blayers=(\d+)", text).group(1)), int(hidden.group(1)) if hidden else None


def child(path: str, machine: str, layers: int | None, searched_gib: float | None) -> None:
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    if layers:
        text = with_layers(text, layers)
    if searched_gib is not None:
        text = searched_text(text, searched_gib)
    row = price(text, machine)
    row["seq"] = int(re.search(r"input\s+input_ids\s*:\s*int64\[\d+,\s*(\d+)\]", text).group(1))
    print(json.dumps(row))


def run_child(recipe: Recipe, layers: int | None, searched_gib: float | None) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child", os.path.join(FOLDER, recipe.file),
               "--machine", recipe.machine]
    command += ["--layers", str(layers)] if layers else []
    command += ["--searched", str(searched_gib)] if searched_gib is not None else []
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=7200)
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return {"error": (result.stderr.strip() or result.stdout.strip())[-400:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", help="recipe files (without .par) to run")
    parser.add_argument("--layers", type=int, help="trace this many layers instead of the recipe's")
    parser.add_argument("--skip-search", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--machine", help=argparse.SUPPRESS)
    parser.add_argument("--searched", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.machine, args.layers, args.searched)
        return
    print(f"{datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}\n")
    print("| recipe | machine | depth | compile + estimate | peak RSS | memory per rank (card) | collectives "
          "(first layer) | estimate | published | estimate / published | searched: step vs recipe, memory |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for recipe in RECIPES:
        if args.only and recipe.file.removesuffix(".par") not in args.only:
            continue
        with open(os.path.join(FOLDER, recipe.file), encoding="utf-8") as handle:
            text = handle.read()
        depth = _shape(text)[0]
        row = run_child(recipe, args.layers, None)
        if "error" in row:
            print(f"| {recipe.name} | {recipe.machine} | | failed: {row['error']} |", flush=True)
            continue
        estimated = figure(row, recipe, text if not args.layers else with_layers(text, args.layers))
        dense_ok = "all_to_all" not in row["kinds"] or "ep" in row["mesh"]
        kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(row["per_layer"].items()))
        searched = ""
        if not args.skip_search:
            found = run_child(recipe, args.layers, math.ceil(row["memory_gib"] * 10) / 10)
            searched = f"failed: {found['error'][-160:]}" if "error" in found else (
                f"{found['step_s'] / row['step_s']:.2f}× ({found['step_s']:.2f} s), {found['memory_gib']:.1f} GiB, "
                f"{found['seconds']:.0f} s, {found['rss_gib']:.1f} GiB RSS"
                + (f", {found['pipeline']}" if found.get("pipeline") else "")
                + (", all-to-alls" if "all_to_all" in found["kinds"] else ""))
        print(f"| {recipe.name} | {recipe.machine} | {args.layers or depth} of {depth} layers | "
              f"{row['seconds']:.0f} s | {row['rss_gib']:.1f} GiB | {row['memory_gib']:.1f} GiB "
              f"({row['card_gib']:.1f}) | {kinds or '—'}{'' if dense_ok else ' — ALL-TO-ALL'} | "
              f"{estimated:,.0f} {recipe.unit.split()[0]} | {recipe.published:,} | {estimated / recipe.published:.2f} | "
              f"{searched} |", flush=True)
        print(f"<!-- {recipe.file}: step {row['step_s']:.3f} s, {row['pipeline'] or 'no pipeline'}; terms "
              f"{json.dumps(row['terms'])}; kinds {row['kinds']}; notes {row['notes']}; {recipe.source}; "
              f"not priced: {recipe.differences or 'nothing named'} -->", flush=True)


if __name__ == "__main__":
    main()
