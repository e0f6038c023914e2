"""Recomputation weighed against the layouts under a memory bound: what the search keeps, what it costs.

For each plan (a LLaMA whose layouts are left to the search under a `memory` bound, nothing named to
recompute), compile it twice: with the layout search run once and the fewest layers recomputed for the
plan it found (RECOMPUTATION_STEPS = 0), and as compile does, the search run again with activations
counted as recomputation leaves them (pardsl/compiler.py, _searched_with_recomputation). Each row gives
the estimated step and memory per rank, the layers recomputed, the collectives (and sends) per step and the compile
time after export; then both plans run on fresh ranks (`pardsl run`'s launcher, every step checked
against serial), and the measured step is the median of the steps after the first, over `--rounds`
rounds taken in turn.

    python benchmarks/recompute_search.py [--steps 5] [--rounds 3] [--plans "dp 2" "dp 2 x tp 2"]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pardsl import compiler  # noqa: E402
from pardsl.compiler import compile_text  # noqa: E402
from pardsl.planning.cost import default_machine, estimate  # noqa: E402
from pardsl.tools.execution import job_for, launch  # noqa: E402

PLANS = {
    "dp 2": ("mesh dp = 2", 4, "8, 256", "50 %"),
    "dp 2 x tp 2": ("mesh dp = 2, tp = 2", 8, "8, 256", "25 %"),
}
TEXT = """{mesh}
model examples.language_models:Llama(vocab_size=256, n_layer={layers}, n_head=8, n_kv_head=4, d_model=256, d_ff=512)
input input_ids : int64[{batch}] in [0, 256)
memory <= {bound}
"""


def compiled_both_ways(name: str):
    mesh, layers, batch, bound = PLANS[name]
    text = TEXT.format(mesh=mesh, layers=layers, batch=batch, bound=bound)
    path = f"<{name}>"
    steps = compiler.RECOMPUTATION_STEPS
    compiler.RECOMPUTATION_STEPS = 0
    try:
        alone = compile_text(text, path)
    finally:
        compiler.RECOMPUTATION_STEPS = steps
    return {"search alone": alone, "weighed": compile_text(text, path)}


def recomputed(compiled) -> str:
    notes = [note.message for note in compiled.program.notes if note.code == "N007"]
    return notes[0].split(" (")[1].split(")")[0] if notes else "none"


def collectives(compiled) -> int:
    """Collectives and point-to-point sends a step, on every axis."""
    return sum(sum(kinds.values()) for kinds in compiled.program.collective_counts_by_axis().values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS))
    args = parser.parse_args()
    machine = default_machine()
    print("| plan | search | estimated step (ms) | memory / bound (MiB) | recomputed | collectives and sends per step | "
          "compile after export (s) | measured step (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.plans:
        plans = compiled_both_ways(name)
        measured = {way: [] for way in plans}
        for _ in range(args.rounds):
            for way, compiled in plans.items():
                report = launch(job_for(compiled, steps=args.steps, timeout_s=600))
                if not report.get("ok"):
                    sys.exit(f"{name}, {way}: not equal to serial: {report}")
                measured[way].append(report["step_ms"]["compiled"])
        for way, compiled in plans.items():
            plan = estimate(compiled, machine)
            print(f"| {name} | {way} | {plan.step_s * 1e3:.1f} | {plan.memory['total'] / 2**20:.1f} / "
                  f"{compiled.memory_bound / 2**20:.1f} | {recomputed(compiled)} | {collectives(compiled)} | "
                  f"{compiled.seconds_after_export:.1f} | {statistics.median(measured[way]):.0f} |")


if __name__ == "__main__":
    main()
