"""AdamW through pardsl's public API, a batch and sequence length that change every step, clipping. `train`
runs on every rank of a process group (the tests' worker pool); run under torchrun, rank 0 writes the
losses and gradient norms as JSON:

    api_train.py PLAN.par OUT.json [--local-batch] [--compile [--compile-backend NAME]] [--steps N]

--local-batch: each rank takes its data-parallel part of the batch itself (plan.data_parallel), as a
DistributedSampler would give it, and passes it with shard_inputs(..., local_batch=True). --compile:
compiled layers with the collectives inside the graphs (pardsl.load(..., compile=True,
collectives_in_graphs=True)). --steps N: the first N of the steps (each compiles the pieces once more).
"""

import json
import sys

import torch
import torch.distributed as dist

import pardsl
from tests.scripts import shut_down

SHAPES = [(4, 16), (2, 8), (6, 12), (2, 6)]  # (batch, seq) per step


def batches():
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, shape, generator=generator) for shape in SHAPES]


def train(plan_path: str, local_batch: bool = False, compile: bool = False, steps: int = len(SHAPES),
          compile_backend: str = "inductor") -> dict:
    """On every rank of an initialised process group: the losses and clipped gradient norms of each step,
    and the last step's output type and local logits' shape."""
    torch.manual_seed(0)
    plan = pardsl.load(plan_path, compile=compile, collectives_in_graphs=True if compile else None,
                       compile_backend=compile_backend)
    model = plan.module()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for batch in batches()[:steps]:
        if local_batch:
            rank, size = plan.data_parallel
            batch = batch.chunk(size)[rank]
        out = model(**plan.shard_inputs(input_ids=batch, labels=batch, local_batch=local_batch))
        out.loss.backward()
        norms.append(pardsl.clip_grad_norm_(model, 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
    return {"losses": losses, "norms": norms, "output": type(out).__name__, "logits": list(out.logits.shape)}


def main() -> None:
    plan_path, out_path = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    def option(name: str, default):
        return type(default)(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default

    result = train(plan_path, "--local-batch" in sys.argv, "--compile" in sys.argv, option("--steps", len(SHAPES)),
                   option("--compile-backend", "inductor"))
    if dist.get_rank() == 0:
        with open(out_path, "w") as handle:
            json.dump(result, handle)
    shut_down()


if __name__ == "__main__":
    main()
