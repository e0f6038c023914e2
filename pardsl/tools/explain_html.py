"""`pardsl explain --html`: the explain report as one self-contained page (no script, no external resource),
with pictures: a step as a timeline per rank, the memory a rank holds against the bound, the mesh, and
where each layer's communication happens.

Every time and byte drawn is the cost model's (pardsl/planning/cost.py) for the plan; where the model gives
no order (layers within a phase, collectives overlapped with compute), the pictures take program order and
say so. The pictures sit at fixed places on the page (PICTURES_LEFT, PICTURES_TOP, PICTURE_GAP), each an SVG
of the size it declares, so that a browser's screenshot can be checked pixel by pixel
(tests/test_explain_html.py)."""

from __future__ import annotations

import html
import math
import textwrap
from dataclasses import dataclass

from pardsl.planning.cost import Estimate, collective_seconds, pipeline_rank_memory, stage_buffer_slots, slot_bytes
from pardsl.planning.pipeline_search import pipelined_step_seconds
from pardsl.program.ir import format_bytes
from pardsl.runtime.schedules import rank_of_stage, stages_of_rank
from pardsl.tools.explain import Layer, layers, report, seconds_text

# Where the pictures are on the page: the header above them has a fixed height, so that the first picture
# starts at PICTURES_TOP whatever the file's name, and each next one PICTURE_GAP below the one before.
PICTURES_LEFT = 24
PICTURES_TOP = 84
PICTURE_GAP = 16

WIDTH = 980  # of each picture
LABELS = 200  # the column of lane and bar names, left of the plot
PLOT = WIDTH - LABELS - 40  # the plot's width; the rest is room for the last tick's label
FONT = 12
CHAR = 7.0  # a generous average width of a character at FONT px, to lay out text that must not overlap
LANE = 26  # a timeline lane's height
BAR = 24  # a memory bar's height

_STYLE = f"""body{{font:14px system-ui,sans-serif;margin:0;color:#222}}
header{{height:{PICTURES_TOP}px;box-sizing:border-box;padding:12px {PICTURES_LEFT}px 0;overflow:hidden}}
header h1{{font-size:20px;margin:0 0 6px;white-space:nowrap;overflow:hidden;text-overflow:ellipsis}}
header p{{margin:0;line-height:1.5;white-space:nowrap;overflow:hidden;text-overflow:ellipsis}}
svg.picture{{display:block;margin:0 0 {PICTURE_GAP}px {PICTURES_LEFT}px}}
main{{margin:0 {PICTURES_LEFT}px 2em}}table{{border-collapse:collapse}}
td,th{{padding:2px 8px;border-bottom:1px solid #ddd;text-align:left;font-variant-numeric:tabular-nums}}
h2{{margin-top:1.5em}}.num{{text-align:right}}pre{{background:#f6f6f6;padding:1em;white-space:pre-wrap}}"""

_COLOURS = {"all_reduce": "#d9534f", "all_gather": "#5bc0de", "reduce_scatter": "#f0ad4e", "all_to_all": "#9b59b6"}

# The timeline's colours, by what a block is
TIMELINE_COLOURS = {
    "forward": "#4e79a7",  # compute, forward
    "backward": "#59a14f",  # compute, backward
    "communication": "#f28e2b",  # communication beside compute (prefetched gathers, gradient buckets)
    "exposed": "#e15759",  # communication the step waits for
}
TIMELINE_NAMES = {"forward": "compute, forward", "backward": "compute, backward",
                  "communication": "communication overlapped with compute",
                  "exposed": "exposed communication (the step waits for it)"}
IDLE = "#ececec"  # a lane's background: where a rank waits (a pipeline's bubble)

# The memory picture's colours, by estimate.memory's keys; any other key is "other"
MEMORY_COLOURS = {
    "parameters": "#76b7b2", "gradients": "#edc948", "optimizer_state": "#b07aa1", "activations": "#ff9da7",
    "gathered_parameters": "#9c755f", "compute_copies": "#8cd17d", "stage_buffers": "#499894", "other": "#bab0ac",
}
# what each part is called, as the text report calls it
MEMORY_NAMES = {"optimizer_state": "optimizer state", "gathered_parameters": "gathered parameters",
                "compute_copies": "low-precision copies", "stage_buffers": "pipeline buffers"}
SERIAL = "#c9c9c9"
BOUND = "#000000"
DEVICE = "#7f1d1d"
PEAK = "#333333"
WORST = "backward's worst moment"  # the estimate's `peak`, as the text report calls it


