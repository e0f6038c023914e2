"""`pardsl explain`: what a plan does and costs, layer by layer, from the cost model (pardsl/planning/cost.py).

Per layer: the layouts chosen for its parameters, each collective with its bytes, estimated time and
reason (each credited to the module whose op needs it: a partial sum's all-reduce to the linear that made
it; gathered parameter groups under their layer), and its compute; a layer that repeats the one before it
(same layouts, same collectives) is said once. At the top the step, with tokens per second and MFU per
device. Then the gradient buckets (one line for each mesh axis), memory per rank, the notes, and the
runner-up plans: the cheapest alternatives that change one choice of inference, priced from its candidates,
leaving out those as good as the plan. `--html` (pardsl/tools/explain_html.py) writes the same as one
self-contained page with pictures.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from pardsl.layouts.oprules import Signature, forms_taken
from pardsl.passes.regather import gathered_again
from pardsl.planning.cost import Estimate, layer_of, plural
from pardsl.planning.pipeline_search import pipelined_step
from pardsl.program.ir import format_bytes, named_layout


def seconds_text(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} µs"


@dataclass
class Layer:
    name: str  # "" for what is outside every module
    parameters: list[tuple[str, str]]  # (name within the layer, layout)
    collectives: list  # CollectiveCost
    compute_s: float
    same_as: str = ""  # the layer before it, where this one repeats it

    def fingerprint(self) -> tuple:
        return (tuple(self.parameters),
                tuple((c.kind, c.axis, c.phase, c.bytes, c.overlapped) for c in self.collectives))


@dataclass
class RunnerUp:
    node: str
    where: str
    axis: str
    chosen: Signature
    alternative: Signature
    extra_bytes: int  # communication, forward and backward
    extra_s: float


def _signature_text(signature: Signature) -> str:
    return f"({', '.join(str(p) for p in signature.operands)}) → {signature.output}"


def layers(compiled, estimate: Estimate) -> list[Layer]:
    program = compiled.program
    mesh = program.mesh
    order: dict[str, Layer] = {}

    def layer(name: str) -> Layer:
        if name not in order:
            order[name] = Layer(name, [], [], 0.0)
        return order[name]

    for op in estimate.ops:
        layer(op.layer).compute_s += op.forward_s + op.backward_s
    for slot in program.parameters:
        owner = layer_of(slot.name.rsplit(".", 1)[0] if "." in slot.name else "")
        inner = slot.name[len(owner) + 1:] if owner and slot.name.startswith(owner + ".") else slot.name
        layer(owner).parameters.append((inner, named_layout(slot.layout, mesh)))
    for cost in estimate.collectives:
        if cost.bucket:
            continue  # buckets span layers: listed on their own
        layer(cost.layer).collectives.append(cost)
    result = list(order.values())
    for before, current in zip(result, result[1:]):
        repeated = all(name.rsplit(".", 1)[-1].isdigit() for name in (before.name, current.name))
        if repeated and before.fingerprint() == current.fingerprint() and \
                before.name.rsplit(".", 1)[0] == current.name.rsplit(".", 1)[0]:
            current.same_as = before.same_as or before.name
    return result


NEAR_EQUAL = 0.01  # of the step: a runner-up closer than this to the plan is noise, not another plan


def runner_ups(compiled, estimate: Estimate, count: int = 3) -> list[RunnerUp]:
    """The alternatives closest in estimated cost to the plan that differ from it by at least NEAR_EQUAL
    of the step (see alternatives)."""
    least = NEAR_EQUAL * estimate.step_s
    return [alt for alt in alternatives(compiled, estimate) if abs(alt.extra_s) >= least][:count]


def alternatives(compiled, estimate: Estimate) -> list[RunnerUp]:
    """Every alternative that changes one op's signature on one axis (what inference chose among,
    `TypedGraph.candidates`), priced from the candidates' bytes, the closest in estimated cost first."""
    typed, mesh, machine = compiled.typed, compiled.program.mesh, estimate.machine
    slow = machine.slowdown(mesh.size)
    found = []
    for node, per_axis in typed.candidates.items():
        for axis, candidates in enumerate(per_axis):
            if len(candidates) < 2 or mesh.axis_sizes[axis] == 1:
                continue
            chosen = next(c for c in candidates if c.chosen)
            for other in sorted((c for c in candidates if not c.chosen), key=lambda c: c.key):
                # bytes as inference priced them; its tie-breaking units (a byte or two) are not traffic
                extra = (other.forward + other.backward) - (chosen.forward + chosen.backward)
                if extra <= 2:  # the same communication: a choice of local work, not another plan
                    continue
                # priced as all-reduce bytes (candidates keep bytes, not kinds); a latency only where the
                # chosen signature communicated nothing
                moved = machine.collective_seconds("all_reduce", extra, mesh.axis_sizes[axis], mesh.axis_stride(axis))
                if chosen.forward + chosen.backward:
                    moved -= machine.collective_seconds("all_reduce", 0, mesh.axis_sizes[axis], mesh.axis_stride(axis))
                compute = (other.compute - chosen.compute) / machine.bytes_per_s
                found.append(RunnerUp(node, compiled.bound.module_paths.get(node, ""), mesh.axis_names[axis],
                                      chosen.signature, other.signature, extra, slow * (moved + compute)))
                break
    found.sort(key=lambda r: (r.extra_s, r.node))
    return found


