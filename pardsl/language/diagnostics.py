"""Diagnostics: errors in the user's .par file, reported as FILE:LINE:COL with the line and a caret.

Every stage reports mistakes in the user's input as `Diagnostic`s and raises `CompileError` with all
of them at once, so one run shows every problem it can find. The CLI prints them; nothing the user can
write ends in a Python traceback.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Every error code pardsl reports, with a one-line title. Codes are stable: tests and users match on them.
ERROR_CODES: dict[str, str] = {
    "E001": "syntax error",
    "E002": "unexpected character",
    "E003": "declaration given twice",
    "E004": "required declaration missing",
    "E008": "the file is not UTF-8 text",
    "E009": "invalid literal (a bad string escape, nesting too deep)",
    "E005": "named dim used before it has a size",
    "E006": "named dim given two sizes",
    "E007": "named dim with an example size below 2",
    "E010": "mesh axis named twice",
    "E011": "mesh axis size must be at least 1",
    "E012": "mesh size does not match the world size",
    "E013": "no shape of a searched mesh has a plan",
    "E020": "model module cannot be imported",
    "E021": "model factory not found in its module",
    "E022": "model factory failed or did not return an nn.Module",
    "E023": "model module in a folder any user may write to",
    "E029": "input too large",
    "E030": "unknown dtype",
    "E031": "value range on a floating-point input",
    "E032": "integer input without a value range",
    "E033": "empty value range",
    "E034": "inputs do not match the model's forward() arguments",
    "E035": "the model cannot be traced with the declared inputs",
    "E036": "the model returns something that is not a tensor",
    "E037": "value range does not fit the dtype",
    "E038": "input dtype the model does not compute in",
    "E039": "integer range larger than the embedding table",
    "E040": "unknown name",
    "E041": "ambiguous name",
    "E043": "tensor given two layouts",
    "E044": "name does not denote a tensor",
    "E050": "layout has the wrong number of mesh axes",
    "E051": "unknown mesh axis",
    "E052": "mesh axis named twice in one layout",
    "E053": "split dimension out of range",
    "E054": "split dimension not divisible by the mesh axes splitting it",
    "E055": "partial sum (P) on a parameter, buffer or input",
    "E056": "a dim split in blocks by more than one mesh axis",
    "E057": "blocks must be at least 1",
    "E058": "zig-zag split on a parameter or buffer",
    "E060": "operation not supported",
    "E061": "operation whose result shape depends on the data",
    "E062": "in-place operation on a view",
    "E063": "the forward makes a tensor from Python-side random numbers, which a trace fixes",
    "E064": "memory bound that is no bound",
    "E070": "pipeline axis that is not a mesh axis",
    "E071": "unknown pipeline schedule",
    "E072": "pipeline cut that names no submodule",
    "E073": "pipeline cuts out of order, or a stage left empty",
    "E074": "batch the micro-batches cannot split",
    "E075": "stage count the schedule or the mesh cannot take",
    "E076": "layout split or partial on the pipeline axis",
    "E078": "what a pipelined plan does not support yet",
    "E080": "unknown recomputation policy",
    "E081": "recomputation that names no submodule the forward calls",
    "E083": "unknown precision option or dtype",
    "E084": "unknown offload target",
    "E085": "unknown substitution, or a choice it does not take",
    "E090": "compile did not finish within its time limit",
}

# Every note: a plan that compiles, with something the user should know about it.
NOTE_CODES: dict[str, str] = {
    "N001": "a written layout is converted before the op that reads it",
    "N002": "values exchanged by an all-to-all nobody wrote (an op could not keep a split)",
    "N003": "the plan needs more memory per rank than the `memory` bound",
    "N004": "the greedy completion is compiled: rated faster than the layout search's plan",
    "N005": "operators without a rule, computed whole on every rank",
    "N006": "the layout search stopped at its time budget: the best plan found is compiled",
    "N007": "layers recomputed in backward, chosen to hold to the `memory` bound",
    "N008": "a searched mesh's plan splits weights over `dp` and synchronises gradients over `tp`",
    "N009": "the search's plan beside the best known recipe (Megatron, FSDP, data parallelism) for the model",
    "N010": "a searched pipeline was chosen on a recipe's layouts that its compile could not take",
    "N011": "the searched pipeline priced fastest held more than the bound once compiled: the next is compiled",
}


def code_reference() -> str:
    """Every error and note code as Markdown: docs/errors.md, which a test keeps equal to this."""
    lines = ["# Error and note codes", "",
             "Every diagnostic `pardsl check`, `compile`, `explain` and `run` print carries one of these codes, "
             "with the file, line and column it concerns. Codes are stable: match on them. This page is "
             "`pardsl codes`' output.", "", "## Errors", "", "| code | meaning |", "|---|---|"]
    lines += [f"| {code} | {title} |" for code, title in ERROR_CODES.items()]
    lines += ["", "## Notes", "", "A note does not stop the compile.", "", "| code | meaning |", "|---|---|"]
    lines += [f"| {code} | {title} |" for code, title in NOTE_CODES.items()]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Span:
    """A region of the .par file, 1-based lines and columns, end exclusive."""

    line: int
    column: int
    end_line: int
    end_column: int

    @staticmethod
    def point(line: int, column: int) -> "Span":
        return Span(line, column, line, column + 1)


@dataclass(frozen=True)
class Diagnostic:
    code: str
    message: str
    span: Span | None
    notes: tuple[str, ...] = ()
    severity: str = "error"

    def render(self, source: "SourceFile") -> str:
        where = f"{source.path}:{self.span.line}:{self.span.column}" if self.span else str(source.path)
        lines = [f"{where}: {self.severity}[{self.code}]: {self.message}"]
        if self.span is not None and 1 <= self.span.line <= len(source.lines):
            text = source.lines[self.span.line - 1]
            gutter = f"{self.span.line:>4} | "
            width = (
                self.span.end_column - self.span.column
                if self.span.end_line == self.span.line
                else len(text) - self.span.column + 1
            )
            lines.append(gutter + text)
            lines.append(" " * (len(gutter) - 2) + "| " + " " * (self.span.column - 1) + "^" * max(1, width))
        lines.extend(f"     = note: {note}" for note in self.notes)
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "code": self.code,
            "severity": self.severity,
            "message": self.message,
            "line": self.span.line if self.span else None,
            "column": self.span.column if self.span else None,
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class SourceFile:
    path: str
    text: str
    lines: tuple[str, ...] = field(init=False)

    def __post_init__(self):
        # Lines end at \n (or \r\n) alone, as the grammar's do: str.splitlines would also split at form
        # feeds, vertical tabs, NEL and U+2028, and every location after one would be wrong.
        lines = self.text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        object.__setattr__(self, "lines", tuple(line.removesuffix("\r") for line in lines))


class CompileError(Exception):
    """Mistakes in the user's input: carries every diagnostic found, never a traceback for the user."""

    def __init__(self, diagnostics: list[Diagnostic], source: SourceFile | None = None):
        assert diagnostics, "a CompileError needs at least one diagnostic"
        self.diagnostics = list(diagnostics)
        self.source = source
        super().__init__(self.render())

    def render(self) -> str:
        if self.source is None:
            return "\n".join(f"error[{d.code}]: {d.message}" for d in self.diagnostics)
        return "\n\n".join(d.render(self.source) for d in self.diagnostics)

    @property
    def codes(self) -> list[str]:
        return [d.code for d in self.diagnostics]


