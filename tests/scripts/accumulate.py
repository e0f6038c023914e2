"""Run under torchrun by tests/test_training.py: gradients accumulated over two micro-batches (two
backwards before one step), through pardsl's public API. Every rank compares its gradient shards with
its shards of the serial model's accumulated gradients, and its collectives per backward with the plan's;
rank 0 writes the largest difference and the counts as JSON.

    accumulate.py PLAN.par OUT.json
"""

import json
import sys

import torch
import torch.distributed as dist

import pardsl
from tests.scripts import shut_down
from examples.hf_models import llama_causal_lm


def main() -> None:
    plan_path, out_path = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
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
    if dist.get_rank() == 0:
        planned = plan.compiled.program.collective_counts_by_axis()["backward"]
        with open(out_path, "w") as handle:
            json.dump({"error": max(errors), "counts": counts, "planned": planned}, handle)
    shut_down()


if __name__ == "__main__":
    main()
