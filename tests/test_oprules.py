import operator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pardsl.layouts.algebra import S
from pardsl.layouts.oprules import RULES, dim_spec, functional_overload, op_name, rule_for, rules_table, signatures


def _nodes(module, *inputs):
    exported = torch.export.export(module, inputs)
    return {n.name: n for n in exported.graph.nodes if n.op == "call_function"}


def _sigs(node):
    return {(tuple(str(p) for p in s.operands), str(s.output)) for s in signatures(dim_spec(node, rule_for(node)))}


def test_linear_signatures_column_row_and_partial():
    node = _nodes(nn.Linear(8, 4), torch.randn(2, 8))["linear"]
    sigs = _sigs(node)
    assert (("B", "B", "B"), "B") in sigs
    assert (("S(0)", "B", "B"), "S(0)") in sigs                 # batch split (data parallel)
    assert (("B", "S(0)", "S(0)"), "S(1)") in sigs              # column parallel
    assert (("S(1)", "S(1)", "P"), "P") in sigs                 # row parallel: the bias is added once
    assert (("P", "B", "P"), "P") in sigs                       # partial input through a linear op
    assert not any(out == "P" and ops[2] == "B" for ops, out in sigs)


def test_affine_add_does_not_pass_partial_sums():
    class AddOne(nn.Module):
        def forward(self, x, y):
            return x + 1.0, x + y, x * 3.0

    nodes = _nodes(AddOne(), torch.randn(4, 4), torch.randn(4, 4))
    assert not any(out == "P" for _, out in _sigs(nodes["add"]))
    assert (("P", "P"), "P") in _sigs(nodes["add_1"])
    assert (("P",), "P") in _sigs(nodes["mul"])


