"""Train a pipelined plan through the public API on its model's own loss, AdamW and clipping, beside the
serial model in the same process; each rank records what it saw (losses, grad norms, its gradients'
largest difference from serial's in the first step, its counts).

`train` runs on every rank of an initialised process group (the tests' worker pool); run as a script under
torchrun, each rank writes its record to OUT.rank-N.json:

    torchrun --nproc-per-node N tests/scripts/pipeline_train.py PLAN.par OUT FACTORY [--layers 2] [--steps 3]
"""

import argparse
import json

import torch
import torch.distributed as dist

import examples.hf_models
import pardsl
from tests.scripts import shut_down


def train(plan_path: str, factory: str, layers: int = 2, steps: int = 3) -> dict:
    """`factory`: the model's factory in examples.hf_models, called with the plan's layers."""
    torch.manual_seed(0)
    plan = pardsl.load(plan_path)
    model = plan.module()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    serial = getattr(examples.hf_models, factory)(layers=layers)
    serial_optimizer = torch.optim.AdamW(serial.parameters(), lr=1e-2)
    serial_parameters = dict(serial.named_parameters(remove_duplicate=False))

    generator = torch.Generator().manual_seed(1)
    record = {"rank": dist.get_rank(), "losses": [], "serial_losses": [], "norms": [], "serial_norms": [],
              "is_last_stage": model.is_last_stage, "is_first_stage": model.is_first_stage,
              "serial_parameter_count": len(list(serial.parameters()))}  # tied weights once
    shape = next(tuple(decl.shape) for decl in plan.compiled.par.inputs if decl.name == "input_ids")  # whole batch
    for step in range(steps):
        batch = torch.randint(0, 256, shape, generator=generator)
        model.rt.counter.reset()
        loss = model.step(**plan.shard_inputs(input_ids=batch, labels=batch))
        record["counts"] = model.rt.counter.summary()
        serial_loss = serial(input_ids=batch, labels=batch)
        serial_loss.backward()
        if step == 0:
            record["grad_error"] = max(
                (parameter.grad - model.rt.shard(serial_parameters[name].grad, layout)).abs().max().item()
                for name, parameter, layout in model.named_shards())
            record["parameters"] = sorted({name for name, _, _ in model.named_shards()})
        record["norms"].append(pardsl.clip_grad_norm_(model, 1.0).item())
        record["serial_norms"].append(torch.nn.utils.clip_grad_norm_(serial.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
        serial_optimizer.step()
        serial_optimizer.zero_grad()
        record["serial_losses"].append(serial_loss.item())
        if loss is not None:
            record["losses"].append(loss.item())
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("plan")
    parser.add_argument("out")
    parser.add_argument("factory", help="the model's factory in examples.hf_models, called with the plan's layers")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    record = train(args.plan, args.factory, args.layers, args.steps)
    with open(f"{args.out}.rank-{dist.get_rank()}.json", "w") as handle:
        json.dump(record, handle)
    shut_down()


if __name__ == "__main__":
    main()
