"""pardsl: a declarative model-parallel compiler for PyTorch.

The public API, for training from one's own script under torchrun (see the README):

    plan = pardsl.load("plan.par")
    model = plan.module(checkpoint=None)
    out = model(**plan.shard_inputs(input_ids=batch, labels=batch))
    pardsl.clip_grad_norm_(model, 1.0)
    pardsl.save(model, "ckpt/step-100", optimizer=opt, metadata={"step": 100})
    pardsl.load_optimizer_state(opt, model, pardsl.latest_checkpoint("ckpt/"))
    pardsl.export_checkpoint("ckpt/", "model.safetensors")
"""

import importlib

__version__ = "0.1.0"

# Exports load on first use: a rank imports pardsl.runtime alone, and the CLI parses its
# arguments before it needs the compiler.
_EXPORTS = {
    "ParallelModule": "api", "PipelineModule": "api", "Plan": "api", "clip_grad_norm_": "api", "load": "api",
    "export_checkpoint": "runtime.checkpoint", "load_optimizer_state": "runtime.checkpoint",
    "save": "runtime.checkpoint", "latest_checkpoint": "runtime.checkpoint",
    "checkpoint_metadata": "runtime.checkpoint", "CheckpointError": "runtime.checkpoint",
    "CompileError": "language.diagnostics", "dtensor_state_dict": "runtime.dtensor_state",
}

__all__ = [*sorted(_EXPORTS), "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'pardsl' has no attribute {name!r}")


def __dir__():
    return __all__
