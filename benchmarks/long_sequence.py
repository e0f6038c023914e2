"""A model whose serial training does not fit this machine, trained on 2 ranks of it.

Hugging Face's LLaMA with eager attention (its scores, heads × sequence² floats, are kept for backward) at
a sequence long enough that serial training needs more memory than the machine has. The plan is Megatron
tensor parallelism with sequence parallelism and full recomputation of every layer, on 2 gloo ranks of
the same machine:

1. equal to serial: `pardsl run` at a short sequence (the sequence is a named dim: the same plan);
2. serial at the long sequence, in a process whose address space is capped (`--cap-gib`): out of memory,
   or its peak where it fits; beside it, serial's peak measured at shorter sequences and the plan's
   estimate of what serial holds;
3. the plan at the long sequence: one training step (forward, backward, AdamW) on each rank, its peak
   resident memory (ru_maxrss, the interpreter and torch included) and time.

    python benchmarks/long_sequence.py [--layers 12 --hidden 256 --heads 8 --seq 8192] [--cap-gib 20]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PLAN = """mesh   tp = 2
model  examples.hf_models:HFLlama(layers={layers}, hidden={hidden}, heads={heads}, kv_heads={heads}, ffn={ffn}, positions={seq}, attention="eager")
input  input_ids : int64[1, seq={short}] in [0, 256)
input  labels    : int64[1, seq] in [0, 256)
recompute model.model.layers.*

