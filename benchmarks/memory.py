"""Measured memory against the estimate: each plan's peak per rank, what the plan says it holds, the step.

Hugging Face's LlamaForCausalLM (examples/hf_models.py, `HFLlama`) with a long sequence and attention in
its reference form (`--attention eager`: the per-head sequence² matrices Megatron's selective
recomputation is about; `sdpa` for the fused kernel), so that activations outweigh parameters, under
data parallelism, ZeRO-3, Megatron TP, Megatron TP with sequence parallelism and context parallelism
(the tokens split, ring attention with `--attention sdpa`; contiguous or zig-zag), each without
recomputation, with `recompute model.model.layers.*` and with its `: selective` form, and under
`precision params bf16, reduce fp32` without and with full recomputation (at this size inference
completes the sequence-parallel layouts by gathering the weights, as ZeRO-3 does). Each plan runs under
`pardsl run --json` (2 ranks, every step checked against serial): the peak is the measured one of its
first step (pardsl/tools/memory.py; on CUDA the allocator's), the estimate `memory_per_rank`'s peak.
Activations are what the first step's forward made and still held as it returned (`forward_bytes`: what
it keeps for backward, and its outputs); beside them, their ratio and the step's to the same plan and
precision without recomputation. A step's time is the median of the steps after the first; each variant
runs `--rounds` times, in turn with the others, and the table gives the median of its rounds' times and of
their ratios to the same round's step without recomputation.

    python benchmarks/memory.py [--layers 8 --hidden 256 --seq 256 --batch 4] [--attention eager|sdpa]
                                [--steps 6] [--rounds 3] [--device cpu|cuda] [--plans "context parallel" ...]
                                [--recompute none full selective] [--precisions float32 bf16] [--serial-share]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HEADER = """mesh   {mesh}
model  examples.hf_models:HFLlama(layers={layers}, hidden={hidden}, heads=8, kv_heads=4, ffn={ffn}, positions={seq}, attention="{attention}")
input  input_ids : int64[{batch}, {seq}] in [0, 256)
{recompute}
{precision}
{bound}
layout {{
{layouts}}}
"""
LAYER = "model.model.layers.*."
MEGATRON = [f"{LAYER}self_attn.{p}_proj.weight : S(0)" for p in "qkv"] + [f"{LAYER}self_attn.o_proj.weight : S(1)"] + \
    [f"{LAYER}mlp.{p}_proj.weight : S(0)" for p in ("gate", "up")] + [f"{LAYER}mlp.down_proj.weight : S(1)"]
PLANS = {
    "data parallel": ("dp = 2", ["input_ids : S(0)"]),
    "ZeRO-3": ("dp = 2", ["input_ids : S(0)", "model.model.embed_tokens.weight : S(0)", "model.lm_head.weight : S(0)"]
               + [f"{LAYER}{w}.weight : S(0)" for w in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                       "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                       "mlp.down_proj")]),
    "Megatron TP": ("tp = 2", MEGATRON + ["model.lm_head.weight : S(0)", "output : S(2)"]),
    "Megatron TP + SP": ("tp = 2", MEGATRON + ["model.model.embed_tokens() : S(1)", f"{LAYER}self_attn() : S(1)",
                                               f"{LAYER}mlp() : S(1)", "model.model.norm() : S(1)",
                                               "model.lm_head.weight : S(0)", "output : S(2)"]),
    # the same with each layer's gathered inputs kept split for backward and gathered again there (Megatron-LM's)
    "Megatron TP + SP, regathered": ("tp = 2", MEGATRON + ["model.model.embed_tokens() : S(1)", f"{LAYER}self_attn() : S(1)",
                                                           f"{LAYER}mlp() : S(1)", "model.model.norm() : S(1)",
                                                           "model.lm_head.weight : S(0)", "output : S(2)"],
                                     "substitute regather_inputs : on"),
    # the sequence split and the rest left to the search under a bound: ring attention with `--attention
    # sdpa` (eager attention's softmax needs every key, so there the sequence is gathered for it)
    "context parallel": ("cp = 2", ["input_ids : S(1)"], "memory <= 60 %"),
    # the same, the sequence split zig-zag: under the causal mask each rank attends as many key blocks
    "context parallel, zig-zag": ("cp = 2", ["input_ids : S(1, zigzag)"], "memory <= 60 %"),
}
RECOMPUTE = {"none": "", "full": "recompute model.model.layers.*", "selective": "recompute model.model.layers.* : selective"}
# each plan in float32, with each recomputation; and under FSDP2's bf16 policy, without and with full recomputation
VARIANTS = [(policy, "float32") for policy in RECOMPUTE] + [("none", "bf16"), ("full", "bf16")]
PRECISION = {"float32": "", "bf16": "precision params bf16, reduce fp32"}


def model_arguments(doc: str, attention: str, steps: int) -> argparse.ArgumentParser:
    """The LLaMA's shape, its attention, the steps and the device, as the benchmarks on it take them."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--attention", choices=("eager", "sdpa"), default=attention)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--device", default="cpu")
    return parser


