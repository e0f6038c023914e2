"""pardsl: a declarative model-parallel compiler for PyTorch.

The public API, for training from one's own script under torchrun (see the README):

    plan = pardsl.load("plan.par")
    model = plan.module(checkpoint=None)
    out = model(**plan.shard_inputs(input_ids=batch, labels=batch))
    pardsl.clip_grad_norm_(model, 1.0)
    pardsl.save(model, "ckpt/", optimizer=opt)
    pardsl.load_optimizer_state(opt, model, "ckpt/")
    pardsl.export_checkpoint("ckpt/", "model.safetensors")
"""

__version__ = "0.1.0"

from .api import ParallelModule, Plan, clip_grad_norm_, load  # noqa: E402
from .checkpoint import export_checkpoint, load_optimizer_state, save  # noqa: E402
from .diagnostics import CompileError  # noqa: E402

__all__ = ["CompileError", "ParallelModule", "Plan", "clip_grad_norm_", "export_checkpoint", "load",
           "load_optimizer_state", "save", "__version__"]
