"""The mesh's shape and the pipeline searched: `mesh dp, tp, pp = 8` with `pipeline pp : schedule ?,
microbatches ?, cut ?` and a memory bound, against every fixed shape compiled on its own with the same
file otherwise (its pipeline searched too where pp > 1, none where pp = 1).

Printed per shape: its estimated step and memory per rank, and the seconds its own compile takes; then
the shape the search kept and the seconds the search over all shapes took, against the kept shape's own
compile (what writing the right shape out costs), the slowest and the mean single shape. Compiles run in one process after one warm-up compile (the solver's first load is
not a shape's cost), on `--machine` (default: this machine's calibration, else gloo's defaults).

    python benchmarks/mesh_search.py [--ranks 8] [--layers 4] [--machine h100-nvlink-ib]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pardsl.compiler import compile_text, mesh_shapes  # noqa: E402
from pardsl.language.diagnostics import CompileError  # noqa: E402
from pardsl.planning.cost import default_machine, estimate, machine_named  # noqa: E402
from pardsl.planning.pipeline_search import pipelined_step_seconds  # noqa: E402

FILE = """mesh     {mesh}
model    examples.hf_models:HFLlama(layers={layers}, hidden=128, heads=8, kv_heads=4, ffn=256, vocab=512)
input    input_ids : int64[16, 32] in [0, 512)
input    labels : int64[16, 32] in [0, 512)
memory <= 50 %
{pipeline}"""
PIPELINE = "pipeline pp : schedule ?, microbatches ?, cut ?\n"


def step_of(compiled, machine) -> float:
    return pipelined_step_seconds(compiled, machine) if compiled.pipeline else estimate(compiled, machine).step_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--machine", default=None)
    args = parser.parse_args()
    machine = machine_named(args.machine) if args.machine else default_machine()
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "bench.par")

    def compiled(mesh: str, pipeline: str):
        return compile_text(FILE.format(mesh=mesh, layers=args.layers, pipeline=pipeline), path, machine=machine)

    compiled("dp = 2, tp = 2, pp = 2", PIPELINE)  # warm-up: the solver's and torch's first loads
    print(f"LLaMA of {args.layers} layers, {args.ranks} ranks, memory <= 50 %, machine {machine.source}")
    print(f"{'shape':<24} {'step':>10} {'memory':>10} {'compile s':>10}")
    singles = {}
    for dp, tp, pp in mesh_shapes(args.ranks, 3):
        clock = time.perf_counter()
        try:
            fixed = compiled(f"dp = {dp}, tp = {tp}, pp = {pp}", PIPELINE if pp > 1 else "")
        except CompileError as error:
            print(f"dp = {dp}, tp = {tp}, pp = {pp:<6} no plan: error[{error.diagnostics[0].code}] "
                  f"{error.diagnostics[0].message}")
            continue
        seconds = time.perf_counter() - clock
        step, memory = step_of(fixed, machine), estimate(fixed, machine).memory["total"]
        singles[(dp, tp, pp)] = (step, memory, seconds)
        print(f"dp = {dp}, tp = {tp}, pp = {pp:<6} {step * 1e3:>8.2f} ms {memory / 2**20:>7.2f} MiB {seconds:>10.1f}")
    clock = time.perf_counter()
    searched = compiled(f"dp, tp, pp = {args.ranks}", PIPELINE)
    seconds = time.perf_counter() - clock
    kept = searched.mesh_shapes[0]
    fastest = min(step for step, _, _ in singles.values())
    times = [t for _, _, t in singles.values()]
    print(f"kept: dp = {kept.sizes[0]}, tp = {kept.sizes[1]}, pp = {kept.sizes[2]}, step {kept.step_s * 1e3:.2f} ms "
          f"(fastest fixed shape {fastest * 1e3:.2f} ms)")
    compiled_shapes = sum(1 for shape in searched.mesh_shapes if not shape.same_as and not shape.why_not)
    own = singles[kept.sizes][2]  # what writing the kept shape out would have cost
    print(f"search over {len(singles)} shapes ({compiled_shapes} compiled, the others their axes renamed): "
          f"{seconds:.1f} s; the kept shape alone: {own:.1f} s ({seconds / own:.1f}x); one shape: "
          f"{max(times):.1f} s at most, {sum(times) / len(times):.1f} s on average ({seconds / max(times):.1f}x and "
          f"{seconds / (sum(times) / len(times)):.1f}x)")


if __name__ == "__main__":
    main()
