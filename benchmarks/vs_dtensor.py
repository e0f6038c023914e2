"""pardsl vs PyTorch DTensor vs serial, one model under one plan, in the same run.

The LLaMA-style model of examples/language_models.py, and Hugging Face's own LlamaForCausalLM
(examples/hf_models.py), under Megatron tensor parallelism of every layer (q/k/v, gate, up column
parallel; o, down row parallel; embeddings, norms and head replicated) three ways:

- pardsl: the module compiled from the equivalent .par file;
- DTensor: `parallelize_module` with ColwiseParallel / RowwiseParallel (the plan torchtitan uses), the
  attention's head counts set to the local ones as torchtitan does;
- serial: the plain model on one thread.

Two gloo ranks, one thread each. Per configuration: forward + backward step time (median of `--steps`
after warm-up), pardsl / DTensor, and collectives per step (pardsl's runtime counter; DTensor's
CommDebugMode). Both parallel results are checked against serial before timing.

Also: compile time (everything after torch.export) of a 32-layer LLaMA-style model.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.timing import median_step_ms  # noqa: E402

# Per model family: the factory in examples/, where its layers are, and the prefix of their names.
FAMILIES = {
    "llama": ("examples.language_models:Llama", "layers", ""),
    "hf-llama": ("examples.hf_models:HFLlama", "model.model.layers", "model.model."),  # transformers' own class
}
CONFIGS = {
    # name: (family, model kwargs, batch, sequence)
    "small (overhead-bound)": ("llama", dict(vocab_size=128, n_layer=2, n_head=4, n_kv_head=4, d_model=64, d_ff=128), 2, 16),
    "large (compute-bound)": ("llama", dict(vocab_size=512, n_layer=2, n_head=8, n_kv_head=8, d_model=512, d_ff=1536), 4, 128),
    "HF LlamaForCausalLM, small": ("hf-llama", dict(vocab=128, layers=2, heads=4, kv_heads=4, hidden=64, ffn=128), 2, 16),
    "HF LlamaForCausalLM, large": ("hf-llama", dict(vocab=512, layers=2, heads=8, kv_heads=8, hidden=512, ffn=1536), 4, 128),
}

PLAN = """mesh tp = 2
model {factory}({kwargs})
input input_ids : int64[{batch}, {seq}] in [0, {vocab})
layout {{
    {prefix}layers.*.self_attn.q_proj.weight : S(0)
    {prefix}layers.*.self_attn.k_proj.weight : S(0)
    {prefix}layers.*.self_attn.v_proj.weight : S(0)
    {prefix}layers.*.self_attn.o_proj.weight : S(1)
    {prefix}layers.*.mlp.gate_proj.weight    : S(0)
    {prefix}layers.*.mlp.up_proj.weight      : S(0)
    {prefix}layers.*.mlp.down_proj.weight    : S(1)
    output                                   : B
}}
"""


def _vocab(kwargs: dict) -> int:
    return kwargs.get("vocab_size", kwargs.get("vocab"))


def _layers(kwargs: dict) -> int:
    return kwargs.get("n_layer", kwargs.get("layers"))


def rank_main(job: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import importlib

    from pardsl.layouts.algebra import Mesh
    from pardsl.runtime.core import Runtime

    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    kwargs, batch, seq = job["kwargs"], job["batch"], job["seq"]
    factory, layers_path, _ = FAMILIES[job["family"]]
    module_name, class_name = factory.split(":")
    torch.manual_seed(0)
    serial = getattr(importlib.import_module(module_name), class_name)(**kwargs)
    ids = torch.randint(0, _vocab(kwargs), (batch, seq), generator=torch.Generator().manual_seed(1))
    grad = torch.randn(batch, seq, _vocab(kwargs), generator=torch.Generator().manual_seed(2))

    # pardsl
    module = types.ModuleType("pardsl_module")
    exec(compile(job["source"], "pardsl_module", "exec"), module.__dict__)
    rt = Runtime(Mesh(("tp",), (2,)))
    compiled = module.CompiledModule(rt)
    compiled.load_full_state_dict(dict(serial.named_parameters()) | dict(serial.named_buffers()))

    # DTensor
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    dtensor = copy.deepcopy(serial)
    for layer in dtensor.get_submodule(layers_path):
        parallelize_module(layer, mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
        })
        if job["family"] == "llama":  # ours keeps head counts; HF's attention infers them from the shapes
            layer.self_attn.n_head //= 2
            layer.self_attn.n_kv_head //= 2

    expected = serial(ids)
    errors = {
        "pardsl": (compiled(ids)[0] - expected).abs().max().item(),
        "dtensor": (dtensor(ids) - expected).abs().max().item(),
    }

    rt.counter.reset()
    compiled(ids)[0].backward(grad)
    pardsl_counts = rt.counter.summary()["collectives"]
    with CommDebugMode() as comm:
        dtensor(ids).backward(grad)
    dtensor_counts = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}

    def pardsl_step():
        compiled(ids)[0].backward(grad)

    def dtensor_step():
        dtensor(ids).backward(grad)

    def serial_step():
        serial(ids).backward(grad)

    result = {
        "pardsl_ms": median_step_ms(pardsl_step, job["steps"]),
        "dtensor_ms": median_step_ms(dtensor_step, job["steps"]),
        "serial_ms": median_step_ms(serial_step, job["steps"]),
        "pardsl_counts": pardsl_counts,
        "dtensor_counts": dtensor_counts,
        "errors": errors,
    }
    dist.destroy_process_group()
    return result


THIRTY_TWO_LAYERS = {
    "llama": "vocab_size=256, n_layer=32, n_head=8, n_kv_head=4, d_model=64, d_ff=128",
    "hf-llama": "vocab=256, layers=32, heads=8, kv_heads=4, hidden=64, ffn=128",
}


def compile_time_32_layers(family: str) -> tuple[float, float]:
    from pardsl.compiler import compile_text

    factory, _, prefix = FAMILIES[family]
    text = PLAN.format(factory=factory, prefix=prefix, batch=2, seq=16, vocab=256, kwargs=THIRTY_TWO_LAYERS[family])
    runs = [compile_text(text, os.path.join(os.getcwd(), "examples", "llama32.par")) for _ in range(3)]
    return statistics.median(r.seconds_after_export for r in runs), statistics.median(r.seconds["export"] for r in runs)


def main() -> None:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from pardsl.compiler import compile_text

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for name, (family, kwargs, batch, seq) in CONFIGS.items():
        factory, _, prefix = FAMILIES[family]
        text = PLAN.format(factory=factory, prefix=prefix, kwargs=", ".join(f"{k}={v}" for k, v in kwargs.items()),
                           batch=batch, seq=seq, vocab=_vocab(kwargs))
        compiled = compile_text(text, os.path.join(os.getcwd(), "examples", "bench.par"))
        job = {"family": family, "kwargs": kwargs, "batch": batch, "seq": seq, "source": compiled.source,
               "steps": args.steps}
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="vs-dtensor",
                              rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                              monitor_interval=0.1, start_method="spawn")
        result = elastic_launch(config, rank_main)(job)[0]
        layers = _layers(kwargs)
        pardsl_ar = sum(result["pardsl_counts"][p]["all_reduce"] for p in ("forward", "backward"))
        dtensor_ar = result["dtensor_counts"].get("all_reduce", 0)
        assert max(result["errors"].values()) < 1e-3, result["errors"]
        rows.append(
            f"| {name} | {result['pardsl_ms']:.2f} ms | {result['dtensor_ms']:.2f} ms | {result['serial_ms']:.2f} ms | "
            f"{result['pardsl_ms'] / result['dtensor_ms']:.2f} | {pardsl_ar / layers:g} | {dtensor_ar / layers:g} |")

    print("| configuration | pardsl | DTensor | serial | pardsl / DTensor | all-reduces per layer per step, pardsl | DTensor |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    for family, what in (("llama", "LLaMA-style model"), ("hf-llama", "HF LlamaForCausalLM")):
        after, export = compile_time_32_layers(family)
        print(f"Compile time of a 32-layer {what} after torch.export: {after:.2f} s (export itself {export:.1f} s)")


if __name__ == "__main__":
    main()
