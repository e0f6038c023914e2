"""Stage 3: bound plan → typed graph. Every tensor gets a layout; the ones not written are inferred.

Inference runs one mesh axis at a time (nd-SBP as the product of one-axis signatures, as OneFlow does),
in graph order, greedily: each op takes the legal signature whose cost is least (OneFlow's min-copy-cost
pass). The cost of a signature is compared in this order:

0. parameters the file writes split on an axis no input is split on, gathered by the signature:
   such a layout asks for the op to compute split (Megatron's tensor parallelism), so a signature that
   uses it as written wins, however fewer bytes a gather of the weight would move than one of the
   activations: the gathered weight would make the axis a data-parallel one the file did not ask for,
   held whole for backward;
1. forward bytes per rank: converting operands from the layouts they have to the ones the signature
   needs, and the result to the layout the user wrote for it. Layouts flow through ops and are converted
   only where an op cannot take them as they are (GSPMD's propagation), so `x : S(0)` with replicated
   weights gives data parallelism, not a gather of x into replicated compute;
2. backward bytes per rank: the adjoints of those conversions, and the one all-reduce of the gradient of
   a broadcast value that sharded computation consumes (Megatron's `f`), once per value;
3. bytes off the critical path, on an axis that splits the batch (an input's dim 0) where the op's data
   is already split and stays so: a
   parameter stored split and gathered whole for the op (the gather is prefetched while the op before
   computes; its gradient is reduce-scattered in buckets during backward),
   and the bucketed all-reduce of a broadcast parameter's gradient. This is why weights stored `S(0)`
   over an axis that splits the batch are gathered (FSDP / ZeRO-3) rather than used split with the
   activations gathered or exchanged, which would stall the computation;
4. the number of conversions, local slices included: a value keeps its layout where it can;
5. local compute (elements of the result on one rank): sharded work wins ties, except where every
   operand is B: a result split there would save local work only, and might have to be gathered again.

Greedy inference sees one op at a time, so two rules keep it from steps that only look cheap:
a conversion already paid for (the same value, axis and placement, for an earlier consumer) costs
nothing again; and a partial sum is finished with an all-reduce, not reduce-scattered, unless a layout
the user wrote asks for the split (Megatron-SP does): the shards of a reduce-scatter would have to be
gathered again later, which one op cannot see.

What the user wrote always stands: a pinned tensor keeps its layout, and where an op needs another one a
conversion is inserted (and reported by the lowering). Parameters and buffers the file leaves out are
free: the first op that consumes one chooses its layout, preferring B on ties. Inputs left out are B.
Outputs left out keep their inferred layout, except that a partial sum is finished (P → B).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pardsl.language.diagnostics import DiagnosticSink
from pardsl.layouts.algebra import CONVERSIONS, B, Layout, Mesh, P, Placement, collective_bytes
from pardsl.layouts.oprules import (
    DimSpec,
    Signature,
    dim_spec,
    is_random,
    is_tensor_list,
    is_tensor_valued,
    op_name,
    rule_for,
    signatures,
    tensor_operands,
    unmet_requirement,
)
from pardsl.model.binding import MOE_HINT, BoundPlan, TensorInfo
from pardsl.model.export import called_at, source_line


@dataclass(frozen=True)
class TypedNode:
    name: str
    op: str
    spec: DimSpec
    operands: tuple[str, ...]  # tensor operand node names, in rule order
    operand_layouts: tuple[Layout, ...]  # the layout each operand must have for this op
    op_layout: Layout  # the layout the op computes
    value_layout: Layout  # the layout the name holds (the user's, if pinned)


@dataclass(frozen=True)
class Candidate:
    """One legal signature of an op on one mesh axis, priced given the layouts decided before it: what a
    search chooses among. Bytes per rank; the key orders candidates, cheapest first."""

    signature: Signature
    forward: int  # communication that stalls the forward
    backward: int  # and the backward
    deferred: int  # communication off the critical path (prefetched gathers, bucketed gradients)
    changes: int  # conversions and choices made (fewer is simpler)
    compute: int  # bytes of the result computed per rank
    index: int  # the signature's place in the rule's order
    chosen: bool = False  # the one inference took
    # parameters the file writes split on this axis that the signature gathers, where no input is split
    # on the axis: weighed before any bytes (see `infer`)
    unwritten: int = 0

    @property
    def key(self) -> tuple[int, ...]:
        return (self.unwritten, self.forward, self.backward, self.deferred, self.changes, self.compute, self.index)


@dataclass
class TypedGraph:
    bound: BoundPlan
    nodes: dict[str, TypedNode]  # op nodes, graph order
    placeholder_layouts: dict[str, Layout]  # parameters, buffers, inputs
    output_layouts: list[Layout]  # per flat output
    requires_grad: frozenset[str]
    candidates: dict[str, list[list[Candidate]]]  # per op node, per mesh axis: what was chosen among
    # the mesh axes whose integer program, the others fixed as this plan has them, proved this plan its
    # optimum (search.search): deciding such an axis alone again from this plan finds it again
    settled: frozenset[int] = frozenset()
    # a program's plan gave way to one without an axis's bucketed gradients, which its own estimate rated
    # faster (search._fewer_buckets): compile rates the plan found without that step too
    saved_buckets: bool = False

    @property
    def mesh(self) -> Mesh:
        return self.bound.mesh

    def layout_of(self, name: str) -> Layout:
        return self.placeholder_layouts[name] if name in self.placeholder_layouts else self.nodes[name].value_layout

    def info(self, name: str) -> TensorInfo:
        return self.bound.tensors[name]


def one_axis_collectives(source: Placement, target: Placement, local_bytes: int, n: int,
                         with_backward: bool) -> list[tuple[str, str, int]]:
    """The collectives (phase, kind, bytes per rank) of converting a value of `local_bytes` from `source`
    to `target` over n ranks, from the conversion catalogue (layouts.CONVERSIONS); a pair with no row
    goes through B."""
    if source == target:
        return []
    conversion = CONVERSIONS.get((source.kind, target.kind))
    if conversion is None or (conversion.kind == "all_to_all" and (source.blocks > 1 or target.blocks > 1)):
        # S → P; and no blocked all-to-all: both via B
        whole = local_bytes * n if source.is_split else local_bytes
        return one_axis_collectives(source, B, local_bytes, n, with_backward) + \
            one_axis_collectives(B, target, whole, n, with_backward)
    target_bytes = local_bytes * (n if source.is_split else 1) // (n if target.is_split else 1)
    steps = []
    if conversion.forward:
        steps.append(("forward", conversion.forward, collective_bytes(conversion.forward, local_bytes, n)))
    if with_backward and conversion.backward:
        steps.append(("backward", conversion.backward, collective_bytes(conversion.backward, target_bytes, n)))
    return steps


def _one_axis_cost(source: Placement, target: Placement, local_bytes: int, n: int, with_backward: bool,
                   written: bool = False) -> int:
    """Bytes per rank of converting a value of `local_bytes` from `source` to `target` over n ranks."""
    if source.kind == "P" and target.kind == "S" and not written:  # priced as finishing the sum (module doc)
        return _one_axis_cost(source, B, local_bytes, n, with_backward) + 1
    return sum(nbytes for _, _, nbytes in one_axis_collectives(source, target, local_bytes, n, with_backward))


ATTENTION_DROPOUT_HINT = ("the fused attention draws its dropout inside the kernel, per rank's heads, not serial's "
                          "mask; eager attention (Hugging Face's attn_implementation=\"eager\") applies dropout "
                          "as an op, which pardsl draws as serial does; or set the attention dropout to 0")


def _check_ops(bound: BoundPlan, sink: DiagnosticSink) -> dict[str, DimSpec]:
    specs: dict[str, DimSpec] = {}
    unsupported: dict[tuple[str, str], list[str]] = {}
    for node in bound.graph.nodes:
        if node.op != "call_function" or node.name in bound.scalars:  # sizes: computed, not laid out
            continue
        rule = rule_for(node)
        where = bound.module_paths.get(node.name) or "the model's own forward()"
        if rule is not None and rule.family == "check":
            continue
        if rule is None or not is_tensor_valued(node):
            unsupported.setdefault((op_name(node), " (random: each rank would draw its own values)"
                                    if is_random(node) else ""), {}).setdefault(where, source_line(node))
            continue
        problem = unmet_requirement(node, rule)
        if problem is not None:
            unsupported.setdefault((op_name(node), f" with {problem}"), {}).setdefault(where, source_line(node))
            continue
        specs[node.name] = dim_spec(node, rule)
    for (op, detail), places in unsupported.items():
        sink.error("E060", f"operation `{op}`{detail} is not supported", bound.par.model.span,
                   f"used in {', '.join(sorted(places)[:3])}", *called_at(*places.values()),
                   "pardsl knows the ops listed in pardsl/layouts/oprules.py (RULES)",
                   *([MOE_HINT] if any("expert" in place for place in places) else []),
                   *([ATTENTION_DROPOUT_HINT] if "dropout_p" in detail else []))
    return specs


def prepare(bound: BoundPlan):
    """What inference and the search both start from: each op's dim spec (unsupported ops are E060), the
    op nodes in graph order, the placeholders, each op's tensor operands, and what needs a gradient.
    Read-only: kept with the bound (BoundPlan.derived) and shared by every caller, as a compile asks for it
    once per search, recipe and greedy completion (nine times for a searched 80-layer model, most of a
    second each)."""
    key = ("prepare", id(bound.graph), frozenset(bound.trained_parameters), tuple(bound.outputs),
           tuple(bound.scalars.items()))
    kept = bound.derived.get(key)
    if kept is None or kept[0] is not bound.graph:  # an id is unique only while its graph lives
        kept = bound.derived[key] = (bound.graph, _prepared(bound))
    return kept[1]


def _prepared(bound: BoundPlan):
    sink = DiagnosticSink(bound.par.source)
    specs = _check_ops(bound, sink)
    sink.raise_if_any()
    graph_nodes = [n for n in bound.graph.nodes if n.op == "call_function" and n.name in specs]
    placeholders = [n.name for n in bound.graph.nodes if n.op == "placeholder"]
    operands = {n.name: tuple(o.name for o in tensor_operands(n)) for n in graph_nodes}
    requires_grad = set(bound.trained_parameters)
    for node in graph_nodes:
        if bound.tensors[node.name].is_differentiable and rule_for(node).differentiable and \
                any(o in requires_grad for o in operands[node.name]):
            requires_grad.add(node.name)
    # A gradient reaches only what an output is computed from: a branch whose result the model does not
    # return (BERT's pooler under a model that returns the hidden states) gets none, nor do its weights.
    reaches_output = {name for _, name in bound.outputs if name in requires_grad}
    for node in reversed(graph_nodes):
        if node.name in reaches_output:
            reaches_output.update(o for o in operands[node.name] if o in requires_grad)
    return specs, graph_nodes, placeholders, operands, frozenset(requires_grad & reaches_output)


def infer(bound: BoundPlan) -> TypedGraph:
    specs, graph_nodes, placeholders, operands, requires_grad = prepare(bound)
    mesh = bound.mesh

    # Per name, the placements decided so far, one per axis processed.
    value: dict[str, list[Placement]] = {name: [] for name in placeholders}
    op_out: dict[str, list[Placement]] = {n.name: [] for n in graph_nodes}
    value.update({n.name: [] for n in graph_nodes})
    needs: dict[str, list[list[Placement]]] = {n.name: [[] for _ in operands[n.name]] for n in graph_nodes}
    candidates: dict[str, list[list[Candidate]]] = {n.name: [] for n in graph_nodes}

    for axis in range(mesh.ndim):
        n = mesh.axis_sizes[axis]

        def layout_with(name: str, placement: Placement) -> Layout:
            decided = value[name][:axis] if len(value[name]) > axis else value[name]
            return Layout(tuple(decided[:axis]) + (placement,) + (B,) * (mesh.ndim - axis - 1))

        def required(decided: list[Placement], placement: Placement) -> Layout:
            return Layout(tuple(decided[:axis]) + (placement,) + (B,) * (mesh.ndim - axis - 1))

        def local_bytes(name: str, placement: Placement) -> int:
            info = bound.tensors[name]
            return math.prod(layout_with(name, placement).local_shape(info.shape, mesh)) * info.itemsize

        # an axis that splits the batch (an input's dim 0): data parallelism's axis, where FSDP and DDP live
        batch_axis = any(pin.layout.placements[axis].is_split and pin.layout.placements[axis].dim == 0
                         for name, pin in bound.pins.items() if name in bound.inputs)
        # an axis some input is split on (the batch, or the sequence: context parallelism) holds data: a
        # weight written split on it is stored split and gathered for use (FSDP), not Megatron's
        data_axis = any(pin.layout.placements[axis].is_split for name, pin in bound.pins.items() if name in bound.inputs)
        if n == 1:  # one rank on this axis: every layout is the same tensor and nothing moves; all B
            for name in placeholders:
                pin = bound.pins.get(name)
                value[name].append(pin.layout.placements[axis] if pin is not None else B)
            for node in graph_nodes:
                pin = bound.pins.get(node.name)
                candidates[node.name].append([Candidate(Signature((B,) * len(operands[node.name]), B), 0, 0, 0, 0, 0, 0, True)])
                for slot in range(len(operands[node.name])):
                    needs[node.name][slot].append(B)
                op_out[node.name].append(B)
                value[node.name].append(pin.layout.placements[axis] if pin is not None else B)
            continue
        free: set[str] = set()
        for name in placeholders:
            pin = bound.pins.get(name)
            if pin is not None:
                value[name].append(pin.layout.placements[axis])
            elif name in bound.inputs:
                value[name].append(B)
            else:
                free.add(name)
        synced: set[str] = set()  # broadcast values whose backward all-reduce is already counted
        bought: dict[str, set[Placement]] = {}  # per value, the conversions already paid for on this axis
        # Pricing an op reads only what `context` keys: the n repeated layers of a model price the same
        # way, once (an 80-layer model's greedy completion took seconds a layer before)
        priced_in: dict[tuple, list[Candidate]] = {}

        def context(node) -> tuple:
            """Everything the op's candidates depend on, with no name in it."""
            def held(o: str) -> tuple:
                info = bound.tensors[o]
                return (info.shape, info.itemsize, o in free, tuple(value[o]), o in requires_grad,
                        o in bound.parameters, o in bound.pins, o in synced, frozenset(bought.get(o, ())))

            pin, info = bound.pins.get(node.name), bound.tensors[node.name]
            return (specs[node.name], rule_for(node).unhidden_gathers, info.shape, info.itemsize,
                    tuple(op_out[node.name]), tuple(value[node.name]), tuple(map(tuple, needs[node.name])),
                    None if pin is None else pin.layout.placements[axis], node.name in requires_grad,
                    frozenset(bought.get(node.name, ())), tuple(held(o) for o in operands[node.name]))

        def price(node) -> list[Candidate]:
            spec = specs[node.name]
            names = operands[node.name]
            pin = bound.pins.get(node.name)
            priced: list[Candidate] = []
            offered: dict[str, set[tuple[int, bool]]] = {}
            for o, letters in zip(names, spec.operands):
                current = value[o][axis] if o not in free else None
                if current is not None and current.is_split and current.blocks > 1 and current.dim < len(letters):
                    if letters[current.dim] is not None:
                        offered.setdefault(letters[current.dim], set()).add(current.arrangement)
            replicated_operands = all(o not in free and value[o][axis] == B for o in names)
            for index, signature in enumerate(signatures(spec, offered)):
                # what the op needs of each operand (and computes), over the axes decided so far and this one
                if any(not (layout_with(o, req if req != P or o not in free else B).fits(bound.tensors[o].shape, mesh)
                            and required(needs[node.name][slot], req).fits(bound.tensors[o].shape, mesh))
                       for slot, (o, req) in enumerate(zip(names, signature.operands))):
                    continue
                if not (layout_with(node.name, signature.output).fits(bound.tensors[node.name].shape, mesh)
                        and required(op_out[node.name], signature.output).fits(bound.tensors[node.name].shape, mesh)):
                    continue
                forward, backward, deferred, changes, unwritten = 0, 0, 0, 0, 0
                sharded_compute = signature.output != B
                # FSDP's and DDP's case: the data is already split on this axis and stays as it is, so the
                # op's work is split whether its parameters are whole or not
                activations = [(o, req) for o, req in zip(names, signature.operands)
                               if o not in bound.parameters and o not in free]
                data_split = batch_axis and signature.output.is_split and any(req.is_split for _, req in activations) and \
                    all(value[o][axis] == req for o, req in activations)
                conversions = []
                for o, req in zip(names, signature.operands):
                    grad = o in requires_grad
                    taken = (B if req == P else req) if o in free else value[o][axis]
                    changes += o in free and req.is_split  # sharding a free tensor is a choice too
                    conversions.append((o, taken, req, grad, False))
                    if req == B and taken == B and sharded_compute and grad and o not in synced:
                        cost = collective_bytes("all_reduce", local_bytes(o, B), n)
                        if o in bound.parameters and data_split:
                            deferred += cost  # bucketed, overlapped with the rest of backward
                        else:
                            backward += cost
                if pin is not None:
                    conversions.append((node.name, signature.output, pin.layout.placements[axis],
                                        node.name in requires_grad, True))
                for name, source, target, grad, written in conversions:
                    if source == target or target in bought.get(name, ()):
                        continue
                    if not data_axis and name in bound.parameters and name in bound.pins and source.is_split:
                        unwritten += 1
                    size = local_bytes(name, source)
                    forward_only = _one_axis_cost(source, target, size, n, False, written)
                    both = _one_axis_cost(source, target, size, n, grad, written)
                    changes += 1
                    if name in bound.parameters and source.is_split and target == B and data_split and \
                            not rule_for(node).unhidden_gathers:
                        deferred += both  # prefetched forward; reduce-scattered in buckets backward
                        continue
                    forward += forward_only
                    backward += both - forward_only
                for inner in signature.inner_collectives:  # a parallel form's own collectives
                    if not inner.made(names[0] in requires_grad):
                        continue
                    first, placement = bound.tensors[names[0]], signature.operands[0]
                    local = layout_with(names[0], placement).local_shape(first.shape, mesh)
                    cost = inner.volume(local, placement, first.itemsize, n) * inner.messages(n)
                    if inner.phase == "forward":
                        forward += cost
                    else:
                        backward += cost
                    changes += 1
                # Splitting the result of an op whose operands are all B only saves local work; any
                # consumer can slice a B value for nothing, but a split made here may need a gather later
                compute = local_bytes(node.name, B if replicated_operands else signature.output)
                priced.append(Candidate(signature, forward, backward, deferred, changes, compute, index,
                                        unwritten=unwritten))
            return priced

        for node in graph_nodes:
            key = context(node)
            if key not in priced_in:
                priced_in[key] = price(node)
            priced = priced_in[key]
            names = operands[node.name]
            pin = bound.pins.get(node.name)
            assert priced, f"no legal signature for {node.name}"  # all-B always fits
            cheapest = min(priced, key=lambda candidate: candidate.key)
            candidates[node.name].append([replace(c, chosen=True) if c is cheapest else c for c in priced])
            best = cheapest.signature
            for slot, (o, req) in enumerate(zip(names, best.operands)):
                if o in free:  # held as the op takes it, but as B where that is a partial sum or a zig-zag split
                    value[o].append(B if req == P or req.mirrored else req)
                    free.discard(o)
                if value[o][axis] != req:
                    bought.setdefault(o, set()).add(req)
                if req == B and best.output != B:
                    synced.add(o)
                needs[node.name][slot].append(req)
            op_out[node.name].append(best.output)
            value[node.name].append(pin.layout.placements[axis] if pin is not None else best.output)
        for name in free:  # parameters no op consumes
            value[name].append(B)

    return typed_graph(bound, specs, graph_nodes, placeholders, operands, requires_grad, value, needs, op_out,
                       candidates)


