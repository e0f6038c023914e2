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
