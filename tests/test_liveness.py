"""The liveness pass (pardsl/passes/liveness.py): the generated forward releases each value after its last use, so
its peak memory is eager PyTorch's, not every activation of the step at once."""

import functools
import os

from pardsl.compiler import compile_file
from pardsl.program.ir import LoweredProgram

from .conftest import REPO

DATA_PARALLEL_LLAMA = """\
mesh   dp = 2
model  examples.hf_models:llama_causal_lm(layers=2)
input  input_ids : int64[4, 64] in [0, 256)
input  labels    : int64[4, 64] in [0, 256)

layout {
    input_ids : S(0)
    labels    : S(0)
    *.weight  : B
}
"""


def _read_after_release(program: LoweredProgram) -> list[str]:
    released, wrong = set(), []
    for statement in program.statements:
        wrong += [name for name in statement.instruction.reads() if name in released]
        if statement.instruction.kind == "release":
            released.update(statement.instruction.reads())
    return wrong


def test_every_tensor_value_is_released_once_after_its_last_use_and_no_output_is():
    compiled = compile_file(os.path.join(REPO, "examples/llama_zero3.par"))
    program = compiled.program
    assert not _read_after_release(program)
    released = [name for s in program.statements if s.instruction.kind == "release" for name in s.instruction.reads()]
    assert len(released) == len(set(released))
    made = {name for s in program.statements if s.layouts for name in s.targets}
    outputs = {output.var for output in program.outputs}
    assert set(released) == made - outputs  # every tensor the forward makes but returns
    assert {"batch", "seq"}.isdisjoint(released)  # sizes: the shape arguments' text reads them
    lines = compiled.source.splitlines()
    # one line per op: a release ends the line that last reads the value; the reshard pass's keep their own
    assert any("mean = aten.mean.dim(pow_1, [-1], True); del pow_1 " in line for line in lines)
    assert sum(line.strip().startswith("del ") for line in lines) == 3  # the resharded groups'


def test_pipeline_stages_release_their_values_and_send_their_outputs():
    compiled = compile_file(os.path.join(REPO, "examples/hf_llama_pp2.par"))
    for stage in compiled.stages:
        assert not _read_after_release(stage)
        released = {name for s in stage.statements if s.instruction.kind == "release" for name in s.instruction.reads()}
        assert released and not released & {output.var for output in stage.outputs}


def _forward_peak_bytes(path: str) -> tuple[int, int]:
    """On every rank: the peak bytes of op results alive at once during the compiled forward, and during
    the serial model's forward on this rank's shard of the batch (the same ops, eager). A result counts
    while its storage lives, whoever holds it: a local, autograd, or a view."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import pardsl
    from examples.hf_models import llama_causal_lm

    class PeakOfResults(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.alive, self.peak = {}, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in torch.utils._pytree.tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    self.alive[storage.data_ptr()] = (weakref.ref(storage), storage.nbytes())
            live = sum(nbytes for ref, nbytes in self.alive.values() if ref() is not None)
            self.peak = max(self.peak, live)
            return out

    plan = pardsl.load(path)
    module = plan.module()
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    local = plan.shard_inputs(input_ids=ids, labels=ids)
    with PeakOfResults() as compiled:
        loss = module(**local)[0]
    loss.backward()
    serial = llama_causal_lm(layers=2)
    with PeakOfResults() as eager:
        loss = serial(input_ids=local["input_ids"], labels=local["labels"]).loss
    loss.backward()
    return compiled.peak, eager.peak


def test_the_compiled_forward_peaks_no_higher_than_eager(pools, tmp_path):
    path = tmp_path / "dp.par"
    path.write_text(DATA_PARALLEL_LLAMA)
    peaks = pools(2).run_on_every_rank(functools.partial(_forward_peak_bytes, str(path)))
    # measured: 1.98 MB against eager's 1.85 (without the pass, 2.82 MB: 1.52 times); what remains is the
    # exported graph's, not liveness: its attention masks made whole (one per layer) where eager sdpa
    # takes `is_causal`, and the loss's partial sums
    for compiled, eager in peaks:
        assert compiled <= eager * 1.1, (compiled, eager)