def _computed_split_where_read_split(bound, graph_nodes, specs, operands, requires_grad, value, needs, op_out,
                                     candidates, axis: int) -> None:
    """A value made whole on every rank from whole operands (an attention mask built from positions and
    expanded over the batch) whose every reader takes it split on `axis` is computed split there instead,
    its operands sliced for nothing (they are whole): the same value, 1/n of the work and memory per rank.
    The greedy choice sees one op at a time, so it keeps such a result whole (rule 5) and its readers slice
    it, and a search weighs its layouts in the objective, where the slices cost nothing; walking the graph
    backwards moves each slice up to where the value is made. Values with a gradient
    stay as chosen (a slice's adjoint is a gather), and so do random ones (a rank would draw other
    numbers than serial) and what the file writes or returns."""
    mesh = bound.mesh
    readers: dict[str, list[tuple[str, int]]] = {}
    for node in graph_nodes:
        for slot, o in enumerate(operands[node.name]):
            readers.setdefault(o, []).append((node.name, slot))
    returned = {name for _, name in bound.outputs if name}
    for node in reversed(graph_nodes):
        name = node.name
        if value[name][axis] != B or op_out[name][axis] != B or name in bound.pins or name in requires_grad or \
                name in returned or is_random(node) or not readers.get(name):
            continue
        wanted = {needs[reader][slot][axis] for reader, slot in readers[name]}
        if len(wanted) != 1:
            continue
        target = wanted.pop()
        if not target.is_split:
            continue
        result = Layout(tuple(value[name][:axis]) + (target,) + tuple(value[name][axis + 1:]))
        if not result.fits(bound.tensors[name].shape, mesh):
            continue
        # a split in blocks (a zig-zag one under ring attention) is made in the same blocks from sliced operands
        letter = specs[name].output[target.dim]
        offered = {letter: {target.arrangement}} if target.arrangement != (1, False) and letter is not None else {}
        for signature in signatures(specs[name], offered):
            if signature.output != target or signature.name or signature.inner_collectives:
                continue
            takes = list(zip(operands[name], signature.operands))
            if all(req == value[o][axis] or (value[o][axis] == B and req.is_split and o not in requires_grad and
                                             Layout(tuple(value[o][:axis]) + (req,) + tuple(value[o][axis + 1:]))
                                             .fits(bound.tensors[o].shape, mesh))
                   for o, req in takes):
                for slot, (_, req) in enumerate(takes):
                    needs[name][slot][axis] = req
                op_out[name][axis] = value[name][axis] = target
                options = candidates[name][axis]
                if not any(c.signature == signature for c in options):
                    # a signature in blocks inference did not price (none was offered it): priced as the whole
                    # one it replaces, the same bytes moved (none), 1/n of the work
                    whole = next(c for c in options if c.chosen)
                    options = options + [replace(whole, signature=signature, compute=whole.compute // mesh.axis_sizes[axis],
                                                 index=len(options))]
                candidates[name][axis] = [replace(c, chosen=c.signature == signature) for c in options]
                break