MAX_PER_CODE = 20
SAME_PLACE_NAMED = 3  # of the other tensors a collapsed error also concerns, how many are named


def _one_per_place(diagnostics: list[Diagnostic]) -> list[Diagnostic]:
    """One diagnostic per code and place, the first, with a note naming the others (the first backquoted
    name of each message)."""
    first: dict[tuple, int] = {}
    others: dict[int, list[str]] = {}
    kept: list[Diagnostic] = []
    for diagnostic in diagnostics:
        place = (diagnostic.code, diagnostic.span)
        if diagnostic.span is None or place not in first:
            first[place] = len(kept)
            kept.append(diagnostic)
            continue
        name = re.search(r"`([^`]+)`", diagnostic.message)
        others.setdefault(first[place], []).append(name.group(1) if name else "")
    for index, names in others.items():
        named = [f"`{n}`" for n in dict.fromkeys(names) if n][:SAME_PLACE_NAMED]
        rest = len(names) - len(named)
        if named:
            also = "for " + ", ".join(named) + (f" and {rest} more" if rest else "")
        else:
            also = f"{rest} more time{'s' if rest > 1 else ''}"
        last = kept[index]
        kept[index] = Diagnostic(last.code, last.message, last.span, last.notes + (f"also {also}",),
                                 last.severity)
    return kept


class DiagnosticSink:
    """Collects diagnostics during one stage; `raise_if_any` ends the stage with all of them."""

    def __init__(self, source: SourceFile):
        self.source = source
        self.diagnostics: list[Diagnostic] = []
        self._counts: dict[str, int] = {}

    def error(self, code: str, message: str, span: Span | None, *notes: str) -> None:
        assert code in ERROR_CODES, code
        self.diagnostics.append(Diagnostic(code, message, span, tuple(notes)))
        self._counts[code] = self._counts.get(code, 0) + 1

    def count(self, code: str) -> int:
        return self._counts.get(code, 0)

    def one_per_place_since(self, start: int) -> None:
        """Of the diagnostics from `start` on (one written line's, for each tensor it names), keep one per
        code and place: `layers.*.fc.weight : S(5)` is one mistake, fixed once, whatever the depth."""
        if len(self.diagnostics) - start < 2:
            return
        for diagnostic in self.diagnostics[start:]:
            self._counts[diagnostic.code] -= 1
        self.diagnostics[start:] = _one_per_place(self.diagnostics[start:])
        for diagnostic in self.diagnostics[start:]:
            self._counts[diagnostic.code] += 1

    def raise_if_any(self) -> None:
        """Raise every diagnostic, in file order; past MAX_PER_CODE of one code, the last one shown says
        how many more there are (200,000 unknown names are not 200,000 messages)."""
        if not self.diagnostics:
            return
        in_file_order = sorted(self.diagnostics, key=lambda d: (d.span.line, d.span.column) if d.span else (0, 0))
        shown, counts = [], {}
        for diagnostic in in_file_order:
            counts[diagnostic.code] = counts.get(diagnostic.code, 0) + 1
            if counts[diagnostic.code] <= MAX_PER_CODE:
                shown.append(diagnostic)
        for code, count in counts.items():
            if count > MAX_PER_CODE:
                index = max(i for i, d in enumerate(shown) if d.code == code)
                last = shown[index]
                shown[index] = Diagnostic(last.code, last.message, last.span, last.notes + (
                    f"{count - MAX_PER_CODE} more error[{code}] not shown",), last.severity)
        raise CompileError(shown, self.source)
