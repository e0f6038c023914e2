"""Stage 5: lowered program → Python source of one SPMD module, rendered from `codegen/module.py.j2`.

The output is deterministic: the same program gives the same bytes (no timestamps, no paths other than
the one the user gave, dict orders fixed by the graph).

Names and other text from outside (the .par file's path, module and parameter names, output paths, the
model's arguments) reach the module only escaped (pardsl/program/ir.py): the templates pass every value
they place in a comment through the `comment` filter (ir.comment_text), in a string through `literal`
(ir.python_literal; the dicts and tuples made here are repr's, which escapes alike), in a docstring through
`docstring`; a comment after code is escaped where its line is made (_commented); code names only
identifiers made of names (ir.python_name), never a name itself.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types

import jinja2

from pardsl import __version__
from pardsl.language import shipped
from pardsl.planning.cost import slot_bytes
from pardsl.program.ir import (
    Arg, Instruction, Items, LoweredProgram, Statement, Text, Var, comment_text, format_bytes, named_layout,
    python_literal, python_name,
)

_COMMENT_COLUMN = 72


@functools.cache
def _template(name: str = "module.py.j2") -> jinja2.Template:
    text = shipped.read_text("pardsl.templates", name)
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, autoescape=False)
    # `literal`, not Jinja's tojson: that writes a character beyond the BMP (𝔘) as a surrogate pair, which
    # Python reads as two characters, not the name's one
    env.filters.update(comment=comment_text, literal=python_literal, docstring=_docstring_text)
    return env.from_string(text)


def _docstring_text(text: str) -> str:
    """`text` inside a triple-quoted docstring: as a comment shows it (a class's docstring cannot hold a lone
    surrogate: Python encodes it as UTF-8), in a literal's escapes, so that no quote of its own ends it."""
    return python_literal(comment_text(text))[1:-1]


def _commented(code: str, comment: str, column: int) -> str:
    """A line of code and its comment after it, at `column` where the code leaves room."""
    return f"{code.ljust(column)}  # {comment_text(comment)}"


