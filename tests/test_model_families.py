"""Beyond decoder language models: Hugging Face's ResNet (convolutions, batch norm in training, pooling,
in-place ReLU and residual adds), ViT (a conv2d patch projection) and T5 (encoder-decoder, relative
position biases computed with `min` and in-place adds), on 2 and 4 ranks: each communicates exactly as
planned and equals serial — outputs, every gradient, and the batch norms' running statistics."""

import pytest

from pardsl.compiler import compile_file

from .test_distributed import check_example

# Per axis and phase. ResNet, 6 batch norms: over a split batch each reduces its statistics forward and
# its gradient sums backward (SyncBatchNorm); + the loss's count and value forward, 1 gradient bucket.
# Channel parallel: per block, the row-parallel convolution's partial sum forward and the block input's
# gradient backward. ViT and T5: Megatron's 2 per layer and direction (T5's decoder: 3, cross-attention
# included; + the encoder output's gradient, read by every cross-attention).
EXPECTED = {
    "hf_resnet_dp2": {"forward": {"dp:all_reduce": 8}, "backward": {"dp:all_reduce": 7}},
    "hf_resnet_channels_tp2": {"forward": {"tp:all_reduce": 2}, "backward": {"tp:all_reduce": 2}},
    "hf_resnet_dp2_tp2": {"forward": {"dp:all_reduce": 8, "tp:all_reduce": 2},
                          "backward": {"dp:all_reduce": 7, "tp:all_reduce": 2}},
    "hf_vit_tp2": {"forward": {"tp:all_reduce": 4}, "backward": {"tp:all_reduce": 4}},
    "hf_vit_tp4": {"forward": {"tp:all_reduce": 4}, "backward": {"tp:all_reduce": 4}},
    "hf_t5_tp2": {"forward": {"tp:all_reduce": 10}, "backward": {"tp:all_reduce": 11}},
    # the masks (position bias + padding, made whole over dp) are split for the batch: their gradient
    # is gathered back over dp in backward, one per self-attention
    "hf_t5_dp2_tp2": {"forward": {"dp:all_reduce": 2, "tp:all_reduce": 10},
                      "backward": {"dp:all_gather": 4, "dp:all_reduce": 1, "tp:all_reduce": 11}},
}


@pytest.mark.parametrize("example", sorted(EXPECTED))
def test_counts_and_equivalence(pools, example):
    check_example(pools, example, EXPECTED[example], by_axis=True)


def test_resnet_batch_norm_is_synchronised_and_in_place_ops_are_functional():
    source = compile_file("examples/hf_resnet_dp2.par").source
    assert source.count("rt.batch_norm(") == 6 and source.count("batch=('dp',))") == 6
    # relu_ and the residual add_ became their functional ops; only the buffers' counters update in place
    in_place = [line for line in source.splitlines() if "_.Tensor(" in line or "_.default(" in line]
    assert len(in_place) == 6 and all("num_batches_tracked" in line for line in in_place)


def test_resnet_channel_parallel_batch_norm_keeps_its_channels():
    compiled = compile_file("examples/hf_resnet_channels_tp2.par")
    assert "rt.batch_norm(" not in compiled.source  # channels split: per-channel statistics are local
    layouts = {p.name: p.local_shape for p in compiled.program.parameters}
    assert layouts["model.resnet.encoder.stages.0.layers.0.layer.0.normalization.weight"] == (4,)
    assert layouts["model.resnet.encoder.stages.0.layers.0.layer.1.convolution.weight"] == (8, 4, 3, 3)


def test_t5_relative_attention_bias_is_split_by_heads():
    compiled = compile_file("examples/hf_t5_tp2.par")
    shapes = {p.name: p.local_shape for p in compiled.program.parameters}
    assert shapes["model.encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] == (32, 4)
    assert "aten.min.other(" in compiled.source
