"""Op rules as data.

Each supported ATen op is one row of `RULES`: a spec family and its parameters. The family turns the row
and the node's concrete shapes into a `DimSpec`: a letter for every dim of every tensor operand and of
the output, einsum style (`"...k,nk,n->...n"` is all there is to say about linear). From a DimSpec the
legal one-axis signatures follow mechanically (`signatures`):

- everything B → B;
- a letter kept in the output split → every operand having it split there, the others B;
- a contracted letter (in operands, not in the output) split → output P, operands without it B;
- partial sums pass through linear ops only: `sum` ops (add, sub, views, reductions) take P in all
  operands together; `product` ops (mul, matmul) take P in one linear operand, the others B.

Two signatures letters cannot express are added by their families: `cat` of m equal parts split alike
gives S(d, blocks=m); a cross-entropy may take its logits split over the classes (vocabulary parallel)
and a mean-reduced one its batch split (a global count of targets). The runtime computes those forms
(`Rule.parallel_form`); their signatures declare the all-reduces they make, so inference can price them.

Letters in `unsplittable` (the dim of a softmax, the normalised dims of layer_norm, dims a reshape
merges or splits non-contiguously) are never split. Addend operands (the bias of linear/addmm) follow
the output: S where they have the letter, B where they broadcast, P where the output is P, so a
row-parallel bias is added once.
"""

from __future__ import annotations

import math
import operator
import string
from dataclasses import dataclass, field
from typing import Any

import torch

import pardsl.runtime.experts  # noqa: F401  (registers pardsl::experts and pardsl::grouped_mm, which RULES names)
from pardsl.layouts.algebra import (B, P, Placement, S, arrangement_order, block_sizes, collective_bytes, halo_rows, per_dim,
                                    transposed_halo_rows, zigzag)
from pardsl.layouts.masks import busiest_zigzag_share, hidden_blocks

Letters = tuple  # one letter (str) or None (a broadcast dim of size 1) per dim


@dataclass(frozen=True)
class Rule:
    family: str  # einsum, matmul, elementwise, reduce, normalize, reshape, permute, source, index, cut, …
    spec: str = ""  # einsum spec, for the einsum family
    linear: str = "none"  # none | sum | product
    linear_operands: tuple[int, ...] = (0, 1)  # for product: operands the op is linear in
    addends: tuple[int, ...] = ()  # operands added to the result (bias)
    dim_arg: int | None = None  # softmax dim / reduce dims / normalized_shape argument position
    keepdim_arg: int | None = None
    shape_arg: int | None = None  # argument holding a global shape, rewritten to the local one
    mean: bool = False  # a mean over split dims is rescaled: local mean × local count / global count
    unsplittable_reduce: bool = False  # reductions that are not sums (amax): reduced dims not split
    unsplittable: str = ""  # einsum letters never split
    requires: tuple[tuple[int, str, Any], ...] = ()  # (argument position, name, value) the op needs
    masked_lookup: bool = False  # embedding: a split vocabulary is a masked local lookup, its result P
    whole_dims: tuple[int, ...] = ()  # output dims never split (tril's matrix dims)
    size_arg: int | None = None  # sizes along a cut dim (split's split_size), made local when it is split
    dim_default: int | tuple = 0  # the dim when the call leaves it out (diff's is -1; roll's (): every dim)
    differentiable: bool = True  # False: no gradient flows through (detach)
    fill_arg: int | None = None  # pad's fill value: P passes a zero fill only
    joins: bool = False  # cat: m equal operands split along the dim join into S(dim, blocks=m)
    parallel_form: str = ""  # runtime function computing the op where it takes one of its extra signatures
    every_signature: bool = False  # the parallel form computes the op under its plain signatures too
    # inference prices gathering the op's split parameters as a stall, not as a prefetch hidden behind
    # compute: gathering a mixture's experts puts every expert on every rank, which a written split of
    # them over the tokens' axis means to avoid (expert parallelism); the search prices both as they run
    unhidden_gathers: bool = False
    spatial: int = 0  # conv / window ops: how many trailing spatial dims (conv2d's 2); 0: from the weight
    transposed: bool = False  # conv_transpose: the weight is [in channels, out channels / groups, *kernel]
    window: str = ""  # pools and resizes whose spatial dims may split: "max", "average" or "nearest"
    groups_arg: int | None = None  # conv: the `groups` argument (grouped channels are not split)
    training_arg: int | None = None  # the `training` argument (batch_norm's, dropout's): traced True, it follows
    # the module's mode in the generated code
    resized: bool = False  # along: the op's dim has another size in the output (topk's k)
    drawn_as: str = ""  # a random op: the runtime function that draws serial's whole values, keeps this rank's


aten = torch.ops.aten  # RULES is keyed by OpOverload: a key naming no operator fails at import


def _op(name: str) -> torch._ops.OpOverload:
    """aten's `op.overload` by name, for keys made in a loop; AttributeError at import if there is none."""
    packet, overload = name.rsplit(".", 1)
    return getattr(getattr(aten, packet), overload)


def _elementwise(linear: str = "none", **kw) -> Rule:
    return Rule("elementwise", linear=linear, **kw)


_UNARY = ["relu", "gelu", "silu", "tanh", "sigmoid", "exp", "log", "rsqrt", "sqrt", "abs", "sin", "cos",
          "reciprocal", "erf", "log1p", "expm1", "softplus", "hardtanh", "leaky_relu", "elu", "square",
          "relu6", "selu", "celu", "mish", "hardswish", "hardsigmoid", "log_sigmoid", "logit", "sinh", "cosh",
          "tan", "asin", "acos", "atan", "asinh", "acosh", "atanh", "erfc", "erfinv", "log2", "log10", "exp2",
          "sign", "sgn", "signbit", "floor", "ceil", "round", "trunc", "frac", "nan_to_num", "isnan", "isinf",
          "isfinite", "digamma", "lgamma", "i0"]
# elementwise operators of several operands (broadcasting) or of a scalar and a tensor
_ELEMENTWISE = ["atan2.default", "hypot.default", "xlogy.Tensor", "fmod.Tensor", "fmod.Scalar", "remainder.Tensor",
                "remainder.Scalar", "clamp.Tensor", "clamp_max.default", "clamp_min.Tensor", "lerp.Scalar",
                "lerp.Tensor", "pow.Tensor_Tensor", "pow.Scalar", "div.Tensor_mode", "floor_divide.default",
                "copysign.Tensor", "fmax.default", "fmin.default", "logical_xor.default", "bitwise_xor.Tensor"]

