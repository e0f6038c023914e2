"""The cost model: what a plan costs per step on a machine, in seconds and in bytes per rank.

One module prices everything, so that `explain`, `plan.json` and a search agree:

- a collective over n ranks costs α per ring step (2(n-1) for an all-reduce, n-1 for the others) + β per
  byte, per kind, where bytes is the per-rank volume of `layouts.collective_bytes` (an all-reduce of T bytes moves
  2T(n-1)/n) — the figure each `Collective` already carries;
- an op costs a roofline, max(FLOP / throughput, bytes / bandwidth), plus a fixed overhead per op (eager
  dispatch); FLOP come from `torch.utils.flop_counter` run on meta tensors of the op's global shapes, and
  each rank does the share its layout leaves it (the product of the axis sizes its result is S or P on).
  Backward costs twice forward where a gradient flows;
- prefetched parameter gathers and gradient buckets hide behind their phase's compute as far as the
  machine overlaps the two; CPU ranks on one host share its cores, so more ranks run each slower;
- memory per rank is parameters, gradients, optimizer state, activations kept for backward, and the
  parameters gathered for use (this group's and the prefetched next one's).

The machine's α, β, throughput, bandwidth and overhead come from `pardsl calibrate`, which measures them
on the backend at hand into a file; without one, defaults for the backend stand (and say so).
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from typing import NamedTuple

import torch

from pardsl.layouts.algebra import COLLECTIVE_KINDS, collective_bytes
from pardsl.layouts.oprules import compute_share
from pardsl.runtime.devices import resolve_backend
from pardsl.runtime.schedules import stage_micro_batches_held, stages_of_rank

CALIBRATION_VERSION = 1


@dataclass(frozen=True)
class LinkCost:
    alpha_s: float  # latency of one step of the ring (a collective over n ranks takes ring_steps of them)
    beta_s_per_byte: float  # per byte of per-rank volume


def _ring_seconds(link: LinkCost, kind: str, nbytes: float, n: int) -> float:
    return link.alpha_s * ring_steps(kind, n) + link.beta_s_per_byte * nbytes


def ring_steps(kind: str, n: int) -> int:
    """Latency terms of a ring collective over n ranks: 2(n-1) for an all-reduce, n-1 for the others."""
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


@dataclass(frozen=True)
class Machine:
    backend: str
    collectives: dict[str, LinkCost]  # per collective kind
    flops_per_s: float  # a large matmul's throughput, one rank
    bytes_per_s: float  # memory bandwidth of an elementwise op, one rank
    op_overhead_s: float  # the cost of running one small op
    source: str  # where the figures come from: a calibration file, or the defaults
    world_size: int = 2  # ranks measured together
    # Processors the ranks share (CPU ranks on one host); 0 where each rank has its own (a GPU each).
    cores: int = 0
    overlap: float = 1.0  # the share of a collective that hides behind compute running beside it
    # Nodes: ranks per node (0: every rank in one), and the links between nodes per collective kind
    # (`collectives` are then the links inside a node)
    ranks_per_node: int = 0
    between_nodes: dict[str, LinkCost] | None = None
    device_memory_bytes: int = 0  # per rank; 0 where not known
    name: str = ""  # a preset's
    half_flops_per_s: float = 0.0  # a large bf16/fp16 matmul's throughput; 0: as float32's

    def span(self, n: int, stride: int = 1) -> tuple[int, int]:
        """A group of n ranks `stride` apart (one mesh axis's, Mesh.axis_stride): how many of them share
        a node, and how many nodes it spans."""
        if not self.ranks_per_node or self.between_nodes is None or n * stride <= self.ranks_per_node:
            return n, 1
        inside = max(1, min(n, self.ranks_per_node // stride))
        return inside, -(-n // inside)

    def collective_seconds(self, kind: str, nbytes: int, n: int, stride: int = 1) -> float:
        """A collective of `nbytes` per-rank volume over n ranks `stride` apart: over the links inside a
        node, or where the group spans nodes over those between them (a ring is as fast as its slowest
        link); an all-reduce whose group has several ranks in each node, hierarchically where that is
        faster (reduce-scatter inside the nodes, all-reduce of a share between them, all-gather inside)."""
        inside, nodes = self.span(n, stride)
        if kind == "send":  # one message to a neighbour, on the links a ring step crosses
            link = (self.collectives if nodes == 1 else self.between_nodes)["all_reduce"]
            return link.alpha_s + nbytes * link.beta_s_per_byte
        if nodes == 1:
            return _ring_seconds(self.collectives[kind], kind, nbytes, n)
        flat = _ring_seconds(self.between_nodes[kind], kind, nbytes, n)
        if kind != "all_reduce" or inside == 1:
            return flat
        whole = nbytes * n / (2 * (n - 1))  # the tensor all-reduced, from its per-rank volume
        share = whole / inside
        hierarchical = (
            _ring_seconds(self.collectives["reduce_scatter"], "reduce_scatter", share * (inside - 1), inside)
            + _ring_seconds(self.between_nodes["all_reduce"], "all_reduce", 2 * share * (nodes - 1) / nodes, nodes)
            + _ring_seconds(self.collectives["all_gather"], "all_gather", share * (inside - 1), inside))
        return min(flat, hierarchical)

    def local_collective_seconds(self, kind: str, local_bytes: int, n: int, stride: int = 1) -> float:
        """A collective whose input is `local_bytes` on each of n ranks, at its per-rank volume."""
        return self.collective_seconds(kind, collective_bytes(kind, local_bytes, n), n, stride)

    def steps_seconds(self, steps, n: int, stride: int = 1) -> float:
        """Of collectives given as (phase, kind, bytes per rank), over n ranks (inference.one_axis_collectives)."""
        return sum(self.collective_seconds(kind, nbytes, n, stride) for _, kind, nbytes in steps)

    def axis_link(self, mesh, axis: int) -> str:
        """Which links an axis's collectives cross, in words."""
        n, stride = mesh.axis_sizes[axis], mesh.axis_stride(axis)
        inside, nodes = self.span(n, stride)
        if nodes == 1:
            return "inside a node" if self.ranks_per_node else "one link"
        if inside == 1:
            return f"between nodes ({nodes} nodes, one rank in each)"
        return f"across {nodes} nodes, {inside} ranks in each (hierarchical all-reduce where faster)"

    def compute_seconds(self, flops: float, nbytes: float, half: bool = False) -> float:
        """One op's roofline on one rank: its arithmetic or its memory traffic, whichever takes longer;
        `half`: the op computes in bf16 or fp16 (tensor cores' rate where the machine gives one)."""
        throughput = self.half_flops_per_s if half and self.half_flops_per_s else self.flops_per_s
        return max(flops / throughput, nbytes / self.bytes_per_s)

    def slowdown(self, world_size: int) -> float:
        """How much slower one rank of `world_size` ranks runs than one of the calibration's, where ranks
        share the host's cores: each takes cores // ranks threads, and more busy threads than cores share."""
        if not self.cores:
            return 1.0

        def speed(ranks: int) -> float:
            threads = max(1, self.cores // ranks)
            return threads / max(1.0, ranks * threads / self.cores)

        return speed(self.world_size) / speed(world_size)

    def to_json(self) -> dict:
        nodes = {} if not self.ranks_per_node else {
            "ranks_per_node": self.ranks_per_node,
            "between_nodes": {k: asdict(v) for k, v in (self.between_nodes or {}).items()}}
        return {"pardsl_calibration": CALIBRATION_VERSION, "backend": self.backend, "world_size": self.world_size,
                "collectives": {k: asdict(v) for k, v in self.collectives.items()},
                "flops_per_s": self.flops_per_s, "bytes_per_s": self.bytes_per_s,
                "op_overhead_s": self.op_overhead_s, "cores": self.cores, "overlap": self.overlap, **nodes,
                **({"device_memory_bytes": self.device_memory_bytes} if self.device_memory_bytes else {}),
                **({"half_flops_per_s": self.half_flops_per_s} if self.half_flops_per_s else {})}


# Figures for machines that have not been calibrated. gloo's are the medians of 3 runs of `pardsl calibrate
# --nproc 2` on a 2-core x86 VM (CPU ranks of one host, 2026-11-26), rounded: what this runtime's
# collectives cost there (through shared memory between ranks of one host, pardsl/runtime/shared_memory.py; over
# gloo's TCP, as between hosts, they cost 3 to 6 times more: α 270 µs and β 1.2 ns/B for an all-reduce on
# the same kind of VM), a core's matmul throughput and memory bandwidth; its CPU ranks share this host's
# cores, as a calibration file records them (without, 4 ranks on 2 cores were rated as fast as 2, and the
# plans of a 4-rank mesh 2 to 5 times faster than they run). NCCL's are round figures for data-centre GPUs
# over NVLink. `pardsl calibrate` replaces either with this machine's.
DEFAULTS = {
    "gloo": Machine("gloo", {"all_reduce": LinkCost(4.7e-5, 2.9e-10), "all_gather": LinkCost(9.3e-5, 3.3e-10),
                             "reduce_scatter": LinkCost(9.7e-5, 7.7e-10), "all_to_all": LinkCost(7.8e-5, 4.7e-10)},
                    1.4e11, 2.8e10, 1.7e-6, "defaults for gloo (no calibration file; run `pardsl calibrate`)",
                    cores=os.cpu_count() or 1, overlap=0.2),
    "nccl": Machine("nccl", {k: LinkCost(1e-5, 1 / 1e11) for k in COLLECTIVE_KINDS}, 3e14, 2e12, 1e-5,
                    "defaults for nccl (no calibration file; run `pardsl calibrate --backend nccl`)"),
}


def _links(alpha_s: float, bytes_per_s: float) -> dict[str, LinkCost]:
    return {kind: LinkCost(alpha_s, 1 / bytes_per_s) for kind in COLLECTIVE_KINDS}


# Machines one rents, by name (`--machine h100-nvlink-ib`): nodes of 8 GPUs, NVLink/NVSwitch inside a node
# and one InfiniBand NIC per GPU between nodes. Round figures a planner can reason with, not a
# measurement: β is per byte of a rank's ring volume (1 / NCCL's bus bandwidth: about 360 GB/s over H100
# NVLink 4 and 230 over A100 NVLink 3; 400 Gb/s NDR and 200 Gb/s HDR InfiniBand give about 42 and 21 GB/s
# per GPU), throughput a large matmul's sustained rate (H100 SXM: 700 of 989 TFLOPS dense bf16, 50 in
# float32 without TF32; A100: 230 of 312, 19), bandwidth HBM's sustained, memory what torch reports.
GIB = 1 << 30
PRESETS = {
    "h100-nvlink-ib": Machine("nccl", _links(2e-6, 3.6e11), 5e13, 2.8e12, 8e-6,
                              "preset h100-nvlink-ib: 8 H100 SXM per node, NVLink 4 inside, 400 Gb/s InfiniBand "
                              "per GPU between", overlap=0.9, ranks_per_node=8, between_nodes=_links(6e-6, 4.2e10),
                              device_memory_bytes=int(79.2 * GIB), name="h100-nvlink-ib", half_flops_per_s=7e14),
    "a100-nvlink-ib": Machine("nccl", _links(3e-6, 2.3e11), 1.9e13, 1.6e12, 8e-6,
                              "preset a100-nvlink-ib: 8 A100 SXM 80 GB per node, NVLink 3 inside, 200 Gb/s "
                              "InfiniBand per GPU between", overlap=0.9, ranks_per_node=8,
                              between_nodes=_links(8e-6, 2.1e10), device_memory_bytes=int(79.2 * GIB),
                              name="a100-nvlink-ib", half_flops_per_s=2.3e14),
    # H800: the H100's compute and memory with NVLink cut to 400 GB/s bidirectional (about 160 GB/s of
    # bus bandwidth, as DeepSeek-V3's report measures it) and a 400 Gb/s InfiniBand NIC per GPU (about 50 GB/s)
    "h800-nvlink-ib": Machine("nccl", _links(2e-6, 1.6e11), 5e13, 2.8e12, 8e-6,
                              "preset h800-nvlink-ib: 8 H800 SXM per node, NVLink 4 cut to 400 GB/s inside, "
                              "400 Gb/s InfiniBand per GPU between", overlap=0.9, ranks_per_node=8,
                              between_nodes=_links(6e-6, 4.2e10), device_memory_bytes=int(79.2 * GIB),
                              name="h800-nvlink-ib", half_flops_per_s=7e14),
    "cpu-gloo": replace(DEFAULTS["gloo"], source="preset cpu-gloo: CPU ranks of one host over gloo (the "
                        "defaults for gloo)", name="cpu-gloo"),
}


def machine_named(spec: str | None, backend: str = "gloo") -> Machine:
    """`--machine NAME|FILE`: a preset by name, a machine file (`pardsl calibrate` writes one), or, for
    None, this machine's calibration for `backend`, else its defaults."""
    if spec in PRESETS:
        return PRESETS[spec]
    if spec is not None and not os.path.exists(spec) and os.sep not in spec and not spec.endswith(".json"):
        raise CalibrationError(f"no machine named {spec!r}: give a file, or one of {', '.join(sorted(PRESETS))}")
    return load_machine(spec, backend)


def calibration_path(backend: str) -> str:
    """Where `pardsl calibrate` writes, and compile reads, the figures for a backend."""
    folder = os.environ.get("PARDSL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "pardsl")
    return os.path.join(folder, f"calibration-{backend}.json")


class CalibrationError(ValueError):
    """A calibration file that cannot be read or is not one."""


def load_machine(path: str | None = None, backend: str = "gloo") -> Machine:
    """The machine from a calibration file: `path`, else the default place for `backend` if it exists,
    else the backend's defaults."""
    if path is None:
        path = calibration_path(backend)
        if not os.path.isfile(path):
            return DEFAULTS[backend]
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        if data.get("pardsl_calibration") != CALIBRATION_VERSION:
            raise CalibrationError(f"{path} is not a pardsl calibration file (version {CALIBRATION_VERSION})")
        collectives = {k: LinkCost(float(v["alpha_s"]), float(v["beta_s_per_byte"]))
                       for k, v in data["collectives"].items()}
        missing = set(COLLECTIVE_KINDS) - set(collectives)
        if missing:
            raise CalibrationError(f"{path} has no figures for {', '.join(sorted(missing))}")
        figures = [data["flops_per_s"], data["bytes_per_s"], data["op_overhead_s"], data.get("overlap", 1.0)]
        if not all(isinstance(f, (int, float)) and math.isfinite(f) and f >= 0 for f in figures) or \
                not data["flops_per_s"] > 0 or not data["bytes_per_s"] > 0:
            raise CalibrationError(f"{path}: throughput, bandwidth and overhead must be finite and positive")
        between = None
        if data.get("ranks_per_node"):
            between = {k: LinkCost(float(v["alpha_s"]), float(v["beta_s_per_byte"]))
                       for k, v in data["between_nodes"].items()}
            if set(COLLECTIVE_KINDS) - set(between) or int(data["ranks_per_node"]) < 1:
                raise CalibrationError(f"{path}: `ranks_per_node` needs figures `between_nodes` for every collective")
        return Machine(data["backend"], collectives, float(data["flops_per_s"]), float(data["bytes_per_s"]),
                       float(data["op_overhead_s"]), f"calibrated: {path}", int(data.get("world_size", 2)),
                       int(data.get("cores", 0)), min(1.0, float(data.get("overlap", 1.0))),
                       int(data.get("ranks_per_node", 0)), between, int(data.get("device_memory_bytes", 0)),
                       half_flops_per_s=float(data.get("half_flops_per_s", 0.0)))
    except OSError as error:
        raise CalibrationError(f"cannot read {path}: {error.strerror}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        if isinstance(error, CalibrationError):
            raise
        raise CalibrationError(f"{path} is not a pardsl calibration file ({type(error).__name__}: {error})") from None


# ---------------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------------
# A plan's estimate


@dataclass
class OpCost:
    node: str
    op: str
    layer: str
    flops: int  # per rank
    bytes: int  # per rank: operands read and result written
    forward_s: float
    backward_s: float


@dataclass
class CollectiveCost:
    kind: str
    axis: str
    phase: str
    bytes: int
    seconds: float
    layer: str
    reason: str
    overlapped: bool  # a prefetched parameter gather or a gradient bucket: off the critical path
    bucket: bool = False  # a gradient bucket's: of parameters of every layer
    # the module whose op needs it: for a partial sum reduced, the op that made it partial (a row-parallel
    # linear), not the op that reads it whole, which may be in the next layer
    module: str = ""
    hidden_s: float = 0.0  # of `seconds`, what moves beside a product in a collective matmul's chunks
    beside_step_s: float = 0.0  # of `seconds`, what moves while its op computes a step (ring attention's)


@dataclass
class Estimate:
    machine: Machine
    ops: list[OpCost]
    collectives: list[CollectiveCost]
    memory: dict[str, int]  # bytes per rank
    seconds: dict[str, float] = field(default_factory=dict)  # compute, communication, exposed, step
    tokens: int | None = None  # a step's tokens, all ranks together: the int64 input's elements; None without one
    model_flops: float = 0.0  # a step's, all ranks together: the model's forward and backward, not recomputation
    peak_flops_per_s: float = 0.0  # one device's, in the dtype the plan computes in
    pipelined: bool = False  # `step` is one micro-batch through the model: a pipeline's step is priced apart
    devices: int = 1  # the mesh's ranks

    @property
    def step_s(self) -> float:
        return self.seconds["step"]

    def tokens_per_s_per_device(self, step_s: float) -> float | None:
        return None if self.tokens is None or step_s <= 0 else self.tokens / step_s / self.devices

    def mfu(self, step_s: float) -> float:
        """Model FLOPs utilisation: the model's FLOPs per step over what the devices could do in the step."""
        return self.model_flops / (step_s * self.devices * self.peak_flops_per_s) if step_s > 0 else 0.0

    def to_json(self) -> dict:
        throughput = {}
        if not self.pipelined:  # a pipeline's step is not `step` (pipeline_search.pipelined_step_seconds)
            tokens = self.tokens_per_s_per_device(self.step_s)
            throughput = {"tokens_per_s_per_device": None if tokens is None else round(tokens, 3),
                          "mfu": round(self.mfu(self.step_s), 6)}
        return {"machine": self.machine.source, "backend": self.machine.backend,
                "seconds": {k: round(v, 9) for k, v in self.seconds.items()}, "memory": self.memory, **throughput}


def repeated_layer(path: str | None) -> str:
    """The repeated block a module path is in (`model.layers.3`), else ""."""
    segments = (path or "").split(".")
    return next((".".join(segments[:i + 1]) for i, part in enumerate(segments) if part.isdigit()), "")


def parameter_unit(path: str) -> str:
    """The repeated block a parameter (`model.layers.3.mlp.up.weight`) belongs to, else "": FSDP's unit
    its gather is grouped by."""
    return repeated_layer(path.rpartition(".")[0])


def layer_of(path: str | None) -> str:
    """The repeated block a module path is in (`model.layers.3`), else the module itself, else ""."""
    return repeated_layer(path) or path or ""


def format_bytes(count: int) -> str:
    """Bytes as a reader takes them in: `53.0 GiB`, `71.1 KiB`, `384 B`."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def slot_bytes(shape, dtype_name: str) -> int:
    """Bytes of a tensor of this shape and dtype (`torch.float32` or `float32`)."""
    return _nbytes(shape, _dtype(dtype_name))


def op_costs(typed, machine: Machine, slow: float = 1.0) -> list[OpCost]:
    """Each op's compute, in graph order, at the share of it its layouts leave a rank: the roofline of its
    FLOPs and the bytes it reads and writes, plus the machine's overhead per op; backward twice forward.
    `slow`: the machine's slowdown with this many ranks sharing it. Kept on the plan for the figures it
    was priced with: a pipeline search prices one plan's ops for each stage program it lowers, and its
    cuts `cut balanced`'s way, on the machine's figures alone (`slow` 1)."""
    figures = (machine.flops_per_s, machine.half_flops_per_s, machine.bytes_per_s, machine.op_overhead_s, slow)
    kept = typed.__dict__.get("_op_costs")
    if kept is None or kept[0] is not typed.bound:
        kept = typed.__dict__["_op_costs"] = (typed.bound, {})
    if figures not in kept[1]:
        kept[1][figures] = tuple(_op_costs(typed, machine, slow))
    return list(kept[1][figures])


def _op_costs(typed, machine: Machine, slow: float) -> list[OpCost]:
    bound, mesh = typed.bound, typed.mesh
    flops = bound.flops
    ops = []
    for name, node in typed.nodes.items():
        share = math.prod(mesh.axis_sizes[a] for a, p in enumerate(node.op_layout.placements) if p.kind != "B")
        info = typed.info(name)
        moved = _nbytes(node.op_layout.local_shape(info.shape, mesh), info.dtype) + sum(
            _nbytes(layout.local_shape(typed.info(operand).shape, mesh), typed.info(operand).dtype)
            for operand, layout in zip(node.operands, node.operand_layouts))
        local_flops = int(flops.get(name, 0) * compute_share(node.spec, node.operand_layouts, node.op_layout,
                                                                 mesh.axis_sizes)) // share
        forward = slow * (machine.compute_seconds(local_flops, moved, info.dtype.itemsize <= 2) + machine.op_overhead_s)
        backward = 2 * forward if name in typed.requires_grad else 0.0
        ops.append(OpCost(name, node.op.removeprefix("aten."), layer_of(bound.module_paths.get(name)),
                          local_flops, moved, forward, backward))
    return ops


def estimate(compiled, machine: Machine, optimizer: str = "adamw") -> Estimate:
    """The plan's step time and memory per rank on `machine`. `optimizer`: the state it keeps per
    parameter (Adam's two moments; SGD without momentum none)."""
    typed, program, mesh = compiled.typed, compiled.program, compiled.program.mesh
    bound = typed.bound
    slow = machine.slowdown(mesh.size)
    # an op of a recomputed region runs its forward again in backward (pardsl/passes/recompute.py)
    ops = [replace(o, backward_s=o.backward_s + o.forward_s) if o.node in program.recomputed_ops else o
           for o in op_costs(typed, machine, slow)]

    # (collective, its layer, whether it is off the critical path, whether a gradient bucket's)
    placed = []
    order = {name: index for index, name in enumerate(typed.nodes)}  # which op comes later, for needed_by
    made_by: dict[int, str] = {}  # a message that moves beside its op's steps: that op
    for statement in program.statements:
        for c in statement.collectives:
            # a recomputed region's: the statement of its body that runs it (none for those made again)
            runs = next((inside for inside in statement.body if c in inside.collectives), statement)
            module = bound.module_paths.get(needed_by(typed, runs, c, order), "")
            if not module and statement.body:  # a region's parameters gathered again: the region's layer's
                module = layer_of(next((bound.module_paths[inside.node] for inside in statement.body
                                        if inside.node in bound.module_paths), ""))
            if c.steps:
                made_by[id(c)] = runs.node
            placed.append((c, layer_of(module), False, False, module, c.reason))
    parameter_names = {slot.var: slot.name for slot in program.parameters}
    for group in program.gathers:
        unit = group.members[0].unit
        if not unit:  # outside the layers: the module that owns them, where one does (an embedding, a head)
            owners = {parameter_names.get(m.attr, "").rpartition(".")[0] for m in group.members}
            unit = owners.pop() if len(owners) == 1 and "" not in owners else ""
        where = f"of {unit}" if unit else "outside the layers"
        layer = layer_of(unit) if unit else ""
        placed.append((group.collective, layer, True, False, unit,
                       f"{plural(len(group.members), 'parameter')} {where}, gathered for use"))
        if group.regather is not None:  # prefetched in backward as in forward
            placed.append((group.regather, layer, True, False, unit,
                           f"{plural(len(group.members), 'parameter')} {where}, gathered again for backward"))
    placed += [(c, "", True, True, "", c.reason) for bucket in program.buckets for c in bucket.collectives]
    forward_s = {o.node: o.forward_s for o in ops}
    # a collective matmul the file asks for where it does not pay costs what it costs; chosen, it pays
    asked = bound.par.substitution("collective_matmul") == "on"
    costs = []
    for c, layer, overlapped, bucket, module, reason in placed:
        seconds, chunked, beside_step = collective_hiding(machine, mesh, c, forward_s, made_by.get(id(c), ""), asked)
        costs.append(CollectiveCost(c.kind, c.axis, c.phase, c.bytes, seconds, layer, reason, overlapped, bucket,
                                    module, chunked, beside_step))

    compute_forward = sum(o.forward_s for o in ops)
    compute_backward = sum(o.backward_s for o in ops)
    stalled = {phase: sum(c.seconds - c.hidden_s - c.beside_step_s for c in costs
                          if c.phase == phase and not c.overlapped)
               for phase in ("forward", "backward")}
    deferred = {phase: sum(c.seconds for c in costs if c.phase == phase and c.overlapped)
                for phase in ("forward", "backward")}
    # Deferred communication hides behind the compute of its phase, as far as the machine overlaps the two
    # (on CPU ranks the collective competes with the compute for the cores); the rest is exposed.
    exposed = {phase: deferred[phase] - machine.overlap * min(deferred[phase], compute)
               for phase, compute in (("forward", compute_forward), ("backward", compute_backward))}
    seconds = {
        "compute_forward": compute_forward, "compute_backward": compute_backward,
        "communication_forward": stalled["forward"], "communication_backward": stalled["backward"],
        "overlapped": deferred["forward"] + deferred["backward"],
        "overlapped_exposed": exposed["forward"] + exposed["backward"],
        "overlapped_forward": deferred["forward"], "overlapped_backward": deferred["backward"],
        "overlapped_exposed_forward": exposed["forward"], "overlapped_exposed_backward": exposed["backward"],
        "chunked_hidden": sum(c.hidden_s for c in costs),
        "chunked_hidden_forward": sum(c.hidden_s for c in costs if c.phase == "forward"),
        "chunked_hidden_backward": sum(c.hidden_s for c in costs if c.phase == "backward"),
    }
    seconds["step"] = compute_forward + compute_backward + stalled["forward"] + stalled["backward"] + \
        seconds["overlapped_exposed"]

    memory = memory_per_rank(program, optimizer)
    pipeline = getattr(compiled, "pipeline", None)
    if pipeline is not None:  # a rank holds its stages, with the micro-batches in flight (pipeline.py)
        activity = program.memory()
        memory = {**pipelined_memory_per_rank(compiled.stages, pipeline, optimizer),
                  "serial_total": serial_bytes(activity["parameters_total"], activity["parameters_trained_total"],
                                               activity["activations_total"] * pipeline.microbatches, optimizer)}
    # the plan computes in half precision under a policy that says so, or where the model's own floating
    # parameters are bf16 or fp16 (a model built in bfloat16): its MFU is against that peak
    floating = [_dtype(p.dtype) for p in program.parameters if _dtype(p.dtype).is_floating_point]
    half = _dtype(program.precision[0]).itemsize <= 2 if program.precision is not None else \
        bool(floating) and all(dtype.itemsize <= 2 for dtype in floating)
    # a pipelined plan is traced for one micro-batch: a step runs all of them
    microbatches = pipeline.microbatches if pipeline is not None else 1
    tokens = step_tokens(program)
    return Estimate(machine, ops, costs, memory, seconds, None if tokens is None else tokens * microbatches,
                    model_flops(typed) * microbatches,
                    machine.half_flops_per_s if half and machine.half_flops_per_s else machine.flops_per_s,
                    pipeline is not None, mesh.size)


def step_tokens(program) -> int | None:
    """The tokens of a step: the elements of the integer input a language model reads (`input_ids`), the
    first one of dtype int64 that is not a target's (`labels`, `targets`); None where there is none."""
    ints = [slot for slot in program.inputs if slot.dtype.removeprefix("torch.") == "int64"]
    tokens = [slot for slot in ints if not any(word in slot.name for word in ("label", "target"))] or ints
    return math.prod(tokens[0].shape) if tokens else None


def model_flops(typed) -> float:
    """The model's FLOPs in a step, all ranks together: each op's forward at its global shapes, and twice it
    in backward where a gradient flows (as op_costs prices them); recomputation is not the model's."""
    return float(sum(flops * (3 if name in typed.requires_grad else 1) for name, flops in typed.bound.flops.items()))


def plural(count: int, word: str, words: str = "") -> str:
    """`count` and the word, in the plural unless there is one: "1 parameter", "3 parameters"."""
    return f"{count} {word if count == 1 else words or word + 's'}"


def needed_by(typed, statement, collective, order: dict[str, int]) -> str:
    """The op whose computation needs a collective, for crediting it to a module. A partial sum reduced
    is needed by the op that made it partial (a row-parallel linear: its matrix product gives each rank a
    share of the sum), not by the op that reads it whole where the conversion happens, which is often the
    next layer's norm: through ops that keep it partial (a residual add, a cast), the latest op that
    makes a partial value of operands that are not (in forward, or made again in backward for a recomputed
    region). A gradient reduced in backward is made partial by the ops the statement runs (column-parallel
    linears reading a value whole). `order`: each op's place in the graph."""
    node = collective.node
    axis = typed.mesh.axis_index(collective.axis)

    def partial(name: str) -> bool:
        return name in typed.nodes and typed.layout_of(name).placements[axis].kind == "P"

    if collective.kind not in ("all_reduce", "reduce_scatter") or not partial(node):
        if collective.phase == "backward" and statement.instruction.kind != "recompute":
            targets = [t for t in statement.targets if t in typed.nodes]
            return targets[0] if targets and node not in targets else node
        return node
    makers, seen, waiting = [], set(), [node]
    while waiting:
        name = waiting.pop()
        if name in seen:
            continue
        seen.add(name)
        inputs = [o for o in typed.nodes[name].operands if partial(o)]
        if inputs:
            waiting += inputs
        else:
            makers.append(name)
    return max(makers, key=order.__getitem__, default=node)


def collective_seconds(machine: Machine, mesh, collective) -> float:
    """A program's collective on `machine`: over its axis's ranks and the links they cross, slowed as
    the ranks sharing the machine slow it."""
    axis = mesh.axis_index(collective.axis)
    return machine.slowdown(mesh.size) * machine.collective_seconds(
        collective.kind, collective.bytes, mesh.axis_sizes[axis], mesh.axis_stride(axis))


def chunked_saving_seconds(machine: Machine, moved_s: float, moved_chunk_s: float, compute_s: float,
                           chunks: int) -> float:
    """What a collective beside a matrix product saves cut into `chunks` (a collective matmul): each chunk's
    transfer (`moved_chunk_s`, where the whole takes `moved_s`) moves while the product of another chunk is
    computed, as far as the machine overlaps the two, at the price of a latency and an op's overhead per
    further chunk. Plain, the step waits for the whole collective, then computes; chunked, for the first
    chunk's transfer, the last one's product, and between them each chunk's transfer and product less what
    of them overlaps. Negative where chunking costs more than it hides."""
    if chunks <= 1:
        return 0.0
    computed_chunk = compute_s / chunks + machine.op_overhead_s
    # ranks sharing a host's cores (CPU ranks) move a chunk by copying it on the thread that computes:
    # nothing of it hides (benchmarks/collective_matmul.py measured the chunked step 7 % slower there)
    overlap = 0.0 if machine.cores else machine.overlap
    hidden = overlap * min(moved_chunk_s, computed_chunk)
    chunked = moved_chunk_s + computed_chunk + (chunks - 1) * (moved_chunk_s + computed_chunk - hidden)
    return moved_s + compute_s - chunked


def hidden_beside_step_seconds(machine: Machine, moved_s: float, op_forward_s: float, steps: int) -> float:
    """Of a message that travels while its op computes one of its `steps` steps (ring attention's keys and
    values, forward), what hides behind that step's share of the op's compute, as far as the machine
    overlaps the two; nothing on ranks that share a host's cores (see chunked_saving_seconds)."""
    overlap = 0.0 if machine.cores else machine.overlap
    return overlap * min(moved_s, op_forward_s / steps) if steps else 0.0


def collective_hiding(machine: Machine, mesh, collective, forward_s: dict[str, float], made_by: str,
                      asked: bool) -> tuple[float, float, float]:
    """A collective's seconds, and of them what hides: beside a product in a collective matmul's chunks
    (what chunking saves; where the file asks for chunks, negative where they cost more), and beside its
    op's step (`made_by`: the op whose step it moves beside)."""
    seconds = collective_seconds(machine, mesh, collective)
    saved = collective_matmul_saving(machine, mesh, collective, forward_s)
    beside_step = hidden_beside_step_seconds(machine, seconds, forward_s.get(made_by, 0.0), collective.steps)
    return seconds, saved if asked else max(0.0, saved), beside_step


def collective_matmul_saving(machine: Machine, mesh, collective, forward_s: dict[str, float],
                             chunks: int | None = None) -> float:
    """Seconds a collective matmul's collective (`collective.chunks` pieces, or `chunks`) saves on `machine`,
    beside the ops it names (`collective.beside`): their forward (`forward_s` per op), or in backward the
    input gradient's products, which cost what the forward's do."""
    chunks = collective.chunks if chunks is None else chunks
    beside = [forward_s[name] for name in collective.beside if name in forward_s]
    if chunks <= 1 or not beside:
        return 0.0
    moved = collective_seconds(machine, mesh, collective)
    moved_chunk = collective_seconds(machine, mesh, replace(collective, bytes=collective.bytes // chunks))
    return chunked_saving_seconds(machine, moved, moved_chunk, sum(beside), chunks)


OPTIMIZER_STATES = {"sgd": 0, "adam": 2, "adamw": 2}  # tensors of state per parameter
DEFAULT_BUCKET_MB = 25.0  # DDP's default gradient bucket size
FIRST_BUCKET_MB = 1.0  # DDP's first bucket: the first collective starts early in backward


def gather_groups(program) -> list[tuple[int, bool]]:
    """Each gather group's bytes whole, in order, and whether it is resharded after forward (a recomputed
    layer gathers its group again for backward, pardsl/passes/recompute.py: nothing of it is kept either)."""
    again = {target for statement in program.statements for inside in statement.body
             if inside.instruction.kind == "param_gather" for target in inside.targets}
    return [(sum(m.nbytes for m in g.members), bool(g.resharded or again & set(g.vars))) for g in program.gathers]


def gathered_in_passing(groups: list[tuple[int, bool]]) -> tuple[int, set[int]]:
    """Of gather groups (gather_groups'), the bytes whole at once of those resharded after forward, and
    which they are: a group is whole only while in use with the next one prefetched (the last group,
    whose backward comes first, likewise), so the largest two neighbours at once. The others are whole
    from their forward to their backward."""
    resharded = [i for i, (_, again) in enumerate(groups) if again]
    passing = sorted(set(resharded + [len(groups) - 1])) if resharded else []
    neighbours = max((groups[a][0] + groups[b][0] for a, b in zip(passing, passing[1:])),
                     default=sum(groups[i][0] for i in passing))
    return neighbours, set(passing)


def memory_per_rank(program, optimizer: str = "adamw") -> dict[str, int]:
    """Bytes one rank holds: parameters, gradients, optimizer state, activations kept for backward and the
    outputs (saved_for_backward.py), parameters gathered for use (resharded after forward: this group and
    the prefetched next; else all of them; converted where used outside a group, each copy an op keeps for
    backward), the compute-dtype copies of parameters (a mixed-precision policy's, which autograd keeps for
    backward; offloaded masters' device copies); and what the serial model holds, for a bound written as a
    percentage. `total` counts every one at once: linear in the plan's choices, it is what the search and a
    `memory <=` bound weigh. `peak` is the estimate of what the device holds at its worst, walking backward
    (_backward_peak): gradients arrive as activations leave, and backward has working memory of its own.
    Where the program offloads, the `host_` entries are what host memory holds (JAX's memory kinds): the
    masters, their gradients and optimizer state."""
    activity = program.memory()
    gradients = sum(_nbytes(p.local_shape, _dtype(p.dtype)) for p in program.parameters if p.requires_grad)
    states = OPTIMIZER_STATES[optimizer]
    # groups resharded after forward (pardsl/passes/reshard.py) are whole two at a time; autograd keeps
    # every other gathered weight from its forward to its backward
    groups = gather_groups(program)
    neighbours, passing = gathered_in_passing(groups)
    held_gathered = {}  # groups kept whole from forward to backward, by layer: freed as its backward ends
    for i, (size, _) in enumerate(groups):
        if i not in passing:
            unit = program.gathers[i].members[0].unit
            held_gathered[unit] = held_gathered.get(unit, 0) + size
    gathered = sum(held_gathered.values()) + neighbours + activity["parameter_copies_per_rank"]
    memory = {
        "parameters": activity["parameters_per_rank"],
        "gradients": gradients,
        "optimizer_state": states * gradients,
        "activations": activity["activations_per_rank"],
        "gathered_parameters": gathered,
        "compute_copies": _compute_copies(program),
    }
    host = {}
    if program.offload is not None:
        floating = sum(_nbytes(p.local_shape, _dtype(p.dtype)) for p in program.parameters
                       if _dtype(p.dtype).is_floating_point)
        host = {"host_parameters": floating, "host_gradients": gradients, "host_optimizer_state": states * gradients}
        memory.update(parameters=memory["parameters"] - floating, gradients=0, optimizer_state=0)
    memory["total"] = sum(memory.values())
    memory["peak"] = memory["total"] - memory["activations"] - memory["gradients"] - sum(held_gathered.values()) + \
        _backward_peak(program, held_gathered, count_gradients=program.offload is None)
    memory["serial_total"] = serial_bytes(activity["parameters_total"], activity["parameters_trained_total"],
                                          activity["activations_total"], optimizer)
    if host:
        memory.update(host, host_total=sum(host.values()))
    return memory


IN_FLIGHT_BUCKETS = 3  # reduce-scatter buckets whose whole gradients a rank holds at once: one filling, two sent


class _HeldBucket(NamedTuple):
    """A gradient bucket as the backward walk sees it."""

    start: int  # the place in backward's order where its first gradient arrives
    nbytes: int  # its buffer's (whole, for a reduce-scatter)
    kind: str
    ranks: int  # those a reduce-scatter splits it over (1 for an all-reduce)
    largest_made: int  # its largest member's gradient as autograd makes it, before it is copied in


def _backward_peak(program, held_gathered: dict[str, int], count_gradients: bool = True) -> int:
    """The most activations and gradients a rank holds at once, walking backward as it runs: the outputs'
    side first (the head), then the repeated layers from the last, then what comes before them. At each
    place: what forward kept that backward has not yet freed (each layer's activations are freed by its own
    backward), backward's own memory there (working), the gradients made so far, the buffers of the
    all-reduce buckets begun and the whole gradients of the reduce-scatter buckets in flight. Parameters
    gathered whole and kept for backward (`held_gathered`, by layer; "" for none) are freed with their
    layer's activations. Each place is looked at as its backward starts (all its activations held, none
    of its gradients made) and as it ends (the reverse). Gradients arrive as activations leave, so the
    peak is mostly below both counted at once (`total`): where the last layer's backward starts, or for a
    recomputed model where the first's ends."""
    layer_order: list[str] = []
    made_at: dict[str, int] = {}  # the place in forward (statements, a region's own in line) of each value
    read_at: dict[str, int] = {}  # and of each parameter's first read
    positions = itertools.count()

    def walk(statements):
        for statement in statements:
            position = next(positions)
            for name in statement.instruction.reads():
                read_at.setdefault(name.removeprefix("self."), position)
            for target in statement.targets:
                made_at.setdefault(target, position)
                layer = program.values.get(target, {}).get("layer")
                if layer and layer not in layer_order:
                    layer_order.append(layer)
            walk(statement.body)

    walk(program.statements)
    first_layer_at = min((made_at[name] for name, v in program.values.items() if v.get("layer") and name in made_at),
                         default=None)

    def place(layer: str, at: int | None) -> str:
        """A repeated layer, else the outputs' side ("after") or the inputs' ("before") of them."""
        if layer:
            return layer
        return "before" if first_layer_at is None or at is None or at < first_layer_at else "after"

    outputs = {output.var for output in program.outputs}
    kept: dict[str, int] = {}
    again: dict[str, dict[str, int]] = {}
    largest: dict[str, int] = {}
    for name, size, layer, region in program.held_for_backward():
        where = "outputs" if name in outputs else place(layer, made_at.get(name))
        if region:
            regions = again.setdefault(where, {})
            regions[region] = regions.get(region, 0) + size
        else:
            kept[where] = kept.get(where, 0) + size
    for name, v in program.values.items():
        if v["kind"] != "placeholder":
            where = place(v.get("layer", ""), made_at.get(name))
            largest[where] = max(largest.get(where, 0), math.prod(v["local_shape"]) * _dtype(v["dtype"]).itemsize)
    for unit, size in held_gathered.items():
        where = unit or "outputs"  # a group of no layer: held through backward
        kept[where] = kept.get(where, 0) + size
    gradients: dict[str, int] = {}
    if count_gradients:
        for p in program.parameters:
            if p.requires_grad:
                where = place(parameter_unit(p.name), read_at.get(p.var))
                gradients[where] = gradients.get(where, 0) + _nbytes(p.local_shape, _dtype(p.dtype))
    order = ["after", *reversed(layer_order), "before"]  # backward's order
    # a bucket's buffer is made when its first gradient arrives; beside it, each gradient as autograd makes
    # it (whole, where a reduce-scatter is to split it) until it is copied in
    mesh = program.mesh
    place_of = {p.var: place(parameter_unit(p.name), read_at.get(p.var)) for p in program.parameters}
    local = {p.var: _nbytes(p.local_shape, _dtype(p.dtype)) for p in program.parameters}
    buckets = []
    for bucket in program.buckets:
        whole = mesh.axis_sizes[mesh.axis_index(bucket.axes[0])] if bucket.kind == "reduce_scatter" else 1
        starts = [order.index(place_of[attr]) for attr, _, _ in bucket.members if place_of.get(attr) in order]
        buckets.append(_HeldBucket(min(starts, default=0), bucket.nbytes, bucket.kind, whole,
                                   max((local.get(attr, 0) * whole for attr, _, _ in bucket.members), default=0)))
        for attr, _, _ in bucket.members:  # its members' gradients are in its buffer until it is reduced
            if place_of.get(attr) in gradients:
                gradients[place_of[attr]] -= local.get(attr, 0)

    def working(where: str) -> int:
        """Backward's own memory at a place: the gradients of its largest value and of that op's input
        (eager attention's softmax: the gradient of its output and of its input, beside the output kept),
        and a recomputed region's activations made again."""
        return max(again.get(where, {}).values(), default=0) + 2 * largest.get(where, 0)

    def in_flight(started) -> int:
        """The buckets' buffers once their first gradient has arrived (`started(where it arrives)`)."""
        begun = [b for b in buckets if started(b.start)]
        scattered = sorted((b for b in begun if b.kind == "reduce_scatter"), key=lambda b: -b.nbytes)
        # the whole gradients of those in flight (at most, the largest); of those let go, this rank's part
        return sum(b.nbytes for b in scattered[:IN_FLIGHT_BUCKETS]) + \
            sum(b.nbytes // b.ranks for b in scattered[IN_FLIGHT_BUCKETS:]) + \
            sum(b.nbytes for b in begun if b.kind == "all_reduce") + max((b.largest_made for b in begun), default=0)

    peak = sum(kept.values())  # the end of forward
    for index, where in enumerate(order):
        # as its backward starts: its activations all held, a recomputed region's made again beside them,
        # the gradients and buckets of the places before it
        before = kept.get("outputs", 0) + sum(kept.get(w, 0) for w in order[index:]) + working(where) + \
            sum(gradients.get(w, 0) for w in order[:index]) + in_flight(lambda start: start < index)
        # as it ends: its activations freed, its gradients made, its buckets begun
        after = kept.get("outputs", 0) + sum(kept.get(w, 0) for w in order[index + 1:]) + \
            sum(gradients.get(w, 0) for w in order[:index + 1]) + in_flight(lambda start: start <= index)
        peak = max(peak, before, after)
    return peak


def _compute_copies(program) -> int:
    """Bytes of parameters' copies in the compute dtype the device holds: under a mixed-precision policy
    each parameter read outside a gather group is cast, and autograd keeps the cast for backward unless a
    recomputed region makes it (its casts are made again in backward, one region at a time, as its
    activations are); under `offload optimizer` every parameter has its device copy between steps; under
    `offload parameters` a copy is made for each use, kept for backward as the policy's casts are (a
    gathered group's shards only pass through)."""
    if program.precision is None and program.offload is None:
        return 0
    floating = {p.var: p for p in program.parameters if _dtype(p.dtype).is_floating_point}
    compute = None if program.precision is None else _dtype(program.precision[0])

    def nbytes(var):
        return _nbytes(floating[var].local_shape, compute or _dtype(floating[var].dtype))

    if program.offload == "optimizer":
        return sum(nbytes(var) for var in floating)
    # the parameters cast or fetched by the forward's own statements, not by a recomputed region's
    read = {name.removeprefix("self.") for statement in program.statements if statement.instruction.kind != "recompute"
            and statement.instruction.callee in ("rt.cast", "sync.fetch")
            for name in statement.instruction.reads()}
    return sum(nbytes(var) for var in floating if var in read)


def serial_bytes(parameters: int, trained: int, activations: int, optimizer: str = "adamw") -> int:
    """What the serial model holds: its parameters, the gradients and optimizer state of those it trains
    (`trained` of the `parameters` bytes), and activations; a `memory <= N %` bound is a share of it."""
    return parameters + trained * (1 + OPTIMIZER_STATES[optimizer]) + activations


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def pipelined_memory_per_rank(stages, plan, optimizer: str = "adamw") -> dict[str, int]:
    """memory_per_rank for a pipeline (`plan`: its PipelinePlan): the rank that holds the most (see
    pipeline_rank_memory)."""
    mesh = stages[0].mesh
    axis_size = mesh.axis_sizes[mesh.axis_index(plan.axis)]
    return max((pipeline_rank_memory(stages, plan, rank, optimizer) for rank in range(axis_size)),
               key=lambda held: held["total"])


def pipeline_rank_memory(stages, plan, rank: int, optimizer: str = "adamw") -> dict[str, int]:
    """What the rank at `rank` along the pipeline axis holds: its stages' parameters, gradients, optimizer
    state and gathered parameters, each stage's activations for one micro-batch times the micro-batches
    it holds at once under the schedule (a recomputed region's, made again in backward, once: the rank's
    largest; what a stage makes from constants alone, which its micro-batches share, once), and torch's
    stage buffers (stage_buffer_slots). `peak` is the larger of two moments, each with the gradient a
    micro-batch's backward makes before it is added to the one held (the largest of the rank's): every
    micro-batch in flight, or the step's last backward, one micro-batch's activations beside the buffers
    of the gradient buckets it fills."""
    mesh = stages[0].mesh
    axis_size = mesh.axis_sizes[mesh.axis_index(plan.axis)]
    in_flight = stage_micro_batches_held(plan.schedule, plan.microbatches, axis_size, rank,
                                         len(stages) // axis_size)
    one_micro_batch = made_again = 0
    held = {"parameters": 0, "gradients": 0, "optimizer_state": 0, "activations": 0, "gathered_parameters": 0,
            "compute_copies": 0, "stage_buffers": 0}
    host: dict[str, int] = {}  # offloaded stages' host memory, apart
    arriving = buckets = 0
    for stage in stages_of_rank(rank, axis_size, len(stages), plan.schedule):
        program = stages[stage]
        memory = memory_per_rank(program, optimizer)
        # a rank runs one micro-batch's backward at a time: the recomputed region it makes again is one
        # region's activations at once (its stages' largest), not one per micro-batch in flight
        again = program.memory()["activations_made_again_per_rank"]
        made_again = max(made_again, again)
        # what the stage makes from constants alone, every micro-batch reads the same copy of
        once = program.memory()["activations_shared_by_micro_batches_per_rank"]
        for key in held.keys() - {"stage_buffers", "activations"}:
            held[key] += memory[key]
        held["activations"] += (memory["activations"] - again - once) * in_flight[stage] + once
        one_micro_batch += memory["activations"] - again
        for key in (k for k in memory if k.startswith("host_")):
            host[key] = host.get(key, 0) + memory[key]
        received, returned = stage_buffer_slots(stages, stage)
        held["stage_buffers"] += plan.microbatches * sum(slot_bytes(s.local_shape, s.dtype) for s in received + returned)
        reduce_dtype = _dtype(program.precision[1]) if program.precision else None
        arriving = max([arriving] + [_nbytes(p.local_shape, reduce_dtype or _dtype(p.dtype))
                                     for p in program.parameters if p.requires_grad])
        buckets += sum(bucket.nbytes for bucket in program.buckets)
    held["activations"] += made_again
    one_micro_batch += made_again
    held["total"] = sum(held.values())
    held["peak"] = held["total"] - held["activations"] + arriving + max(held["activations"], one_micro_batch + buckets)
    held.update(host)
    return held


def stage_buffer_slots(stages, stage: int) -> tuple[list, list]:
    """What torch's PipelineStage keeps a buffer for, once allocated, one per micro-batch: each activation
    the stage receives from the one before (the inputs of every stage but the first), and each gradient of
    its outputs the stage after sends back (that stage's inputs that carry one)."""
    received = [] if stage == 0 else list(stages[stage].inputs)
    returned = [] if stage == len(stages) - 1 else [slot for slot in stages[stage + 1].inputs if slot.requires_grad]
    return received, returned


def default_machine() -> "Machine":
    """The cost model's figures for this machine's backend: its calibration file, else the defaults."""
    return load_machine(None, resolve_backend("auto"))
