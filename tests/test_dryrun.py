"""`pardsl dryrun`: one rank's program at its real shapes in one process, collectives answered by torch's
fake process group; its measured peak beside the estimate, its collectives against the plan's, and the
refusals (a plan over the machine's device memory, a rank off the mesh); a pipelined plan's rank runs its
stages alone, with the micro-batches its schedule holds."""

import contextlib
import io
import json
import os
import subprocess

from pardsl import cli
from pardsl.planning.cost import PRESETS

from .conftest import REPO
from .test_machines import megatron_on


def dryrun(path, *arguments: str) -> subprocess.CompletedProcess:
    """`pardsl dryrun` in this process, as the command line runs it: the worker has torch and the models
    imported already, a third of a fresh process's time."""
    out, err = io.StringIO(), io.StringIO()
    os.chdir(REPO)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["dryrun", str(path), *arguments])
    return subprocess.CompletedProcess(["pardsl", "dryrun", str(path), *arguments], code, out.getvalue(), err.getvalue())


def test_one_rank_of_a_64_rank_plan_runs_alone_with_the_planned_collectives(tmp_path):
    path = tmp_path / "plan.par"
    path.write_text(megatron_on("inner", "outer"))
    result = dryrun(path, "--rank", "37", "--steps", "2", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] and report["collectives_match"] and report["rank"] == 37
    # Megatron's f and g per layer on `inner`; the data-parallel gradients' buckets on `outer`
    assert report["collectives"]["forward"] == {"inner:all_reduce": 4}
    assert report["collectives"]["backward"]["inner:all_reduce"] == 4
    assert report["collectives"] == report["planned"]
    assert 0.85 <= report["peak_bytes"] / report["estimated_bytes"] <= 1.15
    assert set(report["seconds"]) == {"forward", "backward", "optimizer"}
    assert report["peak_after"]["forward"] <= report["peak_after"]["backward"] <= report["peak_bytes"]


def test_a_plan_over_the_machines_device_memory_is_refused_before_it_runs(tmp_path):
    path, machine = tmp_path / "plan.par", tmp_path / "small.json"
    path.write_text(megatron_on("inner", "outer"))
    small = PRESETS["h100-nvlink-ib"].to_json()
    small["device_memory_bytes"] = 16 << 20
    machine.write_text(json.dumps(small))
    result = dryrun(path, "--machine", str(machine))
    assert result.returncode == 1
    assert "more than the 16.0 MiB" in result.stderr and "recompute" in result.stderr


def test_a_rank_off_the_mesh_is_refused_with_reasons(tmp_path):
    path = tmp_path / "plan.par"
    path.write_text(megatron_on("inner", "outer"))
    off = dryrun(path, "--rank", "64")
    assert off.returncode == 1 and "rank 64 is not on the mesh (outer = 8, inner = 8: ranks 0 to 63)" in off.stderr


def test_a_pipelined_rank_runs_its_stage_with_the_micro_batches_its_schedule_holds():
    """pp 2 × tp 2 under 1F1B with 4 micro-batches: rank 0 (stage 0) holds 2 micro-batches at once, rank 3
    (stage 1) one; each runs all four, issuing its stage's tensor-parallel all-reduces once per micro-batch, and its
    gradient bucket once; the peak is near the estimate of that rank's stage."""
    plan = os.path.join(REPO, "examples", "hf_llama_pp2_tp2.par")
    for rank, stage, held in ((0, 0, 2), (3, 1, 1)):
        result = dryrun(plan, "--rank", str(rank), "--json")
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        assert report["collectives_match"], report
        assert f"stage(s) {stage} of 2, micro-batches held at once: {held} in stage {stage} (" in report["notes"][0]
        assert 0.85 <= report["peak_bytes"] / report["estimated_bytes"] <= 1.15


def test_an_interleaved_rank_holds_what_torchs_order_of_its_actions_leaves_in_flight(tmp_path):
    """pp 2 × tp 2 under Interleaved 1F1B with two stages a rank and 4 micro-batches: torch's order of rank
    0's actions has its first stage hold all 4 micro-batches at once and its third stage 2 (every stage was
    counted at 4, an upper bound); the dry run holds as many, issues each stage's collectives once per
    micro-batch, and its peak is near the estimate."""
    from pardsl.runtime.schedules import stage_micro_batches_held

    assert stage_micro_batches_held("Interleaved1F1B", 4, 2, 0, 2) == {0: 4, 2: 2}
    text = open(os.path.join(REPO, "examples", "hf_llama_pp2_tp2.par")).read().replace(
        "schedule 1F1B, microbatches 4, cut before model.model.layers.2",
        "schedule Interleaved1F1B, stages per rank 2, microbatches 4, cut balanced")
    path = tmp_path / "interleaved.par"
    path.write_text(text)
    result = dryrun(path, "--rank", "0", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["collectives_match"], report
    assert "micro-batches held at once: 4 in stage 0, 2 in stage 2 (" in report["notes"][0]
    assert 0.85 <= report["peak_bytes"] / report["estimated_bytes"] <= 1.15


def test_the_schedules_in_flight_counts_follow_torchs_order_of_actions():
    from pardsl.runtime.schedules import stage_micro_batches_held

    assert stage_micro_batches_held("1F1B", 8, 4, 1, 1) == {1: 3}  # p - r
    assert stage_micro_batches_held("GPipe", 8, 4, 1, 1) == {1: 8}  # every micro-batch
    # DualPipeV's rank 0 runs the first stage and the last: the first holds 32 of the 40 micro-batches at
    # most, the last one at a time (its backward follows its forward at once); both were counted at 40
    assert stage_micro_batches_held("DualPipeV", 40, 16, 0, 2) == {0: 32, 31: 1}
    # a split backward frees a micro-batch's activations at its weights' half, which zero bubble defers
    assert stage_micro_batches_held("InterleavedZeroBubble", 8, 4, 3, 2) == {3: 8, 7: 4}
    # an order torch refuses to build (DualPipeV under 2p micro-batches) gives no count: every micro-batch
    assert stage_micro_batches_held("DualPipeV", 4, 4, 0, 2) == {0: 4, 7: 4}


def test_a_pipelined_ranks_gradient_bucket_is_synchronised_once_a_step():
    """pp 2 × dp 2 under GPipe with 2 micro-batches: both held at once, the data-parallel bucket all-reduced
    once, in the last backward; the peak near the estimate."""
    result = dryrun(os.path.join(REPO, "examples", "hf_llama_pp2_dp2.par"), "--rank", "0", "--json")
    report = json.loads(result.stdout)
    assert report["collectives_match"] and report["collectives"]["backward"] == {"dp:all_reduce": 1}
    assert "micro-batches held at once: 2 in stage 0 (" in report["notes"][0]
    # the estimate's last backward: one micro-batch's activations beside the bucket's buffer
    assert 0.85 <= report["peak_bytes"] / report["estimated_bytes"] <= 1.15


def test_an_expert_parallel_rank_runs_alone_its_exchanges_sized_as_it_sends():
    """Nothing arrives through the fake process group: each exchange of counts gives back what the rank
    sends, so its experts get about a balanced routing's rows, and the all-to-alls are the plan's."""
    result = dryrun(os.path.join(REPO, "examples", "hf_mixtral_ep2.par"), "--rank", "1", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["collectives_match"], report
    assert report["collectives"]["forward"] == {"ep:all_to_all": 3}
