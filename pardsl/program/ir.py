"""The program IR: the lowered program (its statements, slots, collectives, gather groups and gradient
buckets) and its instructions, what lowering emits and codegen alone turns into Python.

An instruction names what it does (`kind`), what it calls, and its arguments as data: the program's
values it reads (`Var`), literals already in their Python spelling (`Text`), bracketed groups (`Items`),
and, until lowering has formed the buckets and gather groups, the places they will fill (`Slot`). A pass
over the program reads which values an instruction uses (`reads`) without parsing any text.

Kinds:
  compute         an ATen op on local shards
  convert         one conversion step of one mesh axis (the runtime's autograd collective)
  grad_sync       Megatron's f: identity forward, the gradient all-reduced backward
  param_gather    a stored-split parameter gathered for use (prefetched group, bucketed gradient)
  param_grad_sync a broadcast parameter read by sharded ops: its gradient into a bucket
  fused_linears   linears of one input computed together, their input's gradient collective overlapped
  masked_lookup   the vocabulary-parallel embedding
  form            a rule's parallel form (the vocabulary-parallel loss, synchronised batch norm), or the
                  all-reduce of a partial mean loss's count of targets, started early (early_count.py)
  project         one result of an op with several (x[i])
  size            a named dim's global size, from an input's local shape
  expression      a size the graph computes, as an expression of the named dims
  check           a run-time requirement (a named dim's divisibility)
"""

from __future__ import annotations

import functools

import keyword
import math
import re
from dataclasses import dataclass, field
from typing import Union

import torch

from pardsl.language.diagnostics import Diagnostic
from pardsl.layouts.algebra import COLLECTIVE_KINDS, B, Layout, Mesh
from pardsl.planning.cost import format_bytes  # noqa: F401 - where the program's readers take it from


@dataclass(frozen=True)
class Var:
    """A value of the program: a graph tensor, a conversion of one, or a parameter (`self.x`)."""

    name: str


@dataclass(frozen=True)
class Text:
    """A literal or size, spelled as Python."""

    text: str


@dataclass(frozen=True)
class Items:
    """A list or tuple of arguments."""

    items: tuple["Arg", ...]
    brackets: str = "[]"


@dataclass(frozen=True)
class Slot:
    """A parameter's place in a gather group ("gather") or a gradient bucket ("sync"), known once lowering
    has formed them."""

    kind: str
    index: int


Arg = Union[Var, Text, Items, Slot]


@dataclass(frozen=True)
class Instruction:
    kind: str
    callee: str  # "aten.linear.default", "rt.all_reduce", "sync.all_gather"; "" for project/size/expression
    args: tuple[Arg, ...] = ()
    kwargs: tuple[tuple[str, Arg], ...] = ()

    def reads(self) -> list[str]:
        """The values this instruction reads, in argument order."""
        found: list[str] = []
        for arg in self.args:
            _collect_vars(arg, found)
        for _, arg in self.kwargs:
            _collect_vars(arg, found)
        return found

    def renamed(self, mapping: dict[str, str]) -> "Instruction":
        """The instruction reading `mapping[name]` for each value `name` the mapping has."""
        return Instruction(self.kind, self.callee, tuple(_renamed(a, mapping) for a in self.args),
                           tuple((k, _renamed(v, mapping)) for k, v in self.kwargs))

    def replace_slots(self, fill) -> "Instruction":
        """The instruction with each Slot replaced by `fill(slot)` (an Arg)."""
        return Instruction(self.kind, self.callee, tuple(_filled(a, fill) for a in self.args),
                           tuple((k, _filled(v, fill)) for k, v in self.kwargs))


# Module functions, not closures: a recursive closure is a reference cycle, left for the cyclic collector,
# and these run for every instruction of every candidate plan a compile lowers
def _collect_vars(arg: Arg, found: list[str]) -> None:
    if isinstance(arg, Var):
        found.append(arg.name)
    elif isinstance(arg, Items):
        for item in arg.items:
            _collect_vars(item, found)


