"""In-place ops, handled once (pardsl/model/in_place.py): each becomes its functional op and later reads see
its result; an input's own update stays in place; a write into a view whose memory is read again after
it is a located error (E062)."""

import pytest
import torch
from torch import nn

from pardsl.language.diagnostics import CompileError

from .conftest import run_on


class Chained(nn.Module):
    """x is written twice, and read between and after the writes."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.calls.add_(1)
        h = self.linear(x)
        before = h * 2
        h.add_(before)
        between = h * 1.5
        h.mul_(3.0)
        h.relu_()
        return h.sum(-1) + before.sum(-1) + between.sum(-1)


class WritesIntoAView(nn.Module):
    def forward(self, x):
        y = x * 2
        y.view(-1).add_(1)
        return y


class WritesIntoAViewNothingReadsAgain(nn.Module):
    """MobileNetV2's classifier: in-place dropout on the flattened pooling (a view), whose base nothing
    reads after the write; and a write into a tensor of which a view was read before the write only."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        pooled = self.linear(x).view(4, 2, 4)
        flat = pooled.flatten(1)
        flat.mul_(2.0)
        h = self.linear(x)
        peek = h.view(-1).sum()
        h.add_(1.0)
        return self.linear(flat) + h * peek


def _par(model: str, layouts: str = "") -> str:
    return (f"mesh dp = 2\nmodel tests.test_in_place:{model}()\ninput x : float32[4, 8]\n"
            f"layout {{\n    x : S(0)\n{layouts}}}\n")


def test_in_place_ops_become_functional_and_later_reads_see_them(compile_par, pools):
    compiled = compile_par(_par("Chained"))
    source = compiled.source
    assert "aten.relu.default(" in source and "aten.relu_" not in source and "aten.mul_" not in source
    assert "aten.add_.Tensor(self.calls, 1)" in source  # a buffer's update stays in place, on each rank
    report = run_on(pools, compiled, steps=2)
    assert report["ok"], report  # outputs, gradients, and the buffer after each step equal serial's


def test_a_write_into_a_view_is_located(compile_par):
    with pytest.raises(CompileError) as caught:
        compile_par(_par("WritesIntoAView"))
    [error] = caught.value.diagnostics
    assert (error.code, error.span.line, error.span.column) == ("E062", 2, 1)
    assert "aten.add_.Tensor" in error.message


def test_a_write_into_a_view_nothing_reads_again_becomes_functional(compile_par, pools):
    compiled = compile_par(_par("WritesIntoAViewNothingReadsAgain"))
    assert "aten.mul_" not in compiled.source and "aten.add_" not in compiled.source
    assert run_on(pools, compiled, steps=2)["ok"]