def report(compiled, estimate: Estimate, memory_bound: int | None = None, alternatives_priced: list | None = None,
           op_choices: bool = False) -> str:
    """The whole text: the plan and machine, a summary (step, throughput, memory against the bound and the
    card), then per layer, the gradient buckets, the notes, and the plans a user could write instead
    (`alternatives_priced`, from pardsl/tools/alternatives.py). `op_choices`: also the single-op choices
    inference weighed, closest first."""
    program = compiled.program
    mesh = program.mesh
    seconds, memory, machine = estimate.seconds, estimate.memory, estimate.machine
    ar = machine.collectives["all_reduce"]
    priced_pipeline = pipelined_step(compiled, machine) if compiled.pipeline is not None else None
    pipelined = priced_pipeline.step_s if priced_pipeline is not None else None
    lines = [f"{program.source_path}: mesh {mesh} ({mesh.size} ranks), model {program.model}",
             f"machine: {machine.backend}, {machine.source}; all-reduce α {seconds_text(ar.alpha_s)} per ring step, "
             f"β {ar.beta_s_per_byte * 1e9:.3g} ns/B (α: each step's latency, β: time per byte); "
             f"{_rate_text(machine.flops_per_s)} in float32"
             + (f", {_rate_text(machine.half_flops_per_s)} in 16-bit" if machine.half_flops_per_s else "")
             + f", memory {machine.bytes_per_s / 1e9:,.0f} GB/s"
             + (f"; ranks share {machine.cores} cores" if machine.cores else ""),
             *_axis_links(mesh, machine),
             *_mesh_shapes(compiled, mesh),
             *_pipeline_options(compiled),
             "",
             *_pipelined_step(compiled, priced_pipeline),
             _step_line(seconds, pipelined is not None),
             *_masked_ring_lines(compiled),
             *_substitution_lines(compiled, estimate),
             _throughput_line(estimate, pipelined or seconds["step"]),
             _memory_line(memory, memory_bound, machine.device_memory_bytes), ""]
    recomputed = _recomputed_layers(compiled)
    for layer, last in _folded(layers(compiled, estimate)):
        title = layer.name or "(outside the layers)"
        if layer.same_as:
            through = f" to {last.name.rsplit('.', 1)[-1]}" if last is not layer else ""
            lines.append(f"{title}{through}: as {layer.same_as}")
            continue
        moved = sum(c.seconds for c in layer.collectives)
        lines.append(f"{title}: compute {seconds_text(layer.compute_s)}, communication {seconds_text(moved)}")
        split = [f"{name} {layout}" for name, layout in layer.parameters if layout != "B"]
        replicated = sum(1 for _, layout in layer.parameters if layout == "B")
        if split or replicated:
            whole = [f"{plural(replicated, 'more parameter')} whole on every rank"] if split and replicated else \
                [f"{plural(replicated, 'parameter')} whole on every rank"] if replicated else []
            lines.append("  layouts: " + ", ".join(split + whole))
        if layer.name in recomputed:
            lines.append(f"  made again in backward {recomputed[layer.name]}")
        for cost in layer.collectives:
            when = f"{cost.phase}, overlapped" if cost.overlapped else f"{cost.phase}, in chunks" if cost.hidden_s \
                else f"{cost.phase}, partly hidden" if cost.beside_step_s else cost.phase
            chunked = f" ({seconds_text(cost.beside_step_s)} of it hidden behind the ring step's compute)" \
                if cost.beside_step_s else "" if not cost.hidden_s else \
                f" ({seconds_text(cost.hidden_s)} of it beside the linear's product)" if cost.hidden_s > 0 else \
                f" (in chunks it costs {seconds_text(-cost.hidden_s)} more: asked for by the file)"
            lines.append(f"  {cost.kind.replace('_', '-'):<14} {cost.axis:<4} {when:<19} {format_bytes(cost.bytes):>10} "
                         f"{seconds_text(cost.seconds):>9}  {_why(cost, layer.name)}{chunked}")
    lines += _bucket_lines(estimate)
    notes = [f"{n.severity}[{n.code}] line {n.span.line}: {n.message}" if n.span else f"{n.code}: {n.message}"
             for n in program.notes]
    if notes:
        lines += ["", "notes:"] + [f"  {n}" for n in notes]
    lines += _alternative_lines(estimate, memory_bound, alternatives_priced or [])
    if op_choices:
        lines += _op_choice_lines(compiled, estimate)
    return "\n".join(lines)


