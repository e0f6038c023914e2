"""Rules for ops that were computed whole on every rank: einsum by its subscripts, stack, transposed
convolutions, and recurrent layers (LSTM, GRU) with the batch split. Each model equals serial under a
written plan and under the search, with the collectives counted, and no op is left without a rule."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from .test_distributed import _nonzero, check


class RecurrentLM(nn.Module):
    """An LSTM language model: embedding, two LSTM layers (batch first), a head; and its final state."""

    def __init__(self, vocab: int = 64, d: int = 16, hidden: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids):
        output, (hidden, cell) = self.lstm(self.embed(ids))
        return self.head(output), hidden.sum(0) + cell.sum(0)


class GRUTagger(nn.Module):
    """A bidirectional GRU over [time, batch, features], time first as torch's default, beside a plain
    RNN (ReLU) over the same sequence."""

    def __init__(self, d: int = 8, hidden: int = 16):
        super().__init__()
        self.gru = nn.GRU(d, hidden, bidirectional=True)
        self.rnn = nn.RNN(d, 2 * hidden, nonlinearity="relu")
        self.tag = nn.Linear(2 * hidden, 4)

    def forward(self, x):
        sequence, state = self.gru(x)
        plain, _ = self.rnn(x)
        return self.tag(sequence + plain), state


class UpsamplingNet(nn.Module):
    """A U-Net's step: down by a strided convolution, up by a transposed one, the skip joined by cat."""

    def __init__(self, channels: int = 4, width: int = 8):
        super().__init__()
        self.down = nn.Conv2d(channels, width, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(width, width, 4, stride=2, padding=1)
        self.out = nn.Conv2d(width + channels, channels, 1)

    def forward(self, x):
        return self.out(torch.cat([F.relu(self.up(F.relu(self.down(x)))), x], dim=1))


class EinsumMixer(nn.Module):
    """Attention written with einsum (research code's way), rotary's interleaved pairs made by stack
    (Cohere's form)."""

    def __init__(self, d: int = 16, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.proj = nn.Linear(d, d)

    @staticmethod
    def _turned(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (linear(x).view(b, s, self.heads, d // self.heads) for linear in (self.q, self.k, self.v))
        q, k = q + 0.5 * self._turned(q), k + 0.5 * self._turned(k)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k).softmax(-1)
        return self.proj(torch.einsum("bhqk,bkhd->bqhd", scores, v).reshape(b, s, d))


def _par(model: str, inputs: str, layouts: str = "", mesh: str = "dp = 2") -> str:
    return f"mesh {mesh}\nmodel tests.test_more_ops:{model}()\n{inputs}" + (f"layout {{\n{layouts}}}\n" if layouts else "")


# Data parallel (the batch split): nothing forward; each model's gradients in one bucket. The U-Net split
# by channels: the strided convolution's output channels (column parallel), which the transposed one
# contracts (row parallel: its partial sum all-reduced once). Einsum attention split by heads: q, k, v
# column parallel, the heads joined by stack still split, the projection row parallel (Megatron's).
CASES = {
    "lstm_dp": ("RecurrentLM", "input ids : int64[4, 6] in [0, 64)\n", "    ids : S(0)\n",
                {"forward": {}, "backward": {"dp:all_reduce": 1}}),
    "gru_dp": ("GRUTagger", "input x : float32[5, 4, 8]\n", "    x : S(1)\n",
               {"forward": {}, "backward": {"dp:all_reduce": 1}}),
    "unet_dp": ("UpsamplingNet", "input x : float32[4, 4, 8, 8]\n", "    x : S(0)\n",
                {"forward": {}, "backward": {"dp:all_reduce": 1}}),
    "unet_channels": ("UpsamplingNet", "input x : float32[2, 4, 8, 8]\n",
                      "    down.weight : S(0)\n    down.bias : S(0)\n    up.weight : S(0)\n",
                      {"forward": {"tp:all_reduce": 1}, "backward": {}}),
    "einsum_dp": ("EinsumMixer", "input x : float32[4, 6, 16]\n", "    x : S(0)\n",
                  {"forward": {}, "backward": {"dp:all_reduce": 1}}),
    "einsum_heads": ("EinsumMixer", "input x : float32[4, 6, 16]\n",
                     "".join(f"    {n}.weight : S(0)\n    {n}.bias : S(0)\n" for n in "qkv") + "    proj.weight : S(1)\n",
                     {"forward": {"tp:all_reduce": 1}, "backward": {}}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_written_plans_equal_serial_with_the_planned_collectives(pools, compile_par, case):
    model, inputs, layouts, expected = CASES[case]
    compiled = compile_par(_par(model, inputs, layouts, mesh="tp = 2" if "weight" in layouts else "dp = 2"))
    assert not [note for note in compiled.program.notes if note.code == "N005"]  # every op has its rule
    assert _nonzero(compiled.program.collective_counts_by_axis()) == expected
    report = check(pools, compiled)
    assert _nonzero(report["collectives_by_axis"]) == expected


@pytest.mark.parametrize("model, inputs", [("RecurrentLM", "input ids : int64[4, 6] in [0, 64)\n"),
                                           ("UpsamplingNet", "input x : float32[4, 4, 8, 8]\n"),
                                           ("EinsumMixer", "input x : float32[4, 6, 16]\n")])
def test_searched_plans_equal_serial(pools, compile_par, model, inputs):
    compiled = compile_par(_par(model, inputs + "memory <= 60 %\n"))
    assert not [note for note in compiled.program.notes if note.code == "N005"]
    check(pools, compiled)
