"""Compile time and step time, printed as tables (`make bench`).

1. Compile time of a 64-block MLP: everything after torch.export (binding names, inference, lowering,
   code generation), median of several compiles; export shown beside it for scale.
2. Step time (forward + backward) of compiled programs on 2 gloo ranks, one thread per rank, next to the
   serial model on one thread, median of `--steps` steps after a warm-up, with the collectives per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pardsl.compiler import compile_text  # noqa: E402
from pardsl.tools.execution import job_for  # noqa: E402
from pardsl.tools.pool import WorkerPool  # noqa: E402

DEEP = """mesh tp = 2
model examples.models:DeepMLP(depth={depth}, d_model=64, d_ff=256)
input x : float32[8, 64]
layout {{
    blocks.*.fc1.weight : S(0)
    blocks.*.fc1.bias   : S(0)
    blocks.*.fc2.weight : S(1)
}}
"""

STEP_CONFIGS = [
    # name, .par text
    ("Megatron MLP 256x1024, batch 16", open("examples/mlp.par").read()),
    ("data-parallel MLP 256x1024, batch 16", open("examples/mlp_dp.par").read()),
    ("Megatron MLP 1024x4096, batch 64", open("examples/mlp.par").read()
     .replace("d_model=256, d_ff=1024", "d_model=1024, d_ff=4096").replace("float32[16, 256]", "float32[64, 1024]")),
    ("data-parallel MLP 1024x4096, batch 256", open("examples/mlp_dp.par").read()
     .replace("d_model=256, d_ff=1024", "d_model=1024, d_ff=4096").replace("float32[16, 256]", "float32[256, 1024]")),
]


def compile_table(depth: int, repeats: int) -> list[str]:
    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "deep.par")
    with open(path, "w") as handle:
        handle.write(DEEP.format(depth=depth))
    runs = [compile_text(DEEP.format(depth=depth), path) for _ in range(repeats)]
    after = statistics.median(r.seconds_after_export for r in runs)
    export = statistics.median(r.seconds["export"] for r in runs)
    stages = {k: statistics.median(r.seconds[k] for r in runs) for k in ("bind", "infer", "lower", "codegen")}
    nodes = sum(1 for n in runs[0].bound.graph.nodes if n.op == "call_function")
    return [
        f"| {depth}-block MLP ({nodes} ops) | {after * 1000:.1f} ms | "
        + " | ".join(f"{v * 1000:.1f} ms" for v in stages.values()) + f" | {export * 1000:.0f} ms |",
    ]


def step_table(steps: int) -> list[str]:
    pool = WorkerPool(2, timeout_s=120)
    rows = []
    try:
        for name, text in STEP_CONFIGS:
            compiled = compile_text(text, os.path.join(os.getcwd(), "examples", "bench.par"))
            job = job_for(compiled, steps=steps, timeout_s=120, lr=0.0)  # timing: the same step, every step
            report = pool.run(job)
            counts = report["collectives"]
            per_phase = "; ".join(
                f"{phase}: " + (", ".join(f"{n} {k.replace('_', '-')}" for k, n in counts[phase].items() if n) or "none")
                for phase in ("forward", "backward"))
            compiled_ms, serial_ms = report["step_ms"]["compiled"], report["step_ms"]["serial"]
            rows.append(f"| {name} | {compiled_ms:.2f} ms | {serial_ms:.2f} ms | {compiled_ms / serial_ms:.2f} | "
                        f"{per_phase} | {'yes' if report['ok'] else 'NO'} |")
    finally:
        pool.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--depth", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    print("Compile time after torch.export (median of", args.repeats, "compiles)\n")
    print("| model | after export | bind names | infer | lower | codegen | export (for scale) |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(compile_table(args.depth, args.repeats)))
    print(f"\nStep time, forward + backward, 2 gloo ranks x 1 thread vs serial on 1 thread (median of {args.steps})\n")
    print("| configuration | compiled | serial | compiled / serial | collectives per step | ≡ serial |")
    print("|---|---|---|---|---|---|")
    print("\n".join(step_table(args.steps)))


if __name__ == "__main__":
    main()
