"""pardsl against PyTorch's own tools, one model, one run.

Hugging Face's LlamaForCausalLM (examples/hf_models.py), 4 layers, trained on its own loss, five plans:

| plan | pardsl (.par file, through `pardsl.load`) | PyTorch |
|---|---|---|
| data parallel | batch `S(0)`, weights left to inference (B) | `DistributedDataParallel` (25 MiB buckets) |
| data parallel, loss per rank | the same, and `output.loss : P`: each rank's share of the mean | the same |
| ZeRO-3 | batch `S(0)`, every weight `S(0)` | FSDP2: `fully_shard` per layer, then the root |
| Megatron TP | q/k/v, gate, up `S(0)`; o, down `S(1)` | DTensor `parallelize_module`, Colwise/Rowwise |
| Megatron TP, LLaMA's MLP width | the same, the MLP 1376 wide (LLaMA's 11008 / 4096 of hidden) instead of the model's default 128 | the same |
| searched | `mesh tp = 2` and `memory <= 60 %`, no layout: the search's plan | DTensor, Megatron's plan |

Two gloo ranks, one thread each (serial: one thread). With `--device cuda` every rank's model and
tensors are CUDA ones on GPU `local rank % GPUs`, over NCCL where each rank has a GPU of its own and
over gloo where ranks share one (NCCL refuses two ranks on one GPU). Per plan, both parallel versions
are checked against the serial model first (loss and every gradient), then each is timed: forward,
backward and the gradients made ready (median of `--steps` after warm-up). pardsl's collectives per step come from its
runtime counter, PyTorch's from `CommDebugMode` where it sees them (DTensor's; DDP and FSDP2 call
collectives outside it).

    python benchmarks/vs_torch.py [--steps 10] [--plans dp,dp_partial,zero3,tp,tp_wide,searched] [--profile] [--bucket-mb 25]
                                  [--device cpu|cuda] [--backend gloo|nccl] [--own-collectives] [--alone]

`--profile` adds, per plan, where each step spends its time (torch.profiler, top ops by self time). On
this 2-core VM the profiler itself slows every op (a serial step of 69 ms took 200–380 ms profiled, a
[4, 64, 512] mul 1.6 ms against 33 µs): read its tables for the ops' shares, not their times.
`--own-collectives` also times pardsl's module with gloo's own reduce-scatter, all-gather and all-reduce
instead of the runtime's: through shared memory between ranks of one host (pardsl/runtime/shared_memory.py),
else built on gloo's all-to-all (pardsl/runtime/core.py, `collectives_by_all_to_all`).
`--alone` also times pardsl's module with no one to wait for: each shared-memory collective copies this
rank's input into a buffer and computes its result as the transport does, but with zeros for the peers'
inputs, sending and waiting on nothing. The loss is wrong; the time is the step's own work, what it would
take if communication and the ranks' skew cost nothing: the floor under the parallel version's time.
The versions' steps are taken in turn (benchmarks/timing.py), so that the machine's slow spells fall on
all of them alike.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import weakref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.timing import interleaved_median_ms  # noqa: E402
from pardsl.runtime.shared_memory import SharedMemoryGroup, _Work  # noqa: E402

# name: (model kwargs, batch, sequence, what pardsl is compared with)
PLANS = {
    "dp": (dict(layers=4, hidden=256), 8, 64, "DDP"),
    "dp_partial": (dict(layers=4, hidden=256), 8, 64, "DDP"),
    "zero3": (dict(layers=4, hidden=256), 8, 64, "FSDP2"),
    "tp": (dict(layers=4, hidden=512), 4, 64, "DTensor"),
    # the same plan with LLaMA's MLP width (11008 / 4096 of hidden; the model's default is a quarter of it)
    "tp_wide": (dict(layers=4, hidden=512, ffn=1376), 4, 64, "DTensor"),
    "searched": (dict(layers=4, hidden=512), 4, 64, "DTensor"),
}
TITLES = {"dp": "data parallel", "dp_partial": "data parallel, loss per rank (`output.loss : P`)", "zero3": "ZeRO-3",
          "tp": "Megatron TP", "tp_wide": "Megatron TP, LLaMA's MLP width", "searched": "searched, memory <= 60 %"}
MEGATRON = ("tp", "tp_wide")
TENSOR_PARALLEL = MEGATRON + ("searched",)  # PyTorch's side of both is Megatron's plan in DTensor
DATA_PARALLEL = ("dp", "dp_partial", "zero3")  # the batch split

LAYER_WEIGHTS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def par_text(plan: str, kwargs: dict, batch: int, seq: int, ranks: int = 2) -> str:
    lines = [f"mesh {'tp' if plan in TENSOR_PARALLEL else 'dp'} = {ranks}",
             f"model examples.hf_models:llama_causal_lm({', '.join(f'{k}={v}' for k, v in kwargs.items())})",
             f"input input_ids : int64[{batch}, {seq}] in [0, {kwargs.get('vocab', 256)})",
             f"input labels : int64[{batch}, {seq}] in [0, {kwargs.get('vocab', 256)})"]
    if plan == "searched":  # the mesh, the model and a memory bound: the layouts are the search's
        return "\n".join(lines + ["memory <= 60 %", ""])
    lines.append("layout {")
    if plan in DATA_PARALLEL:
        lines += ["    input_ids : S(0)", "    labels : S(0)"]
    if plan == "dp_partial":  # each rank's share of the mean, as DDP's ranks each have their own loss
        lines.append("    output.loss : P")
    if plan == "zero3":
        lines += [f"    model.layers.*.{w}.weight : S(0)" for w in LAYER_WEIGHTS]
        lines += ["    model.layers.*.input_layernorm.weight : S(0)",
                  "    model.layers.*.post_attention_layernorm.weight : S(0)",
                  "    model.embed_tokens.weight : S(0)", "    model.norm.weight : S(0)", "    lm_head.weight : S(0)"]
    if plan in MEGATRON:
        lines += [f"    model.layers.*.{w}.weight : {'S(1)' if w in ('self_attn.o_proj', 'mlp.down_proj') else 'S(0)'}"
                  for w in LAYER_WEIGHTS]
    return "\n".join(lines + ["}", ""])


def _full(grad: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient (FSDP2's, DTensor's) made whole with plain c10d collectives: torch 2.11's
    `full_tensor()` (functional collectives) crashes on gloo with CUDA tensors."""
    if not hasattr(grad, "placements"):
        return grad
    (placement,), local = grad.placements, grad.to_local()
    if placement.is_replicate():
        return local
    if placement.is_partial():
        whole = local.clone()
        dist.all_reduce(whole)
        return whole
    moved = local.movedim(placement.dim, 0).contiguous()
    out = moved.new_empty((dist.get_world_size() * moved.shape[0], *moved.shape[1:]))
    dist.all_gather_into_tensor(out, moved)
    return out.movedim(0, placement.dim)


