"""Hugging Face `transformers` models as their library writes them, in small configurations.

Each factory builds the library's own class (GPT2LMHeadModel, LlamaForCausalLM, BertModel) from a
config, with dropout 0 unless asked (GPT-2's `dropout`: pardsl draws serial's masks, so runs with it
compare too), and returns a module whose forward
takes tensors and returns one tensor: what `pardsl` traces with `torch.export`. `attention` picks the
library's attention code: "sdpa" (scaled_dot_product_attention with a boolean mask) or "eager"
(matmul, the mask applied with where/masked_fill, softmax).
"""

from __future__ import annotations

import logging

import torch
import transformers

# A tiny vocabulary makes the config warn about GPT-2's special token ids; they are never used here.
logging.getLogger("transformers").setLevel(logging.ERROR)
transformers.logging.set_verbosity_error()


class HFGPT2(torch.nn.Module):
    """GPT-2: learned positions, fused QKV in a Conv1D (weight [in, 3·out]), tied LM head."""

    def __init__(self, layers: int = 2, hidden: int = 64, heads: int = 8, vocab: int = 256, positions: int = 64,
                 attention: str = "sdpa", dropout: float = 0.0):
        super().__init__()
        # `dropout`: GPT-2's residual, embedding and attention dropout (the library's default is 0.1)
        config = transformers.GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=hidden, n_layer=layers,
                                         n_head=heads, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                         bos_token_id=0, eos_token_id=0, attn_implementation=attention)
        self.model = transformers.GPT2LMHeadModel(config)

    def forward(self, input_ids, labels=None):
        """The logits; or, given labels, the library's own causal-LM loss (mean over predicted tokens)."""
        result = self.model(input_ids=input_ids, labels=labels, use_cache=False)
        return result.logits if labels is None else result.loss


class HFLlama(torch.nn.Module):
    """LLaMA: RMSNorm, rotary embeddings (computed under no_grad), SwiGLU, grouped-query attention."""

    def __init__(self, layers: int = 2, hidden: int = 64, heads: int = 8, kv_heads: int = 4, ffn: int = 128,
                 vocab: int = 256, positions: int = 64, attention: str = "sdpa"):
        super().__init__()
        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                          num_hidden_layers=layers, num_attention_heads=heads,
                                          num_key_value_heads=kv_heads, max_position_embeddings=positions,
                                          attn_implementation=attention)
        self.model = transformers.LlamaForCausalLM(config)

    def forward(self, input_ids, labels=None):
        """The logits; or, given labels, the library's own causal-LM loss (mean over predicted tokens)."""
        result = self.model(input_ids=input_ids, labels=labels, use_cache=False)
        return result.logits if labels is None else result.loss


class HFBert(torch.nn.Module):
    """BERT: token type and position embeddings, an encoder with a padding mask, the pooler."""

    def __init__(self, layers: int = 2, hidden: int = 64, heads: int = 8, ffn: int = 128, vocab: int = 256,
                 positions: int = 64, attention: str = "sdpa"):
        super().__init__()
        config = transformers.BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                         num_attention_heads=heads, intermediate_size=ffn,
                                         max_position_embeddings=positions, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0, attn_implementation=attention)
        self.model = transformers.BertModel(config)

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).pooler_output


class HFT5(torch.nn.Module):
    """T5: an encoder and a decoder with cross-attention, relative position biases (an embedding of
    buckets × heads, computed with `min` and in-place adds), RMS-style layer norm, a tied LM head."""

    def __init__(self, layers: int = 2, hidden: int = 64, heads: int = 8, head_dim: int = 8, ffn: int = 128,
                 vocab: int = 256):
        super().__init__()
        config = transformers.T5Config(vocab_size=vocab, d_model=hidden, d_kv=head_dim, d_ff=ffn, num_layers=layers,
                                       num_decoder_layers=layers, num_heads=heads, dropout_rate=0.0,
                                       decoder_start_token_id=0, pad_token_id=0, use_cache=False)
        self.model = transformers.T5ForConditionalGeneration(config)

    def forward(self, input_ids, decoder_input_ids, labels=None):
        result = self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids, labels=labels,
                            use_cache=False)
        return result.logits if labels is None else result.loss


