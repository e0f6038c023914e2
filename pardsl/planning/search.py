"""Stage 3, searched: the layouts the user did not write, chosen by an integer program solved with HiGHS.

The search runs where the file asks for it: it has a `memory <=` bound, a layout written `?`, or no layout
at all. Elsewhere inference's greedy pass (inference.infer) completes the written plan, as before.

As in inference, the mesh's axes are decided one after another (nd-SBP as the product of one-axis
signatures), in the order given (compile runs every order and keeps the plan the cost model rates
fastest, the greedy completion included: descent.searched_or_greedy); on each, one integer program
(Alpa's formulation) chooses everything at once. A group of axes may be decided together by one
program: an op's choices are then the combinations of its one-axis signatures whose layouts fit, a
value's placement is one per axis of the group, and a conversion is priced as lowering plans it over
all of them (layouts.plan_conversion). Compile's descent decides pairs of axes so, from a plan, each op
keeping its signature on at least one of the two. The program:

- a binary per op and legal signature, exactly one taken (a dim some op downstream cuts into m equal
  parts is also offered split in m blocks: blocks_wanted); and per free tensor (a parameter or buffer the
  file leaves out, an input written `?`) per placement a consumer can use, exactly one taken. A written
  layout always stands;
- converting a value from its placement to what a consumer's signature needs costs the catalogue's
  collectives (layouts.CONVERSIONS), once per value and target placement. Each pair of choices (the
  value's placement, the consumer's requirement) is a continuous variable per pair whose sums over each
  side equal that side's choice: a tight linearisation of their product, which HiGHS solves in well
  under a second where the textbook `z >= x + y - 1` ran to its time limit;
- the all-reduce of a broadcast value's gradient where sharded computation reads it (a gathered value's
  gradient is reduce-scattered instead), once per value;
- each op's compute at the share its signature leaves a rank (FLOP from torch's counter, or bytes moved),
  backward twice forward; a parallel form's own collectives; finishing a partial output;
- a parameter's gradient is reduced in buckets behind backward, and on an axis that splits the batch its
  gather is prefetched behind forward and again behind backward (resharded after forward, as memory is
  counted: two groups whole at a time): priced at the share the machine does not overlap (a bucket's
  latency is shared by many parameters: its bytes only). The latencies of the buckets a plan fills are
  weighed after the program is solved (_fewer_buckets): a plan that reduces no parameter's gradient on
  an axis (Megatron's, whose replicated weights see whole activations) saves them.

Costs are seconds of the cost model (pardsl/planning/cost.py: α per ring step + β per byte, per kind; the
machine's throughput and bandwidth), so the objective is the estimated step time of the axis's choices.
The memory bound is a constraint: parameters with their gradients and optimizer state, the activations
autograd keeps for backward (pardsl/model/saved_for_backward.py), and parameters gathered whole while in use,
per rank; an axis before the last gets the bound times what the later axes can still divide.

Repeated layers (model.layers.0, .1, … with the same ops, shapes and layouts) share their binaries, and
values whose consumers are all shared form one class whose conversions are priced once times its size:
the program has one layer's size however deep the model is. Building it costs one layer's work too: an
op's legal signatures, their seconds and its priced runner-ups are computed once per distinct question
(a key of everything the answer reads), which the ops of repeated layers share.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

import torch

from pardsl.language.progress import report
from pardsl.layouts.algebra import (
    B,
    Layout,
    P,
    Placement,
    arrangement_order,
    collective_bytes,
    collective_matmul_cut,
    one_group_gather,
    plan_conversion,
    step_collectives,
)
from pardsl.layouts.oprules import is_tensor_list, op_name, signatures
from pardsl.model.binding import BoundPlan
from pardsl.planning.cost import (
    DEFAULT_BUCKET_MB,
    FIRST_BUCKET_MB,
    OPTIMIZER_STATES,
    Machine,
    chunked_saving_seconds,
    hidden_beside_step_seconds,
    layer_of,
    parameter_unit,
    repeated_layer,
    serial_bytes,
)
from pardsl.planning.inference import Candidate, TypedGraph, one_axis_collectives, prepare, typed_graph
from pardsl.planning import solver
from pardsl.planning.solver import IntegerProgram, nearest_the_bound

EPSILON_S = 1e-9  # a conversion, or a split of a free tensor, that saves nothing is not made
HELD_S = 1e-15  # a copy held for backward is counted where something holds it, not beyond

Joint = tuple[Placement, ...]  # a value's placements on the axes decided together, in their order


class NoPlanFound(RuntimeError):
    """An integer program gave no plan: HiGHS found none within its time (FIRST_PLAN_S where the memory
    bound is hard to meet), or none exists."""


class BoundUnmet(NoPlanFound):
    """No plan meets the memory bound, and the search was asked not to look for the plan nearest it."""


def weight_open_axes(bound: BoundPlan, name: str) -> frozenset[int]:
    """The mesh axes a searched file leaves open for a parameter or buffer it writes a layout for: those its
    `S(0) @ tp` form does not name. Such a layout says how the tensor is split where it is written (the
    Megatron layers on `tp`); how the data-parallel ranks hold it (replicated, or split as ZeRO-3 and FSDP
    do) is the memory bound's question, which the search answers. Read as B there, a layer's weights were
    held whole on `dp` under a bound only a split could meet, and the search reached it by splitting
    activations over `dp` instead, with conversions and all-to-alls in every layer. A list or bare layout
    writes every axis, as does any layout in a file the search does not complete, where axes not named are B."""
    pin = bound.pins.get(name)
    if pin is None or pin.entry.layout.form != "named" or not wants_search(bound) or \
            (name not in bound.parameters and name not in bound.buffers):
        return frozenset()
    named = {bound.mesh.axis_index(axis) for axis, _ in pin.entry.layout.axis_names}
    return frozenset(a for a in range(bound.mesh.ndim) if a not in named)


def wants_search(bound: BoundPlan) -> bool:
    par = bound.par
    return par.memory_bound is not None or bool(bound.searched) or not par.layouts


def splits_the_sequence(bound: BoundPlan) -> bool:
    """Whether the file writes token ids split along the sequence (context parallelism) and leaves the rest
    to the compiler. The greedy completion decides each op alone: the first op that needs the whole
    sequence (attention) gathers it, and every later layer computes all of it on every rank. Keeping the
    split through every layer (ring attention) is a decision about the whole model: the search's."""
    return any(name in bound.inputs and not bound.tensors[name].dtype.is_floating_point and
               any(p.is_split and p.dim >= 1 for p in pin.layout.placements)
               for name, pin in bound.pins.items())


def memory_limit(bound: BoundPlan, optimizer: str = "adamw", microbatches: int = 1) -> int | None:
    """The file's bound in bytes per rank (a percentage is of the serial model's bytes, as cost.py counts
    them; for a pipelined file, bound to one micro-batch, the serial model holds `microbatches` times its
    activations)."""
    written = bound.par.memory_bound
    if written is None:
        return None
    parameters = sum(bound.tensors[name].nbytes for name in bound.parameters)
    trained = sum(bound.tensors[name].nbytes for name in bound.trained_parameters)
    # the op results autograd keeps for backward, as LoweredProgram.memory counts activations
    activations = sum(bound.tensors[name].nbytes for name in bound.kept_for_backward) * microbatches
    return written.bytes(serial_bytes(parameters, trained, activations, optimizer))


def _bucket_seconds(solution: list[float], latencies: dict) -> float:
    """The latencies of the gradient buckets a plan fills: per axis and kind, lowering's first bucket, then
    one per DEFAULT_BUCKET_MB of the gradients beyond it."""
    first, later = FIRST_BUCKET_MB * (1 << 20), DEFAULT_BUCKET_MB * (1 << 20)
    seconds = 0.0
    for latency, members in latencies.values():
        nbytes = sum(nbytes for column, nbytes in members if solution[column] > 0.5)
        if nbytes:
            seconds += latency * (1 + math.ceil(max(0.0, nbytes - first) / later))
    return seconds


