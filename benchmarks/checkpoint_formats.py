"""Save and load of a Llama 3.2 1B shape's shards on 2 and 4 gloo ranks (CPU): pardsl's own format
against torch.distributed.checkpoint (`pardsl.save(..., format="dcp")`), at equal safety: the own format
hashes every file on save and checks the hashes before reading (sha256, the default); a DCP folder pardsl
writes carries the same hashes (`pardsl.dcp.json`), checked the same way, besides DCP's structure checks.

    python benchmarks/checkpoint_formats.py [--worlds 2 4] [--repeats 3] [--dtype bfloat16]

Each rank holds its tensor-parallel shards (tp over every rank); a save is `pardsl.save` of the model
(no optimizer), a load `plan.module(checkpoint=...)`: a new module, every rank reading the slices it holds.
Each is timed on every rank from a barrier to a barrier (the slowest rank's time), `--repeats` times in
turn (own save, own load, DCP save, DCP load); the table gives min / median / max seconds. The files are
read back from the page cache: a load from a cold disk is slower for both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN = """mesh   tp = {world}
model  examples.hf_models:llama_causal_lm(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, \
positions=256, dtype="{dtype}")
input  input_ids : int64[1, 256] in [0, 128256)

layout {{
    model.layers.*.self_attn.q_proj.weight : S(0) @ tp
    model.layers.*.self_attn.k_proj.weight : S(0) @ tp
    model.layers.*.self_attn.v_proj.weight : S(0) @ tp
    model.layers.*.self_attn.o_proj.weight : S(1) @ tp
    model.layers.*.mlp.gate_proj.weight : S(0) @ tp
    model.layers.*.mlp.up_proj.weight : S(0) @ tp
    model.layers.*.mlp.down_proj.weight : S(1) @ tp
    model.embed_tokens.weight : S(0) @ tp
    lm_head.weight : S(0) @ tp
}}
"""


def rank_main(plan_path: str, folder: str, repeats: int, out: str) -> None:
    import gc

    import torch
    import torch.distributed as dist

    import pardsl

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    plan = pardsl.load(plan_path)
    model = plan.module()
    parameters = sum(p.numel() for p in model.parameters())

    def timed(action) -> float:
        dist.barrier()
        start = time.perf_counter()
        result = action()
        dist.barrier()
        del result
        gc.collect()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {}
    for _ in range(repeats):
        for name in ("pardsl", "dcp"):
            path = os.path.join(folder, name)
            times.setdefault(f"{name} save", []).append(
                timed(lambda path=path, name=name: pardsl.save(model, path, format=name)))
            times.setdefault(f"{name} load", []).append(timed(lambda path=path: plan.module(checkpoint=path)))
    sizes = {name: sum(os.path.getsize(os.path.join(folder, name, f)) for f in os.listdir(os.path.join(folder, name)))
             for name in ("pardsl", "dcp")}
    total = torch.tensor([parameters])
    dist.all_reduce(total)
    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump({"times": times, "bytes": sizes, "parameters_per_rank": parameters}, handle)
    dist.barrier()
    dist.destroy_process_group()


def run_world(world: int, repeats: int, dtype: str, work: str) -> dict:
    from pardsl.runtime.devices import free_port

    plan_path = os.path.join(work, f"llama32_1b_tp{world}.par")
    with open(plan_path, "w") as handle:
        handle.write(PLAN.format(world=world, dtype=dtype))
    folder = os.path.join(work, f"checkpoints-{world}")
    os.makedirs(folder)
    out = os.path.join(work, f"result-{world}.json")
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=0", os.path.abspath(__file__),
               "--rank-main", plan_path, folder, str(repeats), out]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run(command, cwd=REPO, env=env, check=True, timeout=3600)
    shutil.rmtree(folder)
    with open(out) as handle:
        return json.load(handle)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-main":
        rank_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="pardsl-checkpoint-formats-")  # 0700: a folder pardsl trusts
    try:
        print(f"{time.strftime('%Y-%m-%d %H:%M %Z')}, {os.cpu_count()} cores, Llama 3.2 1B shape in {args.dtype}, "
              f"model only, {args.repeats} repeats")
        print(f"{'ranks':>5}  {'what':<12} {'GB':>6}  {'min s':>7} {'median s':>9} {'max s':>7}  {'GB/s (median)':>13}")
        for world in args.worlds:
            result = run_world(world, args.repeats, args.dtype, work)
            for what, seconds in result["times"].items():
                gigabytes = result["bytes"][what.split()[0]] / 1e9
                median = statistics.median(seconds)
                print(f"{world:>5}  {what:<12} {gigabytes:>6.2f}  {min(seconds):>7.2f} {median:>9.2f} "
                      f"{max(seconds):>7.2f}  {gigabytes / median:>13.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