def typed_graph(bound, specs, graph_nodes, placeholders, operands, requires_grad, value, needs, op_out,
                candidates) -> TypedGraph:
    """The typed graph from the placements chosen per axis: per name its value's, per op what it needs of
    each operand and what it computes. Outputs left out keep their layout, a partial sum finished."""
    mesh = bound.mesh
    for axis in range(mesh.ndim):
        _computed_split_where_read_split(bound, graph_nodes, specs, operands, requires_grad, value, needs, op_out,
                                         candidates, axis)
    _whole_means(bound, graph_nodes, operands, value, op_out, candidates)
    _parts_taken_as_they_are(graph_nodes, operands, value, needs, op_out)
    nodes = {
        n.name: TypedNode(
            n.name, op_name(n), specs[n.name], operands[n.name],
            tuple(Layout(tuple(p)) for p in needs[n.name]),
            Layout(tuple(op_out[n.name])), Layout(tuple(value[n.name])),
        )
        for n in graph_nodes
    }
    placeholder_layouts = {name: Layout(tuple(value[name])) for name in placeholders}
    output_layouts = []
    for index, (_, node_name) in enumerate(bound.outputs):
        pin = bound.output_pins.get(index)
        if pin is not None:
            output_layouts.append(pin.layout)
        else:
            produced = Layout(tuple(value[node_name])) if node_name else Layout.broadcast(mesh)
            output_layouts.append(Layout(tuple(B if p == P else p for p in produced.placements)))
    return TypedGraph(bound, nodes, placeholder_layouts, output_layouts, requires_grad, candidates)


