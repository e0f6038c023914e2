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
    """A write through a view whose base is read after it: the base's new value is the view's, put back."""

    def forward(self, x):
        y = x * 2
        y.view(-1).add_(1)
        y.t()[1:3].mul_(3.0)
        return y


class FillsAFreshBuffer(nn.Module):
    """DeepSeek-V3's keys: a buffer made by new_empty, its parts written by copy_ (one broadcast, one in
    another dtype), a column zeroed by fill_, a row by index_put_; read after."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        h = self.linear(x)
        buffer = h.new_empty(4, 12)
        buffer[:, :8].copy_(h)
        buffer[..., 8:].copy_(h[:, :1].to(torch.float64))
        buffer.select(1, 9).fill_(0.5)
        buffer[:, 10:].index_put_((torch.tensor([0, 2], device=h.device),), h.new_ones(2))
        return buffer * 2


class BroadcastsAViewItThenWrites(nn.Module):
    """copy_ broadcasts a view of `a` (an expand is made for it), and `a` is written in place later."""

    def forward(self, x):
        a = x * 2
        buffer = x.new_empty(4, 8)
        buffer.copy_(a[:, :1])
        a.add_(1)
        return buffer + a


class ReadsAnAliasTakenBeforeTheWrite(nn.Module):
    """`peek` shares y's memory, is taken before the write and read after: it would see the write."""

    def forward(self, x):
        y = x * 2
        peek = y.t()
        y[0].add_(1)
        return peek * 1


class WritesIntoAnInput(nn.Module):
    def forward(self, x):
        x[0].mul_(2)
        return x * 1


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


class ClampsItsWeightThroughData(nn.Module):
    """Gemma 3n's AltUp: in training, the forward clamps a parameter's values through `.data` before using
    it."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        with torch.no_grad():
            self.linear.weight.mul_(20.0)

    def forward(self, x):
        if self.training:
            self.linear.weight.data.clamp_(-1.0, 1.0)
        return self.linear(x)


class ReadsItsWeightBeforeClamping(ClampsItsWeightThroughData):
    """The weight is read before the write: that read sees the values before it, which made first it would not."""

    def forward(self, x):
        before = self.linear(x)
        self.linear.weight.data.clamp_(-1.0, 1.0)
        return before + self.linear(x)


class ScalesItsWeightThroughData(ClampsItsWeightThroughData):
    """A write that made again gives another value (a pipeline stage runs once per micro-batch)."""

    def forward(self, x):
        self.linear.weight.data.mul_(0.5)
        return self.linear(x)


class ClampsInTheFirstStage(nn.Module):
    """A pipeline whose first stage clamps its weight through `.data`, as each micro-batch's forward does,
    and keeps it for backward (a product with a value that has a gradient)."""

    def __init__(self):
        super().__init__()
        self.first = ClampsItsWeightThroughData()
        self.second = nn.Linear(8, 8)

    def forward(self, x):
        h = self.first(x)
        return self.second(torch.relu(h @ self.first.linear.weight))


class ClampsATiedWeight(nn.Module):
    """Two linears sharing one weight, clamped through the first and read by both."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)
        with torch.no_grad():
            self.first.weight.mul_(20.0)
        self.second.weight = self.first.weight

    def forward(self, x):
        if self.training:
            self.first.weight.data.clamp_(-1.0, 1.0)
        return self.second(torch.relu(self.first(x)))


class ClampsAFrozenWeight(ClampsItsWeightThroughData):
    """The clamped weight is frozen: no gradient, no optimizer state, still clamped."""

    def __init__(self):
        super().__init__()
        self.linear.weight.requires_grad_(False)


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


def test_a_write_into_a_view_puts_the_new_value_back_into_its_base(compile_par, pools):
    compiled = compile_par(_par("WritesIntoAView"))
    source = compiled.source
    assert "aten.add_" not in source and "aten.mul_" not in source
    assert "aten.slice_scatter.default(" in source  # the transposed rows, put back
    assert run_on(pools, compiled, steps=2)["ok"]


