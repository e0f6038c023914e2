"""Stage 1: .par text → syntax tree. Every node carries the span it came from.

The grammar is `grammar/par.lark` (shipped as `pardsl.grammar`). Parsing recovers from syntax errors
line by line, so one run reports every malformed line rather than only the first.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from dataclasses import dataclass
from typing import Any

import lark
from lark import Transformer, v_args

from pardsl.language import shipped
from pardsl.language.diagnostics import DiagnosticSink, SourceFile, Span


@dataclass(frozen=True)
class MeshAxis:
    name: str
    size: int | None  # None: the search chooses it (a searched mesh)
    span: Span


@dataclass(frozen=True)
class MeshDecl:
    axes: tuple[MeshAxis, ...]
    span: Span
    ranks: int | None = None  # `mesh dp, tp = 8`: the product of the axes' sizes, which the search chooses

    @property
    def searched(self) -> bool:
        return self.ranks is not None


@dataclass(frozen=True)
class MemoryBound:
    """`memory <= 40 MiB` (bytes per rank) or `memory <= 50 %` (of the serial model's)."""

    amount: float
    unit: str  # GiB, MiB, KiB or %
    span: Span

    def bytes(self, serial_total: int) -> int:
        if self.unit == "%":
            return int(serial_total * self.amount / 100)
        return int(self.amount * {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[self.unit])

    def __str__(self) -> str:
        return f"{self.amount:g} {self.unit}"


@dataclass(frozen=True)
class ModelDecl:
    module: str
    factory: str
    kwargs: tuple[tuple[str, Any], ...]
    span: Span
    factory_span: Span

    @property
    def text(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs)
        return f"{self.module}:{self.factory}({args})"


@dataclass(frozen=True)
class InputDecl:
    name: str
    dtype: str
    shape: tuple[int, ...]
    value_range: tuple[int, int] | None
    span: Span
    dtype_span: Span
    range_span: Span | None
    # per dim, its name where it is named (it varies at run time; `shape` holds the example size)
    dim_names: tuple[str | None, ...] = ()
    dim_spans: tuple[Span, ...] = ()


@dataclass(frozen=True)
class PlacementSyntax:
    kind: str  # "S", "B" or "P"
    dim: int | None
    span: Span
    blocks: int = 1
    zigzag: bool = False
    sizes: tuple[int, ...] = ()  # S(d, blocks=[4, 1, 1]): the blocks' sizes, as written


@dataclass(frozen=True)
class LayoutSyntax:
    """`bare` (one value), `list` (one value per axis), `named` (value @ axis, others B) or `searched` (`?`:
    the compiler chooses)."""

    form: str
    placements: tuple[PlacementSyntax, ...]
    axis_names: tuple[tuple[str, Span], ...]  # only for the `named` form
    span: Span


@dataclass(frozen=True)
class LayoutEntry:
    target: str
    layout: LayoutSyntax
    span: Span
    target_span: Span


@dataclass(frozen=True)
class PipelineDecl:
    """`pipeline pp : schedule 1F1B, microbatches 4, cut before model.layers.2`: the mesh axis that holds
    the stages, the schedule (torch.distributed.pipelining's name), the micro-batch count, and where the
    program is cut (submodule paths, or `balanced`: the compiler chooses)."""

    axis: str
    axis_span: Span
    schedule: str
    schedule_span: Span
    microbatches: int
    microbatches_span: Span
    cuts: tuple[tuple[str, Span], ...]  # before each of these submodules, in order; empty when balanced
    cut_span: Span
    span: Span
    stages_per_rank: int = 1
    stages_per_rank_span: Span | None = None
    # the options written `?`, for the compiler to choose: "schedule", "microbatches", "cut"
    searched: frozenset[str] = frozenset()

    @property
    def balanced(self) -> bool:
        return not self.cuts


RECOMPUTE_POLICIES = ("full", "selective")


@dataclass(frozen=True)
class RecomputeDecl:
    """`recompute model.layers.* : selective`: the submodules (a path, `*` for any one name) whose
    activations are made again in backward rather than kept, and how much of them: `full` keeps only
    their inputs; `selective` keeps what is costly to make again (matrix products, attention, collective
    results). `recompute ?` (pattern "?", policy "searched"): the search decides."""

    pattern: str
    policy: str
    span: Span
    pattern_span: Span


PRECISION_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass(frozen=True)
class PrecisionDecl:
    """`precision params bf16, reduce fp32`: the dtype parameters are computed in (their master copies,
    and the optimizer's state, stay float32 on the shards), the dtype gradients are reduced in, and the
    dtype floating outputs are given in (default: the compute dtype's)."""

    params: str  # torch dtype names
    reduce: str
    output: str | None
    span: Span


OFFLOAD_TARGETS = ("optimizer", "parameters")


@dataclass(frozen=True)
class OffloadDecl:
    """`offload optimizer` or `offload parameters`: what lives in host memory. `optimizer`: each
    parameter's master on its shard, its gradient and the optimizer's state, stepped on the host, the
    device keeping a copy for compute; `parameters`: that device copy too is made only for each use."""

    targets: tuple[str, ...]  # as written: "optimizer", "parameters"
    span: Span

    @property
    def target(self) -> str:
        """The broadest target written: `parameters` keeps the optimizer on the host as well."""
        return max(self.targets, key=OFFLOAD_TARGETS.index)


# The rewrites of the program a file may ask for or forbid, each a pass over the program IR that runs where
# the cost model says it pays unless the file says `on` or `off`
SUBSTITUTIONS = {
    "collective_matmul": "a gather before a matrix product, or a reduce-scatter after one, cut into chunks "
                         "that move while the product of the chunk before is computed",
    "regather_inputs": "a sequence-parallel linear's input kept split for backward and gathered again "
                       "there, as Megatron-LM does, rather than kept whole",
    "regroup_heads": "key/value heads split over more ranks than there are heads repeated before their "
                     "projection, so that each rank computes the head its query heads read",
    "split_reductions": "a partial sum reduce-scattered where an all-reduce would make it whole, the ops after "
                        "it computed on each rank's share and gathered where they need the whole (sequence "
                        "parallelism's form), where the search finds it pays",
}
SUBSTITUTION_CHOICES = ("on", "off")
# the substitutions the search chooses for itself, value by value: a file may forbid them, not ask for them
SEARCHED_SUBSTITUTIONS = ("split_reductions",)


@dataclass(frozen=True)
class SubstituteDecl:
    """`substitute collective_matmul : off`: a rewrite (SUBSTITUTIONS) asked for everywhere it applies, or
    forbidden; not written, the compiler applies it where its cost model says it pays."""

    name: str
    choice: str  # on, off
    span: Span


@dataclass(frozen=True)
class ParFile:
    source: SourceFile
    meshes: tuple[MeshDecl, ...]
    models: tuple[ModelDecl, ...]
    inputs: tuple[InputDecl, ...]
    layouts: tuple[LayoutEntry, ...]
    memory_bounds: tuple[MemoryBound, ...] = ()
    pipelines: tuple[PipelineDecl, ...] = ()
    recomputes: tuple[RecomputeDecl, ...] = ()
    precisions: tuple[PrecisionDecl, ...] = ()
    offloads: tuple[OffloadDecl, ...] = ()
    substitutes: tuple[SubstituteDecl, ...] = ()

    def substitution(self, name: str) -> str:
        """`on`, `off`, or `auto` (not written: where the cost model says it pays)."""
        return next((decl.choice for decl in self.substitutes if decl.name == name), "auto")

    @property
    def offload(self) -> OffloadDecl | None:
        return self.offloads[0] if self.offloads else None

    @property
    def precision(self) -> PrecisionDecl | None:
        return self.precisions[0] if self.precisions else None

    @property
    def pipeline(self) -> PipelineDecl | None:
        return self.pipelines[0] if self.pipelines else None

    @property
    def recomputes_written(self) -> tuple[RecomputeDecl, ...]:
        """The submodules the file names to recompute (not `recompute ?`)."""
        return tuple(decl for decl in self.recomputes if decl.pattern != "?")

    @property
    def memory_bound(self) -> MemoryBound | None:
        return self.memory_bounds[0] if self.memory_bounds else None

    @property
    def mesh(self) -> MeshDecl:
        return self.meshes[0]

    @property
    def model(self) -> ModelDecl:
        return self.models[0]


def _span(meta) -> Span:
    return Span(meta.line, meta.column, meta.end_line, meta.end_column)


def _token_span(token: lark.Token) -> Span:
    return Span(token.line, token.column, token.end_line, token.end_column)


class _BadString(Exception):
    def __init__(self, span: Span, why: str):
        self.span, self.why = span, why


class _BadDeclaration(Exception):
    def __init__(self, code: str, message: str, span: Span, note: str):
        self.code, self.message, self.span, self.note = code, message, span, note


@dataclass(frozen=True)
class _Dim:
    name: str | None
    size: int | None  # None: a reference to a dim named before
    span: Span


@v_args(meta=True)
class _ToSyntaxTree(Transformer):
    def start(self, meta, statements):
        return statements

    def mesh_axis(self, meta, children):
        name, size = children
        return MeshAxis(str(name), int(size), _span(meta))

    def memory_decl(self, meta, children):
        amount, unit = children
        return MemoryBound(float(amount), str(unit), _span(meta))

    def mesh_decl(self, meta, axes):
        return MeshDecl(tuple(axes), _span(meta))

    def searched_mesh_decl(self, meta, children):
        *names, ranks = children
        return MeshDecl(tuple(MeshAxis(str(name), None, _token_span(name)) for name in names), _span(meta), int(ranks))

    def module_path(self, meta, names):
        return ".".join(str(n) for n in names)

    def call_args(self, meta, kwargs):
        given: dict[str, Span] = {}
        for name, _, span in (k for k in kwargs if k is not None):
            if name in given:
                # Python refuses a keyword given twice; read here, the last would win without a word
                raise _BadDeclaration("E003", f"keyword argument `{name}` given twice", span,
                                      f"first given at column {given[name].column}; keep one")
            given[name] = span
        return tuple((name, value) for name, value, _ in (k for k in kwargs if k is not None))

    def kwarg(self, meta, children):
        name, value = children
        return (str(name), value, _token_span(name))

    def number(self, meta, children):
        text = str(children[0])
        return float(text) if any(c in text for c in ".eE") else int(text)

    def string(self, meta, children):
        # JSON's escapes (\n, \", \\, \u00e9), and any other character as it is ("café")
        token = children[0]
        try:
            return json.loads(str(token))
        except json.JSONDecodeError as error:
            raise _BadString(_token_span(token), error.msg) from None

    def true(self, meta, children):
        return True

    def false(self, meta, children):
        return False

    def none(self, meta, children):
        return None

    def list(self, meta, children):
        return list(children)

    def empty_list(self, meta, children):
        return []

    def tuple(self, meta, children):
        return tuple(children)

    def empty_tuple(self, meta, children):
        return ()

    def dict(self, meta, entries):
        return dict(entries)

    def empty_dict(self, meta, children):
        return {}

    def dict_entry(self, meta, children):
        key, value = children
        return (self.string(meta, [key]), value)

    def model_decl(self, meta, children):
        module, factory = children[0], children[1]
        kwargs = children[2] if len(children) > 2 else ()
        return ModelDecl(module, str(factory), kwargs, _span(meta), _token_span(factory))

    def value_range(self, meta, children):
        return (int(children[0]), int(children[1]), _span(meta))

    def fixed_dim(self, meta, children):
        return _Dim(None, int(children[0]), _span(meta))

    def named_dim(self, meta, children):
        return _Dim(str(children[0]), int(children[1]), _span(meta))

    def dim_reference(self, meta, children):
        return _Dim(str(children[0]), None, _span(meta))

    def input_decl(self, meta, children):
        name, dtype, *rest = children
        value_range = rest.pop() if rest and isinstance(rest[-1], tuple) else None
        dims = [d for d in rest if d is not None]
        return InputDecl(
            str(name),
            str(dtype),
            tuple(-1 if d.size is None else d.size for d in dims),  # references are sized in _check_declarations
            value_range[:2] if value_range else None,
            _span(meta),
            _token_span(dtype),
            value_range[2] if value_range else None,
            tuple(d.name for d in dims),
            tuple(d.span for d in dims),
        )

    def split(self, meta, children):
        written = children[1] if len(children) > 1 else None
        if isinstance(written, tuple):
            return PlacementSyntax("S", int(children[0]), _span(meta), len(written), sizes=written)
        return PlacementSyntax("S", int(children[0]), _span(meta), int(written) if written is not None else 1)

    def block_sizes(self, meta, children):
        return tuple(int(size) for size in children)

    def zigzag_split(self, meta, children):
        return PlacementSyntax("S", int(children[0]), _span(meta), 2, zigzag=True)

    def broadcast(self, meta, children):
        return PlacementSyntax("B", None, _span(meta))

    def partial(self, meta, children):
        return PlacementSyntax("P", None, _span(meta))

    def searched_layout(self, meta, children):
        return LayoutSyntax("searched", (), (), _span(meta))

    def bare_layout(self, meta, children):
        return LayoutSyntax("bare", (children[0],), (), _span(meta))

    def axis_list_layout(self, meta, children):
        return LayoutSyntax("list", tuple(children), (), _span(meta))

    def axis_placement(self, meta, children):
        placement, axis = children
        return (placement, (str(axis), _token_span(axis)))

    def named_axes_layout(self, meta, children):
        return LayoutSyntax(
            "named", tuple(p for p, _ in children), tuple(a for _, a in children), _span(meta)
        )

    def pipeline_schedule(self, meta, children):
        return ("schedule", str(children[0]), _span(meta))

    def pipeline_microbatches(self, meta, children):
        return ("microbatches", int(children[0]), _span(meta))

    def pipeline_schedule_searched(self, meta, children):
        return ("schedule", "?", _span(meta))

    def pipeline_microbatches_searched(self, meta, children):
        return ("microbatches", "?", _span(meta))

    def pipeline_cut_searched(self, meta, children):
        return ("cut", "?", _span(meta))

    def pipeline_stages_per_rank(self, meta, children):
        return ("stages per rank", int(children[0]), _span(meta))

    def pipeline_cut(self, meta, children):
        return ("cut", (str(children[0]), _token_span(children[0])), _span(meta))

    def pipeline_cut_balanced(self, meta, children):
        return ("cut", None, _span(meta))

    def pipeline_further_cut(self, meta, children):
        return ("further cut", (str(children[0]), _token_span(children[0])), _span(meta))

    def pipeline_decl(self, meta, children):
        axis, *options = children
        given: dict[str, tuple] = {}
        cuts: list = []
        for index, (kind, value, span) in enumerate(options):
            if kind == "further cut":  # `cut before a, b`: b continues the list only right after it
                before = options[index - 1] if index else (None, None, None)
                if before[0] not in ("cut", "further cut") or before[1] is None:
                    raise _BadDeclaration("E001", f"`{value[0]}` is no pipeline option", span,
                                       "options are `schedule NAME`, `microbatches N`, `stages per rank N`, "
                                       "`cut before SUBMODULE, ...` and `cut balanced`")
                cuts.append(value)
                continue
            if kind in given:
                raise _BadDeclaration("E003", f"pipeline option `{kind}` given twice", span,
                                   f"first given at column {given[kind][1].column}")
            given[kind] = (value, span)
            if kind == "cut" and value not in (None, "?"):
                cuts.append(value)
        for required, example in (("microbatches", "microbatches 4"), ("cut", "cut before model.layers.2")):
            if required not in given:
                raise _BadDeclaration("E004", f"the pipeline has no `{required}`", _span(meta), f"add `{example}`")
        schedule = given.get("schedule", ("1F1B", _span(meta)))
        per_rank = given.get("stages per rank", (1, None))
        searched = frozenset(kind for kind, (value, _) in given.items() if value == "?")
        if "schedule" in searched and "stages per rank" in given:
            raise _BadDeclaration("E003", "`stages per rank` with `schedule ?`", given["stages per rank"][1],
                                  "the schedule chosen sets how many stages a rank runs: leave it out")
        # a searched option holds a placeholder the compiler replaces: 1F1B, one micro-batch, balanced cuts
        return PipelineDecl(str(axis), _token_span(axis), "1F1B" if "schedule" in searched else schedule[0],
                            schedule[1], 1 if "microbatches" in searched else given["microbatches"][0],
                            given["microbatches"][1], tuple(cuts), given["cut"][1], _span(meta),
                            per_rank[0], per_rank[1], searched)

    def recompute_decl(self, meta, children):
        pattern, policy = children[0], (children[1] if len(children) > 1 else None)
        if policy is not None and str(policy) not in RECOMPUTE_POLICIES:
            raise _BadDeclaration("E080", f"`{policy}` is no recomputation policy", _token_span(policy),
                               "write `full` (only the inputs kept) or `selective` (matrix products, "
                               "attention and collective results kept too)")
        return RecomputeDecl(str(pattern), "full" if policy is None else str(policy), _span(meta),
                             _token_span(pattern))

    def precision_option(self, meta, children):
        return str(children[0]), str(children[1]), _token_span(children[0]), _token_span(children[1])

    def precision_decl(self, meta, options):
        given: dict[str, str] = {}
        for kind, dtype, kind_span, dtype_span in options:
            if kind not in ("params", "reduce", "output"):
                raise _BadDeclaration("E083", f"`{kind}` is no precision option", kind_span,
                                      "write `params`, `reduce` or `output`: `precision params bf16, reduce fp32`")
            if kind in given:
                raise _BadDeclaration("E003", f"precision option `{kind}` given twice", kind_span,
                                      "give each option once")
            if dtype not in PRECISION_DTYPES:
                raise _BadDeclaration("E083", f"`{dtype}` is no precision dtype", dtype_span,
                                      "write bf16, fp16 or fp32")
            given[kind] = PRECISION_DTYPES[dtype]
        if "params" not in given:
            raise _BadDeclaration("E004", "the precision has no `params` dtype", _span(meta),
                                  "add `params bf16`")
        return PrecisionDecl(given["params"], given.get("reduce", "float32"), given.get("output"), _span(meta))

    def offload_decl(self, meta, targets):
        for target in targets:
            if str(target) not in OFFLOAD_TARGETS:
                raise _BadDeclaration("E084", f"`{target}` is nothing pardsl offloads", _token_span(target),
                                      "write `offload optimizer` (masters, gradients and optimizer state on the "
                                      "host) or `offload parameters` (the device copies too, made for each use)")
        return OffloadDecl(tuple(str(target) for target in targets), _span(meta))

    def substitute_decl(self, meta, children):
        name, choice = children
        if str(name) not in SUBSTITUTIONS:
            raise _BadDeclaration("E085", f"`{name}` is no substitution", _token_span(name),
                                  "substitutions: " + "; ".join(f"`{known}` ({what})"
                                                                for known, what in SUBSTITUTIONS.items()))
        if str(choice) not in SUBSTITUTION_CHOICES:
            raise _BadDeclaration("E085", f"`{choice}` is no choice for a substitution", _token_span(choice),
                                  f"write `substitute {name} : on` (wherever it applies) or `: off` (nowhere); "
                                  "leave the line out for the compiler to apply it where it pays")
        if str(name) in SEARCHED_SUBSTITUTIONS and str(choice) == "on":
            raise _BadDeclaration("E085", f"`{name}` cannot be asked for everywhere", _token_span(choice),
                                  "the layout search chooses it value by value, where it pays; write `: off` to "
                                  "forbid it, or write the split layouts you want in the layout block")
        return SubstituteDecl(str(name), str(choice), _span(meta))

    def recompute_searched(self, meta, children):
        return RecomputeDecl("?", "searched", _span(meta), _span(meta))

    def layout_entry(self, meta, children):
        target, layout = children
        return LayoutEntry(str(target), layout, _span(meta), _token_span(target))

    def layout_block(self, meta, entries):
        return list(entries)


@functools.cache
def _parser() -> lark.Lark:
    grammar = shipped.read_text("pardsl.grammar", "par.lark")
    return lark.Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=True)


_TOKEN_NAMES = {
    "_NL": "end of line",
    "$END": "end of file",
    "NAME": "a name",
    "TARGET": "a tensor name",
    "INT": "an integer",
    "SIGNED_INT": "an integer",
    "SIGNED_NUMBER": "a number",
    "NUMBER": "a number",
    "MEMORY_UNIT": "a unit (GiB, MiB, KiB or %)",
    "SCHEDULE_NAME": "a schedule name (GPipe, 1F1B, ...)",
    "SUBMODULE": "a submodule path (model.layers.2)",
    "STRING": "a string",
}


def _describe_expected(expected: set[str]) -> str:
    names = set()
    for terminal in expected:
        if terminal in _TOKEN_NAMES:
            names.add(_TOKEN_NAMES[terminal])
            continue
        try:
            pattern = _parser().get_terminal(terminal).pattern
        except KeyError:
            names.add(terminal)
            continue
        names.add(f"'{pattern.value}'" if pattern.type == "str" else terminal.lower())
    return ", ".join(sorted(names))


def _describe_token(token: lark.Token) -> str:
    if token.type == "_NL":
        return "end of line"
    if token.type == "$END":
        return "end of file"
    return repr(str(token))


_MAX_SYNTAX_ERRORS = 20


def _parse_recovering(source: SourceFile, sink: DiagnosticSink):
    """Parse; on a syntax error, report it and go on parsing from the line after it.

    The rest of the file is parsed on its own (reopened with `layout {` when the bad line is inside a
    layout block or opens one), so each malformed line is reported once, nothing cascades, and no line is
    parsed again for an error after it: a file with errors near its end costs one parse. The tree is only
    wanted from an error-free file, so the parts around errors are checked, not kept.
    """
    lines = list(source.lines)
    start, reopened = 0, False  # the part being parsed starts at lines[start], after a `layout {` if reopened
    while True:
        part = (["layout {"] if reopened else []) + lines[start:]
        offset = start - (1 if reopened else 0)  # line k of the part is line k + offset of the file
        try:
            tree = _parser().parse("\n".join(part) + "\n")
            return tree if not sink.diagnostics else None
        except lark.exceptions.UnexpectedInput as error:
            line, column, message, notes = _describe_error(error, part)
            sink.error("E002" if isinstance(error, lark.exceptions.UnexpectedCharacters) else "E001",
                       message, Span.point(line + offset, column), *notes)
            if token_at_end(error) or not part[line - 1].strip() or len(sink.diagnostics) >= _MAX_SYNTAX_ERRORS:
                return None
            bad = line + offset - 1  # its index in the file
            reopened = _inside_layout_block(part[:line - 1]) or lines[bad].lstrip().startswith("layout")
            start = bad + 1


def _inside_layout_block(lines: list[str]) -> bool:
    """Whether, after these lines, a layout block is open (its `}` not yet seen)."""
    inside = False
    for text in lines:
        stripped = text.split("#", 1)[0].strip()
        if stripped.startswith("layout"):
            inside = not stripped.endswith("}")
        elif stripped.startswith("}"):
            inside = False
    return inside


def token_at_end(error: lark.exceptions.UnexpectedInput) -> bool:
    token = getattr(error, "token", None)
    return token is not None and token.type == "$END"


def _describe_error(error: lark.exceptions.UnexpectedInput, lines: list[str]):
    if isinstance(error, lark.exceptions.UnexpectedCharacters):
        return error.line, error.column, f"unexpected character {error.char!r}", ()
    token = getattr(error, "token", None)
    expected = getattr(error, "accepts", None) or getattr(error, "expected", None) or set()
    notes = (f"expected {_describe_expected(expected)}",) if expected else ()
    if token is None or token.type == "$END" or token.line is None:
        # Point just past the last non-blank line: that is where something is missing.
        last = max((i for i, text in enumerate(lines, 1) if text.strip()), default=1)
        return last, len(lines[last - 1].rstrip()) + 1 if lines else 1, "unexpected end of file", notes
    return token.line, token.column, f"unexpected {_describe_token(token)}", notes


def parse(text: str, path: str = "<string>") -> ParFile:
    """Parse .par text. Raises CompileError listing every syntax error found (one per line)."""
    source = SourceFile(path, text.removeprefix("\ufeff"))
    sink = DiagnosticSink(source)
    statements = _parse_recovering(source, sink)
    sink.raise_if_any()

    transformed = []
    for tree in statements.children:  # one statement at a time, so a failure points at its own line
        try:
            transformed.append(_ToSyntaxTree().transform(tree))
        except lark.exceptions.VisitError as error:
            if isinstance(error.orig_exc, _BadDeclaration):
                bad = error.orig_exc
                sink.error(bad.code, bad.message, bad.span, bad.note)
                continue
            if not isinstance(error.orig_exc, _BadString):
                raise
            sink.error("E009", f"invalid string: {error.orig_exc.why.lower()}", error.orig_exc.span,
                       "strings take JSON's escapes: write a backslash as \\\\")
        except RecursionError:
            sink.error("E009", "a literal is nested too deeply", _span(tree.meta),
                       f"lists, tuples and dicts nest at most about {sys.getrecursionlimit() // 4} deep")
    sink.raise_if_any()
    declared = {kind: [] for kind in (MeshDecl, ModelDecl, InputDecl, MemoryBound, PipelineDecl, RecomputeDecl,
                                      PrecisionDecl, OffloadDecl, SubstituteDecl)}
    layouts = []
    for statement in transformed:  # a layout block is a list of entries; any other statement, one declaration
        if type(statement) in declared:
            declared[type(statement)].append(statement)
        else:
            layouts.extend(statement)
    inputs = _size_named_dims(declared[InputDecl], sink)
    par = ParFile(source, tuple(declared[MeshDecl]), tuple(declared[ModelDecl]), tuple(inputs), tuple(layouts),
                  tuple(declared[MemoryBound]), tuple(declared[PipelineDecl]), tuple(declared[RecomputeDecl]),
                  tuple(declared[PrecisionDecl]), tuple(declared[OffloadDecl]), tuple(declared[SubstituteDecl]))
    _check_declarations(par, sink)
    sink.raise_if_any()
    return par


def _size_named_dims(inputs: list[InputDecl], sink: DiagnosticSink) -> list[InputDecl]:
    """Give each reference to a named dim the example size it was named with; a name is one dim."""
    sizes: dict[str, tuple[int, Span]] = {}
    result = []
    for decl in inputs:
        shape = list(decl.shape)
        for index, (name, span) in enumerate(zip(decl.dim_names, decl.dim_spans)):
            if name is None:
                continue
            if shape[index] >= 0:
                if name in sizes and sizes[name][0] != shape[index]:
                    sink.error("E006", f"dim `{name}` is given two sizes: {sizes[name][0]} and {shape[index]}", span,
                               f"first given on line {sizes[name][1].line}; write `{name}` alone to refer to it")
                sizes.setdefault(name, (shape[index], span))
                if shape[index] < 2:
                    sink.error("E007", f"named dim `{name}` needs an example size of at least 2", span,
                               "a size of 0 or 1 is special to torch.export and would be fixed")
            elif name in sizes:
                shape[index] = sizes[name][0]
            else:
                sink.error("E005", f"dim `{name}` has no size", span, f"give it one where first used: `{name}=8`")
                shape[index] = 1
        result.append(dataclasses.replace(decl, shape=tuple(shape)))
    return result


def _each_once(sink: DiagnosticSink, decls, written) -> None:
    """E003 for a declaration written (`written(decl)`, as the file says it) a second time."""
    first: dict[str, object] = {}
    for decl in decls:
        if written(decl) in first:
            sink.error("E003", f"`{written(decl)}` declared twice", decl.span,
                       f"first declared on line {first[written(decl)].span.line}")
        first.setdefault(written(decl), decl)


def _check_declarations(par: ParFile, sink: DiagnosticSink) -> None:
    for kind, decls in (("mesh", par.meshes), ("model", par.models)):
        if not decls:
            sink.error("E004", f"no `{kind}` declaration", Span.point(1, 1), f"add a `{kind}` line")
        for duplicate in decls[1:]:
            sink.error(
                "E003",
                f"`{kind}` declared twice",
                duplicate.span,
                f"first declared on line {decls[0].span.line}",
            )
    for duplicate in par.memory_bounds[1:]:
        sink.error("E003", "`memory` declared twice", duplicate.span,
                   f"first declared on line {par.memory_bounds[0].span.line}")
    for duplicate in par.precisions[1:]:
        sink.error("E003", "`precision` declared twice", duplicate.span,
                   f"first declared on line {par.precisions[0].span.line}")
    _each_once(sink, par.substitutes, lambda decl: f"substitute {decl.name}")
    for duplicate in par.offloads[1:]:
        sink.error("E003", "`offload` declared twice", duplicate.span,
                   f"first declared on line {par.offloads[0].span.line}; name every target on one line")
    for duplicate in par.pipelines[1:]:
        sink.error("E003", "`pipeline` declared twice", duplicate.span,
                   f"first declared on line {par.pipelines[0].span.line}; one mesh axis holds the stages")
    searched = [decl for decl in par.recomputes if decl.pattern == "?"]
    if searched and par.recomputes_written:
        sink.error("E003", "`recompute ?` with submodules named to recompute", searched[0].span,
                   f"line {par.recomputes_written[0].span.line} names `{par.recomputes_written[0].pattern}`: "
                   "write which to recompute, or `recompute ?` for the search to choose")
    _each_once(sink, par.recomputes, lambda decl: f"recompute {decl.pattern}")
    for bound in par.memory_bounds:
        if not (0 < bound.amount < float("inf")) or (bound.unit == "%" and bound.amount > 100):
            sink.error("E064", f"a memory bound of {bound} cannot be met or is no bound", bound.span,
                       "write a positive size, or a percentage from 0 to 100 of the serial model's memory")
    seen: dict[str, InputDecl] = {}
    for decl in par.inputs:
        if decl.name in seen:
            sink.error(
                "E003", f"input `{decl.name}` declared twice", decl.span,
                f"first declared on line {seen[decl.name].span.line}",
            )
        seen.setdefault(decl.name, decl)


def parse_file(path: str) -> ParFile:
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as error:
        raise FileNotFoundError(f"cannot read {path}: {error.strerror}") from None
    return parse(decode_source(data, path), path)


def decode_source(data: bytes, path: str) -> str:
    """The file's text: UTF-8, a byte-order mark allowed; anything else is E008 at the first bad byte."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line_start = data.rfind(b"\n", 0, error.start) + 1
        line = data.count(b"\n", 0, error.start) + 1
        column = len(data[line_start:error.start].decode("utf-8", "replace")) + 1
        source = SourceFile(path, data.decode("utf-8", "replace"))
        sink = DiagnosticSink(source)
        sink.error("E008", f"the file is not UTF-8 text: byte 0x{data[error.start]:02x} cannot start or continue "
                   "a character", Span.point(line, column), "save the file as UTF-8")
        sink.raise_if_any()
        raise  # unreachable: raise_if_any raised