def _shape(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _summary(counts: dict[str, int], total: int) -> str:
    parts = [f"{n} {kind.replace('_', '-')}" for kind, n in counts.items() if n]
    return (", ".join(parts) + f" ({format_bytes(total)} per rank)") if parts else "none"


def _slot(slot, mesh) -> dict:
    local = "" if tuple(slot.local_shape) == tuple(slot.shape) else f" local {list(slot.local_shape)}"
    return {
        "name": getattr(slot, "name", None) or getattr(slot, "path", ""),
        "var": slot.var,
        "layout_key": repr(slot.layout.key()) if len(slot.layout.key()) != 1 else f"({slot.layout.key()[0]!r},)",
        "shape": _shape(slot.shape),
        "local_shape": _shape(slot.local_shape),
        "dtype": getattr(slot, "dtype", ""),
        "requires_grad": getattr(slot, "requires_grad", True),
        "comment": f"{named_layout(slot.layout, mesh)}  {list(slot.shape)}{local}",
    }


def _arg(arg: Arg) -> str:
    if isinstance(arg, Var):
        return arg.name
    if isinstance(arg, Text):
        return arg.text
    if isinstance(arg, Items):
        inner = ", ".join(_arg(a) for a in arg.items)
        return f"{arg.brackets[0]}{inner}{arg.brackets[1]}"
    raise AssertionError(f"a {arg} left unformed by lowering")


def render_expression(instruction: Instruction) -> str:
    """The Python expression of one instruction: the only place instructions become text."""
    args = [_arg(a) for a in instruction.args]
    if instruction.kind == "project":
        return f"{args[0]}[{args[1]}]"
    if instruction.kind == "size":
        return f"{args[0]}.shape[{args[1]}]" + (f" * {args[2]}" if len(args) > 2 else "")
    if instruction.kind == "expression":
        return args[0]
    if instruction.kind == "release":
        return f"del {', '.join(args)}"
    parts = args + [f"{keyword}={_arg(value)}" for keyword, value in instruction.kwargs]
    return f"{instruction.callee}({', '.join(parts)})"


def _lines(statements) -> list[str]:
    return [_commented(code, comment, _COMMENT_COLUMN) if comment is not None else code
            for code, comment in _codes(statements)]


def _codes(statements) -> list[list]:
    """Per line: its code and its comment (None: a line with no comment at all)."""
    codes: list[list] = []
    for statement in statements:
        expr = render_expression(statement.instruction)
        if statement.instruction.kind == "release" and not statement.comment and codes:
            codes[-1][0] += f"; {expr}"  # a value's last use: released at the end of the line that reads it
            continue
        if statement.instruction.kind == "recompute":
            codes.extend(_region(statement))
            continue
        if statement.instruction.kind == "constants":
            codes.extend(_made_from_constants(statement))
            continue
        codes.append([f"{statement.target} = {expr}" if statement.target else expr, statement.comment])
    return codes


def _region(statement) -> list[list]:
    """A recomputed region (pardsl/passes/recompute.py): a local function of its statements, and the line
    that runs it under rt.recompute. The function is named after the region's module path: an identifier
    made of it here, whatever characters the path holds."""
    instruction = statement.instruction
    function = python_name(_arg(instruction.args[0]))
    instruction = dataclasses.replace(instruction, args=(Text(function), *instruction.args[1:]))
    _, _, *arguments = (_arg(a) for a in instruction.args)
    lines = [[f"def {function}({', '.join(arguments)}):", statement.comment]]
    lines += [["    " + code, comment] for code, comment in _codes(statement.body)]
    lines.append([f"    return {statement.target}", None])
    lines.append([f"{statement.target} = {render_expression(instruction)}", None])
    return lines


def _made_from_constants(statement) -> list[list]:
    """What a stage makes from buffers and constants alone (pardsl/passes/shared_constants.py): a local
    function of its statements, and the line that runs it under rt.made_from_constants, which keeps its
    results for every micro-batch."""
    function = _arg(statement.instruction.args[1])
    lines = [[f"def {function}():", statement.comment]]
    lines += [["    " + code, comment] for code, comment in _codes(statement.body)]
    lines.append([f"    return ({''.join(name + ', ' for name in statement.targets)})", None])
    lines.append([f"{statement.target}{',' if len(statement.targets) == 1 else ''} = "
                  f"{render_expression(statement.instruction)}", None])
    return lines


def _outputs(program: LoweredProgram) -> list[dict]:
    outputs = []
    for output in program.outputs:
        slot = _slot(output, program.mesh)
        slot["path"] = output.path
        outputs.append(slot)
    return outputs


def _resharded(program: LoweredProgram) -> list[str]:
    """In the order backward needs them: the reverse of the forward's last reads."""
    groups = sorted((g.last_read, number, g) for number, g in enumerate(program.gathers) if g.resharded)
    return [f"({number}, {g.regather is not None})" for _, number, g in reversed(groups)]


def _gathers(program: LoweredProgram) -> list[dict]:
    return [{"axis": g.axis, "comment": f"{g.members[0].unit or 'outside the layers'}, {format_bytes(sum(m.nbytes for m in g.members))}",
             "members_text": ", ".join(f"({python_literal(m.attr)}, {m.dim}, {m.blocks})" for m in g.members)}
            for g in program.gathers]


def _buckets(program: LoweredProgram) -> list[dict]:
    return [{"kind": b.kind, "axes": repr(tuple(b.axes)), "members_text": ", ".join(f"({python_literal(m[0])}, {m[1]}, {m[2]})" for m in b.members),
             "comment": f"{format_bytes(b.nbytes)}; {len(b.members)} gradient{'s' if len(b.members) != 1 else ''}"}
            for b in program.buckets]


def _mesh_dict(mesh) -> str:
    return "{" + ", ".join(f"{n!r}: {s}" for n, s in zip(mesh.axis_names, mesh.axis_sizes)) + "}"


# the fewest ATen ops a compiled piece holds: a lone op gains nothing from compiling
_PIECE_OPS = 2
# the conversions a piece may hold where collectives are in the graphs: traced by torch.compile, the
# runtime's collectives under them are functional ones (runtime/functional.py)
_CONVERSIONS_IN_GRAPHS = frozenset({"rt.all_reduce", "rt.all_gather", "rt.reduce_scatter", "rt.all_to_all",
                                    "rt.split", "rt.to_partial", "rt.grad_all_reduce"})
# a name in an expression: not an attribute (`rt.device`), not a keyword argument's (`device=`)
_NAMES = re.compile(r"(?<![.\w])[A-Za-z_]\w*(?!\w|\s*=[^=])")


def _pieces(program: LoweredProgram, known: dict[str, int], collectives: bool = False) -> list[Statement]:
    """Regional compilation: each run of the forward's ATen ops between the runtime's calls (collectives,
    fused norms, casts, gathers) becomes a call of a module function, `self.pieces[k]`, that `torch.compile`
    compiles (api.load(compile=True)). `collectives`: the runs take in the conversions between them, which
    run as functional collectives inside the compiled graphs (runtime/functional.py). The runs are named
    canonically (inputs a0.., weights w0.., values v0..), so every repeated layer whose run is the same code
    calls one function, compiled once for all of them: in one program, and in the stages of a pipeline,
    which share `known` (each function's canonical source → its number, numbered as found). A recomputed
    region's own statements stay as they are. The statements to render."""
    statements = list(program.statements)
    returned = {output.var for output in program.outputs}
    # named dims' sizes (`batch = input_ids.shape[0] * 2`), which ops read as text: a piece takes them too
    sizes = {t for s in statements if s.instruction.kind in ("size", "expression") for t in s.targets}
    rendered: list[Statement] = []
    index = 0
    while index < len(statements):
        end = index
        while end < len(statements) and _pure(statements[end], collectives):
            end += 1
        run = statements[index:end]
        if sum(s.instruction.kind == "compute" for s in run) < _PIECE_OPS:
            rendered.append(statements[index])
            index += 1
            continue
        later = {name for statement in statements[end:] for name in _all_reads(statement)} | returned
        call, released, text = _piece_call(run, later, sizes)
        number = known.setdefault(text, len(known))
        rendered.append(dataclasses.replace(call, instruction=dataclasses.replace(
            call.instruction, callee=f"self.pieces[{number}]")))
        if released:
            rendered.append(Statement("", Instruction("release", "del", tuple(Var(n) for n in released)), ""))
        index = end
    return rendered


def _piece_functions(known: dict[str, int]) -> list[str]:
    """The pieces' source, in their numbers' order."""
    return [text.replace("def _piece(", f"def _piece_{number}(", 1) for text, number in known.items()]


def _own_text(instruction: Instruction) -> str:
    """The instruction's expression with each operand it reads as `_`: what it names besides its operands."""
    return render_expression(instruction.renamed({name: "_" for name in instruction.reads()}))


def _pure(statement: Statement, collectives: bool = False) -> bool:
    """An ATen op of the forward's own (or a release), which a compiled piece may hold: one that reads the
    module (`self.training`) or the step's gathers other than through its operands stays in the forward.
    `collectives`: a conversion too (_CONVERSIONS_IN_GRAPHS)."""
    instruction = statement.instruction
    if statement.body:
        return False
    if collectives and instruction.kind in ("convert", "grad_sync") and instruction.callee in _CONVERSIONS_IN_GRAPHS:
        return True
    if instruction.kind not in ("release", "compute"):
        return False
    if instruction.kind == "release":
        return True
    text = _own_text(instruction)
    return instruction.callee.startswith("aten.") and "self." not in text and "sync." not in text


def _all_reads(statement: Statement) -> list[str]:
    return statement.instruction.reads() + [name for inside in statement.body for name in _all_reads(inside)]


def _piece_call(run: list[Statement], later: set[str], sizes: set[str]) -> tuple[Statement, list[str], str]:
    """The call that runs `run`, the caller's names it released (released after the call instead), and the
    piece's canonical source. `sizes`: the forward's named dims, which a piece takes as arguments (ints:
    torch.compile specialises on each, so a new size compiles the piece once more)."""
    made: list[str] = []
    inputs: list[str] = []
    weights: list[str] = []
    dims: list[str] = []
    released: list[str] = []
    for statement in run:
        if statement.instruction.kind == "release":
            released += [name for name in statement.instruction.reads() if name not in made]
            continue
        for name in statement.instruction.reads():
            if name.startswith("self."):
                weights += [name] if name not in weights else []
            elif name not in made and name not in inputs:
                inputs.append(name)
        dims += [word for word in _NAMES.findall(_own_text(statement.instruction))
                 if word in sizes and word not in dims]
        made += statement.targets
    results = [name for name in made if name in later]
    names = {name: f"a{i}" for i, name in enumerate(inputs)} | {name: f"w{i}" for i, name in enumerate(weights)} | \
        {name: f"v{i}" for i, name in enumerate(made)}
    dim_names = {name: f"d{i}" for i, name in enumerate(dims)}

    def canonical(statement: Statement) -> str:
        code = render_expression(statement.instruction.renamed(names))
        if dim_names:
            code = _NAMES.sub(lambda word: dim_names.get(word.group(0), word.group(0)), code)
        return f"{', '.join(names[t] for t in statement.targets)} = {code}"

    body = [[canonical(s), _shared_comment(s)] for s in run if s.instruction.kind != "release"]
    signature = ", ".join(["rt"] + [names[n] for n in inputs] + [names[n] for n in weights] + list(dim_names.values()))
    lines = [f"def _piece({signature}):"] + \
        ["    " + (_commented(code, comment, _COMMENT_COLUMN - 4) if comment else code) for code, comment in body] + \
        [f"    return ({''.join(names[n] + ', ' for n in results)})"]
    ops = sum(s.instruction.kind == "compute" for s in run)
    conversions = [s.comment for s in run if s.instruction.kind in ("convert", "grad_sync")]
    held = f"{ops} ATen ops" + \
        (f" and {len(conversions)} conversion(s) (functional collectives)" if conversions else "")
    call = Statement(", ".join(results) + ("," if len(results) == 1 else ""),
                     Instruction("compute", "self.pieces", tuple(Var(n) for n in ["rt"] + inputs + weights + dims)),
                     "; ".join([f"{held}, compiled as one piece"] + conversions))
    return call, released, "\n".join(lines)


_BYTES = re.compile(r" [\d.]+ (?:[KMG]i)?B\b")


def _shared_comment(statement: Statement) -> str:
    """A statement's comment inside a piece, which every layer that runs the same code shares: a
    conversion's says what it does, not its bytes nor which layer's op it serves (the call says those)."""
    if statement.instruction.kind in ("convert", "grad_sync"):
        return _BYTES.sub("", statement.comment.split(" — ")[0])
    return statement.comment


def render(program: LoweredProgram, pieces: bool = False, collectives: bool = False) -> str:
    """The module's source; `pieces`: the forward's runs of ATen ops as functions for torch.compile (_pieces),
    `collectives`: with the conversions between them inside."""
    mesh = program.mesh
    counts = program.collective_counts()
    totals = program.collective_bytes()
    known: dict[str, int] = {}
    rendered = _pieces(program, known, collectives) if pieces else program.statements
    return _template().render(
        version=__version__,
        source=program.source_path,
        model=program.model,
        mesh=str(mesh),
        world_size=mesh.size,
        mesh_dict=_mesh_dict(mesh),
        forward_summary=_summary(counts["forward"], totals["forward"]),
        backward_summary=_summary(counts["backward"], totals["backward"]),
        parameters=[_slot(p, mesh) for p in program.parameters],
        buffers=[_slot(b, mesh) for b in program.buffers],
        inputs=[_slot(i, mesh) for i in program.inputs],
        outputs=_outputs(program),
        lines=_lines(rendered),
        pieces=_piece_functions(known),
        gathers=_gathers(program),
        resharded=_resharded(program),
        buckets=_buckets(program),
        training_only=_training_only_message(program.training_only),
        parameter_writes=_parameter_writes(program),
        precision=_precision(program),
        offload=program.offload,
        offload_comment=OFFLOAD_COMMENTS.get(program.offload),
    )


OFFLOAD_COMMENTS = {
    "optimizer": "the parameters below are masters in host memory, which the optimizer steps there; "
                 "each has a device copy for compute, written again after a step changes its master",
    "parameters": "the parameters below are masters in host memory, which the optimizer steps there; "
                  "each use copies its shard to the device (sync.fetch, and before a group's all-gather)",
}


def _precision(program: LoweredProgram) -> str | None:
    """A mixed-precision policy's dtypes as the module spells them: `(torch.bfloat16, torch.float32)`."""
    if program.precision is None:
        return None
    return "(" + ", ".join(f"torch.{dtype}" for dtype in program.precision) + ")"


def _training_only_message(made: list[str]) -> str | None:
    if not made:
        return None
    shown = ", ".join(made[:3]) + (f" and {len(made) - 3} more" if len(made) > 3 else "")
    return (f"this module was traced in training mode, where the model draws random values outside dropout or "
            f"writes its parameters ({shown}); it has no eval-mode forward: evaluate with the serial model, or "
            f"compile the model with those turned off (a stochastic depth rate of 0, no coefficient clip)")


def _parameter_writes(program: LoweredProgram) -> list[dict]:
    return [{"parameter": parameter, "call": call, "comment": comment}
            for parameter, call, comment in program.parameter_writes]


def render_pipeline(stages: list[LoweredProgram], plan, pieces: bool = False, collectives: bool = False) -> str:
    """One module with a class per stage (`plan`: pardsl.pipeline.PipelinePlan); `pieces`: each stage's runs
    of ATen ops as functions for torch.compile (_pieces), one per distinct run whichever stage runs it;
    `collectives`: with the conversions between them inside."""
    mesh = stages[0].mesh
    rendered = []
    known: dict[str, int] = {}
    for index, program in enumerate(stages):
        counts, totals = program.collective_counts(), program.collective_bytes()
        outputs = _outputs(program)
        last = index == len(stages) - 1
        metas = plan.output_meta if last else [(i.dtype, i.requires_grad) for i in stages[index + 1].inputs]
        for output, (dtype, requires_grad) in zip(outputs, metas):
            output.update(dtype=dtype, requires_grad=requires_grad)
        sent = 0 if last else sum(slot_bytes(slot.local_shape, slot.dtype) for slot in stages[index + 1].inputs)
        begins = "the start" if index == 0 else f"`{plan.cut_before[index - 1]}`"
        ends = "to the end" if last else f"up to `{plan.cut_before[index]}`"
        rendered.append({
            "index": index, "last": last,
            "span": f"from {begins} {ends}",
            "forward_summary": _summary(counts["forward"], totals["forward"]),
            "backward_summary": _summary(counts["backward"], totals["backward"]),
            "sends": "nothing (the last stage)" if last else
                     f"{len(outputs)} tensor(s), {format_bytes(sent)} per rank, to stage {index + 1}",
            "parameters": [_slot(p, mesh) for p in program.parameters],
            "buffers": [_slot(b, mesh) for b in program.buffers],
            "inputs": [_slot(i, mesh) for i in program.inputs],
            "outputs": outputs,
            "lines": _lines(_pieces(program, known, collectives) if pieces else program.statements),
            "gathers": _gathers(program),
            "buckets": _buckets(program),
            "parameter_writes": _parameter_writes(program),
        })
    pipeline = {"axis": plan.axis, "schedule": plan.schedule, "microbatches": plan.microbatches,
                "stages_per_rank": plan.stages_per_rank, "cut_before": list(plan.cut_before)}
    return _template("pipeline.py.j2").render(
        version=__version__,
        source=stages[0].source_path,
        model=stages[0].model,
        mesh=str(mesh),
        world_size=mesh.size,
        mesh_dict=_mesh_dict(mesh),
        axis=plan.axis, schedule=plan.schedule, microbatches=plan.microbatches,
        stages_per_rank=plan.stages_per_rank,
        pipeline_dict=repr(pipeline),
        shared=[(name, list(held)) for name, held in plan.shared_parameters],
        stages=rendered,
        pieces=_piece_functions(known),
        training_only=_training_only_message(stages[0].training_only),
        precision=_precision(stages[0]),
        offload=stages[0].offload,
        offload_comment=OFFLOAD_COMMENTS.get(stages[0].offload),
    )


def cannot_compile(programs: list[LoweredProgram]) -> str | None:
    """Why regional compilation cannot take the plan (its program, or a pipeline's stages), or None."""
    if any(_resharded(program) for program in programs):
        # autograd keeps a resharded group's weights through saved-tensor hooks, which torch.compile's
        # graphs do not take
        return ("compiled layers (compile=True, --compile) are not supported yet where gathered weights are "
                "resharded after forward (ZeRO-3, FSDP): compile the plan without them, or without compile")
    return None


def load_module(source: str, name: str = "pardsl_module") -> types.ModuleType:
    """Generated source executed as a module, as if imported from the file `pardsl compile` writes."""
    module = types.ModuleType(name)
    module.__file__ = f"<pardsl:{name}>"
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module