def test_writes_into_a_fresh_buffer_become_scatters(compile_par, pools):
    compiled = compile_par(_par("FillsAFreshBuffer"))
    source = compiled.source
    assert not any(f"aten.{op}_" in source for op in ("copy", "fill", "index_put"))
    assert source.count("aten.slice_scatter.default(") == 3 and source.count("aten.select_scatter.default(") == 1
    assert run_on(pools, compiled, steps=2)["ok"]


def test_a_write_after_a_broadcast_copy_of_a_view_of_its_tensor(compile_par, pools):
    compiled = compile_par(_par("BroadcastsAViewItThenWrites"))
    assert "aten.expand.default(" in compiled.source and "aten.add_" not in compiled.source
    assert run_on(pools, compiled, steps=2)["ok"]


@pytest.mark.parametrize("model", ["ReadsAnAliasTakenBeforeTheWrite", "WritesIntoAnInput"])
def test_a_write_another_alias_would_see_is_located_at_the_models_line(compile_par, model):
    with pytest.raises(CompileError) as caught:
        compile_par(_par(model))
    [error] = caught.value.diagnostics
    assert (error.code, error.span.line, error.span.column) == ("E062", 2, 1)
    assert "aten.add_.Tensor" in error.message or "aten.mul_.Tensor" in error.message
    [line] = [note for note in error.notes if note.startswith("at ")]
    source = "y[0].add_(1)" if model.startswith("Reads") else "x[0].mul_(2)"
    assert line.startswith("at tests/test_in_place.py:") and line.endswith(source)


def test_a_write_into_a_view_nothing_reads_again_becomes_functional(compile_par, pools):
    compiled = compile_par(_par("WritesIntoAViewNothingReadsAgain"))
    assert "aten.mul_" not in compiled.source and "aten.add_" not in compiled.source
    assert run_on(pools, compiled, steps=2)["ok"]


@pytest.mark.parametrize("layout", ["S(0)", "B"], ids=["sharded-and-gathered", "replicated"])
def test_a_parameter_clamped_through_data_is_clamped_on_each_ranks_part_before_the_step(compile_par, pools, layout):
    """`.data` is traced (as detach) so the write is found. Elementwise with constant operands, it is made on
    each rank's part of the weight at the top of the forward, before anything reads it: an all-gather of the
    sharded weight, here, gathers the clamped parts. The weights are 20 times their usual size, so serial's
    outputs are the clamped weight's."""
    compiled = compile_par(_par("ClampsItsWeightThroughData", f"    linear.weight : {layout}\n"))
    source = compiled.source
    write = "rt.write_parameter(self.linear_weight, lambda parameter: parameter.clamp_(-1.0, 1.0))"
    assert source.count(write) == 1 and "detach" not in source
    assert source.index(write) < source.index("sync = rt.parameter_sync(")
    assert "raise RuntimeError(TRAINING_ONLY)" in source  # traced in training mode, where the clamp is made
    assert run_on(pools, compiled, steps=2)["ok"]


@pytest.mark.parametrize("model, statements, layout, write", [
    ("ClampsATiedWeight", "", "first.weight : S(0)", "self.second_weight"),  # one name for the tied weight, the second's
    ("ClampsAFrozenWeight", "", "linear.weight : S(1)", "self.linear_weight"),
    ("ClampsItsWeightThroughData", "precision params bf16, reduce fp32\n", "linear.weight : S(0)", "self.linear_weight"),
    ("ClampsItsWeightThroughData", "offload optimizer\n", "linear.weight : S(0)", "self.linear_weight"),
], ids=["tied", "frozen", "bf16-compute-copy", "offloaded-master"])
def test_a_parameter_clamped_through_data_when_tied_frozen_or_copied(compile_par, pools, model, statements, layout,
                                                                     write):
    """A weight two linears share is written once, through its one storage; a frozen one is still written; in
    bf16 the float32 master is written (the compute copy is made from it after), and with the optimizer
    offloaded the master in host memory (its device copy is made after)."""
    text = _par(model, f"    {layout}\n").replace("layout {", statements + "layout {")
    compiled = compile_par(text)
    line = f"rt.write_parameter({write}, lambda parameter: parameter.clamp_(-1.0, 1.0))"
    assert compiled.source.count("rt.write_parameter(") == 1 and line in compiled.source
    assert run_on(pools, compiled, steps=2)["ok"]