def _fewer_buckets(program: IntegerProgram, latencies: dict, status: str, solution: list[float],
                   hint) -> tuple[str, list[float]]:
    """The program's plan, or a plan that reduces no parameter's gradient on an axis where it would save
    those buckets' latencies. The program prices a bucketed gradient at its bytes alone: a latency shared
    by whatever a plan puts in the bucket is a maximum over the gradients, and written as a column of the
    program (any gradient on the axis ≤ the column) it made the three-axis schemes' programs ten times
    slower to solve (docs/performance.md). So the plan's latencies are added afterwards, and for each axis
    the plan fills buckets on, the program is solved again without those gradients where its linear
    relaxation (a lower bound, and quick) leaves room for a faster plan, cut off at the plan's seconds."""
    best = program.objective(solution) + _bucket_seconds(solution, latencies)
    filled = sorted({axis for (axis, _), (_, members) in latencies.items()
                     if any(solution[column] > 0.5 for column, _ in members)})
    for axis in filled:
        columns = [column for (on, _), (_, members) in latencies.items() if on == axis for column, _ in members]
        without = IntegerProgram(list(program.cost), list(program.integer), list(program.rows))
        for column in columns:
            without.row({column: 1.0}, 0.0, 0.0)
        relaxed = IntegerProgram(without.cost, [False] * len(without.cost), without.rows)
        found, values = relaxed.solve()
        if found != "optimal" or relaxed.objective(values) >= best:
            continue
        without.cutoff = best
        found, values = without.solve(hint=hint)
        if found not in ("optimal", "time limit"):
            continue
        seconds = program.objective(values) + _bucket_seconds(values, latencies)
        if seconds < best:
            best, status, solution = seconds, found, values
    return status, solution


def _layer_key(path: str) -> tuple[str, str] | None:
    """`model.layers.3` → ("model.layers.#", "3"): the family of a repeated layer and its index."""
    layer = layer_of(path)
    match = re.fullmatch(r"(.*\.)?(\d+)", layer)
    if not match:
        return None
    return (match.group(1) or "") + "#", layer


def repeated_layers(bound: BoundPlan, names: list[str], fingerprint) -> dict[str, str]:
    """Each name in a repeated layer identical to an earlier one (same ops, shapes, layouts decided and
    written, and links inside the layer) → the name at its place in the first such layer."""
    paths = {name: bound.parameters.get(name) or bound.buffers.get(name) or bound.module_paths.get(name) or ""
             for name in names}
    layers: dict[tuple[str, str], list[str]] = {}
    for name in names:
        key = _layer_key(paths[name])
        if key is not None:
            layers.setdefault(key, []).append(name)
    representative: dict[str, str] = {}
    first: dict[tuple, list[str]] = {}
    for (family, _), members in layers.items():
        position = {name: index for index, name in enumerate(members)}
        prints = tuple(fingerprint(name, position) for name in members)
        earlier = first.setdefault((family, prints), members)
        if earlier is not members:
            representative.update(zip(members, earlier))
    return representative


def _gather_units(bound: BoundPlan, nodes: list[str], operands) -> dict[str, str]:
    """Per parameter, the group lowering gathers it in (lowering.GatherGroup): its repeated layer, or the
    parameters outside the layers used before the first layer, or those used after it."""
    first_use: dict[str, int] = {}
    first_layer = None
    for index, name in enumerate(nodes):
        if first_layer is None and repeated_layer(bound.module_paths.get(name)):
            first_layer = index
        for o in operands[name]:
            first_use.setdefault(o, index)
    units = {}
    for name, path in bound.parameters.items():
        before = first_layer is None or first_use.get(name, 0) < first_layer
        units[name] = parameter_unit(path) or ("outside, before the layers" if before else "outside, after the layers")
    return units


def _writes_zigzag(bound: BoundPlan) -> bool:
    """Whether the file splits a tensor zig-zag: the search carries such a split, it does not start one."""
    pins = [*bound.pins.values(), *bound.output_pins.values()]
    return any(pin.layout.mirrored_dims() for pin in pins)


def blocks_wanted(specs, nodes: list[str], operands,
                  zigzag_written: bool = False) -> dict[str, dict[str, set[tuple[int, bool]]]]:
    """Per op, per letter of its output, block arrangements (count, mirrored) worth offering its
    signatures, asked by the ops downstream:
    - where an op cuts a dim into m equal parts (a fused QKV projection's split into q, k and v), the dim
      can be split in m blocks all the way from the parameters (Megatron's fused QKV: `S(1, blocks=3)`),
      each rank then holding its share of every part;
    - where the file splits a sequence zig-zag and an op's parallel form takes an operand so (ring
      attention's), the sequence can be split so from where it is made (the positions, the mask, the
      rotary tables built per shard). Without a written zig-zag split nothing asks for one: offering it
      upstream of every attention would widen every model's search for a split no input has.
    Inference offers only the blocks its operands already carry, which a parameter left to the search, or
    a tensor made from nothing, never does."""
    wanted: dict[str, dict[str, set[tuple[int, bool]]]] = {}
    for name in reversed(nodes):  # consumers before producers
        spec = specs[name]
        asks = {letter: set(counts) for letter, counts in wanted.get(name, {}).items()}
        asking_forms = [form for form in spec.extra if form.asked_upstream] if zigzag_written else []
        if spec.cut is not None:
            letter, parts = spec.cut
            asks.setdefault(letter, set()).add((parts, False))
        for slot, (o, letters) in enumerate(zip(operands[name], spec.operands)):
            if o not in specs:
                continue  # a placeholder: its placements are its consumers' signatures'
            asked_of_operand = {d: set(asks.get(letter, ())) for d, letter in enumerate(letters)}
            for signature in asking_forms:
                placement = signature.operands[slot] if slot < len(signature.operands) else B
                if placement.is_split and placement.dim < len(letters):
                    asked_of_operand[placement.dim].add(placement.arrangement)
            for d, asked in asked_of_operand.items():
                if asked and d < len(specs[o].output) and specs[o].output[d] is not None:
                    wanted.setdefault(o, {}).setdefault(specs[o].output[d], set()).update(asked)
    return wanted


@dataclass(frozen=True)
class GraphFacts:
    """What the search reads from the bound graph and no move changes: computed once per compile
    (graph_facts) and shared by every program it solves."""

    specs: dict
    graph_nodes: list
    placeholders: list[str]
    operands: dict[str, tuple[str, ...]]
    requires_grad: frozenset[str]
    flops: dict[str, int]
    cut_blocks: dict[str, dict[str, set[tuple[int, bool]]]]
    gather_unit: dict[str, str]
    consumers: dict[str, list[tuple[str, int]]]
    outputs_of: dict[str, list[int]]

    @property
    def nodes(self) -> list[str]:
        return [node.name for node in self.graph_nodes]


def graph_facts(bound: BoundPlan) -> GraphFacts:
    specs, graph_nodes, placeholders, operands, requires_grad = prepare(bound)
    nodes = [node.name for node in graph_nodes]
    consumers: dict[str, list[tuple[str, int]]] = {name: [] for name in placeholders + nodes}
    for name in nodes:
        for slot, o in enumerate(operands[name]):
            consumers[o].append((name, slot))
    outputs_of: dict[str, list[int]] = {}
    for index, (_, name) in enumerate(bound.outputs):
        if name:
            outputs_of.setdefault(name, []).append(index)
    return GraphFacts(specs, graph_nodes, placeholders, operands, requires_grad, bound.flops,
                      blocks_wanted(specs, nodes, operands, _writes_zigzag(bound)), _gather_units(bound, nodes, operands),
                      consumers,
                      outputs_of)