def _folded(all_layers: list[Layer]) -> list[tuple[Layer, Layer]]:
    """Each layer with the last of the run of layers after it that repeat the same one: `model.layers.1`
    to `model.layers.31: as model.layers.0` on one line."""
    folded: list[tuple[Layer, Layer]] = []
    for layer in all_layers:
        if folded and layer.same_as and folded[-1][0].same_as == layer.same_as:
            folded[-1] = (folded[-1][0], layer)
        else:
            folded.append((layer, layer))
    return folded


def _alternative_lines(estimate: Estimate, bound: int | None, priced: list) -> list[str]:
    """The plans a user could write instead, each against this one: its step and memory, and the lines of
    the file that give it."""
    if not priced:
        return []
    step, held = estimate.step_s, estimate.memory["total"]
    lines = ["", "plans you could write instead (each compiled and priced like this one):"]
    for alternative in priced:
        if alternative.why_not:
            lines.append(f"  {alternative.title}: does not compile, {alternative.why_not}")
        else:
            over = "" if alternative.within_bound else ", over the bound"
            lines.append(f"  {alternative.title}: step {_signed(alternative.step_s - step, seconds_text)} "
                         f"({seconds_text(alternative.step_s)}), memory "
                         f"{_signed(alternative.memory - held, format_bytes)} ({format_bytes(alternative.memory)} per "
                         f"rank{over})")
        lines += [f"      {line}" for line in alternative.edit]
    return lines


def _signed(delta: float, text) -> str:
    return ("+" if delta >= 0 else "−") + text(abs(delta))


