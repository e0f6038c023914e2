"""Models the example .par files name. Written as people write them: plain nn.Modules."""

import torch
from torch import nn
from torch.nn import functional as F


class MLP(nn.Module):
    """The transformer MLP block: up-projection, GELU, down-projection."""

    def __init__(self, d_model: int = 256, d_ff: int = 1024):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class ResidualMLP(nn.Module):
    """A pre-norm residual MLP block followed by a classifier head: LayerNorm, softmax, residuals."""

    def __init__(self, d_model: int = 128, d_ff: int = 512, n_classes: int = 16):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.up = nn.Linear(d_model, d_ff)
        self.down = nn.Linear(d_ff, d_model)
        self.head = nn.Linear(d_model, n_classes, bias=False)

    def forward(self, x):
        h = x + self.down(torch.relu(self.up(self.norm(x))))
        return torch.log_softmax(self.head(h), dim=-1)


class DeepMLP(nn.Module):
    """A stack of `depth` MLP blocks with residual connections (for compile-time benchmarks)."""

    def __init__(self, depth: int = 64, d_model: int = 64, d_ff: int = 256):
        super().__init__()
        self.blocks = nn.ModuleList(MLP(d_model, d_ff) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


class TransformerLayer(nn.Module):
    """One pre-norm transformer layer on hidden states [batch, seq, d_model]: attention, then MLP."""

    def __init__(self, d_model: int = 32, n_head: int = 4, d_ff: int = 128):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d_model)
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.o = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, d_ff)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln_1(x)
        q, k, v = (proj(h).view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln_2(x))