def search(bound: BoundPlan, machine: Machine, limit: int | None = None,
           optimizer: str = "adamw", order: tuple[int | tuple[int, ...], ...] | None = None,
           start: TypedGraph | None = None, facts: GraphFacts | None = None, nearest: bool = True,
           activation_weight: float = 1.0, fewer_buckets: bool = True) -> TypedGraph:
    """`order`: the mesh axes in the order they are decided (default: the mesh's, one at a time); an entry
    that is a tuple of axes is decided jointly, by one program over every combination of their choices
    (Alpa's strategies over a 2-D mesh). With `start`, a plan of the same file, the axes in `order` are
    decided again, each with every other axis as `start` has it: one move of a descent over the mesh's
    axes, which a plan decided one axis at a time cannot make; where an entry has several axes, every op
    keeps its signature in `start` on at least one of them. `facts`: graph_facts(bound), where the caller
    solves several programs. `nearest`: where the bound cannot be met, the plan nearest it (two more
    programs); without it, BoundUnmet, for a caller that has another way to a plan within the bound.
    `activation_weight`: what the bound counts each byte of activations as (a pipeline's rank holds
    several micro-batches' activations of its stage: compiler._compile_pipelined). `fewer_buckets`: a
    program's plan may give way to one without an axis's bucketed gradients (_fewer_buckets); where one
    did, the plan says so (TypedGraph.saved_buckets), and compile rates the plan found without them too."""
    facts = facts or graph_facts(bound)
    mesh = bound.mesh
    decided = _Decided.of(facts, start)
    groups = [(g,) if isinstance(g, int) else tuple(g) for g in (range(mesh.ndim) if order is None else order)]
    proven = None  # the last group, where its program proved its plan optimal
    saved_buckets = False  # a program's plan gave way to one without an axis's bucketed gradients
    for step, group in enumerate(groups):
        decided.forget(group)
        if math.prod(mesh.axis_sizes[a] for a in group) == 1:
            decided.take_whole(bound, facts, group)
            proven = None
            continue
        # the axes still undecided (B so far), whose ranks share what this group leaves per rank
        later = 1 if start is not None else math.prod(mesh.axis_sizes[a] for g in groups[step + 1:] for a in g)
        program = _GroupProgram(bound, machine, facts, decided, group, later, limit, start,
                                OPTIMIZER_STATES[optimizer], activation_weight)
        solution, proven, saved = program.solve(nearest, fewer_buckets)
        saved_buckets |= saved
        program.take(solution)

    def by_axis(decided_on: dict[int, object]) -> list:
        return [decided_on[a] for a in range(mesh.ndim)]

    typed = typed_graph(bound, facts.specs, facts.graph_nodes, facts.placeholders, facts.operands,
                        facts.requires_grad,
                        {name: by_axis(v) for name, v in decided.value.items()},
                        {name: [by_axis(need) for need in v] for name, v in decided.needs.items()},
                        {name: by_axis(v) for name, v in decided.op_out.items()},
                        {name: by_axis(v) for name, v in decided.candidates.items()})
    if proven is not None and len(proven) == 1:
        typed.settled = frozenset(proven)
    typed.saved_buckets = saved_buckets
    return typed


@dataclass
class _Decided:
    """What the search has decided so far, per name and by mesh axis: each value's placement, what each op
    computes and needs of its operands, and each op's priced signatures (explain's runner-ups)."""

    value: dict[str, dict[int, Placement]]
    op_out: dict[str, dict[int, Placement]]
    needs: dict[str, list[dict[int, Placement]]]
    candidates: dict[str, dict[int, list[Candidate]]]

    @classmethod
    def of(cls, facts: GraphFacts, start: TypedGraph | None) -> "_Decided":
        """Nothing decided yet, or everything as the plan `start` has it."""
        nodes = facts.nodes
        decided = cls({name: {} for name in facts.placeholders + nodes}, {name: {} for name in nodes},
                      {name: [{} for _ in facts.operands[name]] for name in nodes}, {name: {} for name in nodes})
        if start is not None:
            for name in facts.placeholders + nodes:
                decided.value[name] = dict(enumerate(start.layout_of(name).placements))
            for name, node in start.nodes.items():
                decided.op_out[name] = dict(enumerate(node.op_layout.placements))
                decided.needs[name] = [dict(enumerate(layout.placements)) for layout in node.operand_layouts]
                decided.candidates[name] = dict(enumerate(start.candidates[name]))
        return decided

    def forget(self, group: tuple[int, ...]) -> None:
        """The group's axes, to be decided afresh (where they came from `start`)."""
        for name, placements in self.value.items():
            for a in group:
                placements.pop(a, None)
        for name, placements in self.op_out.items():
            for a in group:
                placements.pop(a, None)
                for need in self.needs[name]:
                    need.pop(a, None)

    def take_whole(self, bound: BoundPlan, facts: GraphFacts, group: tuple[int, ...]) -> None:
        """Axes of one rank: nothing moves on them, every layout is the same tensor."""
        for a in group:
            for name in self.value:
                pin = bound.pins.get(name)
                self.value[name][a] = pin.layout.placements[a] if pin is not None else B
            for name in self.op_out:
                for need in self.needs[name]:
                    need[a] = B
                self.op_out[name][a] = B
                self.candidates[name][a] = [Candidate(signatures(facts.specs[name])[0], 0, 0, 0, 0, 0, 0, True)]