def _op_choice_lines(compiled, estimate: Estimate) -> list[str]:
    """Single ops' other signatures, as inference priced them (`--op-choices`)."""
    every = alternatives(compiled, estimate)
    shown = runner_ups(compiled, estimate)
    lines = ["", "other choices of single ops (one choice changed each):"]
    if not every:
        lines.append("  none: no other choice of any op changes the communication")
    for alt in shown:
        where = f" in {alt.where}" if alt.where else ""
        lines.append(f"  {alt.node}{where} on {alt.axis}: {_signature_text(alt.alternative)} instead of "
                     f"{_signature_text(alt.chosen)}: {'+' if alt.extra_s >= 0 else ''}{seconds_text(alt.extra_s)} "
                     f"({format_bytes(max(alt.extra_bytes, 0))} more communication)"
                     f" → step {seconds_text(estimate.seconds['step'] + alt.extra_s)}")
    near = sum(abs(alt.extra_s) < NEAR_EQUAL * estimate.seconds["step"] for alt in every)
    if near:
        lines.append(f"  {plural(near, 'other choice' if shown else 'choice')} within {NEAR_EQUAL:.0%} of the step "
                     "left out: as good as the plan's, by this estimate")
    return lines


def _step_line(seconds: dict, pipelined: bool = False) -> str:
    """The step and where its time goes: all the communication in each phase, then the part of it the step
    waits for (what runs beside compute and compute does not hide, and what runs alone); the rest is
    hidden behind compute. A pipelined plan's line is the whole model once, without the pipeline's
    bubble and sends: the pipelined step comes before it."""
    compute = f"compute {seconds_text(seconds['compute_forward'])} forward + " \
              f"{seconds_text(seconds['compute_backward'])} backward"
    total = {phase: seconds[f"communication_{phase}"] + seconds[f"overlapped_{phase}"] +
             seconds.get(f"chunked_hidden_{phase}", 0.0) for phase in ("forward", "backward")}
    exposed = seconds["communication_forward"] + seconds["communication_backward"] + seconds["overlapped_exposed"]
    if not total["forward"] + total["backward"]:
        communication = "no communication"
    else:
        communication = f"communication {seconds_text(total['forward'])} forward + " \
                        f"{seconds_text(total['backward'])} backward, {seconds_text(exposed)} of it exposed " \
                        "(the step waits for it)"
        hidden = total["forward"] + total["backward"] - exposed
        if hidden > 0:
            communication += f", {seconds_text(hidden)} hidden behind compute"
    if pipelined:
        return f"one micro-batch through the whole model, without the pipeline: {seconds_text(seconds['step'])} " \
               f"per rank: {compute}; {communication}"
    return f"estimated step {seconds_text(seconds['step'])} per rank: {compute}; {communication}"


def _masked_ring_lines(compiled) -> list[str]:
    """Ring attentions under a mask the model builds (pardsl/layouts/masks.py): the pieces a rank computes,
    which the estimate counts, the mask hiding the others whole."""
    typed, sizes = compiled.typed, compiled.typed.mesh.axis_sizes
    found: dict[tuple[str, int, int], int] = {}
    for node in typed.nodes.values():
        if all(form.hidden_blocks is None for form in node.spec.extra):
            continue
        for axis, form in forms_taken(node.spec, node.operand_layouts, node.op_layout).items():
            if form.hidden_blocks is not None:
                pairs = 4 * sizes[axis]  # each rank's two pieces by every key piece
                key = (typed.mesh.axis_names[axis], round(form.share_on(sizes[axis]) * pairs), pairs)
                found[key] = found.get(key, 0) + 1
    return [f"ring attention: {plural(count, 'attention')} over `{axis}` compute {computed} of each rank's {pairs} "
            f"(query piece, key piece) pairs: the mask the model builds hides the others whole (found from its "
            f"ops), and the estimate counts those computed" for (axis, computed, pairs), count in sorted(found.items())]