RULES: dict[Any, Rule] = {
    # lookups: an embedding is one_hot(ids) @ weight, so a split vocabulary (v) is a contraction → P
    aten.embedding.default: Rule("einsum", "vd,...->...d", linear="product", linear_operands=(0,),
                                   masked_lookup=True),
    # attention: batch and heads split; sequence and head dims whole
    # (its dropout draws inside the fused kernel, per rank's heads: not serial's mask, so refused)
    # or, with no mask but a causal one, the sequence split: ring attention, the key/value chunks passed
    # around the ranks (pardsl/runtime/ring_attention.py)
    aten.scaled_dot_product_attention.default: Rule("attention", requires=((4, "dropout_p", 0.0),),
                                                    parallel_form="attention"),
    # losses: with reduction="sum" a split batch gives a partial sum; with "mean" too, once the local sum
    # is divided by the global count of non-ignored targets (one all-reduce of a count), or whole, the sum
    # and count all-reduced together. Logits split over the classes (a column-parallel LM head's) are
    # reduced where they lie, Megatron's vocabulary-parallel loss: each rank's max, sum of exps and target
    # logit per row are all-gathered in one collective, never the logits; backward is local.
    aten.cross_entropy_loss.default: Rule("loss", dim_arg=3, parallel_form="cross_entropy"),
    # tensors made from nothing: the same on every rank
    aten.arange.start: Rule("source"),
    aten.arange.default: Rule("source"),
    aten.arange.start_step: Rule("source"),
    # constant fills: made split where a split is wanted, at the local shape
    aten.zeros.default: Rule("source", shape_arg=0),
    aten.ones.default: Rule("source", shape_arg=0),
    aten.full.default: Rule("source", shape_arg=0),
    # the operand gives only dtype and device; the shape is an argument
    aten.new_ones.default: Rule("source"),
    aten.new_zeros.default: Rule("source"),
    aten.new_full.default: Rule("source"),
    # uninitialised buffers, which the forward then writes into (as scatters, see pardsl/model/in_place.py)
    aten.empty.memory_format: Rule("source", shape_arg=0),
    # advanced indexing x[i, j]: the indexed dims of x stay whole; the index tensors' dims may be split
    aten.index.Tensor: Rule("index", linear="product", linear_operands=(0,)),
    # gather(x, dim, index): the gathered dim stays whole; other dims split with the index where sizes match
    aten.gather.default: Rule("gather", linear="product", linear_operands=(0,), dim_arg=1),
    # results cut from an operand along a dim, which stays whole (a conversion comes first if it is split)
    aten.split.Tensor: Rule("cut", linear="sum", dim_arg=2, size_arg=1),
    aten.split_with_sizes.default: Rule("cut", linear="sum", dim_arg=2, size_arg=1),
    aten.chunk.default: Rule("cut", linear="sum", dim_arg=2),
    aten.slice.Tensor: Rule("cut", linear="sum", dim_arg=1),
    aten.narrow.default: Rule("cut", linear="sum", dim_arg=1),
    aten.cat.default: Rule("cut", linear="sum", dim_arg=1, joins=True),
    # a new dim of the operands, whole; the operands' own dims split alike
    aten.stack.default: Rule("stack", linear="sum", dim_arg=1),
    aten.select.int: Rule("select", linear="sum", dim_arg=1),
    aten.unbind.int: Rule("select", linear="sum", dim_arg=1),  # every index of the dim: parts that getitem takes
    # writes into a part of a tensor, functionalised: the tensor's new value with the part replaced
    aten.slice_scatter.default: Rule("cut", linear="sum", dim_arg=2),
    aten.select_scatter.default: Rule("select", linear="sum", dim_arg=2),
    aten.diff.default: Rule("cut", linear="sum", dim_arg=2, dim_default=-1),
    # padding: the padded dims stay whole, the others pass through
    aten.pad.default: Rule("pad", linear="sum", fill_arg=3),
    aten.constant_pad_nd.default: Rule("pad", linear="sum", fill_arg=2),
    operator.getitem: Rule("project", linear="sum"),
    aten.expand.default: Rule("expand", linear="sum", shape_arg=1),
    # checks export leaves in the graph; nothing to compute
    aten._assert_tensor_metadata.default: Rule("check"),
    # matrix products
    aten.linear.default: Rule("einsum", "...k,nk,n->...n", linear="product", addends=(2,)),
    aten.addmm.default: Rule("einsum", "n,mk,kn->mn", linear="product", linear_operands=(1, 2), addends=(0,)),
    aten.mm.default: Rule("einsum", "mk,kn->mn", linear="product"),
    aten.bmm.default: Rule("einsum", "bmk,bkn->bmn", linear="product"),
    aten.matmul.default: Rule("matmul", linear="product"),
    # einsum by its subscripts: each letter a dim, as the rows above are written (a letter repeated in one
    # operand, a diagonal, keeps every dim whole); multilinear, so P passes through any one operand
    aten.einsum.default: Rule("equation", linear="product", linear_operands=(0, 1, 2, 3)),
    # elementwise arithmetic (broadcasting; scalars allowed)
    aten.add.Tensor: _elementwise("sum"),
    aten.sub.Tensor: _elementwise("sum"),
    aten.mul.Tensor: _elementwise("product"),
    aten.div.Tensor: _elementwise("product", linear_operands=(0,)),
    aten.neg.default: _elementwise("sum"),
    aten.rsub.Scalar: _elementwise(),
    aten.pow.Tensor_Scalar: _elementwise(),
    aten.clone.default: _elementwise("sum"),
    aten.contiguous.default: _elementwise("sum"),
    aten.alias.default: _elementwise("sum"),
    aten.detach.default: _elementwise("sum", differentiable=False),
    # dropout: each rank draws the whole tensor's mask as serial's call does (the generator advances alike)
    # and keeps its part, so every layout gives serial's values; linear in x for a given mask, so P passes
    aten.dropout.default: _elementwise("sum", drawn_as="dropout", training_arg=2),
    aten.to.dtype: _elementwise("sum"),
    aten.to.dtype_layout: _elementwise("sum"),
    aten.to.device: _elementwise("sum"),
    aten._to_copy.default: _elementwise("sum"),
    aten.type_as.default: _elementwise("sum"),
    aten.masked_fill.Scalar: _elementwise(),
    aten.masked_fill.Tensor: _elementwise(),
    aten.where.self: _elementwise(),
    aten.where.ScalarSelf: _elementwise(),
    aten.where.ScalarOther: _elementwise(),
    aten.where.Scalar: _elementwise(),
    aten.zeros_like.default: _elementwise(),
    aten.empty_like.default: _elementwise(),
    aten.fill.Scalar: _elementwise(),
    aten.fill.Tensor: _elementwise(),
    aten.ones_like.default: _elementwise(),
    aten.full_like.default: _elementwise(),
    **{_op(f"{cmp}.{kind}"): _elementwise() for cmp in ("eq", "ne", "lt", "le", "gt", "ge")
       for kind in ("Tensor", "Scalar")},
    aten.logical_not.default: _elementwise(),
    aten.logical_and.default: _elementwise(),
    aten.logical_or.default: _elementwise(),
    aten.bitwise_not.default: _elementwise(),
    **{_op(f"{op}.Tensor"): _elementwise() for op in ("__and__", "__or__", "bitwise_and", "bitwise_or")},
    aten.maximum.default: _elementwise(),
    aten.minimum.default: _elementwise(),
    aten.max.other: _elementwise(),
    aten.min.other: _elementwise(),
    aten.clamp.default: _elementwise(),
    aten.clamp_min.default: _elementwise(),
    aten.tril.default: _elementwise(whole_dims=(-2, -1)),
    aten.triu.default: _elementwise(whole_dims=(-2, -1)),
    aten.outer.default: Rule("einsum", "i,j->ij", linear="product"),
    **{_op(f"{name}.default"): _elementwise() for name in _UNARY},
    **{_op(name): _elementwise() for name in _ELEMENTWISE},
    # reductions
    aten.sum.dim_IntList: Rule("reduce", linear="sum", dim_arg=1, keepdim_arg=2),
    aten.sum.default: Rule("reduce", linear="sum"),
    aten.mean.dim: Rule("reduce", linear="sum", dim_arg=1, keepdim_arg=2, mean=True),
    aten.mean.default: Rule("reduce", linear="sum", mean=True),
    aten.amax.default: Rule("reduce", dim_arg=1, keepdim_arg=2, unsplittable_reduce=True),
    # a dim's maximum or minimum and where it is (GPT-OSS's attention sinks): the values and the
    # indices alike
    aten.max.dim: Rule("reduce", dim_arg=1, keepdim_arg=2, unsplittable_reduce=True),
    aten.min.dim: Rule("reduce", dim_arg=1, keepdim_arg=2, unsplittable_reduce=True),
    # normalisation over a dim that must be whole on every rank
    aten.softmax.int: Rule("normalize", dim_arg=1),
    aten._softmax.default: Rule("normalize", dim_arg=1),
    aten.log_softmax.int: Rule("normalize", dim_arg=1),
    aten._log_softmax.default: Rule("normalize", dim_arg=1),
    # layer norm: a split normalised dim is Optimus's and Tesseract's distributed form (the statistics
    # of the row are summed over the ranks that hold its parts)
    aten.layer_norm.default: Rule("normalize", dim_arg=1, parallel_form="layer_norm"),
    # running sums along a dim that stays whole
    aten.cumsum.default: Rule("normalize", linear="sum", dim_arg=1),
    # convolutions: an einsum over channels with windows over the spatial dims. Batch split: data parallel;
    # output channels: column parallel; input channels: row parallel, partial sums with the bias added
    # once. Grouped channels are not split. A spatial dim splits where the windows tile it (output size ×
    # stride = input size): each rank gets the rows of its neighbours its windows read (the halo, sent
    # point to point forward, their gradients sent back backward), none where a window reads only its own
    # rows (1×1, or kernel = stride).
    **{_op(f"conv{k}d.default"): Rule("conv", linear="product", addends=(2,), spatial=k, groups_arg=6,
                                       parallel_form="conv_halo") for k in (1, 2, 3)},
    # transposed convolutions alike: their weight holds the input channels first
    **{_op(f"conv_transpose{k}d.{'default' if k == 1 else 'input'}"):
       Rule("conv", linear="product", addends=(2,), spatial=k, groups_arg=6, transposed=True,
            parallel_form="conv_transpose_halo") for k in (1, 2, 3)},
    aten.convolution.default: Rule("conv", linear="product", addends=(2,), groups_arg=8,  # `transposed`: arg 6
                                     parallel_form="convolution_halo"),
    # pooling and resizing: windows over the trailing spatial dims; batch and channels split. A spatial dim
    # splits where each rank's windows read its own rows (a pool whose stride is its window, a nearest
    # upsampling by a whole factor), or, for max pools, with the rows of its neighbours' it needs
    # exchanged (the halo, as for convolutions). Averages and interpolations are linear, so partial sums
    # pass through them.
    **{_op(f"max_pool{k}d.default"): Rule("window", spatial=k, window="max", parallel_form="max_pool_halo")
       for k in (1, 2, 3)},
    **{_op(f"avg_pool{k}d.default"): Rule("window", linear="sum", spatial=k, window="average") for k in (1, 2, 3)},
    **{_op(f"adaptive_avg_pool{k}d.default"): Rule("window", linear="sum", spatial=k) for k in (1, 2, 3)},
    aten.upsample_nearest1d.vec: Rule("window", linear="sum", spatial=1, window="nearest"),
    aten.upsample_nearest2d.vec: Rule("window", linear="sum", spatial=2, window="nearest"),
    aten.upsample_nearest3d.vec: Rule("window", linear="sum", spatial=3, window="nearest"),
    aten.upsample_linear1d.vec: Rule("window", linear="sum", spatial=1),
    aten.upsample_bilinear2d.vec: Rule("window", linear="sum", spatial=2),
    aten.upsample_bicubic2d.vec: Rule("window", linear="sum", spatial=2),
    aten.upsample_trilinear3d.vec: Rule("window", linear="sum", spatial=3),
    # recurrent layers: the batch splits (each rank runs its sequences through the whole weights, whose
    # gradients are then summed); time, features and layers stay whole. Dropout between layers would draw
    # per rank: refused.
    aten.lstm.input: Rule("recurrent", requires=((5, "dropout", 0.0),)),
    aten.gru.input: Rule("recurrent", requires=((5, "dropout", 0.0),)),
    aten.rnn_tanh.input: Rule("recurrent", requires=((5, "dropout", 0.0),)),
    aten.rnn_relu.input: Rule("recurrent", requires=((5, "dropout", 0.0),)),
    # a mixture of experts' experts as one op (pardsl/runtime/experts.py): tokens split (data parallel),
    # the intermediate dim split (tensor parallel: P), experts and tokens split alike over the same axis
    # (expert parallel: each pair to its expert's rank and back, all-to-alls of a size the routing
    # decides); computed by the runtime under every signature
    torch.ops.pardsl.experts.default: Rule("experts", parallel_form="experts", every_signature=True,
                                                 unhidden_gathers=True),
    # one projection of such experts, where the op above does not know their gate: rows sorted by expert
    # (s), whole, as are the experts (e) that `ends` (where each expert's rows end) counts; the
    # projection's output (n) or input (k) features split, as a linear's do. The runtime calls the op
    torch.ops.pardsl.grouped_mm.default: Rule("einsum", "sk,ekn,e->sn", linear="product", unsplittable="se",
                                              parallel_form="grouped_mm", every_signature=True),
    # batch norm: per-channel statistics, so channels split freely. In training the statistics are over
    # the batch and spatial dims: a split batch computes the global ones (SyncBatchNorm's form: one
    # all-reduce of per-channel sums forward, one backward); in eval the running statistics are used.
    aten.batch_norm.default: Rule("batch_norm", training_arg=5, parallel_form="batch_norm"),
    # group norm: statistics per sample over a group of channels and the spatial dims: batch split only
    aten.group_norm.default: Rule("group_norm"),
    # running products, log-sum-exps, maxima and minima: the dim they run along stays whole
    aten.cumprod.default: Rule("along", dim_arg=1),
    aten.logcumsumexp.default: Rule("along", dim_arg=1),
    aten.cummax.default: Rule("along", dim_arg=1),
    aten.cummin.default: Rule("along", dim_arg=1),
    # reversing or rotating dims, which stay whole; linear, so a partial sum passes
    aten.flip.default: Rule("along", linear="sum", dim_arg=1),
    aten.roll.default: Rule("along", linear="sum", dim_arg=2, dim_default=()),  # no dims: rolls it flattened
    # routing (mixture of experts): ops along one dim, which stays whole; the other dims split alike in
    # every operand of the same rank and size there (scatter's index and source), the rest whole
    aten.topk.default: Rule("along", dim_arg=2, dim_default=-1, resized=True),
    aten.sort.default: Rule("along", dim_arg=1, dim_default=-1),
    aten.sort.stable: Rule("along", dim_arg=99, dim_default=-1),
    aten.argsort.default: Rule("along", dim_arg=1, dim_default=-1),
    aten.argsort.stable: Rule("along", dim_arg=99, dim_default=-1),
    aten.repeat_interleave.self_int: Rule("along", linear="sum", dim_arg=2, dim_default=0, resized=True),
    aten.scatter.src: Rule("along", dim_arg=1),
    aten.scatter.value: Rule("along", dim_arg=1),
    aten.scatter_add.default: Rule("along", dim_arg=1),
    aten.index_add.default: Rule("along", dim_arg=1),
    # x[i, j] = v (accumulate or not): the indexed dims of x stay whole; v's trailing dims split with x's
    # trailing non-indexed dims where they match, the rest of v and the indices whole
    aten.index_put.default: Rule("index_put"),
    # a new trailing dim of classes, whole
    aten.one_hot.default: Rule("one_hot"),
    # a histogram of a split tensor is the sum of the ranks' histograms (P)
    aten.histc.default: Rule("histogram"),
    # views
    aten.view.default: Rule("reshape", linear="sum", shape_arg=1),
    aten.reshape.default: Rule("reshape", linear="sum", shape_arg=1),
    aten._unsafe_view.default: Rule("reshape", linear="sum", shape_arg=1),
    aten.flatten.using_ints: Rule("reshape", linear="sum"),
    aten.unflatten.int: Rule("reshape", linear="sum", shape_arg=2),
    aten.unsqueeze.default: Rule("reshape", linear="sum"),
    aten.squeeze.dim: Rule("reshape", linear="sum"),
    aten.squeeze.dims: Rule("reshape", linear="sum"),
    aten.squeeze.default: Rule("reshape", linear="sum"),
    aten.transpose.int: Rule("permute", linear="sum"),
    aten.permute.default: Rule("permute", linear="sum"),
    aten.t.default: Rule("permute", linear="sum"),
}