def main() -> None:
    sys.path.insert(0, ROOT)  # the plans' model module (examples.hf_models), compiled here for their sizes
    parser = model_arguments(__doc__, attention="eager", steps=6)
    parser.add_argument("--plans", nargs="*", choices=sorted(PLANS), help="plans to run (default: all)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each variant, in turn (default 3)")
    parser.add_argument("--recompute", nargs="*", choices=list(RECOMPUTE),
                        help="the recomputations to run (default: all; without recomputation always, as the base)")
    parser.add_argument("--precisions", nargs="*", choices=list(PRECISION), help="the precisions to run (default: both)")
    parser.add_argument("--serial-share", action="store_true",
                        help="a column: the activations the plan estimates per rank against serial's")
    args = parser.parse_args()
    variants = [(policy, precision) for policy, precision in VARIANTS
                if (policy == "none" or not args.recompute or policy in args.recompute)
                and (not args.precisions or precision in args.precisions)]
    ffn = args.hidden * 8 // 3 // 8 * 8  # LLaMA's SwiGLU width, a multiple of 8
    print(f"HFLlama: {args.layers} layers, hidden {args.hidden}, ffn {ffn}, batch {args.batch} x {args.seq}, "
          f"{args.attention} attention; 2 ranks, {args.device}")
    share = " activations per rank / serial's (estimate) |" if args.serial_share else ""
    print("| plan | recomputation | precision | peak per rank (measured) | estimate | estimate / measured "
          f"| activations (measured) | vs none | step (ms) | vs none | ≡ serial |{share}")
    print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if share else ""))
    with tempfile.TemporaryDirectory() as folder:
        for name, (mesh, layouts, *bound) in PLANS.items():
            if args.plans and name not in args.plans:
                continue
            texts = {variant: HEADER.format(mesh=mesh, layers=args.layers, hidden=args.hidden, ffn=ffn, seq=args.seq,
                                            batch=args.batch, attention=args.attention, recompute=RECOMPUTE[variant[0]],
                                            precision=PRECISION[variant[1]], bound="".join(bound),
                                            layouts="".join(f"    {entry}\n" for entry in layouts))
                     for variant in variants}
            # The variants run in turn, round after round: a drift in the machine's speed touches all of them
            # alike, and each step is set against its own round's without recomputation.
            reports: dict[tuple, list] = {variant: [] for variant in variants}
            for _ in range(args.rounds):
                for variant, text in texts.items():
                    reports[variant].append(_run(folder, text, args))
            for variant in variants:
                print(_row(name, variant, reports, texts[variant], folder, args), flush=True)


def _run(folder: str, text: str, args) -> dict:
    """`pardsl run --json` of the plan `text` on 2 ranks: its report, or {"failed": why}."""
    path = os.path.join(folder, "plan.par")
    with open(path, "w") as handle:
        handle.write(text)
    result = subprocess.run([sys.executable, "-m", "pardsl.cli", "run", path, "--nproc", "2", "--steps",
                             str(args.steps), "--json", "--device", args.device, "--timeout", "600",
                             "--optimizer", "sgd"], capture_output=True, text=True, cwd=ROOT)
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:
        return {"failed": f"failed: {result.stderr.strip().splitlines()[-1:]}"}
    if "memory" not in report:
        errors = "; ".join(f"{e['code']}: {e['message']}" for e in report.get("errors", []))
        return {"failed": errors or "not measured"}
    return report


def _row(name: str, variant: tuple, reports: dict, text: str, folder: str, args) -> str:
    """The table's row of one variant: its memory (the same every round), the median of its rounds' steps and
    of their ratios to the same round's step without recomputation."""
    from pardsl.compiler import compile_text

    policy, precision = variant
    row = f"| {name} | {policy} | {precision} |"
    runs, without = reports[variant], reports[("none", precision)]
    failed = [report["failed"] for report in runs if "failed" in report]
    if failed:
        return f"{row} {failed[0]} | | | | | | | |"
    mib = 2 ** 20
    memory = runs[0]["memory"]
    peak, estimated = max(memory["peak_bytes"]), memory["estimated_bytes"]
    activations = max(memory["forward_bytes"])
    base = without[0].get("memory")  # none where the plan without recomputation failed
    steps = [report["step_ms"]["compiled"] for report in runs]
    ratios = [report["step_ms"]["compiled"] / plain["step_ms"]["compiled"] for report, plain in zip(runs, without)
              if "step_ms" in plain]
    share = ""
    if args.serial_share:
        held = compile_text(text, os.path.join(folder, "plan.par")).program.memory()
        share = f" {held['activations_per_rank'] / held['activations_total']:.2f} |"
    return (f"{row} {peak / mib:.2f} MiB | {estimated / mib:.2f} MiB | {estimated / peak:.2f} | "
            f"{activations / mib:.2f} MiB | {activations / max(base['forward_bytes']) if base else float('nan'):.2f} | "
            f"{statistics.median(steps):.1f} | {statistics.median(ratios) if ratios else float('nan'):.2f} | "
            f"{'yes' if all(report['ok'] for report in runs) else 'NO'} |{share}")


if __name__ == "__main__":
    main()