def _substitution_lines(compiled, estimate: Estimate) -> list[str]:
    """The rewrites the compile made: grouped-query key/value heads read unrepeated, or regrouped
    (pardsl/model/grouped_query.py), and the collective matmuls (pardsl/passes/collective_matmul.py) with
    what they save, or why none was made where the plan has the collectives one could cut."""
    lines = []
    unrepeated = compiled.typed.bound.unrepeated_attentions
    if unrepeated:
        lines.append(f"substitutions: {plural(unrepeated, 'attention')} read the grouped-query key/value heads "
                     f"themselves (`enable_gqa`), not the traced model's copies of them for each query head: "
                     f"no copies made or kept, and a ring over a split sequence passes the heads alone")
    regrouped = compiled.typed.bound.regrouped
    if regrouped:
        heads, ranks = regrouped[0].heads, regrouped[0].ranks
        lines.append(f"substitutions: key/value heads regrouped in {plural(len(regrouped), 'projection')} "
                     f"({heads} head(s) over {ranks} ranks: each rank computes the head its query heads read, "
                     f"its weight held whole and its gradient gathered in backward, where the heads' features "
                     f"split across ranks were exchanged by all-to-all); `substitute regroup_heads : off` in the "
                     f"file turns it off")
    return lines + _split_reduction_lines(compiled) + _collective_matmul_lines(compiled, estimate) + \
        _regathered_lines(compiled)


def _regathered_lines(compiled) -> list[str]:
    """The sequence-parallel linears' inputs kept split for backward and gathered again there
    (pardsl/passes/regather.py), with the bytes a rank holds less and gathers more."""
    again = [c for program in compiled.programs for c in program.collectives if gathered_again(c)]
    if not again:
        return []
    choice = compiled.typed.bound.par.substitution("regather_inputs")
    why = "as the file asks" if choice == "on" else "to hold to the memory bound; `substitute regather_inputs : off` " \
        "in the file turns it off"
    where = " (over the pipeline's stages, per micro-batch)" if compiled.pipeline is not None else ""
    return [f"substitutions: {plural(len(again), 'sequence-parallel input')} kept split for backward and gathered "
            f"again there, as Megatron-LM does ({format_bytes(sum(c.bytes for c in again))} more gathered in "
            f"backward{where}, each whole input no longer held until then), {why}"]


def _split_reduction_lines(compiled) -> list[str]:
    """The partial sums the compiler chose to reduce-scatter (searched, or a recipe's) where an all-reduce
    would have made them whole (the file wrote no layout for them), with what that spares their results: a
    rank holds its 1/n share, not the whole sum (a reduce-scatter's bytes per rank are that difference)."""
    program, pins, mesh = compiled.program, compiled.typed.bound.pins, compiled.program.mesh
    scattered = [c for c in program.collectives if c.kind == "reduce_scatter" and c.phase == "forward"
                 and c.value.split("__")[0] not in pins]
    values = {c.value for c in scattered}
    layouts = {target: layout for statement in program.statements if statement.layouts
               for target, layout in zip(statement.targets, statement.layouts) if target in values}

    def split_on_its_axis(collective) -> bool:  # not a step of a reduction over several axes that ends whole
        layout = layouts.get(collective.value)
        return layout is not None and layout.placements[mesh.axis_index(collective.axis)].is_split

    found = [c for c in scattered if split_on_its_axis(c)]
    off = compiled.typed.bound.par.substitution("split_reductions") == "off"
    if off and not found:
        return ["substitutions: reductions split off, as the file says (no partial sum the compiler chose "
                "is reduce-scattered)"]
    if not found:
        return []
    how = "the file's `substitute split_reductions : off` did not reach them" if off else \
        "`substitute split_reductions : off` in the file forbids it"
    return [f"substitutions: {plural(len(found), 'partial sum')} reduce-scattered where an all-reduce would make "
            f"{'it' if len(found) == 1 else 'them'} whole, chosen by the compiler (sequence parallelism's form: the "
            f"ops after each computed on the rank's share, gathered where they need the whole); their results "
            f"alone take {format_bytes(sum(c.bytes for c in found))} less per rank than held whole; {how}"]


