"""The lowered program's instructions: what lowering emits and codegen alone turns into Python.

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

from dataclasses import dataclass
from typing import Union


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


def _filled(arg: Arg, fill) -> Arg:
    if isinstance(arg, Slot):
        return fill(arg)
    if isinstance(arg, Items):
        return Items(tuple(_filled(a, fill) for a in arg.items), arg.brackets)
    return arg
