"""The model factories of the plans in this folder, at their real shapes (built on the meta device by the
compiler). A plan's folder needs a module of its own: examples/scale/models.py says why."""

from __future__ import annotations

import torch
import transformers

from examples.hf_models import gpt2_lm_head, llama_causal_lm

__all__ = ["llama_causal_lm", "gpt2_lm_head", "deepseek_v3_causal_lm"]


def deepseek_v3_causal_lm(layers: int = 61, dense_layers: int = 3, hidden: int = 7168, heads: int = 128,
                          ffn: int = 18432, expert_ffn: int = 2048, experts: int = 256, top_k: int = 8,
                          groups: int = 8, top_groups: int = 4, vocab: int = 129280, positions: int = 4096,
                          dtype: str = "bfloat16") -> transformers.DeepseekV3ForCausalLM:
    """DeepSeek-V3's shape: multi-head latent attention (queries through a rank-1536 projection, keys and
    values through a rank-512 one, 128-dim heads with a 64-dim rotary part), the first `dense_layers`
    layers with a dense MLP, the others 256 routed experts (top 8 of 8 groups, at most 4 groups a token)
    beside one shared expert. Its experts are traced as one op (pardsl/runtime/experts.py)."""
    config = transformers.DeepseekV3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, moe_intermediate_size=expert_ffn,
        num_hidden_layers=layers, first_k_dense_replace=dense_layers, num_attention_heads=heads,
        num_key_value_heads=heads, n_routed_experts=experts, n_shared_experts=1, num_experts_per_tok=top_k,
        n_group=groups, topk_group=top_groups, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=positions, use_cache=False,
        attn_implementation="sdpa")
    # One expert tensor holds all 256 experts (30 GB in float32): more than the compiler's way of building a
    # model, a parameter at a time on the CPU then moved to meta, can hold. So the model is built on meta
    # here, and its buffers made real again: the rotary tables, rebuilt, and the routers' score bias, zeros
    # as the library starts it.
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(config).to(getattr(torch, dtype))
    model.model.rotary_emb = type(model.model.rotary_emb)(config)
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.device.type == "meta":
                module.register_buffer(name, torch.zeros(buffer.shape, dtype=buffer.dtype),
                                       persistent=name in module.state_dict())
    return model
