"""What one rank's forward keeps for backward, by torch's own saved-tensor hooks, against what the cost
model counts that rank holds (tests/test_saved_for_backward.py). `held` runs on every rank of a process
group (the tests' worker pool) and gives both per plan: bytes of distinct storages autograd saves, the
rank's parameters, buffers and inputs aside, the outputs the caller holds added. Run under torchrun,
rank 0 writes them as JSON:

    held_memory.py OUT.json PLAN.par [PLAN.par ...]
"""

import json
import sys

import torch
import torch.distributed as dist

import pardsl
from pardsl.model.loading import make_inputs
from tests.scripts import shut_down


def saved_storages(forward, own: set[int]) -> tuple[dict[int, int], object]:
    """Bytes per storage autograd saves while `forward()` runs, storages in `own` (data pointers) aside,
    and what `forward()` returned."""
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        outputs = forward()
    return saved, outputs


def saved_by_torch(module, inputs: dict) -> int:
    own = {t.untyped_storage().data_ptr()
           for t in [*module.parameters(), *module.buffers(), *inputs.values()] if isinstance(t, torch.Tensor)}
    saved, outputs = saved_storages(lambda: module(**inputs), own)
    for output in torch.utils._pytree.tree_leaves(outputs):
        if isinstance(output, torch.Tensor):
            saved.setdefault(output.untyped_storage().data_ptr(), output.untyped_storage().nbytes())
    return sum(saved.values())


def held(plans: list[str]) -> dict[str, dict[str, int]]:
    """Per plan: what torch saves on this rank, and what the cost model counts it holds."""
    results = {}
    for path in plans:
        plan = pardsl.load(path)
        module = plan.module()
        inputs = plan.shard_inputs(*make_inputs(plan.compiled.par.inputs, torch.Generator().manual_seed(0)))
        program = plan.compiled.program
        memory = program.memory()
        # a weight gathered in a group that is not released after forward, where some op keeps it for
        # backward (the first layer's weight is not kept where its input needs no gradient)
        bound = plan.compiled.bound
        kept = {bound.parameters[p] for p in bound.parameters_kept_for_backward}
        name_of = {slot.var: slot.name for slot in program.parameters}
        groups_kept = sum(m.nbytes for g in program.gathers if not g.resharded for m in g.members
                          if name_of[m.attr] in kept)
        results[path] = {"torch": saved_by_torch(module, inputs),
                         "counted": memory["activations_per_rank"] + memory["parameter_copies_per_rank"] + groups_kept}
    return results


def main() -> None:
    out_path, plans = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    results = held(plans)
    if dist.get_rank() == 0:
        with open(out_path, "w") as handle:
            json.dump(results, handle)
    shut_down()


if __name__ == "__main__":
    main()
