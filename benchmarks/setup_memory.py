"""Peak memory of each rank while it sets up its shards: `plan.module(checkpoint=...)` against the shard
size and the largest single tensor (the goal: shards plus that tensor, no more), and, for contrast,
`plan.module()` without a checkpoint (which makes each parameter from a record of the factory run on the
meta device, one at a time: pardsl/model/deferred_init.py).

    python benchmarks/setup_memory.py [--layers 8 --hidden 512 --vocab 32000]

The parent builds the model once, writes it as a Hugging Face `model.safetensors`, then runs 2 ranks
under torchrun; each rank samples its resident memory (VmRSS) every millisecond during set-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PLAN = """mesh   tp = 2
model  examples.hf_models:llama_causal_lm({kwargs})
input  input_ids : int64[batch=2, seq=16] in [0, {vocab})
input  labels    : int64[batch, seq] in [0, {vocab})
layout {{
    model.embed_tokens.weight              : S(0)
    model.layers.*.self_attn.q_proj.weight : S(0)
    model.layers.*.self_attn.k_proj.weight : S(0)
    model.layers.*.self_attn.v_proj.weight : S(0)
    model.layers.*.self_attn.o_proj.weight : S(1)
    model.layers.*.mlp.gate_proj.weight    : S(0)
    model.layers.*.mlp.up_proj.weight      : S(0)
    model.layers.*.mlp.down_proj.weight    : S(1)
    lm_head.weight                         : S(0)
}}
"""

MiB = 1 << 20


def rss(kind: str = "RssAnon") -> int:
    """Resident memory of one kind: RssAnon is what the process owns (tensors); RssFile the pages of
    files it has mapped (safetensors reads through mmap: page cache, shared and evictable)."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(kind + ":"):
                return int(line.split()[1]) * 1024
    return 0


class PeakSampler:
    def __init__(self):
        self.peak, self.peak_file, self._running = rss(), rss("RssFile"), True
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while self._running:
            self.peak = max(self.peak, rss())
            self.peak_file = max(self.peak_file, rss("RssFile"))
            time.sleep(0.001)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, rss())


def rank_main(plan_path: str, checkpoint: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    import pardsl
    from pardsl.model.deferred_init import give_back_freed_memory

    dist.init_process_group("gloo")
    plan = pardsl.load(plan_path)
    result = {}
    for mode, source in (("checkpoint", checkpoint), ("factory", None)):
        dist.barrier()
        give_back_freed_memory()  # what the mode before freed, not counted against this one
        before, before_file = rss(), rss("RssFile")
        with PeakSampler() as sampler:
            model = plan.module(checkpoint=source)
        shard = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
        result[mode] = {"before": before, "peak": sampler.peak, "shard": shard,
                        "file": sampler.peak_file - before_file}
        del model
    largest = max(torch.Size(shape).numel() * 4 for _, _, shape in plan.parameter_layouts.values())
    result["largest"] = largest
    result["full"] = sum(torch.Size(shape).numel() * 4 for _, _, shape in plan.parameter_layouts.values())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump(gathered, handle)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rank-worker", nargs=3, metavar=("PLAN", "CHECKPOINT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        return rank_main(*args.rank_worker)

    import torch
    from safetensors.torch import save_file

    from examples.hf_models import llama_causal_lm
    from pardsl.runtime.devices import free_port

    kwargs = dict(layers=args.layers, hidden=args.hidden, heads=8, kv_heads=8, ffn=args.ffn, vocab=args.vocab)
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        model = llama_causal_lm(**kwargs)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(folder, "model.safetensors"))
        del model
        plan_path = os.path.join(folder, "plan.par")
        with open(plan_path, "w") as handle:
            handle.write(PLAN.format(kwargs=", ".join(f"{k}={v}" for k, v in kwargs.items()), vocab=args.vocab))
        out = os.path.join(folder, "result.json")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=127.0.0.1:{free_port()}", os.path.abspath(__file__), "--rank-worker",
                        plan_path, folder, out], check=True, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO})
        with open(out) as handle:
            results = json.load(handle)
    full, largest = results[0]["full"], results[0]["largest"]
    print(f"LLaMA {kwargs}: {full / MiB:.1f} MiB of parameters, largest tensor {largest / MiB:.1f} MiB, tp = 2")
    print("| rank | set-up | shard | peak growth of owned memory (RssAnon) | goal: shard + largest tensor | "
          "file pages mapped (RssFile) |")
    print("|---|---|---|---|---|---|")
    for rank, result in enumerate(results):
        for mode, label in (("checkpoint", "plan.module(checkpoint=model.safetensors)"),
                            ("factory", "plan.module() (from the factory, one tensor at a time)")):
            r = result[mode]
            print(f"| {rank} | {label} | {r['shard'] / MiB:.1f} MiB | {(r['peak'] - r['before']) / MiB:.1f} MiB | "
                  f"{(r['shard'] + largest) / MiB:.1f} MiB | {r['file'] / MiB:.1f} MiB |")


if __name__ == "__main__":
    main()