def test_a_pipeline_stage_clamps_its_weight_once_for_the_micro_batches_in_flight(compile_par, pools):
    """1F1B's first stage keeps the first micro-batch's weight for its backward while the second's forward
    runs: a write made again would move the weight's version on, and backward would refuse it. Made where it
    changes a value only, the stages run equal to serial."""
    compiled = compile_par("mesh pp = 2\nmodel tests.test_in_place:ClampsInTheFirstStage()\n"
                           "input x : float32[4, 8]\n"
                           "pipeline pp : schedule 1F1B, microbatches 2, cut before second\n")
    write = "rt.write_parameter(self.first_linear_weight, lambda parameter: parameter.clamp_(-1.0, 1.0))"
    assert compiled.source.count(write) == 1
    assert run_on(pools, compiled, steps=2)["ok"]


@pytest.mark.parametrize("model, source", [
    ("ReadsItsWeightBeforeClamping", "self.linear.weight.data.clamp_(-1.0, 1.0)"),
    ("ScalesItsWeightThroughData", "self.linear.weight.data.mul_(0.5)"),
])
def test_a_parameter_write_through_data_that_cannot_be_made_first_is_located_and_refused(compile_par, model, source):
    """Read before the write, or made again to another value (a pipeline stage's forward runs once per
    micro-batch), the write cannot be moved to the top of the forward: refused, at the model's line."""
    with pytest.raises(CompileError) as caught:
        compile_par(_par(model, "    linear.weight : S(0)\n"))
    [error] = caught.value.diagnostics
    assert (error.code, error.span.line, error.span.column) == ("E062", 2, 1)
    assert "writes into a parameter or input through `.data`" in error.message
    [line] = [note for note in error.notes if note.startswith("at ")]
    assert line.startswith("at tests/test_in_place.py:") and line.endswith(source)


DEEPSEEK = ('examples.more_families:CausalLM(family="DeepseekV3", n_routed_experts=4, num_experts_per_tok=2, '
            'n_group=2, topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1, num_hidden_layers=1, '
            'q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8)')


def test_deepseek_v3_keys_filled_into_a_fresh_buffer_split_by_heads(compile_par, pools):
    """DeepSeek-V3's attention makes its keys with new_empty and two slice copy_ calls (expand_kv): under
    Megatron's plan the buffer is made whole (no collective: it reads nothing) and each part is put in
    with the heads split. Forward: attention's and the MLP's row-parallel all-reduces; backward: theirs
    and the shared rotary key's gradient (its heads expanded from one), gathered over the heads."""
    from .test_distributed import _nonzero, check

    layouts = "".join(f"    model.model.layers.*.{name} : {layout}\n" for name, layout in (
        ("self_attn.q_b_proj.weight", "S(0)"), ("self_attn.kv_b_proj.weight", "S(0)"),
        ("self_attn.o_proj.weight", "S(1)"), ("mlp.gate_proj.weight", "S(0)"), ("mlp.up_proj.weight", "S(0)"),
        ("mlp.down_proj.weight", "S(1)")))
    compiled = compile_par(f"mesh tp = 2\nmodel {DEEPSEEK}\ninput input_ids : int64[2, 16] in [0, 128)\n"
                           f"layout {{\n{layouts}}}\n")
    assert "aten.copy_" not in compiled.source and compiled.source.count("aten.slice_scatter.default(") == 2
    expected = {"forward": {"tp:all_reduce": 2}, "backward": {"tp:all_gather": 1, "tp:all_reduce": 3}}
    assert _nonzero(compiled.program.collective_counts_by_axis()) == expected
    check(pools, compiled)
