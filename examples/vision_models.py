"""Vision models as Hugging Face's `transformers` writes them, in small configurations.

`HFResNet` is `ResNetForImageClassification` (convolutions, batch norm in training mode, max and adaptive
average pooling, in-place ReLU and residual adds); `HFViT` is `ViTForImageClassification` (a conv2d patch
projection, then a transformer encoder); `HFSwin` is `SwinForImageClassification` (shifted windows: rolls,
window partitions, patch merging; stochastic depth, a random draw per sample). Each forward returns the logits, or the library's own loss when
labels are given.
"""

from __future__ import annotations

import logging

import torch
import transformers

logging.getLogger("transformers").setLevel(logging.ERROR)
transformers.logging.set_verbosity_error()


class HFResNet(torch.nn.Module):
    """ResNet with basic blocks: a 7×7 stem, max pooling, stages of two 3×3 convolutions per block."""

    def __init__(self, channels: tuple[int, ...] = (8, 16), depths: tuple[int, ...] = (1, 1), stem: int = 8,
                 labels: int = 4, layer_type: str = "basic"):
        super().__init__()
        config = transformers.ResNetConfig(num_channels=3, embedding_size=stem, hidden_sizes=list(channels),
                                           depths=list(depths), layer_type=layer_type, num_labels=labels)
        self.model = transformers.ResNetForImageClassification(config)

    def forward(self, pixel_values, labels=None):
        result = self.model(pixel_values=pixel_values, labels=labels)
        return result.logits if labels is None else result.loss


class HFViT(torch.nn.Module):
    """ViT: 16 patches of 8×8 pixels projected by a conv2d, a class token, pre-norm encoder layers."""

    def __init__(self, layers: int = 2, hidden: int = 64, heads: int = 8, ffn: int = 128, image: int = 32,
                 patch: int = 8, labels: int = 4):
        super().__init__()
        config = transformers.ViTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                        intermediate_size=ffn, image_size=image, patch_size=patch, num_labels=labels,
                                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                        attn_implementation="sdpa")
        self.model = transformers.ViTForImageClassification(config)

    def forward(self, pixel_values, labels=None):
        result = self.model(pixel_values=pixel_values, labels=labels)
        return result.logits if labels is None else result.loss


class HFSwin(torch.nn.Module):
    """Swin: 4×4 patches, two stages of windowed attention (windows of 4×4 patches, shifted in the second
    block), patch merging between them, and stochastic depth at `drop_path` (the library's default 0.1)."""

    def __init__(self, embed: int = 16, depths: tuple[int, ...] = (2, 1), heads: tuple[int, ...] = (2, 4),
                 image: int = 32, patch: int = 4, window: int = 4, labels: int = 4, drop_path: float = 0.1):
        super().__init__()
        config = transformers.SwinConfig(image_size=image, patch_size=patch, embed_dim=embed, depths=list(depths),
                                         num_heads=list(heads), window_size=window, num_labels=labels,
                                         drop_path_rate=drop_path, attn_implementation="eager")
        self.model = transformers.SwinForImageClassification(config)

    def forward(self, pixel_values, labels=None):
        result = self.model(pixel_values=pixel_values, labels=labels)
        return result.logits if labels is None else result.loss