class _GroupProgram:
    """One integer program: the choices of every op and free tensor on a group of mesh axes, the other
    axes as decided, priced in seconds of the cost model under the memory bound. Built on construction
    (_offer_choices, then _write_program), solved by `solve` and taken into `decided` by `take`."""

    def __init__(self, bound: BoundPlan, machine: Machine, facts: GraphFacts, decided: _Decided,
                 group: tuple[int, ...], later: int, limit: int | None, start: TypedGraph | None,
                 states: int, activation_weight: float):
        self.bound, self.machine, self.facts, self.decided = bound, machine, facts, decided
        self.mesh = bound.mesh
        self.group, self.later, self.limit, self.start = group, later, limit, start
        self.states, self.activation_weight = states, activation_weight
        self.sizes = [self.mesh.axis_sizes[a] for a in group]
        self.strides = [self.mesh.axis_stride(a) for a in group]  # where its ranks lie: inside nodes or across
        self.whole_joint: Joint = (B,) * len(group)
        self.names = facts.placeholders + facts.nodes
        self.unhidden = 1.0 - machine.overlap
        pipeline = bound.par.pipeline  # its axis holds the stages: no conversion moves a value over it
        self.still = frozenset({bound.mesh.axis_index(pipeline.axis)}) if pipeline is not None else frozenset()
        self._ops: dict[str, str] | None = None  # op names, for the collective matmuls' saving
        self._local_sizes: dict[tuple[str, Joint], int] = {}  # the axes outside the group stay as they are
        self._fitted: dict[tuple, bool] = {}  # the same question comes back for every combination of a group
        self.unsplit_reductions = bound.par.substitution("split_reductions") == "off"
        self.regathered_inputs = bound.par.substitution("regather_inputs") == "on"
        self._offer_choices()
        self._write_program()

    # -- a value's layout and bytes with the group's placements in it

    def pinned(self, name: str) -> Joint | None:
        pin = self.bound.pins.get(name)
        if pin is None or name in self.open:
            return None
        return tuple(pin.layout.placements[a] for a in self.group)

    def _written_on_group(self, name: str) -> dict[int, Placement]:
        """Per position in the group, what the file writes for a tensor on that axis (weight_open_axes)."""
        pin = self.bound.pins.get(name)
        if pin is None:
            return {}
        open_axes = weight_open_axes(self.bound, name)
        return {i: pin.layout.placements[a] for i, a in enumerate(self.group) if a not in open_axes}

    def layout(self, decided: dict[int, Placement], joint: Joint) -> Layout:
        placements = [decided.get(a, B) for a in range(self.mesh.ndim)]
        for a, placement in zip(self.group, joint):
            placements[a] = placement
        return Layout(tuple(placements))

    def local_bytes(self, name: str, joint: Joint) -> int:
        if (name, joint) not in self._local_sizes:
            info = self.bound.tensors[name]
            shape = self.layout(self.decided.value[name], joint).local_shape(info.shape, self.mesh)
            self._local_sizes[name, joint] = math.prod(shape) * info.itemsize
        return self._local_sizes[name, joint]

    def taken_bytes(self, name: str, need: dict[int, Placement], joint: Joint) -> int:
        """A rank's bytes of the value as a reader takes it: `need` on the other axes, `joint` on these."""
        info = self.bound.tensors[name]
        return math.prod(self.layout(need, joint).local_shape(info.shape, self.mesh)) * info.itemsize

    def fits(self, name: str, joint: Joint, decided: dict[int, Placement] | None = None) -> bool:
        key = (name, joint, id(decided))
        if key not in self._fitted:
            shape = self.bound.tensors[name].shape
            self._fitted[key] = self.layout(self.decided.value[name], joint).fits(shape, self.mesh) and \
                (decided is None or self.layout(decided, joint).fits(shape, self.mesh))
        return self._fitted[key]

    # -- what each op and free tensor may be on the group's axes

    def _offer_choices(self) -> None:
        """Legal signatures per op, given the axes decided before these: on each axis of the group the
        rule's own, then every combination of them whose layouts fit; per free tensor, the placements its
        consumers can take it in."""
        bound, facts, decided, group, start = self.bound, self.facts, self.decided, self.group, self.start
        operands = facts.operands
        # a weight written on some axes only (`S(0) @ tp`) is the search's on the others (weight_open_axes)
        self.open = {name for name in facts.placeholders if name in bound.pins and
                     any(a in weight_open_axes(bound, name) for a in group)}
        self.free = {name for name in facts.placeholders if (name not in bound.pins or name in self.open) and
                     (name not in bound.inputs or name in bound.searched)}
        self.batch_axes = {a for a in group if any(
            name in self.free or (self._pinned_on(name, a) or (B,))[0].is_split and self._pinned_on(name, a)[0].dim == 0
            for name in bound.inputs)}
        self.legal: dict[str, list[tuple]] = {}  # per op: its joint signatures, one one-axis signature per axis
        self.legal_on: dict[str, list[list]] = {}  # per op, per axis of the group: its legal one-axis signatures
        self.domain: dict[str, list[Joint]] = {}
        for name in facts.placeholders:
            self.domain[name] = [self.pinned(name) or self.whole_joint]
        # Ops of repeated layers ask the same question: answered once per distinct question (everything
        # the answer reads is in the key), so a deep model costs what its distinct ops cost
        answered: dict[int, tuple[list, list, list]] = {}
        question: dict[tuple, int] = {}  # each distinct question a small number, hashed once
        self.legal_key: dict[str, int] = {}
        for name in facts.nodes:
            key = (
                facts.specs[name], _frozen(facts.cut_blocks.get(name, {})), bound.tensors[name].shape,
                _items(decided.value[name]), _items(decided.op_out[name]), self.pinned(name),
                tuple((o in self.free, bound.tensors[o].shape, None if o in self.free else tuple(self.domain[o]),
                       _items(decided.value[o]), _items(decided.needs[name][slot]))
                      for slot, o in enumerate(operands[name])),
                None if start is None or len(group) == 1 else _signature_on(start.nodes[name], group))
            self.legal_key[name] = key = question.setdefault(key, len(question))
            if key not in answered:
                answered[key] = _legal(name, group, facts.specs[name], facts.cut_blocks.get(name, {}),
                                       operands[name], self.free, self.domain, decided.needs[name],
                                       decided.op_out[name], self.fits,
                                       start.nodes[name] if start is not None and len(group) > 1 else None)
            self.legal_on[name], self.legal[name], outputs = answered[key]
            written = self.pinned(name)
            self.domain[name] = [written] if written is not None else outputs
        # what a free tensor's consumers can take it as (a partial sum: from B, locally; a zig-zag split is
        # an activation's, for its sequence: the parameters' syncs and checkpoints cut plainly)
        for name in self.free:
            written = self._written_on_group(name)  # the axes of the group the file writes it on stand
            whole = tuple(written.get(i, B) for i in range(len(group)))
            wanted = [whole] + [_operand(signature, slot) for consumer, slot in facts.consumers[name]
                                for signature in self.legal[consumer]]
            if start is not None:  # a move may keep it as it is (its consumers may no longer take it so)
                wanted.append(tuple(start.layout_of(name).placements[a] for a in group))
            self.domain[name] = [p for p in dict.fromkeys(wanted)
                                 if P not in p and not any(q.mirrored for q in p) and self.fits(name, p)
                                 and all(p[i] == w for i, w in written.items())]

    def _pinned_on(self, name: str, axis: int) -> Joint | None:
        pin = self.bound.pins.get(name)
        return (pin.layout.placements[axis],) if pin is not None else None

    def _fingerprint(self, name: str, position: dict[str, int]) -> tuple:
        """Everything of a value in a repeated layer that its choices read (repeated_layers)."""
        bound, decided, operands = self.bound, self.decided, self.facts.operands
        info = bound.tensors[name]
        links = tuple(("in", position[o]) if o in position else ("out", bound.tensors[o].shape)
                      for o in operands.get(name, ()))
        return (info.shape, str(info.dtype), tuple(self.domain[name]), _items(decided.value[name]),
                name in self.free, name in self.facts.requires_grad, tuple(self.legal.get(name, ())), links,
                tuple(_items(need) for need in decided.needs.get(name, ())), _items(decided.op_out.get(name, {})),
                name in self.facts.outputs_of)

    # -- the program: its columns, their seconds, and the memory bound

    def _write_program(self) -> None:
        self.shared = repeated_layers(self.bound, self.names, self._fingerprint)
        self.program = program = IntegerProgram()
        self.choice: dict[str, list[int]] = {}  # per name: a column per signature (ops) or placement (free tensors)
        for name in self.names:
            if name in self.shared:
                continue
            options = len(self.legal[name]) if name in self.legal else len(self.domain[name])
            self.choice[name] = [program.column(integer=True) for _ in range(options)]
            program.row({column: 1.0 for column in self.choice[name]}, 1.0, 1.0)
        self.objective: dict[int, float] = {}
        self.memory: dict[int, float] = {}
        self.placements = {name: self._placement_terms(name) for name in self.names}
        self._count_held_values()
        self._price_ops()
        self._price_values()
        self._count_gathered_parameters()
        for column, seconds in self.objective.items():
            program.cost[column] += seconds
        self.memory_row = None
        if self.limit is not None:
            self.memory_row = len(program.rows)
            program.row(self.memory, -math.inf, self.limit * self.later - self.fixed_memory)

    def columns_of(self, name: str) -> list[int]:
        return self.choice[self.shared.get(name, name)]

    def _placement_terms(self, name: str) -> dict[Joint, dict[int, float]]:
        """The value's placement on these axes as sums of choice columns (a constant: one fixed column)."""
        result: dict[Joint, dict[int, float]] = {}
        columns = self.columns_of(name)
        if name in self.legal and self.pinned(name) is None:
            for signature, column in zip(self.legal[name], columns):
                result.setdefault(_output(signature), {})[column] = 1.0
        elif name in self.legal:  # written: whatever the op computes, the value is the written layout
            result[self.domain[name][0]] = {column: 1.0 for column in columns}
        else:
            for placement, column in zip(self.domain[name], columns):
                result[placement] = {column: 1.0}
        return result

    def _count_held_values(self) -> None:
        """Parameters with their gradients and optimizer state, and the activations kept for backward, in
        the memory row; a free tensor split at a whisker's cost, so that one that saves nothing is not."""
        bound = self.bound
        self.fixed_memory = 0.0
        for name in self.names:
            if name in bound.parameters:
                factor = self._parameter_factor(name)
            elif name in bound.kept_for_backward:  # held at its own layout, whoever reads it how
                factor = self.activation_weight
            else:
                continue
            for placement, terms in self.placements[name].items():
                nbytes = self.local_bytes(name, placement) * factor
                if len(self.domain[name]) == 1:
                    self.fixed_memory += nbytes
                    break
                for column in terms:
                    _add(self.memory, column, nbytes)
            if name in self.free:
                for placement, terms in self.placements[name].items():
                    if placement != self.whole_joint:
                        for column in terms:
                            _add(self.objective, column, EPSILON_S)

    def _parameter_factor(self, name: str) -> float:
        """A parameter's device bytes per byte of its shard: the shard, its gradient and optimizer state;
        where the file offloads them (cost.memory_per_rank), a copy for compute in the compute dtype."""
        par, dtype = self.bound.par, self.bound.tensors[name].dtype
        if par.offload is not None and dtype.is_floating_point:
            compute = dtype if par.precision is None else getattr(torch, par.precision.params)
            return compute.itemsize / dtype.itemsize
        trained = name in self.facts.requires_grad
        if par.precision is not None and dtype.is_floating_point:
            # traced in the compute dtype, held as the precision pass holds it: a float32 master with its
            # gradient and optimizer state, and the compute-dtype copy the forward casts it to, which
            # autograd keeps for backward unless a recomputed module makes it again (cost._compute_copies).
            # Counted at the traced dtype, a policy's plan held twice what the bound was met with.
            master = torch.float32.itemsize / dtype.itemsize
            return master * (1 + (1 + self.states) * trained) + (not self._recomputed(name))
        return 1 + (1 + self.states) * trained

    def _recomputed(self, name: str) -> bool:
        """Whether the file names a module holding this parameter to recompute (`recompute model.layers.*`)."""
        path = self.bound.parameters.get(name, "").split(".")
        return any(len(path) > len(pattern) and all(p == "*" or p == q for p, q in zip(pattern, path))
                   for pattern in (decl.pattern.split(".") for decl in self.bound.par.recomputes_written))

    def _conversion_seconds(self, name: str, source: Joint, target: Joint) -> float:
        """Converting a value: on one axis, the catalogue's step; on several, the steps lowering plans
        (layouts.plan_conversion), a parameter's gathers on an axis that splits the batch prefetched."""
        bound, machine, mesh, group, sizes = self.bound, self.machine, self.mesh, self.group, self.sizes
        value = self.decided.value
        gradient, parameter = name in self.facts.requires_grad, name in bound.parameters
        if len(group) == 1:
            steps = one_axis_collectives(source[0], target[0], self.local_bytes(name, source), sizes[0], gradient)
            seconds = machine.steps_seconds(steps, sizes[0], self.strides[0]) - \
                self._chunked_saving(name, source[0], target[0], steps)
            if parameter and source[0].is_split and target[0] == B and group[0] in self.batch_axes:
                # prefetched forward, reduce-scattered in buckets backward, and where compile reshards
                # the group after forward, gathered again for backward
                if self._regathered(self.layout(value[name], target)):
                    again = one_axis_collectives(source[0], target[0], self.local_bytes(name, source), sizes[0], False)
                    seconds += machine.steps_seconds(again, sizes[0], self.strides[0])
                seconds *= self.unhidden
            return seconds + EPSILON_S
        info = bound.tensors[name]
        steps = plan_conversion(self.layout(value[name], source), self.layout(value[name], target), info.shape,
                                info.itemsize, mesh, gradient, self.still)
        # lowering prefetches a parameter's gather where it is one all-gather (lowering.GatherGroup);
        # gathered over several axes, it is gathered where it is used, and reduce-scattered there
        prefetched = parameter and len(steps) == 1 and steps[0].kind == "all_gather" and steps[0].axis in self.batch_axes
        seconds = 0.0
        for conversion in steps:
            moved = machine.steps_seconds(step_collectives(conversion, gradient), mesh.axis_sizes[conversion.axis],
                                          mesh.axis_stride(conversion.axis))
            if prefetched:
                if self._regathered(conversion.target):
                    moved += machine.steps_seconds(step_collectives(conversion, False),
                                                   mesh.axis_sizes[conversion.axis], mesh.axis_stride(conversion.axis))
                moved *= self.unhidden
            seconds += moved
        return seconds + EPSILON_S

    def _chunked_saving(self, name: str, source: Placement, target: Placement, steps) -> float:
        """What the compile's collective matmuls (pardsl/passes/collective_matmul.py) save of a one-axis
        conversion: a linear's partial sums reduce-scattered, or a split activation gathered whole for the
        linears that read it, cut into chunks beside the linear's product, as the compile prices them
        (cost.chunked_saving_seconds); so the layouts that lead to them are weighed with them."""
        bound, machine, n, stride = self.bound, self.machine, self.sizes[0], self.strides[0]
        if n <= 1 or bound.par.substitution("collective_matmul") == "off" or name in bound.parameters:
            return 0.0
        def plain_linear(op: str) -> bool:  # the pass cuts beside a linear with no bias
            return self._op(op) == "aten.linear.default" and len(self.facts.operands[op]) == 2

        readers = self.facts.consumers[name]
        if source == P and target.is_split and plain_linear(name):
            beside = name  # the reduce-scatter forward, and the gradient's all-gather backward
        elif source.is_split and target == B and source.blocks == 1 and not source.mirrored and readers and \
                all(slot == 0 and plain_linear(reader) for reader, slot in readers):
            beside = readers[0][0]  # the first of the linears the gathered value feeds
            steps = [step for step in steps if step[0] == "forward"]  # the gradient's reduce-scatter is not cut
        else:
            return 0.0
        # as the runtime cuts it (a micro-batch of one sequence split by tokens is not cut)
        info = bound.tensors[name]
        local = self.layout(self.decided.value[name], (source,)).local_shape(info.shape, self.mesh)
        cut = collective_matmul_cut(tuple(local), (target if target.is_split else source).dim, n)
        if cut is None:
            return 0.0
        chunks = cut[1]
        # the linear's share of its work on a rank: split over this axis and the ones decided before
        others = math.prod(self.mesh.axis_sizes[a] for a, p in self.decided.op_out.get(beside, {}).items()
                           if p.kind != "B" and a not in self.group)
        compute_s = machine.compute_seconds(self.facts.flops.get(beside, 0) / (n * others), 0, info.itemsize <= 2) \
            + machine.op_overhead_s
        saved = 0.0
        for _, kind, nbytes in steps:  # the forward's collective and its adjoint, each beside a product
            moved = machine.collective_seconds(kind, nbytes, n, stride)
            moved_chunk = machine.collective_seconds(kind, nbytes // chunks, n, stride)
            saved += chunked_saving_seconds(machine, moved, moved_chunk, compute_s, chunks)
        return max(0.0, saved) if bound.par.substitution("collective_matmul") == "auto" else saved

    def _op(self, name: str) -> str:
        if self._ops is None:
            self._ops = {node.name: op_name(node) for node in self.facts.graph_nodes}
        return self._ops.get(name, "")

    def _regathered(self, gathered_to: Layout) -> bool:
        """Whether backward gathers a parameter's prefetched group again (reshard.py, as compile applies
        it): without a bound, an FSDP group, one that leaves its parameters whole; under a bound, every
        group, as the program counts gathered memory (two groups at a time), though compile keeps them
        gathered where the plan fits without."""
        return self.limit is not None or all(p == B for p in gathered_to.placements)

    def _edge(self, source: dict[Joint, dict[int, float]], target: dict[Joint, dict[int, float]]):
        """The pair of placements a value is taken in, as terms per (from, to). Where either side has
        one choice the pair is the other side's; else a continuous variable per pair whose sums over
        each side equal that side's choice (a tight linearisation of their product)."""
        program = self.program
        if len(source) == 1:
            (p, _), = source.items()
            return {(p, q): terms for q, terms in target.items()}
        if len(target) == 1:
            (q, _), = target.items()
            return {(p, q): terms for p, terms in source.items()}
        pairs = {(p, q): {program.column(): 1.0} for p in source for q in target}
        for p, terms in source.items():
            program.row(_subtract({next(iter(pairs[p, q])): 1.0 for q in target}, terms), 0.0, 0.0)
        for q, terms in target.items():
            program.row(_subtract({next(iter(pairs[p, q])): 1.0 for p in source}, terms), 0.0, 0.0)
        return pairs

    def _op_seconds(self, name: str) -> list[list[float]]:
        """Per legal signature, the seconds it adds to its column: the op's compute at the share it leaves
        a rank (backward twice forward), a parallel form's own collectives, converting to what is
        written."""
        bound, machine, mesh, sizes = self.bound, self.machine, self.mesh, self.sizes
        value, operands, requires_grad = self.decided.value, self.facts.operands[name], self.facts.requires_grad
        share = math.prod(mesh.axis_sizes[a] for a, p in self.decided.op_out[name].items() if p.kind != "B")
        backward = 3 if name in requires_grad else 1
        written = self.pinned(name)
        result = []
        for signature in self.legal[name]:
            output = _output(signature)
            split = math.prod(n for n, p in zip(sizes, output) if p != B)
            moved = self.local_bytes(name, output) + sum(
                self.local_bytes(o, _operand(signature, slot)) for slot, o in enumerate(operands))
            work = math.prod(one.share_on(n) for one, n in zip(signature, sizes))
            forward = machine.compute_seconds(self.facts.flops.get(name, 0) * work / share / split, moved)
            terms = [backward * forward]
            for i, one in enumerate(signature):
                for inner in one.inner_collectives:
                    if not inner.made(operands[0] in requires_grad):
                        continue
                    first = bound.tensors[operands[0]]
                    local = self.layout(value[operands[0]], _operand(signature, 0)).local_shape(first.shape, mesh)
                    moved_s = machine.collective_seconds(inner.kind, inner.volume(
                        local, one.operands[0], first.itemsize, sizes[i]), sizes[i], self.strides[i])
                    if inner.beside_its_step:
                        moved_s -= hidden_beside_step_seconds(machine, moved_s, forward, sizes[i])
                    terms.append(inner.messages(sizes[i]) * moved_s)
            if written is not None and written != output:
                terms.append(self._conversion_seconds(name, output, written))
            result.append(terms)
        return result

    def traits(self, name: str) -> tuple:
        """What an op's seconds and prices read beyond its legal key: gradients and dtypes."""
        requires_grad, tensors = self.facts.requires_grad, self.bound.tensors
        return (name in requires_grad, str(tensors[name].dtype),
                tuple((o in requires_grad, str(tensors[o].dtype)) for o in self.facts.operands[name]))

    def _price_ops(self) -> None:
        """Each op's seconds on its columns, and per operand the placements its signatures need (`slots`)."""
        operands = self.facts.operands
        self.slots: dict[str, list[dict[Joint, dict[int, float]]]] = {}  # per op and operand: its signatures' needs
        self.computed: dict[str, dict[int, Joint]] = {}  # per op: what each of its columns computes
        costed: dict[tuple, list[list[float]]] = {}  # once per distinct question, as the legal signatures
        for name in self.facts.nodes:
            key = (self.legal_key[name], self.facts.flops.get(name, 0), self.traits(name))
            if key not in costed:
                costed[key] = self._op_seconds(name)
            for column, terms in zip(self.columns_of(name), costed[key]):
                for seconds in terms:
                    _add(self.objective, column, seconds)
            if self.shared.get(name) in self.slots:  # a repeated layer's op: the same columns, the same needs
                self.slots[name], self.computed[name] = self.slots[self.shared[name]], self.computed[self.shared[name]]
                continue
            by_slot: list[dict[Joint, dict[int, float]]] = [{} for _ in operands[name]]
            self.computed[name] = {}
            for signature, column in zip(self.legal[name], self.columns_of(name)):
                self.computed[name][column] = _output(signature)
                for slot in range(len(operands[name])):
                    terms = by_slot[slot].setdefault(_operand(signature, slot), {})
                    terms[column] = terms.get(column, 0.0) + 1.0
            self.slots[name] = by_slot

    def _price_values(self) -> None:
        """Each value's conversions to what its readers take, the copies held for backward, the reduction
        of its gradient, and finishing a partial output. Values of repeated layers taken by the same
        (shared) consumers are one class, whose conversions are priced once times its size."""
        bound, facts, machine, group, sizes = self.bound, self.facts, self.machine, self.group, self.sizes
        shared, program, consumers = self.shared, self.program, facts.consumers
        self.held_copies: dict[tuple, int] = {}  # (class, the copy's layout on other axes, on these) → its column
        self.copy_rows: set[tuple] = set()
        self.regathered: set[tuple] = set()  # conversions whose gather backward issues again (passes/regather.py)
        self.converted: dict[tuple, int] = {}  # once per value (class), from and to
        self.gathered: dict[str, dict[int, float]] = {}  # per gather group: its conversions' columns → bytes whole
        self.copies: dict[str, int] = {}  # per gather group: how many layers it stands for
        self.gathered_elsewhere: dict[tuple, int] = {}  # (class, need elsewhere, taken at) → gathered on other axes
        lists = {node.name for node in facts.graph_nodes if is_tensor_list(node)}
        classes: dict[tuple, list[str]] = {}
        for name in self.names:
            uses = tuple(sorted({(shared.get(v, v), slot) for v, slot in consumers[name]}))
            ends = tuple((i, tuple(bound.output_pins[i].layout.placements[a] for a in group)
                          if i in bound.output_pins else None) for i in facts.outputs_of.get(name, ()))
            if uses or ends:
                classes.setdefault((shared.get(name, name), uses, ends), []).append(name)
        syncs: dict[tuple, int] = {}  # (class, axis, placements) → its gradient's reduction over the axis
        self.bucketed: dict[tuple[int, str], list[tuple[int, int]]] = {}  # (axis, kind) → (sync column, bytes)
        for key, members in classes.items():
            name, uses, ends = members[0], key[1], key[2]
            count = len(members)
            for v, slot in uses:
                pairs = self._edge(self.placements[name], self.slots[v][slot])
                reader = next(u for u, at in consumers[name] if shared.get(u, u) == v and at == slot)
                # a list (a split's parts) is converted part by part, as each getitem takes it
                # (inference.typed_graph): each reader pays its own
                once = (key, v, slot) if name in lists else key
                self._convert(once, name, pairs, count,
                              self.decided.needs[reader][slot] if name in bound.parameters else None)
                if (reader, name) in bound.kept.reads:
                    self._hold(key, name, reader, v, slot, pairs, members)
                if name not in facts.requires_grad:
                    continue
                # taken whole on an axis by a signature that computes split, the value's gradient is partial
                # over it: one all-reduce of it serves every such consumer; a gathered one's adjoint
                # reduce-scatters it
                taken_whole = {(target, i): [c for c in columns if self.computed[v][c][i] == B]
                               for target, columns in self.slots[v][slot].items() for i in range(len(group))}
                for (source, target), terms in pairs.items():
                    for i, a in enumerate(group):
                        if target[i] != B:
                            continue
                        if (key, i, source, target) not in syncs:
                            kind = "reduce_scatter" if source[i].is_split else "all_reduce"
                            seconds = machine.local_collective_seconds(kind, self.local_bytes(name, target), sizes[i],
                                                                      self.strides[i])
                            syncs[key, i, source, target] = column = program.column()
                            if name in bound.parameters:  # in a bucket: its bytes, behind the rest of backward
                                seconds = self.unhidden * (seconds - machine.collective_seconds(kind, 0, sizes[i], self.strides[i]))
                                self.bucketed.setdefault((i, kind), []).append(
                                    (column, count * self.local_bytes(name, target)))
                            program.cost[column] = count * seconds
                        row = _subtract({syncs[key, i, source, target]: 1.0}, terms)
                        for column in taken_whole[target, i]:
                            row[column] = row.get(column, 0.0) + 1.0
                        program.row(row, 0.0, math.inf)
            for _, written in ends:
                if written is not None:
                    self._convert(key, name, self._edge(self.placements[name], {written: {}}), count, written=True)
                    continue
                for placement, terms in self.placements[name].items():
                    for i, p in enumerate(placement):
                        if p == P:  # a partial output is finished
                            seconds = machine.local_collective_seconds(
                                "all_reduce", self.local_bytes(name, placement), sizes[i], self.strides[i])
                            for column in terms:
                                _add(self.objective, column, count * seconds)

    def _in_group(self, name: str, source: Layout, target: Layout) -> bool:
        """Whether lowering gathers the parameter in a prefetched group."""
        info = self.bound.tensors[name]
        return one_group_gather(plan_conversion(source, target, info.shape, info.itemsize, self.mesh,
                                                name in self.facts.requires_grad, self.still), self.mesh)

    def _gathered_in_group(self, name: str, column: int, nbytes: int, count: int) -> None:
        """A parameter's gather in one of lowering's groups (GatherGroup), where `column` is taken: held a
        group at a time."""
        unit = self.facts.gather_unit[name]
        _add(self.gathered.setdefault(unit, {}), column, nbytes)
        self.copies[unit] = max(self.copies.get(unit, 1), count)

    def _convert(self, key, name: str, pairs, count: int, need: dict[int, Placement] | None = None,
                 written: bool = False) -> None:
        """`need`: what the reader takes on the other axes, where it is a parameter's reader. `written`: the
        target is a layout the file writes (an output's)."""
        program, own = self.program, self.decided.value[name]
        for (p, q), terms in pairs.items():
            if self.unsplit_reductions and not written and self.pinned(name) is None and \
                    any(s.kind == "P" and t.is_split for s, t in zip(p, q)):
                # `substitute split_reductions : off`: a partial sum the search makes is never split, whatever
                # the bound (a price would give way to it where memory is short); the file's own layouts stand
                program.row(dict(terms), -math.inf, 0.0)
                continue
            if p == q:
                if need is not None and need != own and self._in_group(name, self.layout(own, p), self.layout(need, q)):
                    # gathered on an axis this program does not decide, at the bytes the pair leaves a rank
                    taken = (key, _items(need), q)
                    if taken not in self.gathered_elsewhere:
                        self.gathered_elsewhere[taken] = program.column()
                        self._gathered_in_group(name, self.gathered_elsewhere[taken],
                                                self.taken_bytes(name, need, q), count)
                    program.row(_subtract({self.gathered_elsewhere[taken]: 1.0}, terms), 0.0, math.inf)
                continue
            if (key, p, q) not in self.converted:
                column = program.column(count * self._conversion_seconds(name, p, q))
                self.converted[key, p, q] = column
                if name in self.bound.parameters and any(s.is_split and t == B for s, t in zip(p, q)) and \
                        self._in_group(name, self.layout(own, p), self.layout(own, q)):
                    self._gathered_in_group(name, column, self.local_bytes(name, q), count)
            program.row(_subtract({self.converted[key, p, q]: 1.0}, terms), 0.0, math.inf)

    def _hold(self, key, name: str, reader: str, reader_rep: str, slot: int, pairs, members: list[str]) -> None:
        """What an op keeps of an operand it reads converted (saved_for_backward.Kept.reads) is a copy held
        until backward, while some keeping reader takes it so (lowering._copies_held_for_backward); in the
        choices' own columns, which keeps the program as quick to solve as without it."""
        bound, program = self.bound, self.program
        need, own = self.decided.needs[reader][slot], self.decided.value[name]
        moved_before = any(need.get(a, B) != own.get(a, B) for a in set(need) | set(own))
        count = len(members)  # each member a value of its own, converted on its own
        parameter = bound.kept.owner.get(name, name) in bound.parameters
        # a linear's input gathered on one axis, kept split and gathered again in backward where the file
        # asks (passes/regather.py): no copy, the value counted at its own layout
        regathered = self.regathered_inputs and not parameter and not moved_before and slot == 0 and \
            self._op(reader) == "aten.linear.default"
        for (p, q), terms in pairs.items():
            if not (moved_before or p != q):
                continue  # taken as it is: held at its own layout, counted with the values
            if parameter and self._in_group(name, self.layout(own, p), self.layout(need, q)):
                continue  # gathered in a group, counted a group at a time
            if regathered and _gathered_on_one_axis(p, q):
                if (key, p, q) in self.converted and (key, p, q) not in self.regathered:
                    # its gather issued again in backward, where the conversion is made
                    self.regathered.add((key, p, q))
                    program.cost[self.converted[key, p, q]] += count * self._gathered_again_seconds(name, p, q)
                continue
            copy = (key, _items(need), q)
            if copy not in self.held_copies:
                column = program.column(HELD_S)  # at its least where nothing needs it held
                _add(self.memory, column, count * self.taken_bytes(name, need, q) * self.activation_weight)
                self.held_copies[copy] = column
            if parameter:  # whether it is a group's gather depends on the pair
                program.row(_subtract({self.held_copies[copy]: 1.0}, terms), 0.0, math.inf)
            elif (copy, reader_rep, slot) not in self.copy_rows:  # taken as q where the value is not q
                self.copy_rows.add((copy, reader_rep, slot))
                row = _subtract({self.held_copies[copy]: 1.0}, self.slots[reader_rep][slot].get(q, {}))
                if not moved_before:
                    for source in [q] + [p for p in self.placements[name] if regathered and _gathered_on_one_axis(p, q)]:
                        for column, v in self.placements[name].get(source, {}).items():
                            row[column] = row.get(column, 0.0) + v
                program.row(row, 0.0, math.inf)

    def _gathered_again_seconds(self, name: str, source: Joint, target: Joint) -> float:
        """A value's all-gather on the one axis of the group that moves it, from `source` to `target`."""
        i = next(i for i, (s, t) in enumerate(zip(source, target)) if s != t)
        steps = one_axis_collectives(source[i], target[i], self.local_bytes(name, source), self.sizes[i], False)
        return self.machine.steps_seconds(steps, self.sizes[i], self.strides[i])

    def _count_gathered_parameters(self) -> None:
        """Gathered parameters are held one group at a time, the next one prefetched (cost.memory_per_rank
        counts its two largest gather groups). The two largest, in the program: at its least over a level
        λ, 2λ + Σ each group's excess over λ (times the layers it stands for, at most 2: repeated layers
        share their columns); columns scaled to [0, 1]."""
        if not self.gathered:
            return
        program = self.program
        scale = sum(sum(unit.values()) for unit in self.gathered.values())
        held = min(2, sum(self.copies.values()))
        level = program.column(HELD_S * held)  # HELD_S in proportion: at its least, the sum of the two
        _add(self.memory, level, held * scale)
        for unit, terms in self.gathered.items():
            times = min(held, self.copies.get(unit, 1))
            over = program.column(HELD_S * times)
            program.row(_subtract({over: scale, level: scale}, terms), 0.0, math.inf)
            _add(self.memory, over, times * scale)

    # -- solved, and taken

    def solve(self, nearest: bool, fewer_buckets: bool) -> tuple[list[float], tuple[int, ...] | None, bool]:
        """The plan's columns; the group, where the program proved its plan optimal; whether the plan gave
        way to one without an axis's bucketed gradients."""
        program, group, mesh = self.program, self.group, self.mesh
        # a descent's move starts from its plan, one of its choices: branch and bound starts there too
        hint = _hint(self.start, group, self.choice, self.legal, self.domain) if self.start is not None else None
        report(f"searching the layouts: deciding {', '.join(mesh.axis_names[a] for a in group)}"
               f"{' again, from a plan' if self.start is not None else ''}: an integer program of "
               f"{len(program.cost):,} columns and {len(program.rows):,} rows (up to {solver.TIME_LIMIT_S:.0f} s)")
        status, solution = program.solve(hint=hint)
        # proven only after the buckets are weighed: the program alone (`fewer_buckets` off) is not what
        # deciding the group again asks, and a plan nearest an unmeetable bound is not proven
        proven, saved_buckets = None, False
        if status == "infeasible" and self.memory_row is not None:  # the bound cannot be met: N003
            if not nearest:
                raise BoundUnmet()
            status, solution = nearest_the_bound(program, self.memory_row, hint)
        elif status in ("optimal", "time limit") and fewer_buckets:
            # where the batch may be split, every parameter's gradient is reduced: no other plan to try
            latencies = {key: (self.unhidden * self.machine.collective_seconds(key[1], 0, self.sizes[key[0]], self.strides[key[0]]), members)
                         for key, members in self.bucketed.items() if group[key[0]] not in self.batch_axes}
            programs_own = solution
            status, solution = _fewer_buckets(program, latencies, status, solution, hint)
            saved_buckets = solution is not programs_own
            proven = group if status == "optimal" else None
        if status not in ("optimal", "time limit"):  # at the limit: the best plan found by then
            names = ", ".join(mesh.axis_names[a] for a in group)
            raise NoPlanFound(f"the layout search found no plan on axis {names}: {status}")
        return solution, proven, saved_buckets

    def take(self, solution: list[float]) -> None:
        """The solution's choices into `decided`, each op's signatures priced against them (explain)."""
        bound, facts, decided, group, mesh = self.bound, self.facts, self.decided, self.group, self.mesh
        operands = facts.operands

        def taken(name: str) -> int:
            columns = self.columns_of(name)
            return max(range(len(columns)), key=lambda i: solution[columns[i]])

        for name in facts.placeholders:
            chosen = self.domain[name][taken(name)] if name in self.free else self.domain[name][0]
            for i, a in enumerate(group):
                decided.value[name][a] = chosen[i]
        for name in facts.nodes:
            signature = self.legal[name][taken(name)]
            written = self.pinned(name)
            for i, a in enumerate(group):
                for slot, req in enumerate(signature[i].operands):
                    decided.needs[name][slot][a] = req
                decided.op_out[name][a] = signature[i].output
                decided.value[name][a] = written[i] if written is not None else signature[i].output
        priced: dict[tuple, list[list[Candidate]]] = {}  # once per distinct question, as the legal signatures
        for name in facts.nodes:
            index = taken(name)
            key = (self.legal_key[name], index, self.traits(name), _items(decided.value[name]),
                   tuple(_items(decided.value[o]) for o in operands[name]))
            if key not in priced:
                signature = self.legal[name][index]
                priced[key] = [_priced(name, a, self.legal_on[name][i], signature[i], operands[name], decided.value,
                                       facts.requires_grad, bound, mesh, mesh.axis_sizes[a])
                               for i, a in enumerate(group)]
            for i, a in enumerate(group):
                decided.candidates[name][a] = list(priced[key][i])


def _gathered_on_one_axis(source: Joint, target: Joint) -> bool:
    """Whether a value taken from `source` to `target` is all-gathered on one axis, as it is on the others."""
    moved = [(s, t) for s, t in zip(source, target) if s != t]
    return len(moved) == 1 and moved[0][0].is_split and moved[0][1] == B


def _add(terms: dict[int, float], column: int, value: float) -> None:
    terms[column] = terms.get(column, 0.0) + value


def _subtract(row: dict[int, float], terms: dict[int, float]) -> dict[int, float]:
    for column, v in terms.items():
        row[column] = row.get(column, 0.0) - v
    return row


def _items(decided: dict) -> tuple:
    return tuple(sorted(decided.items()))


def _frozen(offered: dict[str, set[tuple]]) -> tuple:
    return tuple(sorted((letter, tuple(sorted(arrangements, key=arrangement_order)))
                        for letter, arrangements in offered.items()))


def _signature_on(node, group: tuple[int, ...]) -> tuple:
    """What a plan's op computes and needs on the group's axes."""
    return tuple((node.op_layout.placements[a], tuple(layout.placements[a] for layout in node.operand_layouts))
                 for a in group)


def _legal(name, group, spec, cut_blocks, operands, free, domain, needs, op_out, fits, start_node):
    """An op's legal signatures on a group of axes, given the axes decided before: on each axis the rule's
    own whose layouts fit, then every combination of them whose layouts fit; with `start_node` (a move of
    the descent over several axes) only those keeping its signature on at least one axis. Returns the
    per-axis lists (index in the rule's order, signature), the joint signatures, and their distinct
    outputs (the op's domain, where its layout is not written)."""
    width = len(group)
    per_axis = []
    for i in range(width):
        offered = {letter: set(counts) for letter, counts in cut_blocks.items()}
        for o, letters in zip(operands, spec.operands):
            if o in free:
                continue
            for joint in domain[o]:
                placement = joint[i]
                if placement.is_split and placement.blocks > 1 and placement.dim < len(letters) and \
                        letters[placement.dim] is not None:
                    offered.setdefault(letters[placement.dim], set()).add(placement.arrangement)
        per_axis.append([
            (index, signature) for index, signature in enumerate(signatures(spec, offered))
            if all(fits(o, _on(i, width, B if (req == P and o in free) else req), needs[slot])
                   for slot, (o, req) in enumerate(zip(operands, signature.operands)))
            and fits(name, _on(i, width, signature.output), op_out)])
    kept = [{index for index, one in entries if _same_signature(start_node, a, one)}
            for a, entries in zip(group, per_axis)] if start_node is not None else None
    legal = []
    for combination in itertools.product(*per_axis):
        indices = tuple(index for index, _ in combination)
        if kept is not None and any(kept) and not any(i in k for i, k in zip(indices, kept)):
            continue
        joint_signature = tuple(signature for _, signature in combination)
        if width == 1 or (
                all(fits(o, tuple(B if (s.operands[slot] == P and o in free) else s.operands[slot]
                                  for s in joint_signature), needs[slot])
                    for slot, o in enumerate(operands))
                and fits(name, _output(joint_signature), op_out)):
            legal.append(joint_signature)
    assert legal, f"no legal signature for {name}"  # all-B always fits
    return per_axis, legal, list(dict.fromkeys(_output(signature) for signature in legal))


def _hint(start: TypedGraph, group: tuple[int, ...], choice: dict[str, list[int]], legal, domain) -> dict[int, float]:
    """The choice columns of the plan `start` on the group's axes: per op the signature it computes there,
    per free tensor its placement (left out where the program does not offer it)."""
    hint = {}
    for name, columns in choice.items():
        if name in legal:
            taken = [j for j, signature in enumerate(legal[name])
                     if all(_same_signature(start.nodes[name], a, one) for a, one in zip(group, signature))]
        else:
            before = tuple(start.layout_of(name).placements[a] for a in group)
            taken = [j for j, joint in enumerate(domain[name]) if joint == before]
        if taken:
            hint.update({column: float(j == taken[0]) for j, column in enumerate(columns)})
    return hint


def _same_signature(node, axis: int, signature) -> bool:
    """Whether a one-axis signature is what the op computes on `axis` in `node` (a plan's)."""
    return signature.output == node.op_layout.placements[axis] and \
        all(req == layout.placements[axis] for req, layout in zip(signature.operands, node.operand_layouts))


def _on(i: int, width: int, placement: Placement) -> Joint:
    """A joint placement: `placement` on the group's i-th axis, B on its others."""
    return (B,) * i + (placement,) + (B,) * (width - i - 1)


def _output(signature: tuple) -> Joint:
    return tuple(one.output for one in signature)


def _operand(signature: tuple, slot: int) -> Joint:
    return tuple(one.operands[slot] for one in signature)


def _priced(name, axis, legal, chosen, operands, value, requires_grad, bound, mesh, n) -> list[Candidate]:
    """Each legal signature priced in bytes against the placements chosen around it: what `explain`
    shows as runner-ups."""
    def local_bytes(tensor: str, placement: Placement) -> int:
        info = bound.tensors[tensor]
        placements = tuple(placement if a == axis else value[tensor].get(a, B) for a in range(mesh.ndim))
        return math.prod(Layout(placements).local_shape(info.shape, mesh)) * info.itemsize

    priced = []
    for index, signature in legal:
        forward = backward = changes = 0
        for o, req in zip(operands, signature.operands):
            source = value[o][axis]
            for phase, _, nbytes in one_axis_collectives(source, req, local_bytes(o, source), n, o in requires_grad):
                forward += nbytes if phase == "forward" else 0
                backward += nbytes if phase == "backward" else 0
            changes += source != req
            if req == B and source == B and signature.output != B and o in requires_grad:
                backward += collective_bytes("all_reduce", local_bytes(o, B), n)
        priced.append(Candidate(signature, forward, backward, 0, changes, local_bytes(name, signature.output),
                                index, signature == chosen))
    return priced
