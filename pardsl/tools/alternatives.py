"""Other plans a user could write, for `pardsl explain`: the same file with a line or a few changed —
parameters sharded over the data axis (ZeRO-3, FSDP) or kept whole there, layers recomputed in backward or
not, the mesh's two axes' sizes exchanged. Each is compiled on the plan's own trace and priced by the same
cost model as the plan, so its step and memory compare with the plan's figure for figure.

Only a plan whose layouts are all written has such neighbours: where the search chose layouts, a changed
line would be searched again (seconds to minutes each), and explain lists what the search compared instead
(the mesh shapes, the pipeline options)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pardsl.compiler import compile_bound
from pardsl.language.diagnostics import CompileError
from pardsl.language.progress import tell
from pardsl.language.syntax import parse
from pardsl.layouts.algebra import B, Layout, Placement
from pardsl.model.binding import bound_for, name_pattern
from pardsl.planning.cost import DEFAULT_BUCKET_MB, estimate, repeated_layer
from pardsl.planning.search import wants_search

MAX_LAYOUT_LINES_SHOWN = 1


@dataclass(frozen=True)
class Alternative:
    title: str  # what a user would call it: "ZeRO-3 over dp"
    edit: list[str]  # the lines to write in the file (a layout change: the first, then how many more)
    step_s: float | None = None  # None where it does not compile
    memory: int | None = None  # per rank, all at once: what a `memory <=` bound weighs
    within_bound: bool = True
    why_not: str = ""

    def to_json(self) -> dict:
        return {"title": self.title, "edit": self.edit, "step_s": self.step_s, "memory": self.memory,
                "within_bound": self.within_bound, "why_not": self.why_not}


def plan_alternatives(compiled, machine, bucket_mb: float = DEFAULT_BUCKET_MB,
                      optimizer: str = "adamw") -> list[Alternative]:
    """Each alternative of the plan that applies to it, compiled and priced with the plan's `optimizer`
    state counted; [] where the search chose the plan's layouts, or it is pipelined (its options are the
    pipeline search's)."""
    par = compiled.par
    if par.mesh.searched or par.pipeline is not None or wants_search(compiled.bound):
        return []
    found = []
    edits = [*_sharding_edits(compiled), *_recompute_edits(compiled), *_mesh_edits(compiled)]
    for index, (title, text, shown) in enumerate(edits):
        tell(f"pricing alternative {index + 1} of {len(edits)}: {title}")
        found.append(_priced(compiled, machine, bucket_mb, optimizer, title, text, shown))
    return found


def _priced(compiled, machine, bucket_mb: float, optimizer: str, title: str, text: str,
            shown: list[str]) -> Alternative:
    try:
        variant = parse(text, compiled.par.source.path)
        other = compile_bound(variant, bound_for(compiled.bound, variant), bucket_mb, machine)
    except CompileError as error:
        first = error.diagnostics[0]
        return Alternative(title, shown, why_not=f"error[{first.code}]: {first.message}")
    priced = estimate(other, machine, optimizer)
    within = other.memory_bound is None or priced.memory["total"] <= other.memory_bound
    return Alternative(title, shown, priced.step_s, priced.memory["total"], within)


# ---------------------------------------------------------------------------------------------------
# layouts


def _data_axes(program) -> list[int]:
    """Mesh axes that split the batch: some input is split on its first dim over them."""
    return [axis for axis in range(program.mesh.ndim) if program.mesh.axis_sizes[axis] > 1 and
            any(slot.layout.placements[axis] == Placement("S", 0) for slot in program.inputs)]


def _sharded_on(layout: Layout, axis: int, shape: tuple[int, ...], mesh) -> Layout | None:
    """`layout` with the parameter also split over `axis` on its first dim that no other axis splits and
    that divides evenly; None where none does."""
    taken = {p.dim for p in layout.placements if p.kind == "S"}
    for dim, size in enumerate(shape):
        if dim not in taken and size % mesh.axis_sizes[axis] == 0:  # untaken: its whole size is local
            return layout.with_axis(axis, Placement("S", dim))
    return None


def _sharding_edits(compiled) -> list[tuple[str, str, list[str]]]:
    """ZeRO-3 over each data axis whose parameters are whole; the parameters whole again on each data axis
    that shards them."""
    program = compiled.program
    mesh = program.mesh
    trained = [slot for slot in program.parameters if slot.requires_grad]
    edits = []
    for axis in _data_axes(program):
        name = mesh.axis_names[axis]
        whole = [slot for slot in trained if slot.layout.placements[axis] == B]
        sharded = [slot for slot in trained if slot.layout.placements[axis].kind == "S"]
        if whole and len(whole) >= len(sharded):
            layouts = {slot.name: _sharded_on(slot.layout, axis, slot.shape, mesh) or slot.layout for slot in whole}
            edit = _layout_edit(compiled, layouts)
            if edit:
                edits.append((f"ZeRO-3 over {name}: parameters sharded over {name}, gathered for use", *edit))
        elif sharded:
            edit = _layout_edit(compiled, {slot.name: slot.layout.with_axis(axis, B) for slot in sharded})
            if edit:
                edits.append((f"parameters whole on {name} (no ZeRO-3): nothing gathered, more held", *edit))
    return edits


