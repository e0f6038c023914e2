"""The torch side of tests/test_dcp.py: examples.hf_models.HFLlama(layers=2) trained with FSDP2 over `dp`
and DTensor tensor parallelism over `tp` on a 2 × 2 DeviceMesh, as torchtitan lays a run out, saved and
loaded with torch.distributed.checkpoint as torchtitan does: the model's state dict at the top level under
its plain names, the optimizer's under `optimizer`, flattened (`StateDictOptions(flatten_optimizer_state_dict
=True)`).

Each function runs on every rank of an initialised 4-rank process group (the tests' worker pool); each
batch is the whole batch, every rank alike, and each dp rank trains on its half of the rows. The loss
returned is the whole batch's mean, the one a pardsl plan of the same model returns.
"""

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import examples.hf_models

BATCH, SEQ, VOCAB, LR = 8, 16, 256, 1e-2
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def batches(count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator) for _ in range(count)]


def _parallel_model(seed: int = 0):
    """HFLlama(layers=2) with its attention and MLP linears split over tp (Megatron's column then row
    split), then each layer and the whole model sharded over dp by FSDP2; and its AdamW."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(seed)
    model = examples.hf_models.HFLlama(layers=2)
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.model.layers:
        parallelize_module(layer, mesh["tp"], plan)
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    return mesh, model, optimizer


def _train(mesh, model, optimizer, inputs: list[torch.Tensor]) -> list[float]:
    rows = BATCH // mesh["dp"].size()
    start = mesh["dp"].get_local_rank() * rows
    losses = []
    for batch in inputs:
        mine = batch[start:start + rows]
        loss = model(input_ids=mine, labels=mine)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        whole = loss.detach().clone()
        dist.all_reduce(whole)  # each dp rank's mean over as many tokens: their mean is the batch's
        losses.append(whole.item() / dist.get_world_size())
    return losses


def _state(model, optimizer) -> dict:
    state = get_model_state_dict(model)
    state["optimizer"] = get_optimizer_state_dict(model, optimizer, options=_OPTIONS)
    return state


def train_save_continue(folder: str, before: int, after: int, seed: int = 1) -> dict:
    """Train `before` steps, save to `folder`, train `after` more: the losses of both parts."""
    mesh, model, optimizer = _parallel_model()
    inputs = batches(before + after, seed)
    first = _train(mesh, model, optimizer, inputs[:before])
    dcp.save(_state(model, optimizer), checkpoint_id=folder)
    return {"before": first, "after": _train(mesh, model, optimizer, inputs[before:])}


def load_continue(folder: str, skip: int, steps: int, seed: int = 1) -> list[float]:
    """Load `folder` into a fresh run (another seed's initial values, written over), then train on the
    batches after the first `skip`: the losses."""
    mesh, model, optimizer = _parallel_model(seed=1234)
    state = _state(model, optimizer)  # the optimizer's state made (zero steps) so that it has slots to fill
    dcp.load(state, checkpoint_id=folder)
    optimizer_state = state.pop("optimizer")
    set_model_state_dict(model, state)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=_OPTIONS)
    return _train(mesh, model, optimizer, batches(skip + steps, seed)[skip:])