def _parts_taken_as_they_are(graph_nodes, operands, value, needs, op_out) -> None:
    """A list of tensors (a split's parts) is not a tensor a collective can move: where a choice would
    convert it for a getitem, the getitem takes its part in the list's layout and the part is converted
    once taken (lowering converts an op's result whose value layout is not the one it computes). Each
    part moves its own bytes, and only the parts that are read."""
    for node in graph_nodes:
        if rule_for(node).family != "project" or not is_tensor_list(node.args[0]):
            continue
        parts = operands[node.name][0]
        for axis, held in enumerate(value[parts]):
            if needs[node.name][0][axis] != held:
                needs[node.name][0][axis] = held
                op_out[node.name][axis] = held


def _whole_means(bound, graph_nodes, operands, value, op_out, candidates) -> None:
    """A mean loss over split rows that is only returned, as a partial mean (`counts`), would be finished
    by a second all-reduce at the output: take the rule's `mean` signature instead (the same operands, the
    local sum and count in one all-reduce, the mean whole). Same bytes, one latency fewer. Where the output
    is written partial, or some of its partial axes have no such signature, the plan stays as it is."""
    consumed = {o for node in graph_nodes for o in operands[node.name]}
    returned: dict[str, list[int]] = {}
    for index, (_, name) in enumerate(bound.outputs):
        if name and name not in consumed:
            returned.setdefault(name, []).append(index)

    def written_partial(name: str, axis: int) -> bool:
        return any(i in bound.output_pins and bound.output_pins[i].layout.placements[axis] != B
                   for i in returned[name])

    for name in returned:
        if name not in op_out or name in bound.pins:  # an input returned as it is; a written layout
            continue
        partial = [axis for axis, placement in enumerate(op_out[name]) if placement == P]
        wholes = {axis: _mean_instead(candidates[name][axis]) for axis in partial if not written_partial(name, axis)}
        if not partial or len(wholes) < len(partial) or None in wholes.values():
            continue
        for axis, whole in wholes.items():
            op_out[name][axis] = value[name][axis] = B
            candidates[name][axis] = [replace(c, chosen=c is whole) for c in candidates[name][axis]]


def _mean_instead(options: list[Candidate]) -> Candidate | None:
    """Where the partial mean (`counts`) was chosen, the `mean` candidate on the same operands."""
    chosen = next((c for c in options if c.chosen), None)
    if chosen is None or chosen.signature.name != "counts":
        return None
    return next((c for c in options if c.signature.name == "mean" and c.signature.operands == chosen.signature.operands),
                None)