def _collective_matmul_lines(compiled, estimate: Estimate) -> list[str]:
    chunked = [c for c in estimate.collectives if c.hidden_s]
    choice = compiled.typed.bound.par.substitution("collective_matmul")
    if chunked:
        saved = estimate.seconds["chunked_hidden"]
        effect = f"saving {seconds_text(saved)} a step" if saved >= 0 else f"costing {seconds_text(-saved)} a step"
        return [f"substitutions: collective matmul on {plural(len(chunked), 'collective')} (sequence parallelism's "
                f"gathers and reduce-scatters cut into chunks, each moving while the linear beside it computes "
                f"another), {effect}"
                + ("" if choice == "on" else "; `substitute collective_matmul : off` in the file turns it off")]
    if choice == "off":
        return ["substitutions: collective matmul off, as the file says"]
    return []


def _rate_text(flops_per_s: float) -> str:
    return f"{flops_per_s / 1e12:.3g} TFLOP/s" if flops_per_s >= 1e12 else f"{flops_per_s / 1e9:.3g} GFLOP/s"


def _throughput_line(estimate: Estimate, step: float) -> str:
    """Tokens per second and model FLOPs utilisation per device, at the step the plan takes (a pipeline's
    as its search prices it). The utilisation is of the compute rate the machine's figures give, which for
    a preset is what a large matmul sustains, not the datasheet's peak."""
    tokens = estimate.tokens_per_s_per_device(step)
    rate = "tokens/s n/a (no int64 token input)" if tokens is None else \
        f"{_count_text(tokens)} tokens/s ({_count_text(estimate.tokens)} token{'s' if estimate.tokens != 1 else ''} " \
        "a step)"
    return (f"per device: {rate}, MFU {estimate.mfu(step):.1%} (model FLOPs {estimate.model_flops:.3g} a step, "
            f"of the {_rate_text(estimate.peak_flops_per_s)} the machine's figures give a device)")


def _count_text(count: float) -> str:
    """`7,306`; below 10, with the digits that say it (`0.42`), never `0` or `1 tokens`."""
    return f"{count:,.0f}" if count >= 10 else f"{count:.2g}"


# Lowering's reason for a conversion names the op that reads the converted value: `pow.Tensor_Scalar
# pow_2 in model.layers.1.input_layernorm`. Said here as what the collective does for that module.
_READER = re.compile(r"^(?P<op>[a-z_][\w]*)(?:\.[\w]+)? [\w]+(?: in (?P<module>\S+))?$")
_DOES = {"all_reduce": "partial sums added up", "all_gather": "gathered whole", "reduce_scatter":
         "partial sums added up and split", "all_to_all": "split another way"}


def _reader_text(cost) -> str:
    """`partial sums added up for post_attention_layernorm (pow)`, where the reason names the reading op."""
    again = "made again in backward: "
    if cost.reason.startswith(again):  # a recomputed region's collective, issued again for backward
        return again + _reader_text(dataclasses.replace(cost, reason=cost.reason.removeprefix(again), phase="forward"))
    if cost.reason == "gradient of a broadcast value read by sharded computation":
        return "the input's gradient added up: each rank's part of the split weights gives a share of it"
    found = _READER.match(cost.reason)
    if not found or cost.kind not in _DOES:
        return _grammatical(cost.reason)
    reader = f"{found['module'] or 'the model'} ({found['op']})"
    if cost.phase == "backward":
        return f"backward of the conversion for {reader}: gradients {_DOES[cost.kind].replace('partial sums ', '')}"
    return f"{_DOES[cost.kind]} for {reader}"


def _why(cost, layer: str) -> str:
    """A collective's reason, after the module that needs it where that is inside its layer."""
    reason = _reader_text(cost)
    if cost.module and cost.module != layer:
        return f"{cost.module.removeprefix(layer + '.') if layer else cost.module}: {reason}"
    return reason


def _grammatical(text: str) -> str:
    """Lowering's reasons count with "(s)" (they are also the generated code's comments): said here with
    the number's own form."""
    return re.sub(r"\b(\d+) (\w+)\(s\)", lambda m: plural(int(m.group(1)), m.group(2)), text)