def _renamed(arg: Arg, mapping: dict[str, str]) -> Arg:
    if isinstance(arg, Var):
        return Var(mapping.get(arg.name, arg.name))
    if isinstance(arg, Items):
        return Items(tuple(_renamed(a, mapping) for a in arg.items), arg.brackets)
    return arg


def _filled(arg: Arg, fill) -> Arg:
    if isinstance(arg, Slot):
        return fill(arg)
    if isinstance(arg, Items):
        return Items(tuple(_filled(a, fill) for a in arg.items), arg.brackets)
    return arg


@dataclass(frozen=True)
class Collective:
    kind: str  # all_reduce, all_gather, reduce_scatter, all_to_all
    axis: str
    phase: str  # forward | backward
    bytes: int  # per rank
    value: str  # the variable it moves
    reason: str
    node: str = ""  # the graph op it is there for ("" for buckets, gather groups and outputs)
    routed: bool = False  # its bytes follow the data (a mixture's routing): `bytes` is a balanced routing's
    # a collective matmul's (pardsl/passes/collective_matmul.py): moved in `chunks` pieces, each while the
    # product of another is computed by the ops `beside` (their forward, or where `beside_backward`, the
    # input gradient's half of their backward)
    chunks: int = 1
    beside: tuple[str, ...] = ()
    beside_backward: bool = False
    # one of `steps` messages, each moving while its op computes a step's share of its work (ring
    # attention's keys and values, forward)
    steps: int = 0

    def to_json(self) -> dict:
        chunked = {"chunks": self.chunks, "beside": list(self.beside)} if self.chunks > 1 else {}
        return {"kind": self.kind, "axis": self.axis, "phase": self.phase, "bytes": self.bytes,
                "value": self.value, "reason": self.reason, "node": self.node,
                **({"routed": True} if self.routed else {}), **chunked}


@dataclass(frozen=True)
class Statement:
    target: str  # the variable (or variables, comma-separated) it binds; "" for a check
    instruction: Instruction
    comment: str
    collectives: tuple[Collective, ...] = ()
    layouts: tuple[Layout, ...] = ()  # the layout of each variable it binds
    node: str = ""  # the graph op it is there for (a conversion: the op whose value it moves)
    body: tuple["Statement", ...] = ()  # a region's own statements (pardsl/passes/recompute.py)

    @functools.cached_property  # a statement does not change: passes make new ones
    def targets(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.target.split(",") if t.strip())


def made_from_constants(statements: list[Statement], drawn: frozenset[str] | set[str] = frozenset()) -> set[int]:
    """The statements (their indices) computed from parameters, buffers and constants alone: a gathered
    weight, an attention mask or rotary table built from positions; any stage or segment that reads one
    can make it again. `drawn`: the graph ops that draw random numbers, made once."""
    definer: dict[str, int] = {}
    found: set[int] = set()
    for index, statement in enumerate(statements):
        if statement.targets and statement.node not in drawn and \
                all(v.startswith("self.") or definer.get(v, -1) in found for v in statement.instruction.reads()):
            found.add(index)
        for target in statement.targets:
            definer[target] = index
    return found


@dataclass(frozen=True)
class TensorSlot:
    """A parameter, buffer or input of the generated module."""

    name: str  # state-dict name or forward() argument
    var: str  # how the forward refers to it
    kind: str  # parameter, buffer, input
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: str
    layout: Layout
    requires_grad: bool = False


@dataclass(frozen=True)
class OutputSlot:
    path: str
    var: str
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    layout: Layout


@dataclass(frozen=True)
class ParameterGather:
    """A parameter all-gathered on one axis before use, in forward order."""

    attr: str
    axis: str
    dim: int
    blocks: int | tuple[int, ...]  # a count of equal blocks, or unequal blocks' sizes
    unit: str  # the repeated block it belongs to (`model.layers.3`), or "" outside any
    dtype: str
    nbytes: int  # whole, on one rank


