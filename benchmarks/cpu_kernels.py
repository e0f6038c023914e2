"""The runtime's fused RMSNorm and rotary embedding on CPU, four ways, in a training step of the examples
on 2 gloo ranks (one thread each): numba's kernels (pardsl/runtime/kernels.py); numba's norm with the
rotary embedding as ATen ops (what each kernel brings apart); the same fused ops written as ATen ops and
compiled by torch.compile (inductor, one graph each way); and the ATen ops eagerly.

The ways take turns step by step, each first in turn, in the same processes on the same model, so a slow
spell of the shared machine falls on each alike; each step is forward, backward and zeroing the
gradients, begun after a barrier. Printed: each way's min, median and max step over `--steps` rounds
(after a warm-up that compiles and checks that the ways give the same output and gradients), the median of
the rounds' ratios, and in how many rounds numba's step beat eager's.

    python benchmarks/cpu_kernels.py [--steps 15] [--plans "examples/llama_tp2.par;..."]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from unittest import mock

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.timing import on_two_ranks, training_step_ms

# name -> (.par file, replacements in its text): the examples as they are, and the HF LLaMA at a size where
# a norm's activation no longer fits in a core's cache.
PLANS = {
    "examples/hf_llama_tp2.par": ("examples/hf_llama_tp2.par", []),
    "examples/llama_tp2.par": ("examples/llama_tp2.par", []),
    "hf_llama_tp2.par at hidden 512, batch 4 x 256": ("examples/hf_llama_tp2.par", [
        ('HFLlama(layers=2, attention="sdpa")',
         'HFLlama(layers=2, hidden=512, heads=8, kv_heads=4, ffn=1376, positions=256, attention="sdpa")'),
        ("int64[2, 16]", "int64[4, 256]")]),
}
# numba's norm with the rotary embedding as ATen ops: what each of the two kernels brings apart
WAYS = ("numba", "numba norms only", "torch.compile", "eager ATen ops")


def _rms_norm_forward(x, weight, eps):
    """What kernels.rms_norm_forward returns: (the norm, x as rows, rsqrt(mean(x²) + eps) per row)."""
    rows = x.detach().reshape(-1, x.shape[-1])
    r = torch.rsqrt(rows.pow(2).mean(-1) + eps)
    return (weight.detach() * (rows * r[:, None])).view(x.shape), rows, r


def _rms_norm_backward(grad, rows, r, weight, needs_weight_grad):
    """What kernels.rms_norm_backward returns: gx = r·(m − n·mean(m·n)), gw = Σ g·n, n = x·r, m = g·w."""
    g = grad.reshape(rows.shape)
    n = rows * r[:, None]
    m = g * weight.detach()
    grad_x = (r[:, None] * (m - n * (m * n).mean(-1, keepdim=True))).view(grad.shape)
    return grad_x, (g * n).sum(0) if needs_weight_grad else None


def _rotate(x, cos, sin, transposed: bool):
    """x·cos + rotate_half(x)·sin, or forward's adjoint (`transposed`), the tables broadcast."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    if transposed:
        return torch.cat([x1 * cos[..., :h] + x2 * sin[..., h:], x2 * cos[..., h:] - x1 * sin[..., :h]], -1)
    return torch.cat([x1 * cos[..., :h] - x2 * sin[..., :h], x2 * cos[..., h:] + x1 * sin[..., h:]], -1)


def _compiled_kernels() -> dict:
    """kernels' functions, the same computations compiled by torch.compile."""
    norm_forward = torch.compile(_rms_norm_forward, dynamic=False)
    norm_backward = torch.compile(_rms_norm_backward, dynamic=False)
    rotate = torch.compile(_rotate, dynamic=False)
    return {"rms_norm_forward": norm_forward, "rms_norm_backward": norm_backward,
            "rotary_forward": lambda x, cos, sin: rotate(x.detach(), cos, sin, False),
            "rotary_backward": lambda grad, cos, sin: rotate(grad, cos, sin, True)}


