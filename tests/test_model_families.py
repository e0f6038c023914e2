"""Beyond decoder language models: Hugging Face's ResNet (convolutions, batch norm in training, pooling,
in-place ReLU and residual adds), ViT (a conv2d patch projection), T5 (encoder-decoder, relative
position biases computed with `min` and in-place adds), Mixtral (mixture of experts as the library writes
it, expert parallel) and Qwen2-MoE in pardsl's static capacity form, on 2 and 4 ranks: each communicates exactly as planned and equals
serial — outputs, every gradient, and the batch norms' running statistics."""

import json

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pardsl.model.moe import use_static_capacity

from pardsl.compiler import compile_file

from .test_distributed import check, check_example

# Per axis and phase. ResNet, 6 batch norms: over a split batch each reduces its statistics forward and
# its gradient sums backward (SyncBatchNorm); + the loss's sum and count forward, 1 gradient bucket.
# Channel parallel: per block, the row-parallel convolution's partial sum forward and the block input's
# gradient backward. ViT and T5: Megatron's 2 per layer and direction (T5's decoder: 3, cross-attention
# included; + the encoder output's gradient, read by every cross-attention).
EXPECTED = {
    "hf_resnet_dp2": {"forward": {"dp:all_reduce": 7}, "backward": {"dp:all_reduce": 7}},
    "hf_resnet_channels_tp2": {"forward": {"tp:all_reduce": 2}, "backward": {"tp:all_reduce": 2}},
    "hf_resnet_dp2_tp2": {"forward": {"dp:all_reduce": 7, "tp:all_reduce": 2},
                          "backward": {"dp:all_reduce": 7, "tp:all_reduce": 2}},
    "hf_vit_tp2": {"forward": {"tp:all_reduce": 4}, "backward": {"tp:all_reduce": 4}},
    "hf_vit_tp4": {"forward": {"tp:all_reduce": 4}, "backward": {"tp:all_reduce": 4}},
    "hf_t5_tp2": {"forward": {"tp:all_reduce": 10}, "backward": {"tp:all_reduce": 11}},
    # the masks (position bias + padding, made whole over dp) are split for the batch: their gradient
    # is gathered back over dp in backward, one per self-attention
    "hf_t5_dp2_tp2": {"forward": {"dp:all_reduce": 1, "tp:all_reduce": 10},
                      "backward": {"dp:all_gather": 4, "dp:all_reduce": 1, "tp:all_reduce": 11}},
    # expert parallelism: the counts per expert, then the pairs to their experts' ranks and back, forward;
    # the rows' two exchanges reversed, backward; the replicated weights' gradients in one bucket. In the
    # static capacity form, one all-to-all each way and direction. With tp: Megatron inside attention and
    # every expert.
    "hf_mixtral_ep2": {"forward": {"ep:all_to_all": 3}, "backward": {"ep:all_reduce": 1, "ep:all_to_all": 2}},
    "hf_qwen_moe_ep2": {"forward": {"ep:all_to_all": 2}, "backward": {"ep:all_reduce": 1, "ep:all_to_all": 2}},
    "hf_mixtral_ep2_tp2": {"forward": {"ep:all_to_all": 3, "tp:all_reduce": 2},
                           "backward": {"ep:all_reduce": 1, "ep:all_to_all": 2, "tp:all_reduce": 3}},
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


def test_expert_parallel_all_to_alls_surround_the_experts():
    compiled = compile_file("examples/hf_mixtral_ep2.par")
    exchanges = [c for c in compiled.program.collectives if c.kind == "all_to_all"]
    assert len(exchanges) == 5 and all("mlp.experts" in c.reason for c in exchanges)
    assert [c.routed for c in exchanges] == [False, True, True, True, True]  # the counts' bytes are fixed
    shapes = {p.name: p.local_shape for p in compiled.program.parameters}
    assert shapes["model.model.layers.0.mlp.experts.gate_up_proj"] == (4, 256, 64)  # 4 of 8 experts


def _mixtral(implementation: str) -> transformers.MixtralForCausalLM:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, experts_implementation=implementation)
    return transformers.MixtralForCausalLM(config)


@pytest.mark.parametrize("groups", [1, 4])
def test_static_capacity_form_equals_the_librarys_experts(groups):
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    reference, capacity = _mixtral("eager"), _mixtral("eager")
    use_static_capacity(capacity.config, groups=groups)
    assert capacity.model.layers[0].mlp.experts.config._experts_implementation == "pardsl_capacity"
    expected, got = reference(input_ids=ids).logits, capacity(input_ids=ids).logits
    torch.testing.assert_close(got, expected)
    expected.square().sum().backward()
    got.square().sum().backward()
    for (name, want), have in zip(reference.named_parameters(), capacity.parameters()):
        torch.testing.assert_close(have.grad, want.grad, msg=name)


def test_a_capacity_factor_drops_the_pairs_past_capacity():
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    full, dropping = _mixtral("eager"), _mixtral("eager")
    use_static_capacity(dropping.config, groups=4, capacity_factor=0.5)  # 1 slot per expert and group of 8
    assert not torch.allclose(dropping(input_ids=ids).logits, full(input_ids=ids).logits)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_conv_nets_under_random_plans_equal_serial(pools, compile_par, data):
    """Random conv stacks (batch or group norm, in-place ReLU and residuals, pools) with the batch split,
    output channels split (column parallel), or input channels split (row parallel)."""
    depth = data.draw(st.integers(1, 3), label="depth")
    widths = [3] + [data.draw(st.sampled_from([4, 8]), label=f"width {i}") for i in range(depth)]
    kernels = [data.draw(st.sampled_from([1, 3]), label=f"kernel {i}") for i in range(depth)]
    strides = [data.draw(st.sampled_from([1, 2]), label=f"stride {i}") for i in range(depth)]
    norms = [data.draw(st.sampled_from(["batch", "group"]), label=f"norm {i}") for i in range(depth)]
    pools_ = [data.draw(st.sampled_from(["max", "avg", "none"]), label=f"pool {i}") for i in range(depth)]
    layouts = ["x : S(0)"] if data.draw(st.booleans(), label="batch split") else []
    for i in range(depth):
        split = data.draw(st.sampled_from(["B", "S(0)", "S(1)"] if i else ["B", "S(0)"]), label=f"conv {i} weight")
        layouts.append(f"convs.{i}.weight : {split}")
    model = (f"tests.zoo:ConvNet(widths={widths}, kernels={kernels}, strides={strides}, norms={json.dumps(norms)}, "
             f"pools={json.dumps(pools_)})")
    text = f"mesh tp = 2\nmodel {model}\ninput x : float32[4, 3, 16, 16]\nlayout {{\n" + \
        "".join(f"  {line}\n" for line in layouts) + "}\n"
    check(pools, compile_par(text))


def test_expert_parallel_with_dropped_tokens_equals_serial(pools, compile_par):
    """With a capacity factor, pairs past an expert's capacity are dropped; the compiled module drops the
    same ones (slots are given in token order within each group, and groups stay whole on a rank)."""
    compiled = compile_par('mesh ep = 2\nmodel examples.hf_models:HFMoE(family="Mixtral", groups=4, '
                           'capacity_factor=1.0)\ninput input_ids : int64[4, 8] in [0, 128)\nlayout {\n'
                           '  input_ids : S(0)\n  model.model.layers.*.mlp.experts.gate_up_proj : S(0)\n'
                           '  model.model.layers.*.mlp.experts.down_proj : S(0)\n}\n')
    report = check(pools, compiled)
    assert report["collectives"]["forward"]["all_to_all"] == 2
