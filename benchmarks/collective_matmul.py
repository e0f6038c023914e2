"""Collective matmuls on CPU: a sequence-parallel LLaMA's training step on 2 gloo ranks (one thread each)
with its gathers and reduce-scatters cut into chunks beside their linears (`substitute collective_matmul :
on`) and without (`: off`), the same model, weights and batch.

The two modules take turns step by step, each first in turn, in the same processes, so a slow spell of the
shared machine falls on both alike; each step is forward, backward and zeroing the gradients, begun after a
barrier. Printed: each way's min, median and max step over `--steps` rounds (after a warm-up that checks
that both give the same output and gradients), the median of the rounds' ratios, and what the cost
model (this machine's defaults for gloo) says each way takes.

    python benchmarks/collective_matmul.py [--steps 5] [--size "hidden=512, batch 8 x 256"]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.timing import on_two_ranks, training_step_ms

WAYS = ("on", "off")
# the example's model at a size whose step waits for its collectives: hidden 512, 8 sequences of 256
SIZE = [('HFLlama(layers=2)', 'HFLlama(layers=2, hidden=512, heads=8, kv_heads=4, ffn=1376, positions=256)'),
        ("int64[2, 16]", "int64[8, 256]")]


def plan_text(way: str) -> str:
    with open(os.path.join(ROOT, "examples", "hf_llama_sp_tp2.par"), encoding="utf-8") as handle:
        text = handle.read()
    for old, new in SIZE:
        assert old in text, old
        text = text.replace(old, new)
    return text.replace("layout {", f"substitute collective_matmul : {way}\n\nlayout {{", 1)


def _worker(rank: int, port: int, paths: dict, steps: int, results) -> None:
    import pardsl

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        plans = {way: pardsl.load(path) for way, path in paths.items()}
        models = {}
        for way, plan in plans.items():
            torch.manual_seed(0)
            models[way] = plan.module()
        shape = plans["on"].compiled.program.inputs[0].shape
        batch = torch.randint(0, 256, tuple(shape), generator=torch.Generator().manual_seed(0))
        inputs = {way: plan.shard_inputs(input_ids=batch) for way, plan in plans.items()}

        def step(way: str, kept: dict | None = None) -> float:
            ms, made = training_step_ms(models[way], inputs[way])
            if kept is not None:
                kept[way] = made
            return ms

        kept = {}
        for _ in range(2):  # warm-up: autograd's first graphs, the transports' buffers
            for way in WAYS:
                step(way, kept)
        for mine, theirs in zip(kept["on"], kept["off"]):  # the same step both ways, within rounding
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
        times = {way: [] for way in WAYS}
        for round_ in range(steps):
            for way in (WAYS if round_ % 2 == 0 else WAYS[::-1]):
                times[way].append(step(way))
        if rank == 0:
            results.put(times)
    finally:
        dist.destroy_process_group()


def measure(paths: dict, steps: int) -> dict:
    return on_two_ranks(_worker, paths, steps)


def main() -> None:
    from pardsl.compiler import compile_file
    from pardsl.planning.cost import default_machine, estimate

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    os.chdir(ROOT)
    machine = default_machine()
    with tempfile.TemporaryDirectory(dir=ROOT) as folder:
        paths = {}
        for way in WAYS:
            paths[way] = os.path.join(folder, f"sp_{way}.par")
            with open(paths[way], "w") as handle:
                handle.write(plan_text(way))
        priced = {way: estimate(compile_file(path, machine=machine), machine) for way, path in paths.items()}
        times = measure(paths, args.steps)
    print(f"2 gloo ranks x 1 thread; {SIZE[0][1]}, {SIZE[1][1]}; forward + backward; {args.steps} rounds, "
          "one step each way in turn")
    print("| way | step (ms) min / median / max | estimate (ms) | estimated exposed communication (ms) |")
    print("|---|---|---|---|")
    for way in WAYS:
        seconds = priced[way].seconds
        exposed = seconds["communication_forward"] + seconds["communication_backward"] + seconds["overlapped_exposed"]
        t = times[way]
        print(f"| collective matmul {way} | {min(t):.1f} / {statistics.median(t):.1f} / {max(t):.1f} | "
              f"{seconds['step'] * 1e3:.1f} | {exposed * 1e3:.1f} |")
    ratio = statistics.median(a / b for a, b in zip(times["on"], times["off"]))
    print(f"\nmedian of the rounds' ratios, on / off: {ratio:.3f}")


if __name__ == "__main__":
    main()