def _bucket_lines(estimate: Estimate) -> list[str]:
    """The gradient buckets, one line for each mesh axis: a large model has hundreds of them. Their exposed
    part is their share of backward's overlapped communication that compute does not hide."""
    seconds = estimate.seconds
    axes: dict[str, list] = {}
    for cost in estimate.collectives:
        if cost.bucket:
            axes.setdefault(cost.axis, []).append(cost)
    if not axes:
        return []
    lines = ["gradient buckets (backward, overlapped with compute):"]
    for axis, costs in axes.items():
        kinds: dict[str, int] = {}
        for cost in costs:
            kinds[cost.kind] = kinds.get(cost.kind, 0) + 1
        moved = sum(c.seconds for c in costs)
        exposed = seconds["overlapped_exposed_backward"] * moved / seconds["overlapped_backward"]
        counted = ", ".join(plural(n, kind.replace("_", "-")) for kind, n in kinds.items())
        lines.append(f"  {axis}: {counted}, {format_bytes(sum(c.bytes for c in costs))}, {seconds_text(moved)}, "
                     f"{seconds_text(exposed)} of it exposed")
    return lines


def _mesh_shapes(compiled, mesh) -> list[str]:
    """A searched mesh: the shape kept, then every other shape priced with its best plan's estimate."""
    shapes = compiled.mesh_shapes
    if not shapes:
        return []

    def sizes_text(sizes) -> str:
        return ", ".join(f"{name} = {size}" for name, size in zip(mesh.axis_names, sizes))

    within = " within the bound" if compiled.memory_bound is not None else ""
    lines = [f"mesh shape searched: {sizes_text(shapes[0].sizes)} kept, the fastest of {len(shapes)}{within} "
             "(each shape's best plan, estimated):"]
    for shape in shapes:
        if shape.why_not:
            lines.append(f"  {sizes_text(shape.sizes)}: no plan, {shape.why_not}")
            continue
        fits = "" if shape.within_bound else ", over the bound"
        twin = f" (as {sizes_text(shape.same_as)}, its axes renamed)" if shape.same_as else ""
        lines.append(f"  {sizes_text(shape.sizes)}: step {seconds_text(shape.step_s)}, memory "
                     f"{format_bytes(shape.memory)} per rank{fits}{twin}")
    return lines


def _pipelined_step(compiled, priced) -> list[str]:
    """A pipelined plan's step and its parts (`priced`: pipeline_search.pipelined_step); the line after it
    gives one micro-batch through the whole model."""
    plan = compiled.pipeline
    if plan is None:
        return []
    synchronised = f", the gradients' synchronisation {seconds_text(priced.synchronised_s)}" \
        if priced.synchronised_s else ""
    return [f"estimated step {seconds_text(priced.step_s)} per rank, pipelined: {plan.microbatches} micro-batch"
            f"{'es' if plan.microbatches > 1 else ''} through {len(compiled.stages)} stages under {plan.schedule}: "
            f"the busiest rank's stages {seconds_text(priced.busiest_s)} (every micro-batch's compute and sends), "
            f"the schedule's bubble {seconds_text(priced.bubble_s)}{synchronised} (the pipeline search's model)"]


def _pipeline_options(compiled) -> list[str]:
    """A searched pipeline: the option kept, then the others priced, by the pipeline search's model."""
    options = compiled.pipeline_options
    if not options:
        return []

    def text(option) -> str:
        cuts = ", ".join(option.cut_before) or "none"
        per_rank = f", {option.stages_per_rank} stages per rank" if option.stages_per_rank > 1 else ""
        over = "" if option.within_bound else ", over the bound"
        layouts = f" (on the layouts of {option.priced_on})" if option.priced_on else ""
        return (f"{option.schedule}{per_rank}, {option.microbatches} micro-batch{'es' if option.microbatches > 1 else ''}, "
                f"cut before {cuts}: step "
                f"{seconds_text(option.step_s)}, memory {format_bytes(option.memory)} per rank{over}{layouts}")

    lines = [f"pipeline searched: {text(options[0])} kept, of {len(options)} priced (the pipeline search's "
             "model: stages' times per micro-batch, the bubble of the schedule):"]
    lines += [f"  {text(option)}" for option in options[1:8]]
    if len(options) > 8:
        lines.append(f"  … {len(options) - 8} more")
    return lines