class HFWhisper(torch.nn.Module):
    """Whisper: a two-convolution front end over mel features, an encoder whose sinusoidal positions are a
    frozen parameter, and a decoder with cross-attention; returns the logits."""

    def __init__(self, layers: int = 1, hidden: int = 64, heads: int = 8, ffn: int = 128, vocab: int = 128,
                 mel_bins: int = 16, frames: int = 32, positions: int = 32):
        super().__init__()
        config = transformers.WhisperConfig(
            vocab_size=vocab, d_model=hidden, encoder_layers=layers, decoder_layers=layers,
            encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn,
            num_mel_bins=mel_bins, max_source_positions=frames // 2, max_target_positions=positions,
            pad_token_id=0, decoder_start_token_id=1, bos_token_id=1, eos_token_id=2, attn_implementation="eager")
        self.model = transformers.WhisperForConditionalGeneration(config)

    def forward(self, input_features, decoder_input_ids):
        return self.model(input_features=input_features, decoder_input_ids=decoder_input_ids, use_cache=False).logits


class HFCausalLM(torch.nn.Module):
    """Any of transformers' decoder-only families (Mistral, Qwen2, Qwen3, Gemma, Olmo, StableLm, Phi,
    GPTNeoX, ...) built from its config class with a small shape, through AutoModelForCausalLM."""

    def __init__(self, family: str = "Mistral", layers: int = 1, hidden: int = 64, heads: int = 8,
                 kv_heads: int = 4, ffn: int = 128, vocab: int = 128, positions: int = 64, attention: str = "sdpa"):
        super().__init__()
        config = getattr(transformers, f"{family}Config")(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=positions,
            attn_implementation=attention)
        self.model = transformers.AutoModelForCausalLM.from_config(config)

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


class HFMoE(torch.nn.Module):
    """A transformers mixture-of-experts family (Mixtral, Qwen2Moe, ...) whose experts compute in pardsl's
    static capacity form (pardsl.moe): the tokens in `groups` groups, each expert with a slot per token of
    a group, so nothing is dropped and the layer equals the library's own; or, with `capacity_factor`,
    fewer slots, dropping the (token, choice) pairs past them as GShard does."""

    def __init__(self, family: str = "Mixtral", layers: int = 1, hidden: int = 32, heads: int = 4, kv_heads: int = 2,
                 ffn: int = 64, experts: int = 4, top_k: int = 2, vocab: int = 128, positions: int = 64,
                 groups: int = 4, capacity_factor: float | None = None):
        super().__init__()
        from pardsl.model.moe import use_static_capacity

        config = getattr(transformers, f"{family}Config")(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=positions,
            num_local_experts=experts, num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=ffn,
            shared_expert_intermediate_size=ffn,
            attn_implementation="sdpa")
        self.model = transformers.AutoModelForCausalLM.from_config(use_static_capacity(config, groups, capacity_factor))

    def forward(self, input_ids, labels=None):
        result = self.model(input_ids=input_ids, labels=labels, use_cache=False)
        return result.logits if labels is None else result.loss


# Hugging Face's classes as they are, for training through pardsl's API: the forward is the library's own
# (input_ids, labels, attention_mask, ...), and the output its ModelOutput (out.loss, out.logits). The
# key-value cache is off: a training step has none to return.

def llama_causal_lm(layers: int = 2, hidden: int = 64, heads: int = 8, kv_heads: int = 4, ffn: int = 128,
                    vocab: int = 256, positions: int = 128, dtype: str = "float32") -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, max_position_embeddings=positions,
                                      use_cache=False, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).to(getattr(torch, dtype))


def gpt2_lm_head(layers: int = 2, hidden: int = 64, heads: int = 8, vocab: int = 256, positions: int = 128,
                 dtype: str = "float32", attention: str = "sdpa", dropout: float = 0.0) -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=hidden, n_layer=layers,
                                     n_head=heads, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                     bos_token_id=0, eos_token_id=0, use_cache=False, attn_implementation=attention)
    return transformers.GPT2LMHeadModel(config).to(getattr(torch, dtype))
