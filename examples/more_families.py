"""Hugging Face `transformers` families in small configurations, built from their config classes, for
`benchmarks/families.py`: each is compiled under the layout search and run against serial.

Every factory takes the family's name and keyword overrides of its config; the defaults are small (one
or two layers, hidden 64, 8 heads, vocabulary 128) and turn the families' dropout off where the library
defaults to some (pardsl draws dropout as serial does, which the check would then also compare).
"""

from __future__ import annotations

import logging

import torch
import transformers

logging.getLogger("transformers").setLevel(logging.ERROR)
transformers.logging.set_verbosity_error()

# transformers' mixture-of-experts families, small: (CausalLM's config overrides, the experts' module path
# under each layer), for tests/test_experts.py and benchmarks/moe_families.py
_SMALL_MLA = "q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8"
MOE_FAMILIES = {
    "Mixtral": ("num_local_experts=4, num_experts_per_tok=2, intermediate_size=32", "mlp"),
    "Qwen2Moe": ("num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, "
                 "shared_expert_intermediate_size=32", "mlp"),
    "Qwen3Moe": ("num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32", "mlp"),
    "Olmoe": ("num_experts=4, num_experts_per_tok=2, intermediate_size=32", "mlp"),
    # experts stored transposed, with biases, gate and up interleaved, a clamped SwiGLU
    "GptOss": ('num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=8, '
               'layer_types=["full_attention"]', "mlp"),
    "Jamba": ("num_experts=4, num_experts_per_tok=2, expert_layer_period=1, expert_layer_offset=0, "
              "attn_layer_period=1, attn_layer_offset=0, use_mamba_kernels=False", "feed_forward"),
    # shared experts beside the routed ones, grouped routing; the first layer dense
    "DeepseekV3": ("n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32, "
                   f"first_k_dense_replace=1, num_hidden_layers=2, {_SMALL_MLA}", "mlp"),
}


def moe_plan(family: str, mesh: str, layouts: dict[str, str] | None = None, memory: str = "") -> str:
    """A `.par` file for a MoE family of MOE_FAMILIES on `mesh` (its first axis splitting the batch), with
    its experts' `layouts` written, or `memory <= ...` for the search."""
    experts = f"model.model.layers.*.{MOE_FAMILIES[family][1]}.experts"
    body = "".join(f"  {experts}.{name} : {layout}\n" for name, layout in (layouts or {}).items())
    first = mesh.split("=")[0].split(",")[0].strip()
    return (f'mesh {mesh}\nmodel examples.more_families:CausalLM(family="{family}", {MOE_FAMILIES[family][0]})\n'
            "input input_ids : int64[4, 8] in [0, 64)\n" + (f"memory <= {memory}\n" if memory else "")
            + (f"layout {{\n  input_ids : S(0) @ {first}\n{body}}}\n" if layouts else ""))


SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=8,
             max_position_embeddings=64, attn_implementation="eager")


class CausalLM(torch.nn.Module):
    """A decoder-only family through AutoModelForCausalLM; returns the logits."""

    def __init__(self, family: str, **overrides):
        super().__init__()
        config = getattr(transformers, f"{family}Config")(**{**SMALL, "num_key_value_heads": 8, **overrides})
        self.model = transformers.AutoModelForCausalLM.from_config(config)

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


class Encoder(torch.nn.Module):
    """An encoder family through AutoModel; returns the last hidden states (its pooler gets no gradient)."""

    def __init__(self, family: str, **overrides):
        super().__init__()
        config = getattr(transformers, f"{family}Config")(
            **{**SMALL, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, **overrides})
        self.model = transformers.AutoModel.from_config(config)

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).last_hidden_state


class Seq2Seq(torch.nn.Module):
    """An encoder-decoder family through AutoModelForSeq2SeqLM; returns the logits."""

    def __init__(self, family: str, **overrides):
        super().__init__()
        config = getattr(transformers, f"{family}Config")(**{
            "vocab_size": 128, "d_model": 64, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 8,
            "decoder_attention_heads": 8, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "max_position_embeddings": 64,
            "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0, "attn_implementation": "eager",
            **overrides})
        self.model = transformers.AutoModelForSeq2SeqLM.from_config(config)

    def forward(self, input_ids, decoder_input_ids):
        return self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids, use_cache=False).logits


class ImageClassifier(torch.nn.Module):
    """A vision family through AutoModelForImageClassification (4 labels); returns the logits."""

    def __init__(self, family: str, **overrides):
        super().__init__()
        config = getattr(transformers, f"{family}Config")(**overrides)
        config.num_labels = 4
        self.model = transformers.AutoModelForImageClassification.from_config(config)

    def forward(self, pixel_values):
        return self.model(pixel_values=pixel_values).logits


class Audio(torch.nn.Module):
    """A speech encoder through AutoModel over raw samples; returns the last hidden states."""

    def __init__(self, family: str, **overrides):
        super().__init__()
        config = getattr(transformers, f"{family}Config")(**overrides)
        self.model = transformers.AutoModel.from_config(config)

    def forward(self, input_values):
        return self.model(input_values).last_hidden_state


class Contrastive(torch.nn.Module):
    """CLIP: a text and an image encoder trained by the contrastive loss over the batch's pairs (each
    caption against every image); returns the loss."""

    def __init__(self, hidden: int = 32, heads: int = 4, layers: int = 1, image: int = 32, patch: int = 8):
        super().__init__()
        text = dict(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                    num_attention_heads=heads, max_position_embeddings=16)
        vision = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, image_size=image, patch_size=patch)
        config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=hidden)
        config._attn_implementation = "sdpa"
        self.model = transformers.CLIPModel(config)

    def forward(self, input_ids, pixel_values):
        return self.model(input_ids=input_ids, pixel_values=pixel_values, return_loss=True).loss
