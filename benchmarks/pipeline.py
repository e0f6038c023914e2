"""Pipeline schedules measured against theory.

Hugging Face LLaMA, 4 layers (hidden 128), cut in two stages, on pp = 2 (2 gloo ranks) and pp = 2 x tp = 2
(4 ranks), under GPipe and 1F1B at 2, 4 and 8 micro-batches. Per rank it measures, over the timed steps:

- the idle fraction: 1 - (time in the stage's forward and backward chunks) / (step time): what the rank
  spends waiting for the other stage, the bubble;
- the activation memory: the most micro-batches whose activations the stage holds at once (torch's
  forward cache) times one micro-batch's activations (what autograd keeps of the stage program's op results);

and prints them beside the bubble formulas: (p - 1)/(m + p - 1) of a step for GPipe; (p - 1)/m of the ideal
step for 1F1B (the same bubble, counted against the work instead of the step: 1F1B's gain is memory, p
micro-batches in flight instead of m).

    python benchmarks/pipeline.py [--steps 6]

On this machine (2 cores) the ranks share cores, so the measured idle time also holds the other rank's
compute; the trend across micro-batch counts is the figure to read.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN = """mesh     pp = 2{tp_axis}
model    examples.hf_models:HFLlama(layers=4, hidden=128, ffn=256)
input    input_ids : int64[16, 32] in [0, 256)
input    labels : int64[16, 32] in [0, 256)
pipeline pp : schedule {schedule}, microbatches {m}, cut before model.model.layers.2
{layout}"""
TP_LAYOUT = """layout {
    model.model.layers.*.self_attn.q_proj.weight : S(0) @ tp
    model.model.layers.*.self_attn.k_proj.weight : S(0) @ tp
    model.model.layers.*.self_attn.v_proj.weight : S(0) @ tp
    model.model.layers.*.self_attn.o_proj.weight : S(1) @ tp
    model.model.layers.*.mlp.gate_proj.weight    : S(0) @ tp
    model.model.layers.*.mlp.up_proj.weight      : S(0) @ tp
    model.model.layers.*.mlp.down_proj.weight    : S(1) @ tp
}
"""


def rank_main(plan_path: str, out: str, steps: int) -> None:
    import torch
    import torch.distributed as dist

    import pardsl

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    plan = pardsl.load(plan_path)
    model = plan.module()
    busy = [0.0]
    in_flight = [0]
    for stage in model.pipeline.stages:
        def timed(method, stage=stage):
            def run(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return method(*args, **kwargs)
                finally:
                    busy[0] += time.perf_counter() - start
                    in_flight[0] = max(in_flight[0], len(stage.fwd_cache))
            return run
        stage.forward_one_chunk = timed(stage.forward_one_chunk)
        stage.backward_one_chunk = timed(stage.backward_one_chunk)
    batch = torch.randint(0, 256, (16, 32), generator=torch.Generator().manual_seed(1))
    inputs = plan.shard_inputs(input_ids=batch, labels=batch)
    model.step(**inputs)  # warm-up
    walls = []
    for _ in range(steps):
        busy[0] = 0.0
        dist.barrier()
        start = time.perf_counter()
        model.step(**inputs)
        walls.append((time.perf_counter() - start, busy[0]))
    per_microbatch = sum(program.memory()["activations_per_rank"]
                         for index, program in enumerate(plan.compiled.stages) if index in model.pipeline.modules)
    walls.sort()
    wall, work = walls[len(walls) // 2]
    with open(f"{out}.{dist.get_rank()}.json", "w") as handle:
        json.dump({"rank": dist.get_rank(), "stage": sorted(model.pipeline.modules), "wall_ms": wall * 1000,
                   "idle": 1 - work / wall, "in_flight": in_flight[0],
                   "activation_bytes": in_flight[0] * per_microbatch}, handle)
    dist.barrier()
    dist.destroy_process_group()


def run(tp: bool, schedule: str, m: int, steps: int) -> list[dict]:
    nproc = 4 if tp else 2
    with tempfile.TemporaryDirectory() as folder:
        plan = os.path.join(folder, "plan.par")
        with open(plan, "w") as handle:
            handle.write(PLAN.format(tp_axis=", tp = 2" if tp else "", schedule=schedule, m=m,
                                     layout=TP_LAYOUT if tp else ""))
        out = os.path.join(folder, "result")
        from pardsl.runtime.devices import free_port

        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=0", os.path.abspath(__file__),
                   "--rank-main", plan, out, str(steps)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
        return [json.load(open(f"{out}.{rank}.json")) for rank in range(nproc)]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-main":
        rank_main(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    p = 2
    print(f"{'mesh':<12}{'schedule':<9}{'m':>3}  {'step ms':>8}  {'idle stage 0':>12}  {'idle stage 1':>12}  "
          f"{'theory':>16}  {'in flight':>9}  {'activations stage 0':>20}")
    for tp in (False, True):
        for schedule in ("GPipe", "1F1B"):
            for m in (2, 4, 8):
                ranks = run(tp, schedule, m, args.steps)
                first = [r for r in ranks if 0 in r["stage"]]
                second = [r for r in ranks if 1 in r["stage"]]
                theory = f"{(p - 1) / (m + p - 1):.2f} of step" if schedule == "GPipe" else f"{(p - 1) / m:.2f} of work"
                print(f"{'pp2 x tp2' if tp else 'pp2':<12}{schedule:<9}{m:>3}  {first[0]['wall_ms']:>8.1f}  "
                      f"{sum(r['idle'] for r in first) / len(first):>12.2f}  "
                      f"{sum(r['idle'] for r in second) / len(second):>12.2f}  {theory:>16}  "
                      f"{first[0]['in_flight']:>9}  {first[0]['activation_bytes'] / 1024:>17.0f} KiB", flush=True)


if __name__ == "__main__":
    main()
