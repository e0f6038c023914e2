"""Machines with nodes: presets and machine files, each mesh axis priced on the links its ranks cross (ranks
laid out as torch's DeviceMesh lays them, the last axis innermost), and explain saying which."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from pardsl.layouts.algebra import Mesh
from pardsl.planning.cost import PRESETS, CalibrationError, load_machine, machine_named

from .conftest import REPO

H100 = PRESETS["h100-nvlink-ib"]
FLAT = dataclasses.replace(H100, ranks_per_node=0, between_nodes=None)
GIB = 1 << 30

MEGATRON = ["self_attn.q_proj.weight : S(0)", "self_attn.k_proj.weight : S(0)", "self_attn.v_proj.weight : S(0)",
            "self_attn.o_proj.weight : S(1)", "mlp.gate_proj.weight : S(0)", "mlp.up_proj.weight : S(0)",
            "mlp.down_proj.weight : S(1)"]


def megatron_on(tp: str, dp: str) -> str:
    """A small LLaMA on an 8 × 8 mesh: Megatron tensor parallelism on `tp`, the batch split over `dp`."""
    lines = [f"    input_ids : S(0) @ {dp}"] + [f"    model.layers.*.{entry} @ {tp}" for entry in MEGATRON]
    return ("mesh   outer = 8, inner = 8\n"
            "model  examples.hf_models:llama_causal_lm(layers=2, hidden=512, heads=8, kv_heads=8, ffn=1024, "
            "vocab=512, positions=256)\n"
            "input  input_ids : int64[64, 256] in [0, 512)\n\nlayout {\n" + "\n".join(lines) + "\n}\n")


def test_presets_load_by_name_and_an_unknown_name_says_which_there_are():
    assert machine_named("h100-nvlink-ib") is H100
    assert (H100.ranks_per_node, H100.backend, round(H100.device_memory_bytes / GIB, 1)) == (8, "nccl", 79.2)
    assert machine_named("a100-nvlink-ib").between_nodes["all_reduce"].beta_s_per_byte > \
        H100.between_nodes["all_reduce"].beta_s_per_byte
    assert machine_named("cpu-gloo").backend == "gloo"
    with pytest.raises(CalibrationError, match="a100-nvlink-ib, cpu-gloo, h100-nvlink-ib"):
        machine_named("h200-cluster")


def test_an_axis_inside_a_node_and_one_across_nodes_are_priced_apart():
    mesh = Mesh(("dp", "tp"), (8, 8))
    assert [mesh.axis_stride(a) for a in range(2)] == [8, 1]
    assert H100.span(8, 8) == (1, 8) and H100.span(8, 1) == (8, 1)
    across = H100.collective_seconds("all_gather", GIB, 8, mesh.axis_stride(0))
    inside = H100.collective_seconds("all_gather", GIB, 8, mesh.axis_stride(1))
    assert across / inside == pytest.approx(3.6e11 / 4.2e10, rel=0.01)  # the bandwidths' ratio, at this size
    assert FLAT.collective_seconds("all_gather", GIB, 8, 8) == pytest.approx(inside)
    # 16 ranks in 2 nodes: the all-reduce inside the nodes, then a share between them, then inside again
    whole = 2 * GIB * 15 / 16
    between = H100.between_nodes["all_reduce"]
    ring_between = between.alpha_s * 30 + between.beta_s_per_byte * whole
    assert H100.span(16, 1) == (8, 2)
    assert H100.collective_seconds("all_reduce", whole, 16, 1) < 0.2 * ring_between
    assert H100.axis_link(mesh, 0) == "between nodes (8 nodes, one rank in each)"
    assert H100.axis_link(mesh, 1) == "inside a node"


def test_tensor_parallelism_across_nodes_is_rated_slower_than_inside_one(compile_par):
    from pardsl.planning.cost import estimate

    outer = compile_par(megatron_on("outer", "inner"), "outer.par")
    inner = compile_par(megatron_on("inner", "outer"), "inner.par")
    on_nodes = [estimate(c, H100).step_s for c in (outer, inner)]
    flat = [estimate(c, FLAT).step_s for c in (outer, inner)]
    assert on_nodes[0] > 1.25 * on_nodes[1]  # the activations' collectives over InfiniBand
    assert flat[0] == pytest.approx(flat[1], rel=0.02)  # a flat machine cannot tell the two apart


def test_a_machine_file_with_nodes_loads_as_it_was_written(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(H100.to_json()))
    loaded = load_machine(str(path), "nccl")
    assert (loaded.ranks_per_node, loaded.between_nodes, loaded.device_memory_bytes, loaded.half_flops_per_s) == \
        (8, H100.between_nodes, H100.device_memory_bytes, H100.half_flops_per_s)
    broken = H100.to_json()
    del broken["between_nodes"]["all_to_all"]
    path.write_text(json.dumps(broken))
    with pytest.raises(CalibrationError, match="between_nodes"):
        load_machine(str(path), "nccl")


def test_explain_says_which_links_each_axis_crosses(tmp_path, capsys):
    from pardsl import cli

    path = tmp_path / "plan.par"
    path.write_text(megatron_on("inner", "outer"))
    os.chdir(REPO)
    assert cli.main(["explain", str(path), "--machine", "h100-nvlink-ib"]) == 0  # as the command runs it
    assert "nodes of 8 ranks: outer (8 ranks) between nodes (8 nodes, one rank in each); inner (8 ranks) " \
           "inside a node" in capsys.readouterr().out
    unknown = subprocess.run([sys.executable, "-m", "pardsl.cli", "explain", str(path), "--machine", "tpu-pod"],
                             capture_output=True, text=True, cwd=REPO, timeout=300)
    assert unknown.returncode == 2 and "no machine named 'tpu-pod'" in unknown.stderr


def test_load_takes_a_machine_by_name(tmp_path):
    import pardsl

    path = tmp_path / "plan.par"
    path.write_text(megatron_on("inner", "outer"))
    with pytest.raises(CalibrationError, match="no machine named 'tpu-pod'"):
        pardsl.load(str(path), machine="tpu-pod")
    plan = pardsl.load(str(path), machine="h100-nvlink-ib")
    assert plan.mesh.size == 64