def _svg_open(name: str, height: int, title: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="picture" id="{name}" width="{WIDTH}" '
            f'height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="system-ui,sans-serif" '
            f'font-size="{FONT}" role="img" aria-label="{html.escape(title)}"><title>{html.escape(title)}</title>'
            f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="#ffffff"/>')


def _text(x: float, y: float, text: str, anchor: str = "start", size: int = FONT, weight: str = "") -> str:
    bold = f' font-weight="{weight}"' if weight else ""
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}"{bold}>'
            f'{html.escape(text)}</text>')


def _fitted(text: str, width: float, size: int = FONT) -> str:
    """`text` cut with an ellipsis to fit `width` px (its start kept: a path's root says where it is)."""
    most = max(1, int(width / (CHAR * size / FONT)))
    return text if len(text) <= most else text[:most - 1] + "…"


def _caption(lines: list[str], y: float) -> tuple[list[str], float]:
    """Caption paragraphs wrapped to the picture's width, from baseline `y`; and the y after them."""
    parts = []
    for paragraph in lines:
        for line in textwrap.wrap(paragraph, int((WIDTH - 20) / CHAR)):
            parts.append(_text(10, y, line))
            y += FONT + 4
    return parts, y


def _legend(entries: list[tuple[str, str, str]], y: float) -> tuple[list[str], float]:
    """Swatches with their names, in rows that fit the width: (key, colour, name) each, a swatch's class
    `swatch` and its key, so that a test finds them."""
    parts, x = [], 10.0
    for key, colour, name in entries:
        width = 18 + len(name) * CHAR + 16
        if x + width > WIDTH - 10 and x > 10:
            x, y = 10.0, y + FONT + 10
        if key == "line":
            parts.append(f'<line x1="{x:.1f}" y1="{y - 4:.1f}" x2="{x + 12:.1f}" y2="{y - 4:.1f}" stroke="{colour}" '
                         'stroke-width="2"/>')
        else:
            parts.append(f'<rect class="swatch" data-key="{key}" x="{x:.1f}" y="{y - FONT + 1:.1f}" width="12" '
                         f'height="12" fill="{colour}"/>')
        parts.append(_text(x + 18, y, name))
        x += width
    return parts, y + FONT + 6


