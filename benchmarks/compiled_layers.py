"""Regional compilation against eager: Hugging Face's LLaMA under data parallelism and Megatron TP on 2
ranks, each run by `pardsl run` eagerly, with `--compile` (collectives between the compiled pieces) and with
`--compile --collectives-in-graphs yes` (functional collectives inside them), every step checked against
serial: the median step after the first, and the graphs torch.compile made (none after the first step).

    python benchmarks/compiled_layers.py [--layers 8 --hidden 256 --seq 256 --batch 4] [--steps 6] [--device cpu|cuda]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from memory import HEADER, MEGATRON, PLANS, model_arguments  # noqa: E402  (the memory benchmark's plans)

CHOSEN = {"data parallel": PLANS["data parallel"],
          "Megatron TP": ("tp = 2", MEGATRON + ["model.lm_head.weight : S(0)", "output : S(2)"])}


def run(path: str, steps: int, device: str, options: list[str]) -> dict:
    command = [sys.executable, "-m", "pardsl.cli", "run", path, "--nproc", "2", "--steps", str(steps), "--json",
               "--device", device, "--timeout", "900"] + options
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    try:
        return json.loads(result.stdout)
    except json.JSONDecodeError:
        return {"ok": False, "error": result.stderr.strip().splitlines()[-1:]}


def main() -> None:
    args = model_arguments(__doc__, attention="sdpa", steps=6).parse_args()
    ffn = args.hidden * 8 // 3 // 8 * 8
    print(f"HFLlama: {args.layers} layers, hidden {args.hidden}, batch {args.batch} x {args.seq}, {args.attention} "
          f"attention; 2 ranks, {args.device}; median of steps 2 to {args.steps}")
    print("| plan | eager step (ms) | compiled step (ms) | compiled / eager | collectives in graphs (ms) | "
          "in graphs / eager | graphs (first step, last; in graphs) | ≡ serial |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for name, (mesh, layouts) in CHOSEN.items():
            path = os.path.join(folder, "plan.par")
            with open(path, "w") as handle:
                handle.write(HEADER.format(mesh=mesh, layers=args.layers, hidden=args.hidden, ffn=ffn, seq=args.seq,
                                           batch=args.batch, attention=args.attention, recompute="", precision="", bound="",
                                           layouts="".join(f"    {entry}\n" for entry in layouts)))
            runs = [run(path, args.steps, args.device, options)
                    for options in ([], ["--compile"], ["--compile", "--collectives-in-graphs", "yes"])]
            failed = [r for r in runs if "step_ms" not in r]
            if failed:
                print(f"| {name} | failed: {failed[0].get('error')} | | | | | | |")
                continue
            eager, compiled, in_graphs = (r["step_ms"]["compiled"] for r in runs)
            graphs = [f"{r['compiled_graphs']['first_step']}, {r['compiled_graphs']['last_step']}" for r in runs[1:]]
            print(f"| {name} | {eager:.1f} | {compiled:.1f} | {compiled / eager:.2f} | {in_graphs:.1f} | "
                  f"{in_graphs / eager:.2f} | {graphs[0]}; {graphs[1]} | "
                  f"{'yes' if all(r['ok'] for r in runs) else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
