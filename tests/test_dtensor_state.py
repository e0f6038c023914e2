"""pardsl.dtensor_state_dict: every DTensor's full_tensor() is the serial model's value, its placements
follow the layout, and torch.distributed.checkpoint saves and loads the state dict."""

import functools
import os

import pytest
import torch

from tests.launch import REPO

MLP_TP2 = os.path.join(REPO, "examples", "mlp.par")
LLAMA_DP2_TP2 = os.path.join(REPO, "examples", "llama_train_dp2_tp2.par")
GPT_DP2_TP2 = os.path.join(REPO, "examples", "gpt_dp2_tp2.par")  # fused q/k/v: S(0, blocks=3) @ tp

# one dim split by both axes of a 2-D mesh: DTensor's Shard order must be pardsl's chunk order
MLP_BOTH_AXES = """\
mesh   dp = 2, tp = 2
model  examples.models:MLP(d_model=256, d_ff=1024)
input  x : float32[16, 256]

layout {
    x            : [B, B]
    fc1.weight   : S(0) @ dp, S(0) @ tp
    fc1.bias     : S(0) @ dp, S(0) @ tp
    fc2.weight   : S(1) @ dp, S(1) @ tp
    output       : [B, B]
}
"""


def _check(par: str, folder: str | None = None) -> dict:
    """On every rank: the names whose full_tensor() differs from the serial model's value, every
    placement, and (given `folder`) the names a dcp save then load into a zeroed model did not restore."""
    import torch.distributed.checkpoint as dcp

    import pardsl

    torch.manual_seed(0)
    plan = pardsl.load(par)
    model = plan.module()
    state = pardsl.dtensor_state_dict(model)
    torch.manual_seed(0)
    serial = plan._full_state()
    wrong = sorted(name for name, value in state.items() if not torch.equal(value.full_tensor(), serial[name]))
    result = {"names": sorted(state), "serial": sorted(name for name in serial
                                                       if name in state or name in plan.parameter_layouts),
              "wrong": wrong, "placements": {name: [repr(p) for p in value.placements] for name, value in state.items()}}
    if folder is not None:
        before = {name: local.detach().clone() for name, local, _ in model.named_shards()}
        dcp.save(state, checkpoint_id=folder)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.zero_()
        dcp.load(pardsl.dtensor_state_dict(model), checkpoint_id=folder)
        result["not_restored"] = sorted(name for name, local, _ in model.named_shards()
                                        if not torch.equal(local, before[name]))
    return result


def _on_every_rank(pools, world: int, par: str, folder=None) -> list[dict]:
    return pools(world).run_on_every_rank(functools.partial(_check, par, folder))


def test_mlp_tp2_full_tensors_placements_and_dcp(pools, tmp_path):
    results = _on_every_rank(pools, 2, MLP_TP2, str(tmp_path / "dcp"))
    for result in results:
        assert result["wrong"] == []
        assert result["names"] == result["serial"]
        assert result["placements"]["fc1.weight"] == ["Shard(dim=0)"]
        assert result["placements"]["fc2.weight"] == ["Shard(dim=1)"]
        assert result["placements"]["fc2.bias"] == ["Replicate()"]
        assert result["not_restored"] == []


def test_gpt_dp2_tp2_with_blocked_split(pools):
    results = _on_every_rank(pools, 4, GPT_DP2_TP2)
    for result in results:
        assert result["wrong"] == []
        assert result["names"] == result["serial"]
        placements = result["placements"]
        assert placements["h.0.attn.c_attn.weight"] == ["Replicate()", "_StridedShard(dim=0, sf=3)"]
        assert placements["h.0.mlp.c_fc.weight"] == ["Replicate()", "Shard(dim=0)"]


def test_one_dim_split_by_both_axes(pools, tmp_path):
    par = tmp_path / "mlp_both_axes.par"
    par.write_text(MLP_BOTH_AXES)
    for result in _on_every_rank(pools, 4, str(par), str(tmp_path / "dcp")):
        assert result["wrong"] == []
        assert result["placements"]["fc1.weight"] == ["Shard(dim=0)", "Shard(dim=0)"]
        assert result["not_restored"] == []


def test_llama_dp2_tp2_full_tensors_and_dcp(pools, tmp_path):
    for result in _on_every_rank(pools, 4, LLAMA_DP2_TP2, str(tmp_path / "dcp")):
        assert result["wrong"] == []
        assert result["names"] == result["serial"]
        assert result["not_restored"] == []


def test_pipelined_model_is_refused():
    from pardsl.runtime.dtensor_state import dtensor_state_dict

    class Pipelined:
        pipeline = object()

    with pytest.raises(NotImplementedError, match="pipelined"):
        dtensor_state_dict(Pipelined())


def test_zigzag_split_is_refused():
    from pardsl.layouts.algebra import B, Layout, zigzag
    from pardsl.runtime.dtensor_state import dtensor_placements

    with pytest.raises(ValueError, match="rotary.cache.*zig-zag"):
        dtensor_placements("rotary.cache", Layout((B, zigzag(0))))


def test_unequal_blocks_are_refused():
    from pardsl.layouts.algebra import Layout, S
    from pardsl.runtime.dtensor_state import dtensor_placements

    with pytest.raises(ValueError, match="qkv_proj.weight.*unequal sizes"):
        dtensor_placements("qkv_proj.weight", Layout((S(0, (2, 1, 1)),)))