def _layout_edit(compiled, changed: dict[str, Layout]) -> tuple[str, list[str]] | None:
    """The file with every parameter's layout written as the plan has it, `changed` applied: the entries
    the file writes for parameters replaced by one line per name pattern (`model.layers.*.mlp.up.weight`)
    where all its layers agree. Returns the text and the lines to show."""
    program, par = compiled.program, compiled.par
    mesh = program.mesh
    names = [slot.name for slot in program.parameters]
    layouts = {slot.name: changed.get(slot.name, slot.layout) for slot in program.parameters}
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(re.sub(r"\.\d+\.", ".*.", name), []).append(name)
    lines, new_lines = [], []
    for pattern, members in groups.items():
        if len({layouts[m] for m in members}) == 1:
            entries = [(pattern, layouts[members[0]], any(m in changed for m in members))]
        else:
            entries = [(m, layouts[m], m in changed) for m in members]
        for target, layout, is_new in entries:
            line = f"    {target} : {layout.render(mesh)}"
            lines.append(line)
            if is_new:
                new_lines.append(line.strip())
    if not new_lines:
        return None
    # a tied weight's other names (a GPT's head, its embedding) too: a layout written for either is its
    every_name = [alias for name in names for alias in compiled.bound.tied.get(name, (name,))]
    parameter_entries = [entry for entry in par.layouts
                         if any(name_pattern(entry.target).fullmatch(name) for name in every_name)]
    text = _with_lines_removed(par.source.text, [entry.span for entry in parameter_entries])
    # a repeated layer's line first: it says the change for every layer
    new_lines.sort(key=lambda line: "*" not in line)
    shown = new_lines[:MAX_LAYOUT_LINES_SHOWN]
    if len(new_lines) > len(shown):
        shown.append(f"(and {len(new_lines) - len(shown)} more layout line{'s' if len(new_lines) - len(shown) > 1 else ''} like it)")
    return _with_layout_lines(text, lines), shown


def _line_range(span) -> range:
    """The lines (0-based) a declaration's span covers; a span that ends at a line's first column ends on
    the line before."""
    last = span.end_line if span.end_column > 1 else span.end_line - 1
    return range(span.line - 1, max(last, span.line))


def _with_lines_removed(text: str, spans) -> str:
    """`text` without the declarations at `spans`. A declaration that shares its line with other text (the
    first layout entry written on the `layout {` line) leaves that text; a line it covers alone goes."""
    lines = text.splitlines(keepends=True)
    cut: dict[int, list[tuple[int, int]]] = {}  # line → column ranges (0-based, end exclusive) to cut
    for span in spans:
        for index in _line_range(span):
            start = span.column - 1 if index == span.line - 1 else 0
            end = span.end_column - 1 if index == span.end_line - 1 else len(lines[index])
            cut.setdefault(index, []).append((start, end))
    kept = []
    for index, line in enumerate(lines):
        for start, end in sorted(cut.get(index, ()), reverse=True):
            line = line[:start] + line[end:]
        if index in cut and not line.strip():
            continue
        kept.append(line if line.endswith("\n") or index == len(lines) - 1 else line + "\n")
    return "".join(kept)


def _with_layout_lines(text: str, lines: list[str]) -> str:
    """`lines` added to the file's layout block (a new one at the end where it has none)."""
    source = text.splitlines()
    opening = next((i for i, line in enumerate(source) if re.match(r"\s*layout\s*\{", line)), None)
    if opening is None:
        return "\n".join([*source, "", "layout {", *lines, "}"]) + "\n"
    if "}" in source[opening]:  # `layout {}` or `layout { a : B }` on one line
        inside = source[opening].split("{", 1)[1].rsplit("}", 1)[0].strip()
        block = ["layout {", *([f"    {inside}"] if inside else []), *lines, "}"]
        return "\n".join([*source[:opening], *block, *source[opening + 1:]]) + "\n"
    closing = next(i for i in range(opening + 1, len(source)) if source[i].strip().startswith("}"))
    return "\n".join([*source[:closing], *lines, *source[closing:]]) + "\n"


# ---------------------------------------------------------------------------------------------------
# recomputation and the mesh


def _recompute_edits(compiled) -> list[tuple[str, str, list[str]]]:
    """Every repeated layer recomputed (selective, or full where selective is written), or nothing
    recomputed where the file recomputes."""
    par = compiled.par
    text = par.source.text
    written = par.recomputes_written
    if written:
        edits = [("no recomputation: every activation kept for backward",
                  _with_lines_removed(text, [decl.span for decl in par.recomputes]), ["(the recompute lines left out)"])]
        if all(decl.policy == "selective" for decl in written):
            full = _with_lines_removed(text, [decl.span for decl in par.recomputes])
            lines = [f"recompute {decl.pattern} : full" for decl in written]
            edits.append(("full recomputation: only each layer's input kept", full.rstrip("\n") + "\n" +
                          "\n".join(lines) + "\n", lines))
        return edits
    layers = sorted({re.sub(r"\.\d+$", ".*", repeated_layer(slot.name.rpartition(".")[0]))
                     for slot in compiled.program.parameters} - {""})
    if not layers or par.recomputes:
        return []
    lines = [f"recompute {pattern} : selective" for pattern in layers]
    return [("selective recomputation of every layer: matrix products and attention kept",
             text.rstrip("\n") + "\n" + "\n".join(lines) + "\n", lines)]


def _mesh_edits(compiled) -> list[tuple[str, str, list[str]]]:
    """A two-axis mesh with its axes' sizes exchanged (`dp = 4, tp = 2` for `dp = 2, tp = 4`)."""
    par, mesh = compiled.par, compiled.program.mesh
    if mesh.ndim != 2 or mesh.axis_sizes[0] == mesh.axis_sizes[1]:
        return []
    line = "mesh   " + ", ".join(f"{name} = {size}" for name, size in zip(mesh.axis_names, reversed(mesh.axis_sizes)))
    source = par.source.text.splitlines()
    covered = _line_range(par.mesh.span)
    text = "\n".join([*source[:covered.start], line, *source[covered.stop:]]) + "\n"
    return [(", ".join(f"{name} = {size}" for name, size in zip(mesh.axis_names, reversed(mesh.axis_sizes))),
             text, [line])]
