"""Gradients accumulated over two micro-batches (two backwards before one step), through pardsl's public
API. Every rank compares its gradient shards with its shards of the serial model's accumulated gradients,
and its collectives per backward with the plan's. `accumulate` runs on every rank of a process group (the
tests' worker pool)."""

import torch
import torch.distributed as dist

import pardsl
from examples.hf_models import llama_causal_lm


def accumulate(plan_path: str) -> dict:
    """On every rank of an initialised process group: the largest difference of any rank's gradient shards
    from serial's, the collectives of each backward by axis, and the plan's."""
    generator = torch.Generator().manual_seed(7)
    micro_batches = [torch.randint(0, 256, (4, 16), generator=generator) for _ in range(2)]

    torch.manual_seed(0)
    serial = llama_causal_lm(layers=2)
    for batch in micro_batches:
        serial(input_ids=batch, labels=batch).loss.backward()
    expected = {name: p.grad for name, p in serial.named_parameters()}

    torch.manual_seed(0)
    plan = pardsl.load(plan_path)
    model = plan.module()
    rt = model.rt
    counts = []
    for batch in micro_batches:
        rt.counter.reset()
        model(**plan.shard_inputs(input_ids=batch, labels=batch)).loss.backward()
        counts.append(rt.counter.summary()["collectives_by_axis"]["backward"])
    error = max((parameter.grad - rt.shard(expected[name], layout)).abs().max().item()
                for name, parameter, layout in model.named_shards())
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    planned = plan.compiled.program.collective_counts_by_axis()["backward"]
    return {"error": max(errors), "counts": counts, "planned": planned}
