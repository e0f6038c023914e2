"""A rank's measured memory (pardsl/tools/memory.py): what a step makes on top of what it held, views and
in-place writes not counted twice; and the plan's estimate of it."""

import json
import os
import subprocess
import sys

import pytest
import torch

from pardsl.tools.memory import held_bytes, peak_measured, peak_so_far

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_cpu_peak_counts_what_a_step_makes_and_not_its_views():
    x = torch.ones(1024)  # 4 KiB, held as the step begins
    with peak_measured(torch.device("cpu"), held_bytes([x, x[:10]])) as peak:
        y = x * 2  # 4 KiB made
        z = y.view(32, 32).t()  # a view: nothing made
        z.mul_(3)  # in place: nothing made
        del y, z
        w = torch.empty(2048)  # 8 KiB made, once the 4 KiB are freed
        del w
    assert peak == [4096 + 8192]


def test_what_a_step_made_and_still_holds_is_counted_apart_from_its_peak():
    x = torch.ones(1024)
    with peak_so_far(torch.device("cpu"), held_bytes([x])) as measure:
        y = x * 2  # 4 KiB made and held
        z = torch.empty(2048)  # 8 KiB made, then freed
        del z
        assert measure.made_and_held() == 4096
        del y
        assert measure.made_and_held() == 0
        assert measure() == 4096 + 4096 + 8192


LLAMA = """mesh   {mesh}
model  examples.hf_models:HFLlama(layers=4, hidden=128, heads=8, kv_heads=4, ffn=336, positions=256, attention="eager")
input  input_ids : int64[4, 256] in [0, 256)
{recompute}
layout {{
{layouts}
}}
"""
ZERO3 = ["input_ids : S(0)", "model.model.embed_tokens.weight : S(0)", "model.lm_head.weight : S(0)"] + \
    [f"model.model.layers.*.{w}.weight : S(0)" for w in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                         "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                         "mlp.down_proj")]
MEGATRON_SP = [f"model.model.layers.*.self_attn.{p}_proj.weight : S(0)" for p in "qkv"] + \
    ["model.model.layers.*.self_attn.o_proj.weight : S(1)", "model.model.layers.*.mlp.gate_proj.weight : S(0)",
     "model.model.layers.*.mlp.up_proj.weight : S(0)", "model.model.layers.*.mlp.down_proj.weight : S(1)",
     "model.model.embed_tokens() : S(1)", "model.model.layers.*.self_attn() : S(1)",
     "model.model.layers.*.mlp() : S(1)", "model.model.norm() : S(1)", "model.lm_head.weight : S(0)", "output : S(2)"]


@pytest.mark.parametrize("mesh, layouts, recompute", [
    # data parallelism alone is left to make test-slow: ZeRO-3's case below recomputes the same layers
    pytest.param("dp = 2", ["input_ids : S(0)"], "recompute model.model.layers.*", marks=pytest.mark.slow),
    # ZeRO-3 without recomputation is left to make test-slow: its sibling below recomputes the same plan
    pytest.param("dp = 2", ZERO3, "", marks=pytest.mark.slow),
    ("dp = 2", ZERO3, "recompute model.model.layers.*"),
    ("tp = 2", MEGATRON_SP, "recompute model.model.layers.* : selective"),
])
def test_the_estimated_peak_is_within_15_percent_of_the_measured_one(tmp_path, mesh, layouts, recompute):
    """The estimate walks backward: gradients arrive as activations (and weights kept gathered) leave, a
    recomputed layer's activations are made again one at a time, bucket buffers hold gradients. Against
    each rank's measured peak under `pardsl run` (2 fresh ranks: the CPU transport's buffers are made in
    the step measured and count for the rank that owns them): data parallelism with recomputation,
    ZeRO-3 with and without, Megatron-SP with selective recomputation."""
    path = tmp_path / "plan.par"
    path.write_text(LLAMA.format(mesh=mesh, recompute=recompute, layouts="\n".join(f"    {e}" for e in layouts)))
    result = subprocess.run([sys.executable, "-m", "pardsl.cli", "run", str(path), "--nproc", "2", "--steps", "1",
                             "--json", "--optimizer", "sgd", "--timeout", "120"],
                            capture_output=True, text=True, cwd=REPO, timeout=300, env={**os.environ, "PYTHONPATH": REPO})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"], report
    estimated = report["memory"]["estimated_bytes"]
    for peak in report["memory"]["peak_bytes"]:
        assert 0.85 <= estimated / peak <= 1.15, (estimated, report["memory"])