def rank_main(job: dict) -> dict:
    import copy
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    import pardsl
    from examples.hf_models import llama_causal_lm
    from pardsl.runtime.devices import rank_device

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(job["backend"], timeout=datetime.timedelta(seconds=300))
    plan_name, kwargs, batch, seq = job["plan"], job["kwargs"], job["batch"], job["seq"]
    tensor_parallel = plan_name in TENSOR_PARALLEL
    os.chdir(ROOT)
    device = rank_device(job["device"])

    torch.manual_seed(0)
    serial = llama_causal_lm(**kwargs).to(device)
    ids = torch.randint(0, kwargs.get("vocab", 256), (batch, seq),
                        generator=torch.Generator().manual_seed(1)).to(device)
    expected_loss = serial(input_ids=ids, labels=ids).loss
    expected_loss.backward()
    expected_grads = {name: p.grad.clone() for name, p in serial.named_parameters()}
    serial.zero_grad(set_to_none=True)
    rank = dist.get_rank()

    # pardsl, through the public API
    plan = pardsl.load(job["par_path"], bucket_mb=job["bucket_mb"])
    torch.manual_seed(0)
    model = plan.module(device=device)
    local = plan.shard_inputs(input_ids=ids, labels=ids, device=device)
    rt = model.rt
    loss = model(**local).loss
    loss.backward()
    whole = loss.detach().clone()
    if plan_name == "dp_partial":  # the ranks' shares add up to the mean
        dist.all_reduce(whole)
    errors = {"pardsl": abs(whole.item() - expected_loss.item())}
    for name, parameter, layout in model.named_shards():
        want = rt.shard(expected_grads[name], layout)
        errors["pardsl"] = max(errors["pardsl"], (parameter.grad - want).abs().max().item())
    model.zero_grad(set_to_none=True)
    rt.counter.reset()
    model(**local).loss.backward()
    pardsl_counts = rt.counter.summary()["collectives"]
    model.zero_grad(set_to_none=True)

    # PyTorch's tool
    mesh = init_device_mesh(device.type, (dist.get_world_size(),),
                            mesh_dim_names=("tp" if tensor_parallel else "dp",))
    torch_model = copy.deepcopy(serial)
    world = dist.get_world_size()
    half = slice(rank * batch // world, (rank + 1) * batch // world)
    torch_ids = ids if tensor_parallel else ids[half]
    if plan_name in ("dp", "dp_partial"):
        from torch.nn.parallel import DistributedDataParallel

        torch_model = DistributedDataParallel(torch_model, device_ids=[device] if device.type == "cuda" else None)
    elif plan_name == "zero3":
        from torch.distributed.fsdp import fully_shard

        for layer in torch_model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(torch_model, mesh=mesh)
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for layer in torch_model.model.layers:
            parallelize_module(layer, mesh, {w: (RowwiseParallel() if w in ("self_attn.o_proj", "mlp.down_proj")
                                                 else ColwiseParallel()) for w in LAYER_WEIGHTS})

    def torch_loss():
        out = torch_model(input_ids=torch_ids, labels=torch_ids).loss
        # DDP and FSDP see half the batch: HF's mean over the local tokens; every rank has the same count
        return out

    loss = torch_loss()
    loss.backward()
    global_loss = loss.detach().clone()
    if not tensor_parallel:
        dist.all_reduce(global_loss)
        global_loss /= world
    errors["torch"] = abs(global_loss.item() - expected_loss.item())
    named = dict(torch_model.module.named_parameters() if plan_name in ("dp", "dp_partial")
                 else torch_model.named_parameters())
    for name, want in expected_grads.items():
        got = _full(named[name].grad)
        errors["torch"] = max(errors["torch"], (got - want).abs().max().item())
    torch_model.zero_grad(set_to_none=True)
    with CommDebugMode() as comm:
        torch_loss().backward()
    torch_counts = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
    torch_model.zero_grad(set_to_none=True)

    def pardsl_step():
        model(**local).loss.backward()
        model.zero_grad(set_to_none=True)

    def torch_step():
        torch_loss().backward()
        torch_model.zero_grad(set_to_none=True)

    def serial_step():
        serial(input_ids=ids, labels=ids).loss.backward()
        serial.zero_grad(set_to_none=True)

    steps = {"pardsl": pardsl_step, "torch": torch_step}
    if tensor_parallel:
        steps["serial"] = serial_step
    if job["own_collectives"] and (rt.by_all_to_all or rt.shared):
        def pardsl_own_step():  # the same module with gloo's own collectives
            by_all_to_all, shared = rt.by_all_to_all, rt.shared
            rt.by_all_to_all, rt.shared = False, {}
            try:
                pardsl_step()
            finally:
                rt.by_all_to_all, rt.shared = by_all_to_all, shared

        steps["pardsl_own"] = pardsl_own_step
    if job["alone"] and rt.shared:
        alone = {axis: _Alone(group) for axis, group in rt.shared.items()}

        def pardsl_alone_step():  # the same module, its collectives' peers taken to be absent
            shared = rt.shared
            rt.shared = alone
            try:
                pardsl_step()
            finally:
                rt.shared = shared

        steps["pardsl_alone"] = pardsl_alone_step
    medians = interleaved_median_ms(steps, job["steps"], device=device)
    result = {
        "pardsl_ms": medians["pardsl"],
        "torch_ms": medians["torch"],
        "serial_ms": medians.get("serial"),
        "pardsl_own_ms": medians.get("pardsl_own"),
        "pardsl_alone_ms": medians.get("pardsl_alone"),
        "pardsl_counts": pardsl_counts,
        "torch_counts": torch_counts,
        "errors": errors,
        "profile": None,
        "peak_mib": {"pardsl": _peak_mib(pardsl_step, device), "torch": _peak_mib(torch_step, device)}
        if device.type == "cuda" else None,
    }
    if job["profile"]:  # every rank profiles (collectives need both); rank 0's tables are returned
        tables = {"pardsl": _profile(pardsl_step, device), "PyTorch": _profile(torch_step, device)}
        result["profile"] = tables if rank == 0 else None
    dist.destroy_process_group()
    return result


class _Alone(SharedMemoryGroup):
    """A rank's shared-memory transport with its peers taken away (`--alone`): a collective copies this
    rank's input into a buffer of its own and computes its result from it and from zeros in the peers'
    places, as the transport computes it from theirs; nothing is sent or waited on."""

    def __init__(self, real: SharedMemoryGroup):  # no socket: there is no one to talk to
        self.rank, self.size, self.peers = real.rank, real.size, real.peers
        self._memory: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._lent: dict[int, weakref.ref] = {}  # address → a tensor lent and not yet sent (several at once)

    def lend(self, shape, dtype: torch.dtype) -> torch.Tensor:
        lent = torch.empty(shape, dtype=dtype)
        self._lent[lent.data_ptr()] = weakref.ref(lent)
        return lent

    def _lent_buffer(self, x: torch.Tensor) -> torch.Tensor | None:
        held = self._lent.get(x.data_ptr())
        lent = held() if held is not None else None
        return lent if lent is not None and lent.numel() == x.numel() else None

    def _started_work(self, x: torch.Tensor, result, collective: str):
        x = x.contiguous().view(-1)
        if (x.numel(), x.dtype) not in self._memory:
            self._memory[(x.numel(), x.dtype)] = torch.empty_like(x), torch.zeros_like(x)
        mine, zeros = self._memory[(x.numel(), x.dtype)]
        if self._lent_buffer(x) is not None:  # written into a lent buffer: no copy
            mine = x
            del self._lent[x.data_ptr()]
        else:
            mine.copy_(x)
        work = _Work(lambda: result([mine if r == self.rank else zeros for r in range(self.size)]))
        return work, work.result


def _peak_mib(step, device: torch.device) -> float:
    """The most CUDA memory one step holds at once, on top of what is allocated before it (the model, its
    inputs): activations kept for backward, parameters gathered, gradients."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def _profile(step, device: torch.device) -> str:
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])) as prof:
        for _ in range(3):
            step()
        if on_gpu:
            torch.cuda.synchronize(device)
    return prof.key_averages().table(sort_by="self_cuda_time_total" if on_gpu else "self_cpu_time_total",
                                     row_limit=12)


def _counts(counts: dict) -> str:
    parts = []
    for phase in ("forward", "backward"):
        inner = ", ".join(f"{n} {k.replace('_', '-')}" for k, n in counts[phase].items() if n)
        parts.append(f"{phase}: {inner or 'none'}")
    return "; ".join(parts)


def main() -> None:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--plans", default="dp,dp_partial,zero3,tp,tp_wide,searched")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="pardsl's gradient bucket size (DDP's: 25)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                        help="default: nccl with a GPU for each rank, else gloo")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--own-collectives", action="store_true",
                        help="also time pardsl with gloo's own collectives (the runtime builds its reduce-scatter, "
                             "and small all-gathers and all-reduces, on gloo's all-to-all)")
    parser.add_argument("--alone", action="store_true",
                        help="also time pardsl with no one to wait for: its collectives' copies and sums done with "
                             "zeros for the peers' inputs (a wrong loss; the step's own work, the floor of its time)")
    args = parser.parse_args()
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" and torch.cuda.device_count() >= args.nproc else "gloo"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows, notes = [], []
    with tempfile.TemporaryDirectory() as folder:
        for plan_name in args.plans.split(","):
            kwargs, batch, seq, tool = PLANS[plan_name]
            par_path = os.path.join(folder, f"{plan_name}.par")
            with open(par_path, "w") as handle:
                handle.write(par_text(plan_name, kwargs, batch, seq, args.nproc))
            job = {"plan": plan_name, "kwargs": kwargs, "batch": batch, "seq": seq, "steps": args.steps,
                   "par_path": par_path, "profile": args.profile, "bucket_mb": args.bucket_mb,
                   "device": args.device, "backend": args.backend, "own_collectives": args.own_collectives,
                   "alone": args.alone}
            config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=args.nproc, run_id=f"vs-torch-{plan_name}",
                                  rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                                  monitor_interval=0.1, start_method="spawn")
            result = elastic_launch(config, rank_main)(job)[0]
            assert max(result["errors"].values()) < 1e-4, result["errors"]
            serial = f"{result['serial_ms']:.1f} ms" if result["serial_ms"] else "—"
            versus_serial = f"{result['pardsl_ms'] / result['serial_ms']:.2f}" if result["serial_ms"] else "—"
            width = f", ffn {kwargs['ffn']}" if "ffn" in kwargs else ""
            rows.append(f"| {TITLES[plan_name]}, hidden {kwargs['hidden']}{width}, batch {batch} × {seq} | "
                        f"{result['pardsl_ms']:.1f} ms | {tool} {result['torch_ms']:.1f} ms | {serial} | "
                        f"**{result['pardsl_ms'] / result['torch_ms']:.2f}** | {versus_serial} |")
            notes.append(f"- {TITLES[plan_name]}: pardsl {_counts(result['pardsl_counts'])}"
                         + (f"; {tool} (CommDebugMode) {result['torch_counts']}" if result["torch_counts"] else "")
                         + (f"; pardsl with gloo's own collectives {result['pardsl_own_ms']:.1f} ms"
                            if result["pardsl_own_ms"] else "")
                         + (f"; pardsl alone (`--alone`) {result['pardsl_alone_ms']:.1f} ms"
                            + (f", {result['pardsl_alone_ms'] / result['serial_ms']:.2f} of serial"
                               if result["serial_ms"] else "")
                            if result["pardsl_alone_ms"] else "")
                         + (f"; peak memory of a step on rank 0: pardsl {result['peak_mib']['pardsl']:.1f} MiB, "
                            f"{tool} {result['peak_mib']['torch']:.1f} MiB" if result["peak_mib"] else ""))
            for who, table in (result["profile"] or {}).items():
                notes.append(f"\n{who}'s step, {TITLES[plan_name]}, rank 0, 3 steps:\n```\n{table}```")
    print(f"{args.nproc} ranks, {args.backend}, {args.device} tensors"
          + (f" ({torch.cuda.get_device_name(0)})" if args.device == "cuda" else "") + f", torch {torch.__version__}")
    print("| plan | pardsl | PyTorch | serial | pardsl / PyTorch | pardsl / serial |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("Collectives per step:")
    print("\n".join(notes))


if __name__ == "__main__":
    main()