def _patches(way: str) -> dict:
    if way == "numba":
        return {}
    if way == "torch.compile":
        return _compiled_kernels()
    if way == "numba norms only":
        return {"rotary_fits": lambda *args: False}
    return {"rms_norm_fits": lambda *args: False, "rotary_fits": lambda *args: False}


def _worker(rank: int, port: int, path: str, steps: int, results) -> None:
    import pardsl
    from pardsl.runtime import kernels

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        plan = pardsl.load(path)
        torch.manual_seed(0)
        model = plan.module()
        shape = plan.compiled.program.inputs[0].shape
        batch = torch.randint(0, 256, tuple(shape), generator=torch.Generator().manual_seed(0))
        inputs = plan.shard_inputs(input_ids=batch)
        calls = {"rms_norm_forward": 0, "rotary_forward": 0}

        def counted(name, function):
            def call(*args):
                calls[name] += 1
                return function(*args)
            return call

        patches = {way: _patches(way) for way in WAYS}
        for name in calls:  # how many fused ops a step runs, counted on the numba way
            patches["numba"][name] = counted(name, getattr(kernels, name))

        def step(way: str, kept: dict | None = None) -> float:
            with mock.patch.multiple(kernels, **patches[way]):
                ms, made = training_step_ms(model, inputs)
            if kept is not None:
                kept[way] = made
            return ms

        kept = {}
        for _ in range(3):  # warm-up: numba's and inductor's compiles, autograd's first graphs
            for way in WAYS:
                step(way, kept)
        for way in WAYS[1:]:  # the same step each way: output and gradients within rounding
            for mine, numba_s in zip(kept[way], kept["numba"]):
                torch.testing.assert_close(mine, numba_s, rtol=1e-4, atol=1e-5)
        for name in calls:
            calls[name] = 0
        step("numba")
        fused = dict(calls)
        times = {way: [] for way in WAYS}
        for round_ in range(steps):  # each way first in turn: none always follows the same one
            for way in WAYS[round_ % len(WAYS):] + WAYS[:round_ % len(WAYS)]:
                times[way].append(step(way))
        if rank == 0:
            results.put((times, fused))
    finally:
        dist.destroy_process_group()


def measure(path: str, steps: int) -> tuple[dict, dict]:
    return on_two_ranks(_worker, path, steps)


def _ratio(times: dict, a: str, b: str) -> str:
    """The median of the rounds' ratios of way `a` to way `b`: each pair from one round."""
    return f"{statistics.median(x / y for x, y in zip(times[a], times[b])):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--plans", default=";".join(PLANS), help="names of PLANS, separated by semicolons")
    args = parser.parse_args()
    os.chdir(ROOT)
    print(f"2 gloo ranks x 1 thread; forward + backward; {args.steps} rounds of one step each way, in turn")
    print("| plan | fused ops per step | numba (ms) min / median / max | numba norms only (ms) | torch.compile (ms) "
          "| eager ATen ops (ms) | numba / eager | numba / numba norms only | compiled / eager | numba / compiled "
          "| rounds numba beat eager |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for name in args.plans.split(";"):
            source, replacements = PLANS[name]
            with open(source, encoding="utf-8") as handle:
                text = handle.read()
            for old, new in replacements:
                assert old in text, (source, old)
                text = text.replace(old, new)
            path = os.path.join(folder, os.path.basename(source))
            with open(path, "w") as handle:
                handle.write(text)
            times, fused = measure(path, args.steps)
            figures = {way: f"{min(t):.2f} / {statistics.median(t):.2f} / {max(t):.2f}" for way, t in times.items()}
            print(f"| {name} | {fused['rms_norm_forward']} norms, {fused['rotary_forward']} rotary | "
                  f"{figures['numba']} | {figures['numba norms only']} | {figures['torch.compile']} | "
                  f"{figures['eager ATen ops']} | {_ratio(times, 'numba', 'eager ATen ops')} | "
                  f"{_ratio(times, 'numba', 'numba norms only')} | {_ratio(times, 'torch.compile', 'eager ATen ops')} | "
                  f"{_ratio(times, 'numba', 'torch.compile')} | "
                  f"{sum(a < b for a, b in zip(times['numba'], times['eager ATen ops']))} of {args.steps} |", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