@dataclass(frozen=True)
class GatherGroup:
    """Parameters gathered by one all-gather: consecutive in forward order, of one layer (FSDP's unit)
    or of none; the next group is prefetched while this one's ops compute."""

    axis: str
    members: tuple[ParameterGather, ...]
    collective: Collective
    vars: tuple[str, ...] = ()  # the program's variables holding its members whole
    resharded: bool = False  # dropped once the forward has used it (pardsl/passes/reshard.py)
    regather: Collective | None = None  # resharded and kept for backward: gathered again there
    # where the forward last reads it (a statement number): backward needs the resharded groups in the
    # reverse order of these, which is not their own where a tied head reads the first group last
    last_read: int = -1


@dataclass(frozen=True)
class GradientBucket:
    """Parameter gradients synchronised by one collective during backward, issued when the last arrives."""

    kind: str  # all_reduce | reduce_scatter
    axes: tuple[str, ...]
    members: tuple[tuple[str, int, int | tuple[int, ...]], ...]  # (parameter attribute, dim, blocks), in arrival order
    nbytes: int  # the gradients' bytes on one rank (whole, for a reduce-scatter)
    collectives: tuple[Collective, ...]


@dataclass
class LoweredProgram:
    mesh: Mesh
    source_path: str
    model: str
    parameters: list[TensorSlot]
    buffers: list[TensorSlot]
    inputs: list[TensorSlot]
    statements: list[Statement]
    outputs: list[OutputSlot]
    values: dict[str, dict]  # every graph tensor: layout, global and local shape (for plan.json)
    notes: list[Diagnostic] = field(default_factory=list)
    gathers: list[GatherGroup] = field(default_factory=list)
    buckets: list[GradientBucket] = field(default_factory=list)
    # random draws the model makes in training mode outside dropout (stochastic depth's `rand`), as
    # "`op` in module": traced in training mode, the forward draws them in eval mode too, so it refuses that
    training_only: list[str] = field(default_factory=list)
    # writes the model makes into its parameters through `.data`, made on this rank's parts before the
    # forward reads them: (the parameter as the forward names it, the method's call, comment)
    parameter_writes: list[tuple[str, str, str]] = field(default_factory=list)
    # the graph's ops whose forward runs again in backward, in recomputed regions (pardsl/passes/recompute.py)
    recomputed_ops: frozenset[str] = frozenset()
    # (compute dtype, reduce dtype) of a mixed-precision policy (pardsl/passes/precision.py), else None
    precision: tuple[str, str] | None = None
    # what lives in host memory (pardsl/passes/offload.py): None, "optimizer" or "parameters"
    offload: str | None = None
    # of the values the program takes as inputs (a pipeline stage's, from the stage before), those a fused
    # op keeps for backward where autograd would keep a copy of them (pardsl/passes/fused_norms.py): counted
    # where the program's inputs are, not among its values
    inputs_kept: frozenset[str] = frozenset()

    @property
    def collectives(self) -> list[Collective]:
        return ([c for s in self.statements for c in s.collectives] + [g.collective for g in self.gathers] +
                [g.regather for g in self.gathers if g.regather is not None] +
                [c for b in self.buckets for c in b.collectives])

    def layout_of(self, var: str) -> Layout | None:
        """The layout of a program variable: a slot's, or the one its statement gives it (None for a size)."""
        for slot in self.parameters + self.buffers + self.inputs:
            if var in (slot.var, f"self.{slot.var}"):
                return slot.layout
        for statement in self.statements:
            # the substring test first: passes ask this of every statement of a long program
            if var in statement.target and statement.layouts and var in statement.targets:
                return statement.layouts[statement.targets.index(var)]
        return None

    def collective_counts(self) -> dict[str, dict[str, int]]:
        counts = {phase: {kind: 0 for kind in COLLECTIVE_KINDS} for phase in ("forward", "backward")}
        for c in self.collectives:
            if c.kind in COLLECTIVE_KINDS:  # point-to-point sends (a halo's) are counted by axis only
                counts[c.phase][c.kind] += 1
        return counts

    def collective_counts_by_axis(self) -> dict[str, dict[str, int]]:
        counts: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}
        for c in self.collectives:
            key = f"{c.axis}:{c.kind}"
            counts[c.phase][key] = counts[c.phase].get(key, 0) + 1
        return {phase: dict(sorted(by_key.items())) for phase, by_key in counts.items()}

    def memory(self) -> dict[str, int]:
        """Bytes per rank: parameters (and their full size, for the ratio); activations: what a rank holds
        for backward or returns, at the layout it holds it (converted copies an op keeps included), and the
        serial model's, for the ratio (saved_for_backward.py), which keeps what a pass made this program
        keep no longer or keeps in its place (`kept_here`: pardsl/passes/fused_norms.py, and a gathered copy
        kept split: pardsl/passes/regather.py), keeps beyond it (`held_here`: a
        recomputed region's inputs) or makes again in backward (`recomputed`: pardsl/passes/recompute.py);
        the converted copies of parameters an op keeps for backward outside gather groups."""
        def nbytes(shape, dtype):
            return math.prod(shape) * torch_dtype(dtype).itemsize

        held = self.held_for_backward()
        # backward makes one recomputed region's activations again at a time: the largest adds to the peak
        again: dict[str, int] = {}
        for _, size, _, region in held:
            if region:
                again[region] = again.get(region, 0) + size
        return {
            "parameters_per_rank": sum(nbytes(p.local_shape, p.dtype) for p in self.parameters),
            "parameters_total": sum(nbytes(p.shape, p.dtype) for p in self.parameters),
            "parameters_trained_total": sum(nbytes(p.shape, p.dtype) for p in self.parameters if p.requires_grad),
            "activations_per_rank": sum(size for _, size, _, region in held if not region) +
            max(again.values(), default=0),
            "activations_made_again_per_rank": max(again.values(), default=0),
            # what a pipeline stage makes from constants once and every micro-batch shares
            # (pardsl/passes/shared_constants.py): held once, however many micro-batches are in flight
            "activations_shared_by_micro_batches_per_rank": sum(
                size for name, size, _, region in held
                if not region and self.values.get(name, {}).get("shared_by_micro_batches")),
            "parameter_copies_per_rank": sum(nbytes(v["local_shape"], v["dtype"]) for v in self.values.values()
                                             if v["kind"] == "copy" and v["parameter"]),
            "activations_total": sum(nbytes(v["shape"], v["dtype"]) for v in self.values.values()
                                     if v.get("kept_for_backward")),
        }

    def made_from_constants(self, drawn: frozenset[str] = frozenset()) -> set[str]:
        """The values the program computes from parameters, buffers and constants alone (see
        made_from_constants)."""
        statements = self.statements
        return {target for index in made_from_constants(statements, drawn) for target in statements[index].targets}

    def held_for_backward(self) -> list[tuple[str, int, str, str]]:
        """The activations a rank holds from forward into backward: (name, local bytes, the repeated layer
        that makes it or "", the recomputed region that makes it again in backward or ""). What autograd
        keeps (unless a pass made the program keep it no longer), a region's inputs, the outputs, and the
        converted copies an op keeps."""
        held = []
        for name, v in self.values.items():
            size, layer = math.prod(v["local_shape"]) * torch_dtype(v["dtype"]).itemsize, v.get("layer", "")
            # what autograd keeps (the serial model's flag, or a converted copy an op keeps), unless a pass
            # said otherwise: kept no longer, or kept where autograd would not (a fused op's own choice)
            kept = v.get("kept_here", bool(v.get("kept_for_backward") or v["kind"] == "copy" and not v["parameter"]))
            if v.get("held_here") or kept and not v.get("recomputed"):
                held.append((name, size, layer, ""))
            if kept and v.get("recomputed"):  # made again by its region, beside a region's input it may be too
                held.append((name, size, layer, v["recomputed"]))
        return held

    def collective_bytes(self) -> dict[str, int]:
        """Bytes per rank and phase, the routed collectives' at a balanced routing."""
        totals = {"forward": 0, "backward": 0}
        for c in self.collectives:
            totals[c.phase] += c.bytes
        return totals

    def routed_bytes(self) -> dict[str, int]:
        """The part of collective_bytes that follows the data: a run counts what it sent apart."""
        return self._bytes(lambda c: c.routed)

    def fixed_bytes(self) -> dict[str, int]:
        """The part of collective_bytes the plan fixes: what a run's `bytes` counts."""
        return self._bytes(lambda c: not c.routed)

    def _bytes(self, which) -> dict[str, int]:
        totals = {"forward": 0, "backward": 0}
        for c in self.collectives:
            if which(c):
                totals[c.phase] += c.bytes
        return totals


