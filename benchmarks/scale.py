"""Estimates checked at scale: one rank's real program, dry-run, against the estimate; and the estimate for
published runs on H100s against their figures.

1. LLaMA 3.2 shapes of 1 B and 3 B parameters (Hugging Face's LlamaForCausalLM) on meshes of 8 and 64
   ranks — ZeRO-3 over 8, Megatron TP 8, dp 8 × tp 8, and 4 stages under 1F1B × tp 8 (8 micro-batches of
   a sequence), each without and with full recomputation —
   each plan's rank 0 dry-run (`pardsl dryrun`: its shards at their real shapes, collectives answered by a
   fake process group) on this machine's CPU: measured peak and time per phase beside `explain`'s estimate,
   and whether the collectives issued are the plan's.
2. torchtitan's published Llama 3.1 8B run (8 H100s, FSDP, local batch 2, sequence 8192, selective
   activation checkpointing, bf16 compute: 5,762 tokens/s per GPU, 82.4 GiB), written as a plan and
   estimated on the `h100-nvlink-ib` preset; and the 70B shape on 256 GPUs (FSDP 32 × TP 8), its estimate.

    python benchmarks/scale.py [--sizes 1b 3b] [--seq 256] [--skip-published]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Llama 3.2 1B and 3B, Llama 3.1 8B and 70B: (layers, hidden, heads, kv heads, ffn, vocabulary)
SHAPES = {"1b": (16, 2048, 32, 8, 8192, 128256), "3b": (28, 3072, 24, 8, 8192, 128256),
          "8b": (32, 4096, 32, 8, 14336, 128256), "70b": (80, 8192, 64, 8, 28672, 128256)}
WEIGHTS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj"]
MEGATRON = {"self_attn.q_proj": "S(0)", "self_attn.k_proj": "S(0)", "self_attn.v_proj": "S(0)",
            "self_attn.o_proj": "S(1)", "mlp.gate_proj": "S(0)", "mlp.up_proj": "S(0)", "mlp.down_proj": "S(1)"}


def plan_text(shape: str, mesh: str, layouts: list[str], batch: int, seq: int, extra: list[str] = ()) -> str:
    layers, hidden, heads, kv_heads, ffn, vocab = SHAPES[shape]
    return (f"mesh   {mesh}\n"
            f"model  examples.hf_models:llama_causal_lm(layers={layers}, hidden={hidden}, heads={heads}, "
            f"kv_heads={kv_heads}, ffn={ffn}, vocab={vocab}, positions={max(seq, 128)})\n"
            f"input  input_ids : int64[{batch}, {seq}] in [0, {vocab})\n" + "".join(f"{line}\n" for line in extra)
            + "\nlayout {\n" + "".join(f"    {entry}\n" for entry in layouts) + "}\n")


def zero3(axis: str) -> list[str]:
    return [f"input_ids : S(0) @ {axis}", f"model.embed_tokens.weight : S(0) @ {axis}", f"lm_head.weight : S(0) @ {axis}"] + \
        [f"model.layers.*.{w}.weight : S(0) @ {axis}" for w in WEIGHTS]


def megatron(axis: str, batch_axis: str | None = None) -> list[str]:
    return ([f"input_ids : S(0) @ {batch_axis}"] if batch_axis else []) + \
        [f"model.layers.*.{w}.weight : {p} @ {axis}" for w, p in MEGATRON.items()] + [f"lm_head.weight : S(0) @ {axis}"]


PLANS = {  # name: (mesh, layouts, sequences in the batch, further lines)
    "ZeRO-3 over 8": ("dp = 8", zero3("dp"), 8, []),
    "Megatron TP 8": ("tp = 8", megatron("tp"), 1, []),
    "dp 8 × tp 8": ("dp = 8, tp = 8", megatron("tp", "dp"), 8, []),
    # rank 0 runs the first of 4 stages, holding 4 of the 8 micro-batches (a sequence each) at once
    "pp 4 × tp 8, 1F1B": ("pp = 4, tp = 8", megatron("tp"), 8, ["pipeline pp : schedule 1F1B, microbatches 8, cut balanced"]),
}


def dry_run(text: str, folder: str) -> dict:
    path = os.path.join(folder, "plan.par")
    with open(path, "w") as handle:
        handle.write(text)
    result = subprocess.run([sys.executable, "-m", "pardsl.cli", "dryrun", path, "--json"], capture_output=True,
                            text=True, cwd=ROOT, timeout=3600)
    try:
        return json.loads(result.stdout)
    except json.JSONDecodeError:
        return {"ok": False, "errors": [result.stderr.strip()[-300:]]}


def published(seq: int = 8192) -> None:
    from pardsl.compiler import compile_text
    from pardsl.planning.cost import PRESETS, estimate

    machine = PRESETS["h100-nvlink-ib"]
    runs = [
        ("Llama 3.1 8B, FSDP 8, local batch 2, selective AC", "8b", "dp = 8", zero3("dp"), 2 * 8,
         ["precision params bf16, reduce fp32", "recompute model.layers.* : selective"], 5762, 82.4),
        ("Llama 3.1 70B, FSDP 32 × TP 8, local batch 1, full AC", "70b", "dp = 32, tp = 8",
         ["input_ids : S(0) @ dp", "model.embed_tokens.weight : S(0) @ dp"]
         + [f"model.layers.*.{w}.weight : {p} @ tp, {'S(1)' if p == 'S(0)' else 'S(0)'} @ dp" for w, p in MEGATRON.items()]
         + ["lm_head.weight : S(0) @ tp, S(1) @ dp"], 32,
         ["precision params bf16, reduce fp32", "recompute model.layers.*"], None, None),
    ]
    print("\n| published run | tokens/s per GPU (published) | estimated | estimate / published | memory per GPU (published) "
          "| estimated | compile + estimate |")
    print("|---|---|---|---|---|---|---|")
    for name, shape, mesh, layouts, batch, extra, tokens_s, memory_gib in runs:
        start = time.perf_counter()
        compiled = compile_text(plan_text(shape, mesh, layouts, batch, seq, extra), os.path.join(ROOT, "scale.par"))
        result = estimate(compiled, machine)
        seconds = time.perf_counter() - start
        ranks = compiled.program.mesh.size
        estimated = batch * seq / ranks / result.step_s
        estimated_gib = result.memory["peak"] / 2**30
        print(f"| {name} | {tokens_s or '—'} | {estimated:,.0f} | "
              f"{f'{estimated / tokens_s:.2f}' if tokens_s else '—'} | {memory_gib or '—'} GiB | {estimated_gib:.1f} GiB | "
              f"{seconds:.0f} s |")
        print(f"<!-- {name}: step {result.step_s:.3f} s = compute {result.seconds['compute_forward']:.3f} + "
              f"{result.seconds['compute_backward']:.3f}, communication {result.seconds['communication_forward']:.3f} + "
              f"{result.seconds['communication_backward']:.3f}, exposed {result.seconds['overlapped_exposed']:.3f}; "
              f"memory {json.dumps({k: round(v / 2**30, 2) for k, v in result.memory.items()})} -->")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["1b", "3b"], choices=["1b", "3b"])
    parser.add_argument("--seq", type=int, default=256, help="each rank's sequence (a local batch of 1 sequence)")
    parser.add_argument("--skip-published", action="store_true")
    args = parser.parse_args()
    print(f"Dry runs of rank 0 on this machine's CPU (sequence {args.seq}, one sequence per data-parallel rank):\n")
    print("| shape | plan | recomputation | peak (measured) | estimate | estimate / measured | forward | backward "
          "| optimizer | collectives = plan |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for shape in args.sizes:
            for name, (mesh, layouts, batch, lines) in PLANS.items():
                for recompute in ("none", "full"):
                    extra = lines + (["recompute model.layers.*"] if recompute == "full" else [])
                    report = dry_run(plan_text(shape, mesh, layouts, batch, args.seq, extra), folder)
                    if "peak_bytes" not in report:
                        print(f"| {shape} | {name} | {recompute} | failed: {report.get('errors')} |")
                        continue
                    peak, estimated = report["peak_bytes"], report["estimated_bytes"]
                    seconds = report["seconds"]
                    print(f"| {shape} | {name} | {recompute} | {peak / 2**30:.2f} GiB | {estimated / 2**30:.2f} GiB | "
                          f"{estimated / peak:.2f} | {seconds['forward']:.1f} s | {seconds['backward']:.1f} s | "
                          f"{seconds['optimizer']:.1f} s | {'yes' if report['collectives_match'] else 'NO'} |",
                          flush=True)
    if not args.skip_published:
        published()


if __name__ == "__main__":
    main()