def describe(rule: Rule) -> str:
    """A rule's printed form: its family, then every field that differs from the default."""
    defaults = Rule(rule.family)
    fields = [f"{name}={value!r}" for name, value in vars(rule).items()
              if name != "family" and value != getattr(defaults, name)]
    return " ".join([rule.family, *fields])


def rules_table() -> list[str]:
    """One line per op: `namespace.op.overload: family field=value …`, sorted by op: the rule data as it
    is written, which tests/golden/op_rules.txt holds line by line (`pardsl rules` prints rules_in_words)."""
    return sorted(f"{target_name(op)}: {describe(rule)}" for op, rule in RULES.items())


RULES_KEY = """\
How each op may run on one mesh axis: the layouts its inputs may have, and the layout its output then has.
  S(d)      split: each rank holds one slice of the tensor along its dim d
  B         broadcast: every rank holds the whole tensor
  P         partial: every rank holds a tensor of the whole shape, and the true value is their sum
  →         gives: the inputs' layouts on the left, the output's on the right
Every op also takes all its inputs B and gives B; that is not repeated below. An input with another layout
than one a line allows is converted first (a collective that `pardsl explain` shows).
Columns, after the op's name:
  split:    which dims may be split, and where the output is then split
  partial:  whether partial sums pass through the op, with no all-reduce before it:
              all P → P            the op adds, so partial sums add up across the split (sum(a) + sum(b) = sum(a + b))
              one P, others B → P  the op is linear in that input (sum(a) · b = sum(a · b))
              no                   a P input is all-reduced (summed into B) first
  also:     other layouts the op runs under, computed its own way, with what the ranks exchange for it
  needs:    an argument the op must have to run on split inputs at all
  note:     anything else about the op
einsum `ik,kj->ij`: each letter names a dim of an input or of the output. A letter in the output may be
split alike in every input that has it, and the output is split there; a letter summed away (only in the
inputs) may be split alike in every input that has it, and the output is P."""


def _tensor_inputs(op) -> tuple[list[str], bool]:
    """The names of an operator's tensor arguments, in the order the rules number their operands, up to
    a list of tensors (einsum's, cat's, index's indices), whose members take the numbers after; and
    whether there is one."""
    names = []
    for argument in getattr(getattr(op, "_schema", None), "arguments", ()):
        kind = str(argument.type).removeprefix("Optional[")
        if kind.startswith("List[") and "Tensor" in kind:
            return names, True
        if kind.startswith("Tensor"):
            names.append(argument.name)
    return names, False


def _named(positions, names: list[str]) -> str:
    return ", ".join(names[i] if i < len(names) else f"input {i + 1}" for i in positions)


def _takes_a_number(op) -> bool:
    """Whether a number may be among the op's arguments: x + 1 exports as add.Tensor(x, 1)."""
    if op in (aten.add.Tensor, aten.sub.Tensor):
        return True
    return any(str(a.type) in ("float", "int", "Scalar", "number")
               for a in getattr(getattr(op, "_schema", None), "arguments", ()))


_SPLIT_WORDS = {
    "elementwise": "any dim, split alike in every input that has it (a dim of size 1 that broadcasts: B) → S of it",
    "source": "nothing to split in: made the same on every rank, so B only",
    "gather": "the gathered dim stays whole; another dim split alike in self and index, where their sizes "
              "match → S of it",
    "index": "the indexed dims stay whole; the index tensors' dims may be split → S of where they land",
    "project": "takes one result of an op with several: the layout that result has",
    "cut": "the dim it cuts or joins along stays whole (unless it takes all of it); other dims split alike → S of them; "
           "a dim cut into m equal parts may be split in m blocks, S(d, blocks=m), each part → S(d); a projection's "
           "output taken apart by slices into parts of other sizes, in blocks of those sizes, S(d, blocks=[4, 1, 1])",
    "stack": "the inputs' dims split alike → S of them; the new dim stays whole",
    "select": "the selected dim stays whole; other dims split alike → S of them",
    "pad": "the padded dims stay whole; other dims → S of them",
    "expand": "a dim the input has, split → S of it; the dims it is expanded along: the input B",
    "check": "nothing computed (a check that torch.export leaves in the graph): any layout passes",
    "attention": "batch and heads split alike in query, key, value (and mask) → S of them; the sequence and "
                 "head dims whole",
    "recurrent": "the batch only, alike in the input and the states → S of it; time, features and layers "
                 "whole, the weights B",
    "experts": "the tokens → S(0); the hidden dim and the experts whole (but see also)",
    "conv": "batch → S(0); output channels in weight and bias → S of the output's channels (column parallel); input channels in "
            "input and weight → P, the bias added once (row parallel); a spatial dim where each output row "
            "reads only its own input rows → S of it; grouped channels whole",
    "window": "the dims before the spatial ones (batch, channels) → S of them; a spatial dim where each rank's "
              "windows read only its own rows → S of it",
    "batch_norm": "channels, alike in input, weight, bias and running statistics → S(1); in eval also the "
                  "batch and spatial dims",
    "group_norm": "the batch only → S(0)",
    "along": "the dim it runs along stays whole; other dims split alike in every input with that dim at "
             "the same size → S of them",
    "index_put": "the indexed dims of self stay whole; its trailing dims split alike with the values' → S of them",
    "one_hot": "any dim → S of it; the new dim of classes stays whole",
    "histogram": "any dim → P (the ranks' histograms add up)",
    "normalize": "the dim it normalises along stays whole; other dims → S of them",
    "reshape": "a split dim → S of the dim it becomes; dims the view merges or splits non-contiguously stay whole",
    "permute": "any dim → S of where it moves",
    "loss": "the rows with the targets' → S of them with reduction='none', P with 'sum'; the classes whole",
}

_ALSO_WORDS = {
    "attention": "self-attention with the sequence split: query, key, value S(seq) → S(seq), plainly or "
                 "zig-zag, each rank's keys and values sent around the ranks (ring attention)",
    "cross_entropy": "logits split over the classes S(1), targets B → B, each row's max, sum of exps and "
                     "target logit all-gathered (vocabulary parallel); with reduction='mean', rows split → P "
                     "(a count of targets all-reduced) or → B (the sum and the count all-reduced together)",
    "layer_norm": "the normalised dim split, weight and bias alike → S of it, each row's sum and sum of squares "
                  "all-reduced",
    "batch_norm": "in training, the batch or a spatial dim split → S of it, each channel's statistics "
                  "all-reduced (as SyncBatchNorm)",
    "experts": "the intermediate dim split in the expert weights → P (tensor parallel); the experts split with "
               "the tokens → S(0), each token sent to its expert's rank and back by all-to-alls (expert parallel)",
}


def rule_in_words(op, rule: Rule) -> str:
    """One op's rule as `pardsl rules` prints it, in the words RULES_KEY explains."""
    names, listed = _tensor_inputs(op)
    if rule.family in ("einsum", "matmul", "equation"):
        spec = {"matmul": "as mm or bmm, with broadcast batch dims", "equation": "as its own subscripts"}
        split = f"einsum `{rule.spec}`" if rule.family == "einsum" else f"einsum {spec[rule.family]}"
        if names and rule.family == "einsum":
            split += f" over ({', '.join(names)})"
    elif rule.family == "source" and rule.shape_arg is not None:
        split = "nothing to split in: may be made S of any dim, each rank filling its own slice"
    elif rule.family == "reduce":
        split = "dims kept → S of them; " + ("reduced dims stay whole" if rule.unsplittable_reduce else
                                              "a reduced dim split → P (partial sums add up across the split)")
    else:
        split = _SPLIT_WORDS[rule.family]
    if rule.whole_dims:
        split += f"; except dims {', '.join(map(str, rule.whole_dims))}, which stay whole"
    if rule.addends:
        split += (f"; {_named(rule.addends, names)} (added to the result) follows the output: S where it has "
                  "the split dim, B where it broadcasts, P where the output is P")
    if rule.masked_lookup:
        split += "; a split vocabulary is a masked lookup of each rank's rows → P"

    if rule.family == "check":
        partial = "any layout (nothing computed)"
    elif rule.linear == "sum":
        partial = "all P → P (partial sums add up across the split)"
        if rule.family == "elementwise" and _takes_a_number(op):
            partial += ", not with a nonzero number among its arguments (as in x + 1, which every rank would add)"
        if rule.fill_arg is not None:
            partial += ", with a zero fill only"
    elif rule.linear == "product":
        operands = [i for i in rule.linear_operands if i < len(names) or listed]
        which = "any one input" if listed and not names else _named(operands, names) if len(operands) == 1 else \
            "any one of " + _named(operands, names)
        if rule.addends:
            which += f" ({_named(rule.addends, names)} P with it)"
        partial = f"one P, others B → P: {which} (one partial sum times whole values adds up)"
    else:
        partial = "no"

    fields = [f"split: {split}", f"partial: {partial}"]
    also = _ALSO_WORDS.get(rule.parallel_form)
    if rule.parallel_form.endswith("_halo"):
        also = ("a spatial dim split where the windows tile it → S of it, each rank's edge rows sent to its "
                "neighbours (a halo)")
    if rule.joins:
        also = "m inputs of equal size, each S(d) along the joined dim → S(d, blocks=m)"
    if also:
        fields.append(f"also: {also}")
    for position, name, value in rule.requires:
        fields.append(f"needs: {name}={value!r}")
    notes = []
    if rule.mean:
        notes.append("a mean over a split dim is the local sum over the global count")
    if rule.drawn_as:
        notes.append("random: each rank draws the whole tensor as serial does and keeps its part")
    if rule.resized:
        notes.append("the output has another size along the dim it runs along")
    if not rule.differentiable:
        notes.append("no gradient flows through")
    if notes:
        fields.append(f"note: {'; '.join(notes)}")
    return " | ".join(fields)


def rules_in_words() -> list[str]:
    """`pardsl rules`: RULES_KEY's lines, a blank line, then one line per op, sorted by op as rules_table."""
    lines = sorted((target_name(op), rule_in_words(op, rule)) for op, rule in RULES.items())
    width = max(len(name) for name, _ in lines)
    return [*RULES_KEY.splitlines(), "", *(f"{name:<{width}}  {words}" for name, words in lines)]


