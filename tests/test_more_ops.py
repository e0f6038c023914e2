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


class VmapWindow(nn.Module):
    """Each position the mean of its last 3, by a [seq, seq] mask made with torch.vmap over a function of
    one query and one key position (transformers makes a mask with a custom overlay so)."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device)
        def in_window(q, k):
            return (k <= q) & (q - k < 3)
        mask = torch.vmap(torch.vmap(in_window, in_dims=(None, 0)), in_dims=(0, None))(positions, positions)
        weights = mask.to(x.dtype) / mask.sum(-1, keepdim=True)
        return torch.einsum("qk,bkd->bqd", weights, self.fc(x))


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
    # the trace keeps vmap as functorch's calls, no ATen ops: decomposed into the batched ops it runs
    "vmap_dp": ("VmapWindow", "input x : float32[4, 6, 16]\n", "    x : S(0)\n",
                {"forward": {}, "backward": {"dp:all_reduce": 1}}),
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


class HaloUNet(nn.Module):
    """A U-Net's level: two 3×3 convolutions with batch norm, a 2×2 max pool down, a strided 3×3
    convolution, a nearest upsampling back up, the skip joined, a 1×1 convolution out."""

    def __init__(self, channels: int = 3, width: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, width, 3, padding=1)
        self.norm1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.down = nn.Conv2d(width, width, 3, stride=2, padding=1)
        self.pool_conv = nn.Conv2d(width, width, 5, padding=2)
        self.out = nn.Conv2d(3 * width, channels, 1)

    def forward(self, x):
        skip = F.relu(self.conv2(F.relu(self.norm1(self.conv1(x)))))
        pooled = F.max_pool2d(skip, 2)
        strided = self.down(skip)
        deep = F.relu(self.pool_conv(pooled + strided))
        up = F.interpolate(deep, scale_factor=2, mode="nearest")
        return self.out(torch.cat([up, skip, F.max_pool2d(skip, 3, stride=1, padding=1)], dim=1))


HALO_PINS = "".join(f"    {module}() : S(2)\n" for module in ("conv1", "norm1", "conv2", "down", "pool_conv", "out"))


@pytest.mark.parametrize("ranks, size", [(2, 32), (4, 64)])
def test_an_image_split_by_rows_exchanges_only_its_halos(pools, compile_par, ranks, size):
    """Rows split over sp, each convolution's output kept so: every 3×3 and 5×5 convolution and the 3×3 max
    pool send each neighbour the rows its windows read (one send before and one after, the strided one's
    only after: 9 forward; their gradients back, but the input's, which needs none: 7), batch norm
    reduces its statistics over the rows, the 2×2 pool and the nearest upsampling need nothing; the image
    itself is never gathered. A rank holds 1/ranks of the activations."""
    compiled = compile_par(_par("HaloUNet", f"input x : float32[1, 3, {size}, {size}]\n", "    x : S(2)\n" + HALO_PINS,
                                mesh=f"sp = {ranks}"))
    expected = {"forward": {"sp:all_reduce": 1, "sp:send": 9}, "backward": {"sp:all_reduce": 2, "sp:send": 7}}
    assert _nonzero(compiled.program.collective_counts_by_axis()) == expected
    assert not [c for c in compiled.program.collectives if c.kind == "all_gather"]
    memory = compiled.program.memory()
    assert memory["activations_per_rank"] <= memory["activations_total"] / ranks
    report = check(pools, compiled)
    assert _nonzero(report["collectives_by_axis"]) == expected


def test_the_search_may_split_an_image_by_rows(pools, compile_par):
    compiled = compile_par(_par("HaloUNet", "input x : float32[1, 3, 32, 32]\n", "    x : S(2)\n", mesh="sp = 2")
                           .replace("layout {", "memory <= 40 %\nlayout {"))
    assert "halo_2=('sp',)" in compiled.source
    check(pools, compiled)


@pytest.mark.parametrize("ranks, size", [(2, 16), (4, 32)])
def test_a_transposed_convolution_over_split_rows_exchanges_its_halo(pools, compile_par, ranks, size):
    """The U-Net step's strided convolution down (1 row of the rank before) and transposed convolution up
    (each input row makes 2 output rows; 1 row of each neighbour's reaches a rank's own): 3 sends forward,
    the transposed one's 2 gradients back (the input needs none)."""
    compiled = compile_par(_par("UpsamplingNet", f"input x : float32[1, 4, {size}, {size}]\n",
                                "    x : S(2)\n    down() : S(2)\n    up() : S(2)\n    out() : S(2)\n", mesh=f"sp = {ranks}"))
    expected = {"forward": {"sp:send": 3}, "backward": {"sp:all_reduce": 1, "sp:send": 2}}
    assert _nonzero(compiled.program.collective_counts_by_axis()) == expected
    assert "rt.conv_transpose_halo(" in compiled.source
    check(pools, compiled)


class HaloVolumes(nn.Module):
    """1-D convolutions (5 taps; 3 taps dilated by 2) with a max pool, and a 3-D convolution, for the halo
    of each convolution form."""

    def __init__(self, channels: int = 2):
        super().__init__()
        self.line = nn.Conv1d(channels, channels, 5, padding=2)
        self.dilated = nn.Conv1d(channels, channels, 3, padding=2, dilation=2)
        self.volume = nn.Conv3d(channels, channels, 3, padding=1)

    def forward(self, signal, volume):
        line = F.max_pool1d(F.relu(self.line(signal)), 3, stride=1, padding=1)
        return self.dilated(line), self.volume(volume)


def test_one_and_three_dimensional_convolutions_exchange_their_halos(pools, compile_par):
    """A length split for conv1d (5 taps, and 3 dilated by 2: 2 rows each way) and its max pool (1 each
    way); a depth split for conv3d (1 each way): 2 sends each forward, their gradients back where the
    input needs them (not the signal's and volume's own)."""
    compiled = compile_par(_par("HaloVolumes", "input signal : float32[2, 2, 64]\ninput volume : float32[1, 2, 8, 6, 6]\n",
                                "    signal : S(2)\n    volume : S(2)\n    line() : S(2)\n    dilated() : S(2)\n"
                                "    volume() : S(2)\n", mesh="sp = 2"))
    expected = {"forward": {"sp:send": 8}, "backward": {"sp:all_reduce": 1, "sp:send": 4}}
    assert _nonzero(compiled.program.collective_counts_by_axis()) == expected
    assert compiled.source.count("rt.conv_halo(") == 3 and compiled.source.count("rt.max_pool_halo(") == 1
    check(pools, compiled)