layout {{
    model.model.layers.*.self_attn.q_proj.weight : S(0)
    model.model.layers.*.self_attn.k_proj.weight : S(0)
    model.model.layers.*.self_attn.v_proj.weight : S(0)
    model.model.layers.*.self_attn.o_proj.weight : S(1)
    model.model.layers.*.mlp.gate_proj.weight    : S(0)
    model.model.layers.*.mlp.up_proj.weight      : S(0)
    model.model.layers.*.mlp.down_proj.weight    : S(1)
    model.model.embed_tokens()                   : S(1)
    model.model.layers.*.self_attn()             : S(1)
    model.model.layers.*.mlp()                   : S(1)
    model.model.norm()                           : S(1)
}}
"""
GIB = 1 << 30


def _batch(seq: int):
    import torch

    ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(1))
    return ids, ids.clone()


def serial_step(args, seq: int) -> dict:
    """One serial training step at `seq` in this process: its peak resident memory, or where it ran out."""
    import torch

    from examples.hf_models import HFLlama

    torch.manual_seed(0)
    model = HFLlama(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.heads, ffn=args.ffn,
                    positions=args.seq, attention="eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, labels = _batch(seq)
    start = time.perf_counter()
    try:
        model(ids, labels).backward()
        optimizer.step()
    except (RuntimeError, MemoryError) as error:
        return {"seq": seq, "out_of_memory": True, "error": str(error).splitlines()[0][:160],
                "peak_gib": _peak_gib()}
    return {"seq": seq, "out_of_memory": False, "peak_gib": _peak_gib(), "seconds": time.perf_counter() - start}


def plan_step(rank: int, port: int, path: str, seq: int, queue) -> None:
    """One rank of the plan: one training step at `seq`; its peak resident memory and time."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        import pardsl

        torch.manual_seed(0)
        plan = pardsl.load(path)
        model = plan.module()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids, labels = _batch(seq)
        set_up = _peak_gib()
        start = time.perf_counter()
        loss = model(**plan.shard_inputs(input_ids=ids, labels=labels))
        loss.backward()
        optimizer.step()
        queue.put({"rank": rank, "peak_gib": _peak_gib(), "after_set_up_gib": set_up,
                   "seconds": time.perf_counter() - start, "loss": loss.item()})
    finally:
        dist.destroy_process_group()


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def _capped_serial(args, seq: int, cap_gib: float | None) -> dict:
    """serial_step in a fresh process, its address space capped at `cap_gib` (None: no cap)."""
    code = ("import json, resource, sys; sys.path.insert(0, {root!r}); "
            "cap = {cap!r}; "
            "cap and resource.setrlimit(resource.RLIMIT_AS, (int(cap * 2**30), int(cap * 2**30))); "
            "import argparse; from benchmarks.long_sequence import serial_step; "
            "print(json.dumps(serial_step(argparse.Namespace(**{ns!r}), {seq})))").format(
        root=ROOT, cap=cap_gib, ns=vars(args), seq=seq)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=3600)
    lines = result.stdout.strip().splitlines()
    if result.returncode or not lines:
        return {"seq": seq, "out_of_memory": True, "error": (result.stderr.strip().splitlines() or ["killed"])[-1][:160]}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--short", type=int, default=256, help="the sequence the plan is checked against serial at")
    parser.add_argument("--cap-gib", type=float, default=20.0,
                        help="serial's address space at the long sequence (below the machine's memory, so that "
                             "running out is an error, not the kernel's OOM killer)")
    args = parser.parse_args()
    args.ffn = args.hidden * 8 // 3 // 8 * 8
    import torch.multiprocessing as mp

    from pardsl.compiler import compile_text
    from pardsl.planning.cost import memory_per_rank

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "long.par")
        text = PLAN.format(layers=args.layers, hidden=args.hidden, heads=args.heads, ffn=args.ffn, seq=args.seq,
                           short=args.short)
        with open(path, "w") as handle:
            handle.write(text)
        print(f"HFLlama (eager attention): {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
              f"ffn {args.ffn}; tp = 2 with sequence parallelism and full recomputation")

        checked = subprocess.run([sys.executable, "-m", "pardsl.cli", "run", path, "--nproc", "2", "--steps", "2",
                                  "--json", "--timeout", "600"], capture_output=True, text=True, cwd=ROOT)
        report = json.loads(checked.stdout) if checked.stdout.strip() else {}
        if "max_rel_err" not in report:
            raise SystemExit(f"the plan did not run: {report.get('errors') or checked.stderr.strip()[-2000:]}")
        print(f"1. at sequence {args.short}: equal to serial: {report['ok']} (max relative error: output "
              f"{report['max_rel_err']['output']:.2e}, gradients {report['max_rel_err']['grad']:.2e})")

        long_text = text.replace(f"seq={args.short}", f"seq={args.seq}")
        memory = memory_per_rank(compile_text(long_text, path).program)
        print(f"2. serial at sequence {args.seq}: the plan's estimate of what serial holds: "
              f"{memory['serial_total'] / GIB:.1f} GiB; of what a rank of the plan holds: {memory['total'] / GIB:.2f} GiB")
        for seq in (args.seq // 4, args.seq // 2):
            measured = _capped_serial(args, seq, None)
            print(f"   serial at sequence {seq}: peak resident {measured.get('peak_gib', float('nan')):.2f} GiB, "
                  f"step {measured.get('seconds', float('nan')):.1f} s")
        attempt = _capped_serial(args, args.seq, args.cap_gib)
        print(f"   serial at sequence {args.seq}, address space capped at {args.cap_gib:g} GiB: "
              + (f"out of memory ({attempt['error']})" if attempt["out_of_memory"]
                 else f"fits, peak {attempt['peak_gib']:.2f} GiB"))

        port = _free_port()
        queue = mp.get_context("spawn").SimpleQueue()
        ranks = [mp.get_context("spawn").Process(target=plan_step, args=(rank, port, path, args.seq, queue))
                 for rank in range(2)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(timeout=3600)
            if process.is_alive():
                process.kill()
        results = sorted((queue.get() for _ in range(sum(p.exitcode == 0 for p in ranks))), key=lambda r: r["rank"])
        for result in results:
            print(f"3. the plan at sequence {args.seq}, rank {result['rank']}: peak resident {result['peak_gib']:.2f} GiB "
                  f"({result['after_set_up_gib']:.2f} after set-up), step {result['seconds']:.1f} s, loss {result['loss']:.4f}")
        if len(results) < 2:
            print("3. the plan at the long sequence FAILED on some rank")
        else:
            print(f"   both ranks together: {sum(r['peak_gib'] for r in results):.2f} GiB")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


if __name__ == "__main__":
    main()