@dataclass(frozen=True)
class DimSpec:
    """A rule instantiated for one node: letters per operand dim and per output dim."""

    operands: tuple[Letters, ...]
    output: Letters
    linear: str
    linear_operands: tuple[int, ...]
    addends: tuple[int, ...]
    unsplittable: frozenset[str] = frozenset()
    contractible: bool = True  # a split contracted letter gives P (sum-like contraction)
    affine: bool = False  # a non-tensor scalar is added: P cannot pass (x + 1 over P adds n)
    fixed_size: frozenset[str] | None = None  # letters whose dim keeps its size (may carry blocks); None: all
    sums_contraction: bool | None = None  # a split contracted letter gives P; None: when the op is linear
    cut: tuple[str, int] | None = None  # (letter, m): the op cuts that dim into m equal parts
    extra: tuple["Signature", ...] = ()  # signatures the letters cannot express (cat's blocks, a loss's)

    def letters(self) -> list[str]:
        seen: dict[str, None] = {}
        for letters in (*self.operands, self.output):
            for letter in letters:
                if letter is not None:
                    seen.setdefault(letter)
        return list(seen)


@dataclass(frozen=True)
class InnerCollective:
    """A collective a parallel form makes itself, on the axis of its signature: an all-reduce of what it
    counts, or an all-gather of each rank's share (statistics that do not simply add up, such as a max
    with the sum of exps below it)."""

    per_row: int  # values per row of operand 0: per index of its dims other than the split one
    fixed: int = 0  # and values besides
    per_index: tuple[int, int] = (0, 0)  # (dim, n): and n values per index of operand 0's local dim (channels)
    what: str = ""
    phase: str = "forward"  # or backward: the form's autograd function reduces in its backward
    itemsize: int | None = None  # bytes per value when not operand 0's (statistics reduced in float64)
    min_itemsize: int = 0  # at least this many (sums of a half-precision operand reduced in float32)
    kind: str = "all_reduce"  # or all_gather: then each rank contributes these values, and gets everyone's;
    # or send: one message of these values to a neighbour; or all_to_all
    routed: bool = False  # the values sent follow the data (a mixture's routing): these are a balanced one's
    around_the_ring: bool = False  # one send per step around the ring of the axis's ranks: n - 1 of them
    # it travels while the form computes a step (ring attention's keys and values, and backward the sums of
    # their gradients while the next step computes): hidden behind a step's share of the op's forward
    # compute, as far as the machine overlaps the two (a backward step computes more than a forward one)
    beside_its_step: bool = False
    # and this many values per value of operand 0's local shape (other tensors, sized in proportion to it
    # where another axis splits them alike: ring attention's keys and values, by the queries' local shape)
    per_value: float = 0.0

    def values(self, local_shape: tuple[int, ...], placement: Placement) -> int:
        """How many values it reduces, for operand 0 of this local shape and placement on the axis."""
        elements = math.prod(local_shape)
        rows = elements // local_shape[placement.dim] if placement.is_split else elements
        dim, per_index = self.per_index
        return self.per_row * rows + per_index * local_shape[dim] + self.fixed + round(self.per_value * elements)

    def nbytes(self, local_shape: tuple[int, ...], placement: Placement, operand_itemsize: int) -> int:
        return self.values(local_shape, placement) * max(self.itemsize or operand_itemsize, self.min_itemsize)

    def volume(self, local_shape: tuple[int, ...], placement: Placement, operand_itemsize: int, n: int) -> int:
        """Bytes each rank sends for it over n ranks."""
        return collective_bytes(self.kind, self.nbytes(local_shape, placement, operand_itemsize), n)

    def messages(self, n: int) -> int:
        """How many of it the form makes over n ranks (each of `volume`'s bytes)."""
        return n - 1 if self.around_the_ring else 1

    def made(self, input_needs_grad: bool) -> bool:
        """A backward reduction is for the input's gradient: none where the input needs none."""
        return self.phase == "forward" or input_needs_grad


@dataclass(frozen=True)
class Signature:
    """One axis: the placement each operand must have, and the output's."""

    operands: tuple[Placement, ...]
    output: Placement
    split_letter: str | None = None  # which letter is split, if any
    # An extra signature (DimSpec.extra) is computed by the rule's parallel form, which takes the op's own
    # arguments and, as keyword `name`, the axes it is taken on; it declares the all-reduces it makes.
    name: str = ""
    inner_collectives: tuple[InnerCollective, ...] = ()
    # the share of its split of the op's work a rank does in this form (the busiest rank's), where the
    # form leaves some undone: ring attention split zig-zag skips the blocks a causal mask hides
    compute_share: float = 1.0
    # or, under a mask tensor, per query block and key block whether it hides the block whole (the share
    # then depends on the ranks the sequence is split over; attentions under different masks differ)
    hidden_blocks: tuple[tuple[bool, ...], ...] | None = None
    # whether the search should offer its operands' block arrangements to the ops that make them, all the
    # way up (the form is why a zig-zag split is worth making; a loss merely takes one)
    asked_upstream: bool = False

    def share_on(self, ranks: int) -> float:
        """The busiest rank's share of its split of the op's work, the form taken over `ranks` ranks."""
        return self.compute_share if self.hidden_blocks is None else busiest_zigzag_share(self.hidden_blocks, ranks)


def forms_taken(spec: DimSpec, operand_layouts, op_layout) -> dict[int, Signature]:
    """Per mesh axis, the extra signature (a rule's parallel form) the op computes on it, if any."""
    taken = {}
    for axis, output in enumerate(op_layout.placements):
        operands = tuple(layout.placements[axis] for layout in operand_layouts)
        for signature in spec.extra:
            if signature.operands == operands and signature.output == output:
                taken[axis] = signature
    return taken


def compute_share(spec: DimSpec, operand_layouts, op_layout, axis_sizes) -> float:
    """The share of its split of the op's work a rank does: the product, over the axes where the op takes
    a parallel form, of that form's share on that axis's ranks."""
    return math.prod(form.share_on(axis_sizes[axis])
                     for axis, form in forms_taken(spec, operand_layouts, op_layout).items())


def is_tensor_list(node: torch.fx.Node) -> bool:
    """A list of tensors: the result of split, which getitem projects (no collective moves it whole)."""
    value = node.meta.get("val")
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, torch.Tensor) for v in value)


def is_tensor_valued(node: torch.fx.Node) -> bool:
    """A tensor, or a list of tensors (the result of split, projected by getitem)."""
    return isinstance(node.meta.get("val"), torch.Tensor) or is_tensor_list(node)