def torch_dtype(name: str) -> torch.dtype:
    """A dtype as the program spells it (`torch.float32` or `float32`)."""
    return getattr(torch, name.removeprefix("torch."))


def named_layout(layout: Layout, mesh: Mesh) -> str:
    """`S(1)@tp`, `P@dp, S(0)@tp`, `B`: every non-B placement with its axis."""
    parts = [f"{p}@{mesh.axis_names[a]}" for a, p in enumerate(layout.placements) if p != B]
    return ", ".join(parts) if parts else "B"


# Text from outside the compiler (the .par file's name, the model's module paths, parameter and output names,
# its arguments) becomes Python only through the three functions below. A name is any string (a config-driven
# model keys its heads by name in an nn.ModuleDict): a line break in a comment or a quote in a string would end
# it, and the rest of the name would run as a statement wherever the module is imported.

# a coding declaration: on the module's first two lines it names the encoding Python reads the file in
# (under utf-7, `+AAo-` is a line break), and where it is no codec the module does not import
_CODING = re.compile(r"coding([:=])")


def comment_text(value) -> str:
    """`value` as the text of a `#` comment, on one line: every character that is not printable (each line
    break str.splitlines knows, NUL and the other controls, a byte-order mark) as its escape (`\\n`,
    `\\x00`, `\\u2028`), and a coding declaration's `:` or `=` as its escape. Printable text, non-ASCII
    included, stays as it is."""
    text = "".join(c if c.isprintable() else _escape(c) for c in str(value))
    return _CODING.sub(lambda match: "coding" + _hex(match.group(1)), text)


def python_literal(text: str) -> str:
    """`text` as a Python string literal: repr's escapes (a backslash, the quote, every character that is not
    printable), in double quotes as JSON writes them, so that a plain name reads `"fc1.weight"`."""
    return '"' + "".join(_IN_LITERAL.get(c) or (c if c.isprintable() else _escape(c)) for c in text) + '"'


def python_name(text: str) -> str:
    """`text` as an identifier: ASCII letters, digits and underscores, any other character `_` (Python reads
    identifiers NFKC-normalised, so `ﬁ` in code would be `fi`, and `²` is no identifier character), with
    `p_` before one that would begin with a digit, be a keyword or be private (`__x`, renamed in a class)."""
    name = "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in text)
    if not name or name[0].isdigit() or keyword.iskeyword(name) or name.startswith("__"):
        name = "p_" + name
    return name


_IN_LITERAL = {"\\": "\\\\", '"': '\\"'}


def _escape(character: str) -> str:
    return repr(character)[1:-1]  # `\n`, `\x1c`, `\u2028`: the escape Python itself writes


def _hex(character: str) -> str:
    return f"\\x{ord(character):02x}"