def test_softmax_dim_is_never_split_and_layer_norms_only_by_its_distributed_form():
    class Norms(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(8)

        def forward(self, x):
            return torch.softmax(x, dim=1), self.ln(x)

    nodes = _nodes(Norms(), torch.randn(4, 8))
    assert {out for _, out in _sigs(nodes["softmax"])} == {"B", "S(0)"}
    assert {out for _, out in _sigs(nodes["layer_norm"])} == {"B", "S(0)", "S(1)"}
    [form] = dim_spec(nodes["layer_norm"], rule_for(nodes["layer_norm"])).extra
    assert (form.name, form.operands, form.output) == ("features", (S(1), S(0), S(0)), S(1))
    statistics, gradients = form.inner_collectives
    assert (statistics.phase, statistics.nbytes((4, 4), S(1), 4)) == ("forward", 2 * 4 * 8)  # float64, per row
    assert (gradients.phase, gradients.nbytes((4, 4), S(1), 4)) == ("backward", 2 * 4 * 4)


def test_view_maps_a_split_through_merged_and_split_dims():
    class Heads(nn.Module):
        def forward(self, x):
            return x.view(2, 3, 4, 8).reshape(2, 3, 32)

    nodes = _nodes(Heads(), torch.randn(2, 3, 32))
    view = {(ops, out) for ops, out in _sigs(nodes["view"])}
    assert (("S(2)",), "S(2)") in view          # hidden split → heads split
    assert not any(out == "S(3)" for _, out in view)  # the inner dim of a split group cannot carry it
    assert (("P",), "P") in view


def test_broadcast_operand_takes_B_on_the_broadcast_dim():
    class Scale(nn.Module):
        def forward(self, x, s):
            return x * s

    node = _nodes(Scale(), torch.randn(4, 8), torch.randn(8))["mul"]
    assert (("S(0)", "B"), "S(0)") in _sigs(node)
    assert (("S(1)", "S(0)"), "S(1)") in _sigs(node)


def test_mean_over_a_split_dim_gives_a_partial_sum():
    class Mean(nn.Module):
        def forward(self, x):
            return x.mean(dim=1)

    node = _nodes(Mean(), torch.randn(4, 8))["mean"]
    assert (("S(1)",), "P") in _sigs(node)
    assert RULES[node.target].mean


def test_rules_are_data():
    # Every rule is a row of one table; families are few.
    assert {r.family for r in RULES.values()} == {"einsum", "matmul", "elementwise", "reduce", "normalize",
                                                  "reshape", "permute", "attention", "source", "cut", "project",
                                                  "expand", "check", "select", "loss", "index", "gather", "pad",
                                                  "conv", "window", "batch_norm", "group_norm", "along", "one_hot",
                                                  "histogram", "index_put", "equation", "stack", "recurrent",
                                                  "experts"}
    assert RULES[torch.ops.aten.linear.default].spec == "...k,nk,n->...n"


def test_index_keeps_indexed_dims_whole_and_splits_with_the_index():
    class Index(nn.Module):
        def forward(self, x, rows, cols):
            return x[rows, cols], x[:, cols]

    nodes = _nodes(Index(), torch.randn(6, 8, 4), torch.arange(6)[:, None], torch.arange(8)[None, :])
    both, second = _sigs(nodes["index"]), _sigs(nodes["index_1"])
    # x[rows, cols]: the result is [6, 8, 4]; its first two dims come from the index tensors
    assert (("B", "S(0)", "B"), "S(0)") in both
    assert (("B", "B", "S(1)"), "S(1)") in both
    assert (("S(2)", "B", "B"), "S(2)") in both
    assert (("P", "B", "B"), "P") in both                       # linear in x, never in the index
    assert not any(ops[0] in ("S(0)", "S(1)") for ops, _ in both)
    # x[:, cols]: dim 0 of x passes through; dim 1 is replaced by the index's [1, 8]
    assert (("S(0)", "B"), "S(0)") in second
    assert (("B", "S(1)"), "S(2)") in second


def test_gather_cumsum_and_diff_keep_their_dim_whole():
    class Scans(nn.Module):
        def forward(self, x, index):
            return torch.gather(x, 1, index), torch.cumsum(x, dim=1), torch.diff(x, dim=1)

    nodes = _nodes(Scans(), torch.randn(4, 6), torch.zeros(4, 3, dtype=torch.long))
    gather, cumsum, diff = (_sigs(nodes[n]) for n in ("gather", "cumsum", "diff"))
    assert (("S(0)", "S(0)"), "S(0)") in gather                 # rows split with the index's rows
    assert not any("S(1)" in ops for ops, _ in gather)          # the gathered dim, and 3 ≠ 6 columns
    assert (("P", "B"), "P") in gather
    for sigs in (cumsum, diff):
        assert (("S(0)",), "S(0)") in sigs and (("P",), "P") in sigs
        assert not any("S(1)" in ops for ops, _ in sigs)


def test_cat_of_equal_split_parts_is_a_blocked_split_and_blocks_contract():
    class Join(nn.Module):
        def forward(self, a, b, w):
            return torch.cat([a, b], dim=1) @ w

    nodes = _nodes(Join(), torch.randn(4, 8), torch.randn(4, 8), torch.randn(16, 4))
    assert (("S(1)", "S(1)"), "S(1, blocks=2)") in _sigs(nodes["cat"])
    spec = dim_spec(nodes["matmul"], rule_for(nodes["matmul"]))
    blocked = {(tuple(str(p) for p in s.operands), str(s.output)) for s in signatures(spec, {"k": {(2, False)}})}
    assert (("S(1, blocks=2)", "S(0, blocks=2)"), "P") in blocked


class _Vision(nn.Module):
    """One of each op the vision rules cover, in training mode (batch norm over the batch)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(4, 6, 3)
        self.conv = nn.Conv2d(4, 6, 3, padding=1)
        self.grouped = nn.Conv2d(6, 6, 3, padding=1, groups=2)
        self.bn = nn.BatchNorm2d(6)
        self.gn = nn.GroupNorm(2, 6)

    def forward(self, x, s):
        y = self.gn(self.bn(self.grouped(self.conv(x))))
        y = F.max_pool2d(y, 2) + F.avg_pool2d(y, 2) + F.adaptive_avg_pool2d(y, (4, 4))
        z = self.conv1(s)
        return F.interpolate(y, scale_factor=2.0), torch.maximum(z, z.min(torch.zeros_like(z)))


# One golden line per op: its legal one-axis signatures beyond all-B (operands -> output).
VISION_GOLDEN = """\
aten.conv2d.default: S(0),B,B->S(0) | B,S(0),S(0)->S(1) | S(1),S(1),P->P | P,B,P->P | B,P,P->P | S(2),B,B->S(2) | S(3),B,B->S(3)
aten.conv2d.default: S(0),B,B->S(0) | P,B,P->P | B,P,P->P | S(2),B,B->S(2) | S(3),B,B->S(3)
aten.batch_norm.default: S(1),S(0),S(0),S(0),S(0)->S(1) | S(0),B,B,B,B->S(0) | S(2),B,B,B,B->S(2) | S(3),B,B,B,B->S(3)
aten.group_norm.default: S(0),B,B->S(0)
aten.max_pool2d.default: S(0)->S(0) | S(1)->S(1) | S(2)->S(2) | S(3)->S(3)
aten.avg_pool2d.default: S(0)->S(0) | S(1)->S(1) | S(2)->S(2) | S(3)->S(3) | P->P
aten.adaptive_avg_pool2d.default: S(0)->S(0) | S(1)->S(1) | P->P
aten.conv1d.default: S(0),B,B->S(0) | B,S(0),S(0)->S(1) | S(1),S(1),P->P | P,B,P->P | B,P,P->P
aten.upsample_nearest2d.vec: S(0)->S(0) | S(1)->S(1) | S(2)->S(2) | S(3)->S(3) | P->P
aten.min.other: S(0),S(0)->S(0) | S(1),S(1)->S(1) | S(2),S(2)->S(2)
aten.maximum.default: S(0),S(0)->S(0) | S(1),S(1)->S(1) | S(2),S(2)->S(2)
"""


def test_vision_rules_golden_lines():
    """Convolutions: batch, output channels (column), input channels (row: P, the bias added once); grouped
    ones keep channels whole; a 3×3 with padding 1 splits its rows and columns by its halo form (the last
    two), a 1-D one without padding (its output shorter than its input) not. Pools whose stride is their
    window and whole-factor nearest resizes split spatial dims as they are; an adaptive pool not; averages
    pass P. Batch norm splits channels, or the batch or the image's rows and columns through its
    synchronised form; group norm the batch."""
    nodes = _nodes(_Vision(), torch.randn(2, 4, 8, 8), torch.randn(2, 4, 10))
    skipped = ("aten.add.Tensor", "aten.add_.Tensor", "aten.zeros_like.default")
    assert _signature_lines(n for n in nodes.values() if op_name(n) not in skipped) == VISION_GOLDEN


def _signature_lines(nodes) -> str:
    """One line per node: its op, then its legal one-axis signatures beyond all-B."""
    lines = []
    for node in nodes:
        signature_text = " | ".join(f"{','.join(str(p) for p in s.operands)}->{s.output}"
                                    for s in signatures(dim_spec(node, rule_for(node)))[1:])
        lines.append(f"{op_name(node)}: {signature_text}\n")
    return "".join(lines)


def test_synchronised_batch_norm_declares_its_reductions():
    node = next(n for n in _nodes(_Vision(), torch.randn(2, 4, 8, 8), torch.randn(2, 4, 10)).values()
                if op_name(n) == "aten.batch_norm.default")
    form, *spatial = dim_spec(node, rule_for(node)).extra
    assert form.name == "batch" and [f.name for f in spatial] == ["batch", "batch"]  # rows, columns
    statistics, gradients = form.inner_collectives
    # per channel a sum and a sum of squares, in float64; the count is known (the batch splits evenly)
    assert (statistics.phase, statistics.nbytes((1, 6, 8, 8), S(0), 4)) == ("forward", 2 * 6 * 8)
    assert (gradients.phase, gradients.nbytes((1, 6, 8, 8), S(0), 4)) == ("backward", 2 * 6 * 4)


def test_in_place_ops_take_their_functional_ops_rule():
    aten = torch.ops.aten
    assert functional_overload(aten.add_.Tensor) is aten.add.Tensor
    assert functional_overload(aten.__and__.Tensor) is None and functional_overload(aten.add.Tensor) is None
    relu_ = _nodes(_InPlaceRelu(), torch.randn(2, 3))
    [node] = [n for n in relu_.values() if n.target is aten.relu_.default]
    assert rule_for(node) is RULES[aten.relu.default]


class _InPlaceRelu(nn.Module):
    def forward(self, x):
        return (x * 2).relu_()


class _Routing(nn.Module):
    """The routing ops of a mixture of experts, on [tokens, experts] scores."""

    def forward(self, scores, index):
        values, chosen = torch.topk(scores, 2, dim=-1)
        order = torch.sort(scores, dim=-1).values + torch.argsort(scores, dim=-1)
        mask = F.one_hot(chosen, 4)
        placed = torch.zeros_like(scores).scatter(1, index, values).scatter_add(1, index, values)
        added = torch.zeros(8, 4).index_add(0, torch.arange(4), scores[:4])
        put = torch.zeros(8, 4, 3).index_put((index[:, 0],), torch.ones(8, 4, 3), accumulate=True)
        return values.repeat_interleave(2, dim=0), order, mask, placed, added, torch.histc(scores, bins=5), put


ROUTING_GOLDEN = """\
aten.topk.default: S(0)->S(0)
aten.sort.default: S(0)->S(0)
aten.argsort.default: S(0)->S(0)
aten.one_hot.default: S(0)->S(0) | S(1)->S(1)
aten.scatter.src: S(0),S(0),S(0)->S(0)
aten.scatter_add.default: S(0),S(0),S(0)->S(0)
aten.index_add.default: S(1),B,S(1)->S(1)
aten.index_put.default: S(1),B,S(1)->S(1) | S(2),B,S(2)->S(2)
aten.repeat_interleave.self_int: S(1)->S(1) | P->P
aten.histc.default: S(0)->P | S(1)->P
"""


def test_routing_rules_golden_lines():
    """topk, sort, scatter, index_add, index_put, repeat_interleave keep their dim whole and split the others alike
    where operands have them; one_hot adds a whole dim; a histogram of split values is a partial sum."""
    nodes = _nodes(_Routing(), torch.randn(8, 4), torch.randint(0, 4, (8, 2)))
    routing = ("topk", "sort", "argsort", "one_hot", "scatter", "scatter_add", "index_add", "repeat_interleave",
               "histc", "index_put")
    assert _signature_lines(n for n in nodes.values() if op_name(n).split(".")[1] in routing) == ROUTING_GOLDEN


class _FallbacksWithRules(nn.Module):
    """einsum (explicit and implicit output, broadcast dims, a diagonal), stack, transposed convolutions
    (plain and grouped), an LSTM batch first and a bidirectional GRU."""

    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1)
        self.grouped_up = nn.ConvTranspose1d(4, 6, 3, groups=2)
        self.lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True)
        self.gru = nn.GRU(8, 16, bidirectional=True)

    def forward(self, x, image):
        mixed = torch.einsum("bij,jk->bik", x, x[0])
        implicit = torch.einsum("...ij,jk", x, x[0])
        diagonal = torch.einsum("bii->bi", x)
        stacked = torch.stack([x, mixed], dim=1)
        up = self.up(image)
        grouped = self.grouped_up(image[:, :, 0])
        output, (hidden, cell) = self.lstm(x)
        sequence, state = self.gru(x)
        return mixed, implicit, diagonal, stacked, up, grouped, output, hidden, cell, sequence, state


FALLBACKS_GOLDEN = """\
aten.einsum.default: S(0),B->S(0) | S(1),B->S(1) | B,S(1)->S(2) | S(2),S(0)->P | P,B->P | B,P->P
aten.einsum.default: S(0),B->S(0) | S(1),B->S(1) | B,S(1)->S(2) | S(2),S(0)->P | P,B->P | B,P->P
aten.einsum.default: P->P
aten.stack.default: S(0),S(0)->S(0) | S(1),S(1)->S(2) | S(2),S(2)->S(3) | P,P->P
aten.conv_transpose2d.input: S(0),B,B->S(0) | B,S(1),S(0)->S(1) | S(1),S(0),P->P | P,B,P->P | B,P,P->P
aten.conv_transpose1d.default: S(0),B,B->S(0) | P,B,P->P | B,P,P->P
aten.lstm.input: S(0),S(1),S(1),B,B,B,B,B,B,B,B->S(0)
_operator.getitem: S(0)->S(0) | S(1)->S(1) | S(2)->S(2) | P->P
_operator.getitem: S(0)->S(1) | P->P
_operator.getitem: S(0)->S(1) | P->P
aten.gru.input: S(1),S(1),B,B,B,B,B,B,B,B->S(1)
_operator.getitem: S(0)->S(0) | S(1)->S(1) | S(2)->S(2) | P->P
_operator.getitem: S(1)->S(1) | P->P
"""


def test_einsum_stack_transposed_convolution_and_recurrent_golden_lines():
    """einsum: each subscript a dim (the contracted j gives P; a diagonal keeps every dim whole); stack: a
    new whole dim; transposed convolutions: the weight's channels the other way round, grouped ones whole;
    LSTM and GRU: the batch only, wherever it lies (batch first or not), in the sequence and the states."""
    nodes = _nodes(_FallbacksWithRules(), torch.randn(2, 8, 8), torch.randn(2, 4, 5, 5))
    shown = ("einsum", "stack", "conv_transpose2d", "conv_transpose1d", "lstm", "gru", "getitem")
    assert _signature_lines(n for n in nodes.values() if op_name(n).split(".")[1] in shown) == FALLBACKS_GOLDEN


def test_every_rule_has_one_golden_line():
    """`pardsl rules` prints each op's rule; the table is held here line by line, so a changed rule, a
    new op or a removed one shows up as a diff of one line (regenerate with `pardsl rules`)."""
    golden = (Path(__file__).parent / "golden" / "op_rules.txt").read_text().splitlines()
    assert rules_table() == golden


def test_rule_keys_are_operators():
    assert all(isinstance(op, torch._ops.OpOverload) or op is operator.getitem for op in RULES)


def test_an_aten_operator_without_a_rule_is_computed_whole():
    """Without a row, an ATen operator with tensor results is WHOLE: its one signature reads every operand
    whole and gives whole results. A random one too: every rank draws serial's values from the same
    generator state (test_distributed.py runs one)."""
    from pardsl.layouts.oprules import WHOLE

    class Mixed(nn.Module):
        def forward(self, x, y):
            return torch.kron(x, y), torch.linalg.qr(x).Q, torch.rand_like(x)

    nodes = _nodes(Mixed(), torch.randn(4, 8), torch.randn(4, 8))
    assert RULES.get(nodes["kron"].target) is None and rule_for(nodes["kron"]) is WHOLE
    assert _sigs(nodes["kron"]) == {(("B", "B"), "B")}
    assert rule_for(nodes["linalg_qr"]) is WHOLE and _sigs(nodes["linalg_qr"]) == {(("B",), "B")}  # Q and R
    assert rule_for(nodes["rand_like"]) is WHOLE and _sigs(nodes["rand_like"]) == {(("B",), "B")}


def test_running_and_reversing_operators_keep_their_other_dims_split():
    """cumprod, logcumsumexp, cummax, flip and roll: the dims they run along or reverse stay whole, the
    others split; flip and roll are linear (a partial sum passes), the running ones are not. roll without
    dims rolls the flattened tensor: every dim whole."""

    class Running(nn.Module):
        def forward(self, x):
            return (torch.cumprod(x, 1), torch.logcumsumexp(x, 1), torch.cummax(x, 1).values,
                    torch.flip(x, dims=[0, 2]), torch.roll(x, 1, dims=2), torch.roll(x, 1))

    nodes = _nodes(Running(), torch.randn(2, 4, 6))
    for name in ("cumprod", "logcumsumexp", "cummax"):
        assert _sigs(nodes[name]) == {(("B",), "B"), (("S(0)",), "S(0)"), (("S(2)",), "S(2)")}, name
    assert _sigs(nodes["flip"]) == {(("B",), "B"), (("S(1)",), "S(1)"), (("P",), "P")}
    assert _sigs(nodes["roll"]) == {(("B",), "B"), (("S(0)",), "S(0)"), (("S(1)",), "S(1)"), (("P",), "P")}
    assert _sigs(nodes["roll_1"]) == {(("B",), "B"), (("P",), "P")}