def tensor_operands(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Tensor operands in argument order (flattened through lists), as rules number them."""
    flat, _ = torch.utils._pytree.tree_flatten((node.args, node.kwargs))
    return [a for a in flat if isinstance(a, torch.fx.Node) and is_tensor_valued(a)]


def op_name(node: torch.fx.Node) -> str:
    """`namespace.op.overload` for an operator (aten.add.Tensor, transformers.grouped_mm.default), the
    module and name of any other callable."""
    return target_name(node.target)


def target_name(target) -> str:
    if hasattr(target, "_schema"):
        return f"{target._schema.name.replace('::', '.')}.{target._overloadname}"
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__name__', target)}"


def functional_overload(target) -> torch._ops.OpOverload | None:
    """aten.add_.Tensor → aten.add.Tensor: the functional op of an in-place one (None if not in-place, or
    if it has no functional twin)."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return None
    namespace, name = schema.name.split("::")
    if not name.endswith("_") or name.startswith("__"):
        return None
    packet = getattr(getattr(torch.ops, namespace), name[:-1], None)
    return getattr(packet, target._overloadname, None) if packet is not None else None


def unmet_requirement(node: torch.fx.Node, rule: Rule) -> str | None:
    """Why this node falls outside what its rule supports (dropout with p > 0), or None."""
    for position, name, value in rule.requires:
        actual = call_arg(node, position, name, value)
        if actual != value:
            return f"{name}={actual!r} (pardsl supports {name}={value!r})"
    return None


# An operator without a row is computed whole: its tensor operands converted to B, the op run alike on
# every rank, its result B. That is right for any operator whose result depends only on its operands,
# which excludes the random ones (tagged nondeterministic_seeded: each rank would draw its own), and it
# costs the gathers of its operands, which lowering's note N005 names.
WHOLE = Rule("whole")


def carries_gradient(dtype: torch.dtype) -> bool:
    """A dtype autograd carries a gradient in: floating point, or complex (an FFT's result)."""
    return dtype.is_floating_point or dtype.is_complex


def is_random(node: torch.fx.Node) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def drawn_ops(graph: torch.fx.Graph) -> frozenset[str]:
    """The graph's ops that draw random numbers."""
    return frozenset(node.name for node in graph.nodes if node.op == "call_function" and is_random(node))


def computes_whole(node: torch.fx.Node) -> bool:
    """An ATen operator without a rule that can be computed whole on every rank: tensor results (one, or
    several that getitem takes), from its operands alone. A random one (stochastic depth's `rand`) too:
    every rank draws the whole tensor from the same generator state, in serial's order, so each draws
    serial's values. Other namespaces' operators (a library's custom ops) may keep state or mutate what
    they are given, which their schema need not say: they stay unsupported (E060)."""
    target = node.target
    return (isinstance(target, torch._ops.OpOverload) and target.namespace == "aten"
            and not target._schema.is_mutable
            and (isinstance(node.meta.get("val"), torch.Tensor) or is_tensor_list(node))
            and sum(len(_shape(o)) for o in tensor_operands(node)) + len(_shape(node)) <= len(_LETTERS))


def is_drawn_whole(node: torch.fx.Node) -> bool:
    """A random operator without a rule (stochastic depth's `rand`): computed whole, each rank drawing
    serial's values. Attention is tagged random for its own dropout, and has a rule."""
    return is_random(node) and rule_for(node) is WHOLE


def rule_for(node: torch.fx.Node) -> Rule | None:
    """The node's rule; an in-place op (what binding leaves of them: updates of graph inputs) has its
    functional op's rule, and computes in place on the local value. An operator without one is WHOLE
    where it can be computed so."""
    rule = RULES.get(node.target)
    if rule is None and functional_overload(node.target) is not None:
        rule = RULES.get(functional_overload(node.target))
    if rule is None and computes_whole(node):
        rule = WHOLE
    return rule


def _shape(node: torch.fx.Node) -> tuple[int, ...]:
    value = node.meta["val"]
    if isinstance(value, (list, tuple)):  # a split: its parts differ only along the dim that stays whole
        value = value[0]
    return tuple(concrete_size(s) for s in value.shape)


def concrete_size(size) -> int:
    """A dim's size: its example size where it is named in the .par file (a SymInt), else the int."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        if hint is None:
            raise ValueError("a size that depends on the data")
        return int(hint)
    return int(size)


def call_arg(node: torch.fx.Node, position: int, name: str, default: Any = None) -> Any:
    """The argument at `position`, or given by keyword: `name`, or the name the operator's schema gives
    that position (flip's and roll's `dims`)."""
    if position < len(node.args):
        return node.args[position]
    if name in node.kwargs:
        return node.kwargs[name]
    arguments = getattr(getattr(node.target, "_schema", None), "arguments", ())
    return node.kwargs.get(arguments[position].name, default) if position < len(arguments) else default


_LETTERS = string.ascii_lowercase + string.ascii_uppercase


def _broadcast_letters(shapes: list[tuple[int, ...]], out_shape: tuple[int, ...], fresh: str) -> list[Letters]:
    """Right-aligned broadcasting: an operand dim of size 1 against a larger output dim gets None."""
    out_letters = tuple(fresh[i] for i in range(len(out_shape)))
    result = []
    for shape in shapes:
        offset = len(out_shape) - len(shape)
        result.append(tuple(
            None if (size == 1 and out_shape[offset + i] != 1) else out_letters[offset + i]
            for i, size in enumerate(shape)
        ))
    return result


def _einsum(spec: str, shapes: list[tuple[int, ...]], out_shape: tuple[int, ...]) -> tuple[list[Letters], Letters]:
    inputs, output = spec.split("->")
    terms = inputs.split(",")
    terms = terms[: len(shapes)]  # optional trailing operands (a bias left out)
    batch_rank = len(out_shape) - len(output.replace("...", ""))
    batch = _LETTERS[-batch_rank:] if batch_rank > 0 else ""
    operand_letters = []
    batch_shapes = []
    for term, shape in zip(terms, shapes):
        if "..." in term:
            explicit = len(term) - 3
            batch_shapes.append(shape[: len(shape) - explicit])
        else:
            batch_shapes.append(None)
    out_batch_shape = out_shape[:batch_rank]
    for term, shape, batch_shape in zip(terms, shapes, batch_shapes):
        if batch_shape is None:
            operand_letters.append(tuple(term))
            continue
        [broadcast] = _broadcast_letters([batch_shape], out_batch_shape, batch)
        operand_letters.append(broadcast + tuple(term.replace("...", "")))
    return operand_letters, tuple(batch) + tuple(output.replace("...", ""))


def _matmul_spec(a_rank: int, b_rank: int) -> str:
    """torch.matmul's cases: 1-D operands lose their dim in the output; batch dims broadcast."""
    a = "...mk" if a_rank >= 2 else "k"
    b = "...kn" if b_rank >= 2 else "k"
    out = "..." + ("m" if a_rank >= 2 else "") + ("n" if b_rank >= 2 else "")
    return f"{a},{b}->{out}"


def _reshape_letters(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> tuple[Letters, Letters, set[str]]:
    """Group dims whose products match; only the leading dims of a group carry a split across it."""
    in_letters: list[str | None] = [None] * len(in_shape)
    out_letters: list[str | None] = [None] * len(out_shape)
    unsplittable: set[str] = set()
    letters = iter(_LETTERS)
    if 0 in in_shape or 0 in out_shape:  # an empty tensor: products cannot group dims, and no split carries
        in_letters = [next(letters) for _ in in_shape]
        out_letters = [next(letters) for _ in out_shape]
        return tuple(in_letters), tuple(out_letters), set(in_letters) | set(out_letters)
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        # size-1 dims carry nothing
        if i < len(in_shape) and in_shape[i] == 1:
            i += 1
            continue
        if j < len(out_shape) and out_shape[j] == 1:
            j += 1
            continue
        if i >= len(in_shape) or j >= len(out_shape):
            break
        group_in, group_out = [i], [j]
        prod_in, prod_out = in_shape[i], out_shape[j]
        i, j = i + 1, j + 1
        while prod_in != prod_out:
            if prod_in < prod_out:
                group_in.append(i)
                prod_in *= in_shape[i]
                i += 1
            else:
                group_out.append(j)
                prod_out *= out_shape[j]
                j += 1
        # Chunks of a group's leading dim are contiguous blocks of the flattened group, on both sides,
        # so the leading dims share a letter; divisibility of each side is checked by Layout.fits.
        lead = next(letters)
        in_letters[group_in[0]] = lead
        out_letters[group_out[0]] = lead
        for k in group_in[1:]:
            in_letters[k] = next(letters)
            unsplittable.add(in_letters[k])
        for k in group_out[1:]:
            out_letters[k] = next(letters)
            unsplittable.add(out_letters[k])
    return tuple(in_letters), tuple(out_letters), unsplittable


def _whole_slice(node: torch.fx.Node) -> bool:
    """aten.slice.Tensor from the start to the end, step 1: the identity, whatever the dim's size."""
    if node.target is not aten.slice.Tensor:
        return False
    start, end, step = (call_arg(node, i, name, default) for i, name, default in
                        ((2, "start", None), (3, "end", None), (4, "step", 1)))
    return start in (None, 0) and (end is None or (isinstance(end, int) and end >= 2 ** 62)) and step == 1


@dataclass
class _Draft:
    """A node's letters as its family's function finds them: what dim_spec makes its DimSpec of."""

    operand_letters: list = field(default_factory=list)
    output: tuple = ()
    unsplittable: set = field(default_factory=set)
    contractible: bool = True
    affine: bool = False
    fixed_size: frozenset | None = None
    cut: tuple | None = None
    sums_contraction: bool | None = None
    extra: tuple = ()


def dim_spec(node: torch.fx.Node, rule: Rule) -> DimSpec:
    """The letters of a node's operands and result under its rule: its family's function
    (_LETTERS_OF_FAMILY) at the node's concrete shapes."""
    operands = tensor_operands(node)
    shapes = [_shape(o) for o in operands]
    out_shape = _shape(node)
    if rule.family == "check":
        return DimSpec((), (), "none", (), ())
    if rule.family == "whole":  # every dim of every tensor its own letter, none ever split: B in, B out
        letters = iter(_LETTERS)
        operand_letters = [tuple(next(letters) for _ in shape) for shape in shapes]
        output = tuple(next(letters) for _ in out_shape)
        return DimSpec(tuple(operand_letters), output, "none", (), (),
                       frozenset(l for ls in (*operand_letters, output) for l in ls))
    draft = _Draft()
    _LETTERS_OF_FAMILY[rule.family](node, rule, shapes, out_shape, draft)
    return DimSpec(tuple(draft.operand_letters), tuple(draft.output), rule.linear, rule.linear_operands,
                   tuple(a for a in rule.addends if a < len(operands)), frozenset(draft.unsplittable),
                   draft.contractible, draft.affine, fixed_size=draft.fixed_size, cut=draft.cut,
                   sums_contraction=draft.sums_contraction, extra=draft.extra)


# One function per rule family: each fills a _Draft with the letters of the node's operands and result,
# the letters no split may take, and the parallel forms (extra signatures) the family offers.


def _letters_products(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    spec = rule.spec if rule.family == "einsum" else _matmul_spec(len(shapes[0]), len(shapes[1]))
    draft.operand_letters, draft.output = _einsum(spec, shapes, out_shape)
    draft.unsplittable |= set(rule.unsplittable)


def _letters_source(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    # an operand (new_ones' self) only lends dtype and device; a constant fill of a given shape may be made
    # split (the same value everywhere), an arange not
    draft.operand_letters, draft.output = [(None,) * len(s) for s in shapes], tuple(_LETTERS[: len(out_shape)])
    if rule.shape_arg is None:
        draft.unsplittable |= set(draft.output)


def _letters_gather(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    index_letters = tuple(_LETTERS[: len(shapes[1])])
    dim = call_arg(node, rule.dim_arg, "dim") % len(shapes[1])
    x_letters = tuple(letter if d != dim and shapes[0][d] == shapes[1][d] else _LETTERS[-1 - d]
                      for d, letter in enumerate(index_letters))
    draft.operand_letters, draft.output = [x_letters, index_letters], index_letters
    draft.unsplittable |= {index_letters[dim]} | (set(x_letters) - set(index_letters))


def _letters_index(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    draft.operand_letters, draft.output, whole = _index_letters(node, shapes, out_shape)
    draft.unsplittable |= whole


def _letters_project(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    draft.operand_letters, draft.output = [tuple(_LETTERS[: len(out_shape)])], tuple(_LETTERS[: len(out_shape)])
    moved = recurrent_state_dims(node)
    if moved is not None:  # a recurrent layer's final state: its batch dim is not the output's
        output_batch, state_batch = moved
        letters = iter("KLMNOPQRSTUVWXYZ")
        draft.operand_letters = [tuple("n" if d == output_batch else next(letters) for d in range(len(shapes[0])))]
        draft.output = tuple("n" if d == state_batch else next(letters) for d in range(len(out_shape)))
        draft.unsplittable |= set(draft.operand_letters[0] + draft.output) - {"n"}


def _letters_cut(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    in_letters = tuple(_LETTERS[: len(shapes[0])])
    dim = call_arg(node, rule.dim_arg, "dim", rule.dim_default) % len(shapes[0])
    if not _whole_slice(node):  # `x[:, None]` exports a slice of all of dim 0: it commutes with a split
        draft.unsplittable.add(in_letters[dim])
    draft.operand_letters, draft.output = [in_letters for _ in shapes], in_letters
    parts = _equal_parts(node, dim, shapes[0][dim]) if node.target is not aten.slice.Tensor else \
        _block_sliced(node, dim, shapes[0][dim])
    draft.cut = (in_letters[dim], parts) if parts else None
    if rule.joins and len(shapes) > 1 and len({shape[dim] for shape in shapes}) == 1:
        # each rank's chunks of the m parts, side by side, are its chunk of each of m blocks
        draft.extra = (Signature(tuple(S(dim) for _ in shapes), S(dim, len(shapes)), in_letters[dim]),)


def _letters_loss(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    in_letters = tuple(_LETTERS[: len(shapes[0])])
    classes, batch = in_letters[1], in_letters[:1] + in_letters[2:]
    draft.operand_letters = [in_letters, batch] + [(classes,)] * (len(shapes) - 2)  # an optional class weight
    draft.unsplittable.add(classes)
    reduction = call_arg(node, rule.dim_arg, "reduction", 1)
    draft.output = batch if reduction == 0 else ()
    if reduction == 1:
        draft.unsplittable |= set(batch)
    draft.sums_contraction = reduction == 2
    if rule.parallel_form and len(shapes) == 2:  # no class weight
        smoothing = call_arg(node, 5, "label_smoothing", 0.0) != 0.0
        # per row, each rank's max, sum of exps below it, target logit (and logit sum) in one all-gather,
        # in float32 at least: every rank combines them alike (Megatron all-reduces the max first, then
        # the sums: two latencies where this takes one, and as many bytes on two ranks)
        draft.extra = (Signature((S(1), B), B, classes, name="classes", inner_collectives=(
            InnerCollective(4 if smoothing else 3, what="max, sum of exps and target logit per row",
                            min_itemsize=4, kind="all_gather"),)),)
        # the rows split plainly, or zig-zag (a sequence's tokens): the same sum, whichever rows a rank holds
        splits = (S, zigzag)
        if reduction == 1:  # the local sum over the global count of counted targets: a partial mean
            # (the count in float32 at least: a half-precision one is exact only up to 256 targets)
            draft.extra += tuple(Signature((split(in_letters.index(letter)), split(batch.index(letter))), P, letter,
                                     name="counts", inner_collectives=(
                                         InnerCollective(0, 1, what="count of targets", min_itemsize=4),))
                           for letter in batch for split in splits)
            # or the mean itself, where it is wanted whole: the local sum and count in one all-reduce
            # (one latency where the partial mean and its all-reduce take two), reduced in float32 at least
            draft.extra += tuple(Signature((split(in_letters.index(letter)), split(batch.index(letter))), B, letter,
                                     name="mean", inner_collectives=(
                                         InnerCollective(0, 2, what="sum and count of targets",
                                                        min_itemsize=4),))
                           for letter in batch for split in splits)


def _letters_pad(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    in_letters = tuple(_LETTERS[: len(shapes[0])])
    amounts = call_arg(node, 1, "pad")  # (before, after) pairs from the last dim backwards
    draft.unsplittable |= {in_letters[-1 - i // 2] for i, amount in enumerate(amounts) if amount}
    draft.operand_letters, draft.output = [in_letters], in_letters
    draft.affine = call_arg(node, rule.fill_arg, "value", 0) not in (None, 0, 0.0)


def _letters_select(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    in_letters = tuple(_LETTERS[: len(shapes[0])])
    dim = call_arg(node, rule.dim_arg, "dim", 0) % len(shapes[0])
    draft.unsplittable.add(in_letters[dim])
    selected = in_letters[:dim] + in_letters[dim + 1:]
    if len(shapes) == 2:  # select_scatter(x, part, dim, index): x with its part at index replaced
        draft.operand_letters, draft.output = [in_letters, selected], in_letters
    else:
        draft.operand_letters, draft.output = [in_letters], selected


def _letters_expand(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    draft.operand_letters = _broadcast_letters(shapes, out_shape, _LETTERS)
    draft.output = tuple(_LETTERS[: len(out_shape)])


def _letters_attention(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    # q [..., h, s, d], k [..., h_kv, t, d], v [..., h_kv, t, e] → [..., h, s, e]; an optional mask
    # broadcasts to [..., h, s, t]. Grouped-query heads split with the query heads: chunk r of the
    # query heads reads chunk r of the key/value heads.
    batch = tuple(_LETTERS[: len(shapes[0]) - 3])
    q, k, v = batch + ("H", "S", "D"), batch + ("H", "T", "D"), batch + ("H", "T", "E")
    draft.operand_letters = [q, k, v]
    if len(shapes) > 3:
        [mask] = _broadcast_letters([shapes[3]], out_shape[:-1] + (shapes[1][-2],), batch + ("H", "S", "T"))
        draft.operand_letters.append(mask)
    draft.output = batch + ("H", "S", "E")
    draft.unsplittable |= {"S", "T", "D", "E"}
    if shapes[0][-2] == shapes[1][-2]:  # self-attention: ring attention over a split sequence
        sequence = len(batch) + 1
        # a mask keeps the query rows it has split like the queries, and every key column
        mask = [S(draft.operand_letters[3].index("S")) if "S" in draft.operand_letters[3] else B] \
            if len(shapes) > 3 else []
        # a message: the rank's keys and values, sized by its queries' local shape (as many rows, batch
        # and heads split alike, grouped-query heads in proportion). Backward passes them around again,
        # and their gradients' sums (float32) after them, each on its way while the next step computes;
        # the last, the sums home, waited for
        per_query = shapes[1][-3] * (shapes[1][-1] + shapes[2][-1]) / (shapes[0][-3] * shapes[0][-1])
        sends = (
            InnerCollective(0, per_value=per_query, what="keys and values to the next rank", kind="send",
                            around_the_ring=True, beside_its_step=True),
            InnerCollective(0, per_value=per_query, what="keys and values to the next rank", kind="send",
                            phase="backward", around_the_ring=True, beside_its_step=True),
            InnerCollective(0, per_value=per_query, what="the keys' and values' gradients summed so far, to the "
                            "next rank", kind="send", phase="backward", itemsize=4, around_the_ring=True,
                            beside_its_step=True),
            InnerCollective(0, per_value=per_query, what="the keys' and values' gradients home", kind="send",
                            phase="backward", itemsize=4))
        # the same, the sequence split zig-zag (rank r of n holding pieces r and 2n - 1 - r): under
        # `is_causal` every rank computes half its blocks, where a plain split leaves the last rank all of
        # its own; a mask tensor's blocks are skipped where it hides them whole, which its ops tell
        zigzag_mask = [zigzag(m.dim) if m.is_split else m for m in mask]
        causal = len(shapes) == 3 and bool(call_arg(node, 5, "is_causal", False))
        hidden = hidden_blocks(call_arg(node, 3, "attn_mask"), shapes[0][-2]) if len(shapes) > 3 else None
        draft.extra = (Signature((S(sequence),) * 3 + tuple(mask), S(sequence), "S", name="ring", inner_collectives=sends),
                       Signature((zigzag(sequence),) * 3 + tuple(zigzag_mask), zigzag(sequence), "S",
                                 name="ring_zigzag", inner_collectives=sends, compute_share=0.5 if causal else 1.0,
                                 hidden_blocks=hidden,
                                 asked_upstream=True))


def _letters_conv(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    # x [n, c, *in], weight [o, c/groups, *kernel], bias [o] → [n, o, *out]; x may lack the batch dim
    # (transposed: weight [c, o/groups, *kernel])
    k = len(shapes[1]) - 2
    batch = ("n",) if len(shapes[0]) == k + 2 else ()
    grouped = call_arg(node, rule.groups_arg, "groups", 1) != 1
    transposed = rule.transposed or (node.target is aten.convolution.default and call_arg(node, 6, "transposed"))
    spatial_in, kernel, spatial_out = list("pqr"[:k]), tuple("uvw"[:k]), list("xyz"[:k])
    weight = ("c", "g") if transposed and grouped else ("c", "o") if transposed else ("o", "g" if grouped else "c")
    halos = _halos(node, shapes[0], out_shape, k, shapes[1][2:], transposed)
    for j, halo in enumerate(halos):
        if halo == (0, 0):  # each output row reads its own input rows: the dim splits as it is
            spatial_out[j] = spatial_in[j]
    draft.operand_letters = [batch + ("c",) + tuple(spatial_in), weight + kernel, ("o",)][: len(shapes)]
    draft.output = batch + ("o",) + tuple(spatial_out)
    draft.unsplittable |= (set(spatial_in + spatial_out) - (set(spatial_in) & set(spatial_out))) | set(kernel) | \
        ({"c", "g", "o"} if grouped else set())
    draft.extra = _halo_signatures(halos, len(batch) + 1, len(shapes))


def _letters_equation(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    equation = call_arg(node, 0, "equation").replace(" ", "")
    inputs, _, output = equation.partition("->")
    terms = inputs.split(",")
    if not _:  # implicit output: the letters used once, in alphabetical order, after the broadcast dims
        counts = {letter: inputs.count(letter) for letter in inputs if letter.isalpha()}
        output = ("..." if "..." in inputs else "") + "".join(sorted(l for l, n in counts.items() if n == 1))
    repeated = any(len(set(t.replace("...", ""))) != len(t.replace("...", "")) for t in terms)
    if repeated or len(terms) != len(shapes) or ("..." in inputs and "..." not in output):
        # diagonals, and broadcast dims summed away: every dim its own letter, none split
        letters = iter(_LETTERS)
        draft.operand_letters = [tuple(next(letters) for _ in shape) for shape in shapes]
        draft.output = tuple(next(letters) for _ in out_shape)
        draft.unsplittable |= {l for ls in (*draft.operand_letters, draft.output) for l in ls}
        return
    # the equation's letters renamed from the start of the alphabet: the broadcast dims take the end
    renamed = {letter: _LETTERS[i] for i, letter in enumerate(dict.fromkeys(c for c in equation if c.isalpha()))}
    spec = "".join(renamed.get(c, c) for c in f"{','.join(terms)}->{output}")
    operand_letters, draft.output = _einsum(spec, shapes, out_shape)
    sizes: dict[str, int] = {}
    for letters, shape in zip(operand_letters, shapes):
        for letter, size in zip(letters, shape):
            if letter is not None:
                sizes[letter] = max(sizes.get(letter, 1), size)
    # a dim of size 1 broadcast against the letter's larger size reads the same values on every rank
    draft.operand_letters = [tuple(None if letter is not None and size == 1 and sizes[letter] > 1 else letter
                                   for letter, size in zip(letters, shape))
                             for letters, shape in zip(operand_letters, shapes)]


def _letters_stack(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    in_letters = tuple(_LETTERS[: len(shapes[0])])
    dim = call_arg(node, rule.dim_arg, "dim", 0) % len(out_shape)
    draft.operand_letters = [in_letters for _ in shapes]
    draft.output = in_letters[:dim] + ("J",) + in_letters[dim:]
    draft.unsplittable.add("J")


def _letters_recurrent(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    # (input, hx, params, has_biases, layers, dropout, train, bidirectional, batch_first): input [t, n, f]
    # ([n, t, f] batch first; [t, f] unbatched), each state [layers × directions, n, h], the weights whole;
    # results: output like the input with features of the hidden size, then the final states
    batched = len(shapes[0]) == 3
    batch_first = batched and call_arg(node, 8, "batch_first", False)
    sequence = ("n", "t", "f") if batch_first else ("t", "n", "f") if batched else ("t", "f")
    states = len(shapes) - 1 - len(call_arg(node, 2, "params"))
    draft.operand_letters = [sequence] + [("l", "n", "h")[-len(shapes[1]):]] * states + \
        [(None,) * len(shape) for shape in shapes[1 + states:]]
    draft.output = sequence[:-1] + ("o",)
    draft.unsplittable |= {"t", "f", "l", "h", "o"}


def _letters_experts(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    # (hidden [t, h], index [t, k], weights [t, k], gate_up [e, i, h] (transposed [e, h, i]), its bias
    # [e, i] or None, down [e, o, i] (transposed [e, i, o]), gate, transposed, ...) -> [t, o]. A split h
    # would sum before the gate, so it stays whole; a split k sums the choices' contributions (P); a split
    # o is each rank's columns of the down projection. The experts (e) split with the tokens, and the
    # intermediate dim (i), by the forms below, which the runtime computes.
    has_bias = node.args[4] is not None
    gate, transposed = node.args[6], node.args[7]
    gate_up, down = (("e", "h", "i"), ("e", "i", "o")) if transposed else (("e", "i", "h"), ("e", "o", "i"))
    draft.operand_letters = [("t", "h"), ("t", "k"), ("t", "k"), gate_up] + [("e", "i")] * has_bias + [down]
    draft.output = ("t", "o")
    draft.unsplittable |= {"e", "h", "i"}
    draft.sums_contraction = True
    # gate and up are the intermediate dim's two halves where concatenated: a split keeps them paired
    halves = 2 if pardsl.runtime.experts.GATES[gate][1] else 1
    weights = [S(gate_up.index("i"), halves)] + [S(1, halves)] * has_bias + [S(down.index("i"))]
    tokens, experts = (S(0), S(0), S(0)), (S(0),) * (2 + has_bias)
    choices, hidden = shapes[1][1], shapes[0][1]
    draft.extra = (
        Signature((B, B, B, *weights), P, "i", name="intermediate"),
        Signature((*tokens, *experts), S(0), "t", name="expert_parallel", inner_collectives=(
            InnerCollective(0, shapes[3][0], what="rows for each expert", itemsize=8, kind="all_to_all"),
            InnerCollective(0, per_index=(0, choices * hidden), what="each (token, choice) pair to its expert's rank",
                            kind="all_to_all", routed=True),
            InnerCollective(0, per_index=(0, choices * out_shape[1]), what="the experts' results back",
                            kind="all_to_all", routed=True),
            InnerCollective(0, per_index=(0, choices * out_shape[1]), what="the results' gradients to the experts",
                            kind="all_to_all", phase="backward", routed=True),
            InnerCollective(0, per_index=(0, choices * hidden), what="the pairs' gradients back", kind="all_to_all",
                            phase="backward", routed=True))),
    )


def recurrent_state_dims(node: torch.fx.Node) -> tuple[int, int] | None:
    """For a final state taken from a recurrent layer's results (getitem i > 0): (the batch dim of the
    layer's output, which the results' layout speaks of, and the state's own batch dim); None otherwise."""
    layer = node.args[0] if node.target is operator.getitem else None
    if not isinstance(layer, torch.fx.Node) or RULES.get(layer.target, WHOLE).family != "recurrent" or \
            node.args[1] == 0 or len(_shape(tensor_operands(layer)[0])) != 3:
        return None
    return (0 if call_arg(layer, 8, "batch_first", False) else 1), 1


def _letters_window(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    rank = len(shapes[0])
    leading = tuple(_LETTERS[: rank - rule.spatial])
    spatial_in, spatial_out = list("pqr"[: rule.spatial]), list("xyz"[: rule.spatial])
    halos = _window_halos(node, rule, shapes[0], out_shape)
    for j, halo in enumerate(halos):
        if halo == (0, 0):
            spatial_out[j] = spatial_in[j]
    draft.operand_letters, draft.output = [leading + tuple(spatial_in)], leading + tuple(spatial_out)
    draft.unsplittable |= set(spatial_in + spatial_out) - (set(spatial_in) & set(spatial_out))
    if rule.parallel_form:
        draft.extra = _halo_signatures(halos, len(leading), 1)


def named_arg(node: torch.fx.Node, name: str, default: Any = None) -> Any:
    """The argument the operator's schema names `name`, given by position or keyword, else `default`."""
    arguments = [argument.name for argument in getattr(getattr(node.target, "_schema", None), "arguments", ())]
    return call_arg(node, arguments.index(name), name, default) if name in arguments else default


def _halo(size: int, out_size: int, kernel: int, stride: int, padding: int, dilation: int) -> tuple[int, int] | None:
    """halo_rows where the windows tile the dim (out_size × stride = size), else None."""
    before, after = halo_rows(kernel, stride, padding, dilation)
    return (before, after) if out_size * stride == size and before >= 0 and after >= 0 else None


def _transposed_halo(size: int, out_size: int, kernel: int, stride: int, padding: int,
                     dilation: int) -> tuple[int, int] | None:
    """transposed_halo_rows where each input row makes `stride` output rows (out_size = size × stride) and
    the kernel covers the stride (no output row is left to the bias alone), else None."""
    reach = dilation * (kernel - 1)
    before, after = transposed_halo_rows(kernel, stride, padding, dilation)
    if out_size != size * stride or reach + 1 < stride or before < 0 or (after - 1) * stride + reach + 1 - padding < 0:
        return None
    return before, after


def _halos(node: torch.fx.Node, in_shape, out_shape, k: int, kernel, transposed: bool = False) -> list:
    """A convolution's halo per spatial dim."""
    padding = named_arg(node, "padding", 0)
    if isinstance(padding, str):  # conv2d.padding's "same" / "valid": not read here
        return [None] * k
    stride, dilation, padding = per_dim(named_arg(node, "stride"), k), per_dim(named_arg(node, "dilation"), k), \
        per_dim(padding, k, 0)
    first = len(in_shape) - k
    halo = _transposed_halo if transposed else _halo
    return [halo(in_shape[first + j], out_shape[first + j], kernel[j], stride[j], padding[j], dilation[j])
            for j in range(k)]


def _window_halos(node: torch.fx.Node, rule: Rule, in_shape, out_shape) -> list:
    """A pool's or resize's halo per spatial dim, by the rule's `window`: a max pool's where its windows
    tile the dim; an average pool's none, where its windows tile the rows exactly without padding (its
    edge windows divide by what they cover); a nearest upsampling's none, by whole factors."""
    k, first = rule.spatial, len(in_shape) - rule.spatial
    if rule.window == "nearest":
        return [(0, 0) if out_shape[first + j] % in_shape[first + j] == 0 else None for j in range(k)]
    if rule.window not in ("max", "average") or named_arg(node, "ceil_mode", False):
        return [None] * k
    kernel = per_dim(named_arg(node, "kernel_size"), k)
    stride = per_dim(named_arg(node, "stride"), k, kernel)
    padding, dilation = per_dim(named_arg(node, "padding", 0), k, 0), per_dim(named_arg(node, "dilation", 1), k)
    halos = [_halo(in_shape[first + j], out_shape[first + j], kernel[j], stride[j], padding[j], dilation[j])
             for j in range(k)]
    return halos if rule.window == "max" else [h if h == (0, 0) and padding[j] == 0 else None
                                               for j, h in enumerate(halos)]


def _halo_signatures(halos: list, first: int, operands: int) -> tuple["Signature", ...]:
    """The spatial splits with a halo: the input split along the dim, the rest B, the output split alike
    (named `halo_<dim>` in the form's call). Each rank sends its last rows to the next rank and its first
    rows to the one before (a ring, so that every rank sends alike; the first and the last drop what
    wraps around), and backward the gradients of the rows it was sent, back to their owners."""
    extra = []
    for j, halo in enumerate(halos):
        if halo is None or halo == (0, 0):
            continue
        dim, (before, after) = first + j, halo
        sends = []
        for phase, what in (("forward", "row(s)"), ("backward", "gradients of row(s)")):
            if before:
                sends.append(InnerCollective(before, what=f"{what}: its last {before} along dim {dim} to the next "
                                             "rank", phase=phase, kind="send"))
            if after:
                sends.append(InnerCollective(after, what=f"{what}: its first {after} along dim {dim} to the rank "
                                             "before", phase=phase, kind="send"))
        extra.append(Signature((S(dim),) + (B,) * (operands - 1), S(dim), None, name=f"halo_{dim}",
                               inner_collectives=tuple(sends)))
    return tuple(extra)


def _letters_norm_over_channels(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    # x [n, c, *spatial]; weight, bias (and batch norm's running mean and variance) [c]
    rank = len(shapes[0])
    x_letters = ("n", "c") + tuple("pqr"[: rank - 2])
    draft.operand_letters, draft.output = [x_letters] + [("c",)] * (len(shapes) - 1), x_letters
    if rule.family == "group_norm":
        draft.unsplittable |= set(x_letters) - {"n"}
    elif call_arg(node, rule.training_arg, "training", False):
        draft.unsplittable |= set(x_letters) - {"c"}
        # per channel (the rank's own, where another axis splits them): the sum and the centered sum of
        # squares, and the count, in float64; backward: the sums of the gradient and of it times x̂
        # A spatial dim split (images split by rows) is reduced alike: the statistics are over every dim
        # but the channels.
        draft.extra = tuple(
            Signature((S(d),) + (B,) * (len(shapes) - 1), S(d), x_letters[d], name="batch", inner_collectives=(
                InnerCollective(0, 0, (1, 2), "batch statistics per channel", itemsize=8),
                InnerCollective(0, 0, (1, 2), "gradient sums per channel", phase="backward")))
            for d in range(rank) if d != 1)
    else:  # eval: running statistics, nothing to reduce
        draft.unsplittable |= set(x_letters) - {"c", "n"}


def _letters_along(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    rank = len(shapes[0])
    x_letters = tuple(_LETTERS[: rank])
    dim = call_arg(node, rule.dim_arg, "dim", rule.dim_default)
    # one dim, or a list of them (flip's, roll's); roll without dims shifts the flattened tensor
    along = set(range(rank)) if dim in ([], ()) else \
        {d % rank for d in (dim if isinstance(dim, (list, tuple)) else [dim])}
    spare = iter("KLMNOPQRSTUVWXYZ")
    draft.operand_letters = [x_letters] + [
        tuple(x_letters[d] if d not in along and len(shape) == rank and shape[d] == shapes[0][d] else next(spare)
              for d in range(len(shape)))
        for shape in shapes[1:]]
    draft.output = tuple("J" if d in along and rule.resized else letter for d, letter in enumerate(x_letters))
    draft.unsplittable |= {x_letters[d] for d in along} | {"J"} | \
        {l for letters in draft.operand_letters for l in letters if l not in x_letters}


def _letters_index_put(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    rank = len(shapes[0])
    x_letters = tuple(_LETTERS[: rank])
    indexed = {d for d, index in enumerate(node.args[1]) if index is not None}
    spare = iter("KLMNOPQRSTUVWXYZ")
    *index_shapes, values_shape = shapes[1:]
    values = [next(spare) for _ in values_shape]
    for back in range(1, min(len(values_shape), rank) + 1):  # right-aligned, as values broadcast
        d = rank - back
        if d in indexed or values_shape[-back] != shapes[0][d]:
            break
        values[-back] = x_letters[d]
    draft.operand_letters = [x_letters] + [tuple(next(spare) for _ in shape) for shape in index_shapes] + \
        [tuple(values)]
    draft.output = x_letters
    draft.unsplittable |= {x_letters[d] for d in indexed} | {l for letters in draft.operand_letters[1:]
                                                             for l in letters if l not in x_letters}


def _letters_one_hot(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    draft.operand_letters = [tuple(_LETTERS[: len(shapes[0])])]
    draft.output = draft.operand_letters[0] + ("J",)
    draft.unsplittable.add("J")


def _letters_histogram(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    draft.operand_letters, draft.output = [tuple(_LETTERS[: len(shapes[0])])], ("J",)
    draft.unsplittable.add("J")
    draft.sums_contraction = True


def _letters_elementwise(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    draft.operand_letters = _broadcast_letters(shapes, out_shape, _LETTERS)
    draft.output = tuple(_LETTERS[: len(out_shape)])
    scalars = [a for a in node.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    draft.affine = rule.linear == "sum" and bool(scalars) and any(s != 0 for s in scalars)
    draft.unsplittable |= {draft.output[d] for d in rule.whole_dims if -len(draft.output) <= d < len(draft.output)}


def _letters_reduce(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    in_letters = tuple(_LETTERS[: len(shapes[0])])
    dims = call_arg(node, rule.dim_arg, "dim") if rule.dim_arg is not None else None
    rank = len(shapes[0])
    reduced = set(range(rank)) if dims in (None, []) else \
        {d % rank for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    keepdim = bool(call_arg(node, rule.keepdim_arg, "keepdim", False)) if rule.keepdim_arg is not None else False
    draft.output = tuple(None if d in reduced else in_letters[d] for d in range(rank)) if keepdim else \
        tuple(in_letters[d] for d in range(rank) if d not in reduced)
    draft.operand_letters = [in_letters]
    if rule.unsplittable_reduce:
        draft.unsplittable |= {in_letters[d] for d in reduced}


def _letters_normalize(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    in_letters = tuple(_LETTERS[: len(shapes[0])])
    rank = len(shapes[0])
    arg = call_arg(node, rule.dim_arg, "dim")
    if isinstance(arg, (list, tuple)):  # layer_norm's normalized_shape: the trailing dims
        normalized = list(range(rank - len(arg), rank))
    else:
        normalized = [arg % rank]
    draft.unsplittable |= {in_letters[d] for d in normalized}
    trailing = tuple(in_letters[d] for d in normalized)
    draft.operand_letters = [in_letters] + [trailing for _ in shapes[1:]]
    draft.output = in_letters
    if rule.parallel_form and len(normalized) == 1:
        # x split along the normalised dim, weight and bias alike: per row, one all-reduce of its sum
        # and sum of squares (float64) forward, one of the gradient's two sums backward
        dim = normalized[0]
        draft.extra = (Signature((S(dim),) + (S(0),) * (len(shapes) - 1), S(dim), trailing[0], name="features",
                           inner_collectives=(
                               InnerCollective(2, what="sum and sum of squares per row", itemsize=8),
                               InnerCollective(2, what="gradient sums per row", phase="backward",
                                              min_itemsize=4))),)


def _letters_reshape(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    in_letters, draft.output, draft.unsplittable = _reshape_letters(shapes[0], out_shape)
    draft.operand_letters = [in_letters]
    draft.contractible = False
    draft.fixed_size = frozenset(l for i, l in enumerate(in_letters)
                           if l is not None and l in draft.output and shapes[0][i] == out_shape[draft.output.index(l)])


def _letters_permute(node: torch.fx.Node, rule: Rule, shapes: list, out_shape: tuple, draft: _Draft) -> None:
    in_letters = tuple(_LETTERS[: len(shapes[0])])
    rank = len(shapes[0])
    if node.target is aten.transpose.int:
        d0, d1 = node.args[1] % rank, node.args[2] % rank
        order = list(range(rank))
        order[d0], order[d1] = order[d1], order[d0]
    elif node.target is aten.t.default:
        order = list(reversed(range(rank)))
    else:
        order = [d % rank for d in node.args[1]]
    draft.operand_letters = [in_letters]
    draft.output = tuple(in_letters[d] for d in order)


_LETTERS_OF_FAMILY = {
    "einsum": _letters_products,
    "matmul": _letters_products,
    "source": _letters_source,
    "gather": _letters_gather,
    "index": _letters_index,
    "project": _letters_project,
    "cut": _letters_cut,
    "loss": _letters_loss,
    "pad": _letters_pad,
    "select": _letters_select,
    "expand": _letters_expand,
    "attention": _letters_attention,
    "equation": _letters_equation,
    "stack": _letters_stack,
    "recurrent": _letters_recurrent,
    "experts": _letters_experts,
    "conv": _letters_conv,
    "window": _letters_window,
    "batch_norm": _letters_norm_over_channels,
    "group_norm": _letters_norm_over_channels,
    "along": _letters_along,
    "index_put": _letters_index_put,
    "one_hot": _letters_one_hot,
    "histogram": _letters_histogram,
    "elementwise": _letters_elementwise,
    "reduce": _letters_reduce,
    "normalize": _letters_normalize,
    "reshape": _letters_reshape,
    "permute": _letters_permute,
}
# every family RULES names has its function (or is one of the two dim_spec answers itself): checked at import
assert {rule.family for rule in RULES.values()} <= set(_LETTERS_OF_FAMILY) | {"check", "whole"}



def _index_letters(node: torch.fx.Node, shapes: list[tuple[int, ...]],
                   out_shape: tuple[int, ...]) -> tuple[list[Letters], Letters, set[str]]:
    """x[i, :, j]: the indexed dims of x are replaced by the index tensors' broadcast shape, in place of
    the first indexed dim when the indexed dims are adjacent, in front otherwise (NumPy's rule)."""
    x_letters = tuple(_LETTERS[: len(shapes[0])])
    indices = list(node.args[1])
    indexed = [d for d, index in enumerate(indices) if index is not None]
    index_shape = tuple(torch.broadcast_shapes(*shapes[1:]))
    index_letters = tuple(_LETTERS[len(_LETTERS) - len(index_shape):])
    kept = [x_letters[d] for d in range(len(x_letters)) if d not in indexed]
    if indexed == list(range(indexed[0], indexed[-1] + 1)):
        output = x_letters[: indexed[0]] + index_letters + x_letters[indexed[-1] + 1:]
    else:
        output = index_letters + tuple(kept)
    whole = {x_letters[d] for d in indexed}  # (a boolean mask's result has a data-dependent shape: E061)
    operand_letters = [x_letters] + _broadcast_letters(shapes[1:], index_shape, index_letters)
    assert len(output) == len(out_shape), (output, out_shape)
    return operand_letters, output, whole


def _equal_parts(node: torch.fx.Node, dim: int, size: int) -> int | None:
    """How many equal parts a split/chunk cuts `dim` into (None: unequal, or not a split)."""
    parts = node.meta.get("val")
    if not isinstance(parts, (list, tuple)) or len(parts) < 2:
        return None
    sizes = {concrete_size(p.shape[dim]) for p in parts}
    return len(parts) if len(sizes) == 1 and size == len(parts) * sizes.pop() else None


def slice_bounds(node: torch.fx.Node, dim: int, size: int) -> tuple[int, int] | None:
    """(start, end) of a slice of `dim`, of `size`, taking a run of it in steps of 1 (`qkv[..., 0:h]`);
    None where a bound is computed, or the slice steps or takes nothing."""
    start, end, step = (call_arg(node, 2, "start"), call_arg(node, 3, "end"), call_arg(node, 4, "step", 1))
    source = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    traced = source.shape[dim] if source is not None and dim < source.dim() else size
    if any(isinstance(v, (torch.SymInt, torch.fx.Node)) for v in (traced, start, end, step)):
        return None  # a named dim's, or a computed bound: no fixed block
    try:
        size, start = concrete_size(size), concrete_size(start if start is not None else 0)
        end = min(concrete_size(end), size) if end is not None else size
    except (TypeError, ValueError):
        return None
    start, end = (start + size if start < 0 else start), (end + size if end < 0 else end)
    if step != 1 or end <= start or start < 0:
        return None
    return start, end


# what a fused projection computes: slices of its output that take it apart, each part once, are its q, k
# and v (Phi-3's qkv_proj), taken from a split in those blocks with nothing moved
_PROJECTIONS = (aten.linear.default, aten.addmm.default, aten.mm.default, aten.matmul.default)


def sliced_in_blocks(source: torch.fx.Node, dim: int) -> int | tuple[int, ...] | None:
    """The blocks the slices that read `source` along `dim` take it apart in, each block once: k where
    they are k equal blocks (Phi-3's q, k and v under multi-head attention), the blocks' sizes in lowest
    terms where they differ (its q, k and v under grouped-query attention: [4, 1, 1]); else None."""
    rank = len(source.meta["val"].shape) if "val" in source.meta else None
    if rank is None:
        return None
    size = source.meta["val"].shape[dim]
    bounds = [slice_bounds(user, dim, size) for user in source.users
              if user.target is aten.slice.Tensor and call_arg(user, 1, "dim", 0) % rank == dim % rank]
    if len(bounds) < 2 or None in bounds:
        return None
    bounds.sort()
    if bounds[0][0] != 0 or bounds[-1][1] != concrete_size(size) or \
            any(end != start for (_, end), (start, _) in zip(bounds, bounds[1:])):
        return None  # they overlap, leave a gap, or take less than the whole
    lengths = tuple(end - start for start, end in bounds)
    return len(lengths) if len(set(lengths)) == 1 else block_sizes(lengths)


def _block_sliced(node: torch.fx.Node, dim: int, size: int) -> int | tuple[int, ...] | None:
    """The blocks a slice's part is one of, as a cut's parts: where the slice reads a projection's output
    features and it and its sibling slices take every block once (sliced_in_blocks). Other slices (a
    rotary table's first positions, a mask's corner) are no part of a fused weight: offering their
    producers splits in blocks would only widen the search."""
    source = node.args[0]
    if not isinstance(source, torch.fx.Node) or source.target not in _PROJECTIONS or \
            dim != len(source.meta["val"].shape) - 1 or slice_bounds(node, dim, size) is None:
        return None
    return sliced_in_blocks(source, dim)


def _placement_for(letters: Letters, letter: str, arrangement: tuple = (1, False)) -> Placement:
    return S(letters.index(letter), *arrangement) if letter in letters else B


def signatures(spec: DimSpec, blocks: dict[str, set[tuple[int, bool]]] | None = None) -> list[Signature]:
    """Every legal one-axis signature of the op, cheapest-looking first (all-B, splits, partials).

    `blocks` offers, per letter, the block arrangements its operands are split in ((k, mirrored):
    S(d, blocks=k), or S(d, zigzag)): a letter kept whole in size carries them through; cutting a dim
    into k equal parts turns S(d, blocks=k) into a plain split of every part. A parallel form taking a
    zig-zag split is offered only where one is: else every attention and loss would widen the search
    by a form nothing feeds.
    """
    blocks = blocks or {}
    n = len(spec.operands)
    result = [Signature((B,) * n, B)]
    splittable = [l for l in spec.letters() if l not in spec.unsplittable]
    plain = (1, False)
    for letter in splittable:
        if letter in spec.output:
            carried = blocks.get(letter, set()) if spec.fixed_size is None or letter in spec.fixed_size else set()
            for arrangement in [plain, *sorted(carried - {plain}, key=arrangement_order)]:
                operands = tuple(_placement_for(letters, letter, arrangement) for letters in spec.operands)
                result.append(Signature(operands, S(spec.output.index(letter), *arrangement), letter))
    if spec.cut is not None:
        letter, parts = spec.cut
        operands = tuple(_placement_for(letters, letter, (parts, False)) for letters in spec.operands)
        result.append(Signature(operands, S(spec.output.index(letter)), letter))
    sums = spec.linear != "none" if spec.sums_contraction is None else spec.sums_contraction
    for letter in splittable:
        if letter not in spec.output and spec.contractible and sums:
            # every operand split alike, in blocks too: each rank sums over the same indices
            for arrangement in [plain, *sorted(blocks.get(letter, set()) - {plain}, key=arrangement_order)]:
                operands = tuple(
                    P if i in spec.addends else _placement_for(letters, letter, arrangement)
                    for i, letters in enumerate(spec.operands)
                )
                result.append(Signature(operands, P, letter))
    if spec.linear == "sum" and not spec.affine:
        result.append(Signature((P,) * n, P))
    elif spec.linear == "product":
        for i in spec.linear_operands:
            if i < n:
                operands = tuple(P if (j == i or j in spec.addends) else B for j in range(n))
                result.append(Signature(operands, P))
    zigzag_offered = any(mirrored for arrangements in blocks.values() for _, mirrored in arrangements)
    return result + [extra for extra in spec.extra
                     if zigzag_offered or not any(p.mirrored for p in (*extra.operands, extra.output))]