def _nice_step(span: float, ticks: int = 6) -> float:
    """A tick step of 1, 2 or 5 times a power of ten that cuts `span` into about `ticks` parts."""
    raw = span / ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def _axis(y: float, span: float, unit: float, name: str, label_of) -> list[str]:
    """A horizontal axis at `y` over the plot, from 0 to `span` (in the plot's units), ticks in `unit`s."""
    step = _nice_step(span / unit) * unit
    parts = [f'<line x1="{LABELS}" y1="{y:.1f}" x2="{LABELS + PLOT}" y2="{y:.1f}" stroke="#555"/>']
    count = int(span / step + 1e-9)
    for i in range(count + 1):
        x = LABELS + PLOT * (i * step) / span
        parts.append(f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{x:.1f}" y2="{y + 5:.1f}" stroke="#555"/>')
        parts.append(_text(x, y + 18, label_of(i * step), "middle"))
    parts.append(_text(LABELS + PLOT / 2, y + 36, name, "middle"))
    return parts


# A step as a timeline


@dataclass
class Block:
    lane: int
    start: float  # seconds from the step's start
    seconds: float
    kind: str  # a TIMELINE_COLOURS key
    title: str  # the tooltip: what it is and what it costs
    labels: tuple[str, ...] = ()  # the first that fits is written inside (a pipeline's micro-batch)


@dataclass
class Timeline:
    lanes: list[str]
    blocks: list[Block]
    notes: list[str]  # the caption: how it was laid out
    separated: bool = False  # a pixel's gap after each block: a pipeline's micro-batches side by side

    @property
    def end(self) -> float:
        return max((b.start + b.seconds for b in self.blocks), default=0.0)


def _collective_text(cost) -> str:
    return (f"{cost.kind.replace('_', '-')} on {cost.axis}, {cost.phase}, {format_bytes(cost.bytes)}, "
            f"{seconds_text(cost.seconds)}: {cost.reason}")


def step_timeline(compiled, estimate: Estimate) -> Timeline:
    """The step on each rank, from the estimate: without a pipeline every rank runs the same program, one
    lane for them all (and one for what it communicates beside compute); with one, a lane per rank along
    the pipeline axis, each micro-batch's forward and backward through its stages as the schedule orders
    them."""
    if compiled.pipeline is not None:
        return _pipeline_timeline(compiled, estimate)
    return _spmd_timeline(compiled, estimate)


def _spmd_timeline(compiled, estimate: Estimate) -> Timeline:
    seconds, ranks = estimate.seconds, compiled.program.mesh.size
    every = "the rank" if ranks == 1 else "both ranks" if ranks == 2 else f"all {ranks} ranks"
    compute: dict[str, dict[str, float]] = {}
    for op in estimate.ops:
        phases = compute.setdefault(op.layer, {"forward": 0.0, "backward": 0.0})
        phases["forward"] += op.forward_s
        phases["backward"] += op.backward_s
    order = [layer.name for layer in layers(compiled, estimate)]
    blocks, now = [], 0.0
    background = [c for c in estimate.collectives if c.overlapped]
    for phase, names in (("forward", order), ("backward", order[::-1])):
        start = now
        for name in names:
            spent = compute.get(name, {}).get(phase, 0.0)
            if spent:
                blocks.append(Block(0, now, spent, phase, f"{name or '(outside the layers)'}: {phase} compute "
                                                          f"{seconds_text(spent)}"))
                now += spent
            for cost in estimate.collectives:
                if not cost.overlapped and cost.layer == name and cost.phase == phase:
                    blocks.append(Block(0, now, cost.seconds, "exposed", f"{name or '(outside the layers)'}: "
                                        + _collective_text(cost)))
                    now += cost.seconds
        beside = start
        for cost in background:
            if cost.phase == phase:
                blocks.append(Block(1, beside, cost.seconds, "communication",
                                    f"{cost.layer or '(outside the layers)'}: " + _collective_text(cost)))
                beside += cost.seconds
        waited = seconds[f"overlapped_exposed_{phase}"]
        if waited:
            blocks.append(Block(0, now, waited, "exposed", f"{phase}: {seconds_text(waited)} of the "
                                f"{seconds_text(seconds[f'overlapped_{phase}'])} communicated beside compute that "
                                f"compute does not hide (the machine overlaps {estimate.machine.overlap:.0%} of it)"))
            now += waited
    lanes = [every] + (["beside compute"] if background else [])
    notes = [f"Every rank runs the same program: one lane stands for {every}. Forward then backward, each "
             "layer's compute followed by the collectives it waits for; the cost model gives no order within a "
             "phase, so layers are in program order (backward in reverse)."]
    if background:
        notes.append("The second lane: collectives issued beside compute (prefetched parameter gathers, "
                     "gradient buckets), from the start of their phase in program order; what compute does not "
                     "hide of them is exposed at the end of the phase.")
    moved = seconds["communication_forward"] + seconds["communication_backward"] + seconds["overlapped"]
    exposed = moved - seconds["overlapped"] + seconds["overlapped_exposed"]
    notes.append(f"Estimated step {seconds_text(seconds['step'])}: compute {seconds_text(seconds['compute_forward'])} "
                 f"forward + {seconds_text(seconds['compute_backward'])} backward, communication "
                 f"{seconds_text(moved)} of which {seconds_text(exposed)} exposed; on {estimate.machine.source}.")
    return Timeline(lanes, blocks, notes)


def _stage_of_ops(compiled) -> dict[str, int]:
    """Each op's stage: the ops from the first one inside a cut's submodule on are the next stage's, as
    the pipeline pass cuts them (pardsl/passes/pipeline.py)."""
    paths, stage, found = compiled.bound.module_paths, 0, {}
    cuts = list(compiled.pipeline.cut_before)
    for name in compiled.typed.nodes:
        path = paths.get(name) or ""
        while stage < len(cuts) and (path == cuts[stage] or path.startswith(cuts[stage] + ".")):
            stage += 1
        found[name] = stage
    return found


def _rank_orders(schedule: str, ranks: int, stages: int, m: int) -> list[list[tuple[str, int, int]]] | None:
    """Each pipeline rank's actions, in the order torch's schedule runs them: ("F" or "B", stage,
    micro-batch). None for the schedules drawn by a greedy order instead (the V-shaped ones)."""
    orders = []
    for rank in range(ranks):
        own = stages_of_rank(rank, ranks, stages, schedule)
        if schedule == "GPipe":
            orders.append([("F", own[0], i) for i in range(m)] + [("B", own[0], i) for i in range(m)])
        elif schedule == "1F1B":  # p - r forwards, then one backward and one forward, then the backwards
            warmup = min(m, ranks - rank)
            order = [("F", own[0], i) for i in range(warmup)]
            for i in range(m):
                order.append(("B", own[0], i))
                if warmup + i < m:
                    order.append(("F", own[0], warmup + i))
            orders.append(order)
        elif schedule == "LoopedBFS":  # each stage's every micro-batch, then backward all in the reverse order
            orders.append([("F", s, i) for s in own for i in range(m)] +
                          [("B", s, i) for s in own[::-1] for i in reversed(range(m))])
        elif schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
            orders.append(_interleaved(rank, ranks, own, m))
        else:
            return None
    return orders


def _interleaved(rank: int, ranks: int, own: list[int], m: int) -> list[tuple[str, int, int]]:
    """Interleaved 1F1B's order on one rank (torch's ScheduleInterleaved1F1B): rounds of `ranks`
    micro-batches through each of its stages in turn, a warm-up of forwards, then one forward and one
    backward, then the backwards left."""
    chunks, total = len(own), len(own) * m
    warmup = min(total, (chunks - 1) * ranks + 2 * (ranks - 1 - rank))

    def action(kind: str, step: int) -> tuple[str, int, int]:
        local = (step // ranks) % chunks
        stage = own[local if kind == "F" else chunks - 1 - local]
        return kind, stage, (step // (ranks * chunks)) * ranks + step % ranks

    order = [action("F", f) for f in range(warmup)]
    for step in range(total - warmup):
        order += [action("F", warmup + step), action("B", step)]
    return order + [action("B", b) for b in range(total - warmup, total)]


def _laid_out(orders, ranks, stages, m, schedule, duration, sent, returned):
    """Each action's (start, end): a rank runs its actions one at a time, each once what it needs has
    arrived (a forward the stage before's activations, `sent[s]` after it; a backward its own forward and
    the stage after's gradient, `returned[s]` after it). `orders`: each rank's order, or None for a greedy
    one (of the actions that can start, the earliest, backward first)."""
    done: dict[tuple[str, int, int], tuple[float, float]] = {}
    free = [0.0] * ranks

    def ready_at(action):
        kind, stage, i = action
        needs = ([(("F", stage - 1, i), sent[stage])] if kind == "F" and stage > 0 else []) + \
            ([(("F", stage, i), 0.0)] if kind == "B" else []) + \
            ([(("B", stage + 1, i), returned[stage])] if kind == "B" and stage < stages - 1 else [])
        if any(need not in done for need, _ in needs):
            return None
        return max([done[need][1] + lag for need, lag in needs], default=0.0)

    def place(rank, action, at):
        start = max(free[rank], at)
        done[action] = (start, start + duration[action[0]][action[1]])
        free[rank] = done[action][1]

    if orders is not None:
        position = [0] * ranks
        moved = True
        while moved:
            moved = False
            for rank in range(ranks):
                while position[rank] < len(orders[rank]):
                    at = ready_at(orders[rank][position[rank]])
                    if at is None:
                        break
                    place(rank, orders[rank][position[rank]], at)
                    position[rank] += 1
                    moved = True
        if all(p == len(o) for p, o in zip(position, orders)):
            return done
        done.clear()  # an order that waits on itself: laid out greedily instead
        free = [0.0] * ranks
    left = {(kind, s, i) for s in range(stages) for i in range(m) for kind in ("F", "B")}
    while left:
        options = []
        for action in left:
            at = ready_at(action)
            if at is not None:
                rank = rank_of_stage(action[1], ranks, schedule)
                options.append((max(at, free[rank]), action[0] == "F", action[2], action[1], rank, action))
        start, _, _, _, rank, action = min(options)
        place(rank, action, start)
        left.remove(action)
    return done


def _pipeline_timeline(compiled, estimate: Estimate) -> Timeline:
    plan, stages, machine = compiled.pipeline, compiled.stages, estimate.machine
    mesh = compiled.program.mesh
    ranks = mesh.axis_sizes[mesh.axis_index(plan.axis)]
    count, m = len(stages), plan.microbatches
    stage_of = _stage_of_ops(compiled)
    compute = {phase: [0.0] * count for phase in ("F", "B")}
    for op in estimate.ops:
        compute["F"][stage_of[op.node]] += op.forward_s
        compute["B"][stage_of[op.node]] += op.backward_s
    # collectives on the stage's other axes (tensor parallelism's), which its micro-batch waits for
    waits = {phase: [0.0] * count for phase in ("F", "B")}
    buckets = [0.0] * count
    for k, program in enumerate(stages):
        for statement in program.statements:
            for c in statement.collectives:
                waits["F" if c.phase == "forward" else "B"][k] += collective_seconds(machine, mesh, c)
        buckets[k] = sum(collective_seconds(machine, mesh, c) for b in program.buckets for c in b.collectives)
    duration = {phase: [compute[phase][k] + waits[phase][k] for k in range(count)] for phase in ("F", "B")}
    sent, returned = [0.0] * count, [0.0] * count  # sent[k]: into stage k; returned[k]: back into stage k
    for k in range(count):
        received, gradients = stage_buffer_slots(stages, k)
        moved = sum(slot_bytes(s.local_shape, s.dtype) for s in received)
        sent[k] = machine.collective_seconds("send", moved, 2) if moved else 0.0
        moved = sum(slot_bytes(s.local_shape, s.dtype) for s in gradients)
        returned[k] = machine.collective_seconds("send", moved, 2) if moved else 0.0
    orders = _rank_orders(plan.schedule, ranks, count, m)
    done = _laid_out(orders, ranks, count, m, plan.schedule, duration, sent, returned)
    blocks = []
    for (kind, k, i), (start, _) in sorted(done.items(), key=lambda item: item[1]):
        rank = rank_of_stage(k, ranks, plan.schedule)
        phase = "forward" if kind == "F" else "backward"
        title = f"stage {k}, micro-batch {i}: {phase} {seconds_text(compute[kind][k])}"
        # a rank of several stages says which: micro-batch 3's forward through stage 2 is "F3 s2"
        labels = (f"{kind}{i} s{k}", f"{kind}{i}") if count > ranks else (f"{kind}{i}",)
        blocks.append(Block(rank, start, compute[kind][k], phase, title, labels))
        if waits[kind][k]:
            blocks.append(Block(rank, start + compute[kind][k], waits[kind][k], "exposed",
                                f"stage {k}, micro-batch {i}: {phase} collectives on the other axes "
                                f"{seconds_text(waits[kind][k])}"))
    for rank in range(ranks):
        now = max((end for (_, k, _), (_, end) in done.items()
                   if rank_of_stage(k, ranks, plan.schedule) == rank), default=0.0)
        for k in stages_of_rank(rank, ranks, count, plan.schedule):
            if buckets[k]:
                blocks.append(Block(rank, now, buckets[k], "exposed", f"stage {k}: gradient buckets "
                                    f"{seconds_text(buckets[k])}, once a step after its last backward"))
                now += buckets[k]
    others = mesh.size // ranks
    lanes = []
    for rank in range(ranks):
        own = ", ".join(str(k) for k in stages_of_rank(rank, ranks, count, plan.schedule))
        who = f"{plan.axis}{rank}" + (f" ({others} ranks)" if others > 1 else "")
        lanes.append(f"{who}: stage{'s' if ',' in own else ''} {own}")
    sends = max(sent + returned)
    notes = [f"{plan.schedule}, {m} micro-batches through {count} stages on {ranks} ranks along {plan.axis}: "
             f"a lane per rank, F0 micro-batch 0's forward through the rank's stage, B0 its backward"
             f"{' (F0 s2: through stage 2)' if count > ranks else ''}, each at "
             f"the cost model's time for the stage at one micro-batch. Grey: the rank waits (the bubble)."]
    if orders is None:
        notes.append(f"{plan.schedule} splits backward into input and weight gradients, which this picture does not "
                     "draw: each backward is one block, each rank runs the earliest action it can, backward first.")
    elif plan.schedule == "InterleavedZeroBubble":
        notes.append("InterleavedZeroBubble splits backward into input and weight gradients, which this picture "
                     "does not draw: each backward is one block, in Interleaved1F1B's order.")
    notes.append(f"A stage starts a micro-batch once the one before has sent its activations (a backward once the "
                 f"one after has sent the gradient back), at most {seconds_text(sends)} a send; gradient buckets at "
                 f"the end. The pipeline search's estimate of the step: "
                 f"{seconds_text(pipelined_step_seconds(compiled, machine))}; this layout ends at "
                 f"{seconds_text(max(b.start + b.seconds for b in blocks))}. Parameter gathers within a stage are "
                 "not drawn (neither model prices them).")
    return Timeline(lanes, blocks, notes, separated=True)


def _time_unit(span: float) -> tuple[float, str]:
    return (1.0, "s") if span >= 1 else (1e-3, "ms") if span >= 1e-3 else (1e-6, "µs")


def _number(value: float) -> str:
    return f"{round(value, 6):g}"


def timeline_svg(timeline: Timeline) -> str:
    """The timeline: lanes down, time across on a labelled axis, a legend and the caption."""
    end = timeline.end or 1e-6
    unit, unit_name = _time_unit(end)
    span = end * 1.02
    scale = PLOT / span
    top = 30
    axis_y = top + LANE * len(timeline.lanes) + 4
    parts = [_text(10, 18, "A step, rank by rank", weight="bold", size=14)]
    for index, name in enumerate(timeline.lanes):
        y = top + index * LANE
        parts.append(f'<rect class="lane" x="{LABELS}" y="{y}" width="{PLOT}" height="{LANE - 6}" fill="{IDLE}"/>')
        parts.append(_text(LABELS - 8, y + (LANE - 6) / 2 + 4, _fitted(name, LABELS - 16), "end"))
    for block in timeline.blocks:
        x, width = LABELS + block.start * scale, block.seconds * scale
        if timeline.separated and width > 2:
            width -= 1
        y = top + block.lane * LANE
        parts.append(f'<rect class="{block.kind}" x="{x:.2f}" y="{y}" width="{width:.2f}" height="{LANE - 6}" '
                     f'fill="{TIMELINE_COLOURS[block.kind]}" shape-rendering="crispEdges">'
                     f'<title>{html.escape(block.title)}</title></rect>')
        label = next((label for label in block.labels if width >= len(label) * 7 + 4), "")
        if label:
            parts.append(f'<text x="{x + width / 2:.1f}" y="{y + (LANE - 6) / 2 + 4:.1f}" text-anchor="middle" '
                         f'font-size="11" fill="#ffffff">{html.escape(label)}</text>')
    parts += _axis(axis_y, span, unit, f"time ({unit_name})", lambda t: _number(t / unit))
    legend = [(kind, TIMELINE_COLOURS[kind], TIMELINE_NAMES[kind]) for kind in TIMELINE_COLOURS
              if any(b.kind == kind for b in timeline.blocks)] + [("idle", IDLE, "waiting (idle)")]
    swatches, y = _legend(legend, axis_y + 62)
    caption, y = _caption(timeline.notes, y + 8)
    height = int(y + 4)
    return _svg_open("timeline", height, "A step as a timeline per rank") + "".join(parts + swatches + caption) + \
        "</svg>"


# Memory per rank against the bound


def _optimizer(memory: dict) -> str:
    """The optimizer the estimate counted state for: whether it holds any is all that tells them apart."""
    held = memory.get("optimizer_state", 0) or memory.get("host_optimizer_state", 0)
    return "adamw" if held else "sgd"


def memory_bars(compiled, estimate: Estimate) -> list[tuple[str, dict]]:
    """What each rank holds, as the cost model estimates it: one bar for all ranks of an SPMD plan; a
    pipeline's ranks along its axis each their own stages'."""
    plan, mesh = compiled.pipeline, compiled.program.mesh
    if plan is None:
        return [("each rank" if mesh.size > 1 else "the rank", estimate.memory)]
    ranks = mesh.axis_sizes[mesh.axis_index(plan.axis)]
    bars = []
    for rank in range(ranks):
        own = stages_of_rank(rank, ranks, len(compiled.stages), plan.schedule)
        bars.append((f"{plan.axis}{rank}: stage{'s' if len(own) > 1 else ''} {', '.join(map(str, own))}",
                     pipeline_rank_memory(compiled.stages, plan, rank, _optimizer(estimate.memory))))
    return bars


def _segments(memory: dict, host: bool = False) -> list[tuple[str, int]]:
    """A bar's parts, in estimate.memory's order: device memory's, or with `host` host memory's."""
    parts: dict[str, int] = {}
    for key, value in memory.items():
        if key in ("total", "peak", "serial_total", "host_total") or key.startswith("host_") != host or not value:
            continue
        key = key.removeprefix("host_")
        key = key if key in MEMORY_COLOURS else "other"
        parts[key] = parts.get(key, 0) + value
    return list(parts.items())


def _byte_unit(most: float) -> tuple[float, str]:
    return next(((size, unit) for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
                 if most >= 2 * size), (1, "B"))


def memory_svg(compiled, estimate: Estimate, memory_bound: int | None) -> str:
    """One stacked bar per rank (or per pipeline rank) against a byte scale, the bound and what one device
    holds as lines, serial's total as a bar of its own; host memory (offload) as bars apart."""
    bars = memory_bars(compiled, estimate)
    serial = estimate.memory["serial_total"]
    device = estimate.machine.device_memory_bytes
    host_bars = [(name, _segments(m, host=True)) for name, m in bars]
    host_bars = [(name, segments) for name, segments in host_bars if segments]  # offloaded plans' only
    most = max([m["total"] for _, m in bars] + [m["peak"] for _, m in bars] + [memory_bound or 0] +
               [sum(v for _, v in segments) for _, segments in host_bars])
    shows_device = bool(device) and device <= 4 * most
    most = max(most, device if shows_device else 0)
    serial_fits = serial <= 6 * most
    span = max(most, serial if serial_fits else 0, 1) * 1.1
    scale = PLOT / span
    rows = [(name, _segments(m), m["peak"]) for name, m in bars]
    parts = [_text(10, 18, "Memory per rank", weight="bold", size=14)]

    lines = []
    if memory_bound is not None:
        lines.append(("bound", memory_bound, BOUND, f"bound {format_bytes(memory_bound)}", ""))
    if shows_device:
        lines.append(("device", device, DEVICE, f"device memory {format_bytes(device)} (dashed)",
                      ' stroke-dasharray="6,3"'))
    crossing = [LABELS + value * scale for _, value, _, _, _ in lines]
    top = 34 + 14 * len(lines)  # room above the bars for the lines' names
    y = top

    def bar(name, segments, y, label_end="", after=0.0):
        x = float(LABELS)
        out = [_text(LABELS - 8, y + BAR / 2 + 4, _fitted(name, LABELS - 16), "end")]
        for key, value in segments:
            width = value * scale
            out.append(f'<rect class="memory {key}" x="{x:.2f}" y="{y}" width="{width:.2f}" height="{BAR}" '
                       f'fill="{MEMORY_COLOURS[key]}" shape-rendering="crispEdges"><title>{MEMORY_NAMES.get(key, key)} '
                       f'{format_bytes(value)}</title></rect>')
            x += width
        if label_end:  # past the bar, its peak and any line the text would cross
            start = max(x, after) + 6
            for line in sorted(crossing):
                if start - 4 <= line <= start + len(label_end) * CHAR + 4:
                    start = line + 6
            out.append(_text(start, y + BAR / 2 + 4, label_end))
        return out

    for name, segments, peak in rows:
        total = sum(v for _, v in segments)
        x = LABELS + peak * scale
        parts += bar(name, segments, y, format_bytes(total), x)
        parts.append(f'<line class="peak" x1="{x:.1f}" y1="{y - 3}" x2="{x:.1f}" y2="{y + BAR + 3}" stroke="{PEAK}" '
                     f'stroke-width="2" stroke-dasharray="2,2"><title>{WORST} {format_bytes(peak)}</title></line>')
        y += BAR + 8
    width = (serial if serial_fits else span * 0.98) * scale
    parts.append(_text(LABELS - 8, y + BAR / 2 + 4, "serial (one device)", "end"))
    parts.append(f'<rect class="serial" x="{LABELS}" y="{y}" width="{width:.2f}" height="{BAR}" fill="{SERIAL}">'
                 f'<title>serial {format_bytes(serial)}</title></rect>')
    said = format_bytes(serial) if serial_fits else f"{format_bytes(serial)}, past the scale"
    if not serial_fits:  # a break in the bar: it goes on past the plot
        cut = LABELS + width - 14
        parts.append(f'<path d="M{cut:.1f},{y + BAR + 2} l6,-{BAR + 4} M{cut + 5:.1f},{y + BAR + 2} l6,-{BAR + 4}" '
                     'stroke="#ffffff" stroke-width="3"/>')
    parts.append(_text(LABELS + width + 6 if serial_fits else LABELS + 8, y + BAR / 2 + 4, said))
    y += BAR + 8
    bottom = y
    for index, (key, value, colour, name, dash) in enumerate(lines):
        x = round(LABELS + value * scale)
        parts.append(f'<line class="{key}" x1="{x}" y1="{top - 10 - 14 * index}" x2="{x}" y2="{bottom}" '
                     f'stroke="{colour}" stroke-width="2"{dash}><title>{html.escape(name)}</title></line>')
        # each line's name on a row of its own above the bars, beside the line on the side with room
        right = x + 4 + len(name) * CHAR <= WIDTH
        parts.append(_text(x + 4 if right else x - 4, top - 12 - 14 * index, name, "start" if right else "end"))
    unit, unit_name = _byte_unit(span)
    parts += _axis(bottom + 4, span, unit, f"bytes per rank ({unit_name})", lambda b: f"{_number(b / unit)}")
    y = bottom + 62
    if host_bars:
        parts.append(_text(10, y + 4, "Host memory (offloaded), per rank, on the same scale", weight="bold"))
        y += 14
        for name, segments in host_bars:
            parts += bar(name, segments, y, format_bytes(sum(v for _, v in segments)))
            y += BAR + 8
        y += 14
    used = {key for _, segments, _ in rows for key, _ in segments} | {k for _, s in host_bars for k, _ in s}
    legend = [(key, MEMORY_COLOURS[key], MEMORY_NAMES.get(key, key)) for key in MEMORY_COLOURS if key in used]
    legend.append(("serial", SERIAL, "serial: what one device would hold"))
    legend.append(("line", PEAK, f"{WORST} (dotted)"))
    legend += [("line", colour, name) for _, _, colour, name, _ in lines]
    swatches, y = _legend(legend, y + 4)
    notes = ["Each bar is what a rank holds all at once, by the cost model: its parameters' shards, their gradients "
             "and optimizer state, activations kept for backward, parameters gathered for use and low-precision "
             "copies; what a `memory <=` bound weighs. The dotted tick is the estimate of backward's worst moment, "
             "as gradients arrive and activations leave."]
    if compiled.pipeline is not None:
        notes.append("A pipeline's rank holds its stages, with the activations of the micro-batches its schedule "
                     "keeps in flight and torch's stage buffers.")
    if device and not shows_device:
        notes.append(f"The device's memory, {format_bytes(device)}, is far past the scale.")
    if memory_bound is None:
        notes.append("No bound: the file has no `memory <=` line.")
    caption, y = _caption(notes, y + 8)
    height = int(y + 4)
    return _svg_open("memory", height, "Memory per rank against the bound") + "".join(parts + swatches + caption) + \
        "</svg>"


# The mesh and the layers


def _mesh_svg(mesh) -> str:
    """The ranks as a grid: the first axis down, the others across (their product)."""
    rows = mesh.axis_sizes[0] if mesh.ndim > 1 else 1
    cols = mesh.size // rows
    cell = 56
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{cols * cell + 20}" height="{rows * cell + 40}">']
    for rank in range(mesh.size):
        r, c = divmod(rank, cols)
        coords = ", ".join(f"{n}{i}" for n, i in zip(mesh.axis_names, mesh.coordinates(rank)))
        parts.append(f'<rect x="{10 + c * cell}" y="{10 + r * cell}" width="{cell - 6}" height="{cell - 6}" '
                     f'fill="#eef" stroke="#447"/><text x="{13 + c * cell}" y="{30 + r * cell}" font-size="12">'
                     f'rank {rank}</text><text x="{13 + c * cell}" y="{46 + r * cell}" font-size="10">'
                     f'{html.escape(coords)}</text>')
    axes = (f"{mesh.axis_names[0]} down, {' × '.join(mesh.axis_names[1:])} across" if mesh.ndim > 1
            else f"{mesh.axis_names[0]} across")
    parts.append(f'<text x="10" y="{rows * cell + 30}" font-size="12">{html.escape(axes)}</text></svg>')
    return "".join(parts)


def _layers_svg(all_layers: list[Layer]) -> str:
    """One bar per layer: compute in grey, each collective a segment in its kind's colour."""
    width, row = 640, 22
    scale = width / max(max((l.compute_s + sum(c.seconds for c in l.collectives)) for l in all_layers), 1e-12)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 260}" height="{row * len(all_layers) + 30}">']
    for index, layer in enumerate(all_layers):
        y = 10 + index * row
        parts.append(f'<text x="0" y="{y + 14}" font-size="12">{html.escape(_fitted(layer.name or "(outside)", 210))}'
                     '</text>')
        x = 220.0
        parts.append(f'<rect x="{x:.1f}" y="{y}" width="{layer.compute_s * scale:.1f}" height="16" fill="#bbb">'
                     f'<title>compute {seconds_text(layer.compute_s)}</title></rect>')
        x += layer.compute_s * scale
        for cost in layer.collectives:
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{max(cost.seconds * scale, 1):.1f}" height="16" '
                         f'fill="{_COLOURS[cost.kind]}"><title>{html.escape(_collective_text(cost))}</title></rect>')
            x += max(cost.seconds * scale, 1)
    parts.append("</svg>")
    return "".join(parts)


def html_page(compiled, estimate: Estimate, memory_bound: int | None = None, alternatives_priced: list | None = None,
              op_choices: bool = False) -> str:
    """One self-contained page: no script, no external resource. The pictures first, at the places the
    module's constants give, then the mesh, the layers, the collectives and the text report
    (`alternatives_priced`, `op_choices`: as the report takes them)."""
    program = compiled.program
    all_layers = layers(compiled, estimate)
    legend = " ".join(f'<span style="background:{c};padding:0 6px;color:#fff">{k.replace("_", "-")}</span>'
                      for k, c in _COLOURS.items())
    rows = []
    for layer in all_layers:
        for cost in layer.collectives:
            rows.append(f"<tr><td>{html.escape(layer.name or '(outside)')}</td><td>{cost.kind.replace('_', '-')}</td>"
                        f"<td>{html.escape(cost.axis)}</td><td>{cost.phase}{', overlapped' if cost.overlapped else ''}"
                        f"</td><td class=num>{format_bytes(cost.bytes)}</td><td class=num>{seconds_text(cost.seconds)}"
                        f"</td><td>{html.escape(cost.reason)}</td></tr>")
    title = html.escape(program.source_path)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>pardsl explain: {title}</title>
<style>{_STYLE}</style></head><body>
<header><h1 title="{title}">{title}</h1>
<p>mesh {html.escape(str(program.mesh))} ({program.mesh.size} ranks), model <code>{html.escape(program.model)}</code></p>
</header>
{timeline_svg(step_timeline(compiled, estimate))}
{memory_svg(compiled, estimate, memory_bound)}
<main>
<h2>Mesh</h2>{_mesh_svg(program.mesh)}
<h2>Layers and where communication happens</h2><p>compute in grey; {legend}</p>
{_layers_svg(all_layers)}
<h2>Collectives</h2><table><tr><th>layer</th><th>collective</th><th>axis</th><th>phase</th><th>bytes per rank</th>
<th>estimated</th><th>why</th></tr>{''.join(rows)}</table>
<h2>Report</h2><pre>{html.escape(report(compiled, estimate, memory_bound, alternatives_priced, op_choices))}</pre>
</main>
</body></html>
"""