def _recomputed_layers(compiled) -> dict[str, str]:
    """Each layer a recomputed region makes again in backward (pardsl/passes/recompute.py), with what it
    keeps."""
    paths, found = compiled.bound.module_paths, {}
    for statement in compiled.program.statements:
        if statement.instruction.kind == "recompute":
            policy = statement.instruction.args[1].text.strip("'")
            once = sum(inside.instruction.callee == "rt.made_once" for inside in statement.body)
            kept = "only its inputs kept" if policy == "full" else \
                "matrix products, attention and collective results kept"
            if once:
                kept += f"; {plural(once, 'op')} not made again, since backward needs none of " \
                        f"{'its' if once == 1 else 'their'} results"
            for inside in statement.body:
                if layer := layer_of(paths.get(inside.node)):
                    found.setdefault(layer, f"({policy}): {kept}")
    return found


def _axis_links(mesh, machine) -> list[str]:
    """Where each mesh axis's collectives run, on a machine of several nodes (ranks laid out as torch's
    DeviceMesh lays them: the last axis innermost)."""
    if not machine.ranks_per_node:
        return []
    links = "; ".join(f"{name} ({size} ranks) {machine.axis_link(mesh, axis)}"
                      for axis, (name, size) in enumerate(zip(mesh.axis_names, mesh.axis_sizes)))
    return [f"nodes of {machine.ranks_per_node} ranks: {links}"]


_MEMORY_PARTS = {"parameters": "parameters", "gradients": "gradients", "optimizer_state": "optimizer state",
                 "activations": "activations", "gathered_parameters": "gathered parameters",
                 "compute_copies": "low-precision copies", "stage_buffers": "pipeline buffers"}


def _memory_line(memory: dict, bound: int | None, card: int = 0) -> str:
    """Memory per rank as a stack that adds up to what a `memory <=` bound weighs, then the estimate of
    backward's worst moment (gradients arriving as activations leave, its working memory), the bound and
    the card."""
    parts = " + ".join(f"{_MEMORY_PARTS.get(k, k.replace('_', ' '))} {format_bytes(v)}" for k, v in memory.items()
                       if k in _MEMORY_PARTS and v)
    checks = []
    if bound is not None:
        if memory["total"] > bound:
            checks.append(f"bound {format_bytes(bound)}: EXCEEDED")
        elif memory["peak"] > bound:  # the bound weighs what is held; backward's working memory comes on top
            checks.append(f"bound {format_bytes(bound)}: the count is within it, backward's worst moment is not")
        else:
            checks.append(f"bound {format_bytes(bound)}: within")
    if card:
        checks.append(f"the card holds {format_bytes(card)}: {'fits' if memory['peak'] <= card else 'DOES NOT FIT'}")
    host = ""
    if "host_total" in memory:  # offloaded: what host memory holds, apart from the device's
        held = ", ".join(f"{k.removeprefix('host_').replace('_', ' ')} {format_bytes(v)}" for k, v in memory.items()
                         if k.startswith("host_") and k != "host_total")
        host = f"\nhost memory per rank {format_bytes(memory['host_total'])} ({held})"
    return (f"memory per rank {format_bytes(memory['total'])} counted all at once as a bound weighs it ({parts}); "
            f"{format_bytes(memory['peak'])} at backward's worst moment; serial {format_bytes(memory['serial_total'])}"
            + "".join(f"; {c}" for c in checks) + host)
