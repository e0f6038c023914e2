"""torch.distributed.checkpoint folders both ways: a LLaMA trained by FSDP2 with DTensor tensor parallelism
and saved with DCP resumes under pardsl plans (dp 2 × tp 2, and a 2-stage pipeline) with the losses the
torch run goes on to have; a pardsl run saved with `format="dcp"` resumes under FSDP2 alike. And the
safety of reading such a folder: refused, naming the problem, where it is writable by others, damaged,
incomplete or cut short."""

import functools
import os
import pickle

import pytest
import torch

from tests.launch import REPO
from tests.scripts import fsdp2_llama

PP2 = os.path.join(REPO, "examples", "hf_llama_pp2.par")  # HFLlama(layers=2), [8, 16] batches
GPT_DP2_TP2 = os.path.join(REPO, "examples", "gpt_dp2_tp2.par")  # fused q/k/v: S(0, blocks=3) @ tp
GPT_TP4 = os.path.join(REPO, "examples", "gpt_tp4.par")

# examples/hf_llama_loss_dp2_tp2.par at the torch run's batch (its file takes half of it)
with open(os.path.join(REPO, "examples", "hf_llama_loss_dp2_tp2.par")) as _file:
    DP2_TP2 = _file.read().replace("int64[4, 16]", "int64[8, 16]")
assert DP2_TP2.count("int64[8, 16]") == 2

BEFORE, AFTER = 2, 2  # steps before the save, and after it


def _close(ours: list[float], theirs: list[float]) -> bool:
    return len(ours) == len(theirs) and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ours, theirs))


def _pardsl_run(par: str, load: str | None, save: str | None, skip: int, steps: int, save_after: int = 0) -> list:
    """A pardsl run of `par` on the torch run's batches from the `skip`-th: loaded from `load` (model and
    AdamW), saved to `save` as DCP after `save_after` steps; this rank's losses (none on a pipeline's
    first stage)."""
    import pardsl

    torch.manual_seed(0)
    plan = pardsl.load(par)
    model = plan.module(checkpoint=load)
    optimizer = torch.optim.AdamW(model.parameters(), lr=fsdp2_llama.LR)
    if load is not None:
        pardsl.load_optimizer_state(optimizer, model, load)
    losses = []
    for step, batch in enumerate(fsdp2_llama.batches(skip + steps, seed=1)[skip:]):
        if save is not None and step == save_after:
            pardsl.save(model, save, optimizer=optimizer, format="dcp")
        inputs = plan.shard_inputs(input_ids=batch, labels=batch)
        if getattr(model, "pipeline", None) is not None:
            loss = model.step(**inputs)
        else:
            loss = model(**inputs)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if loss is not None:
            losses.append(loss.item())
    return losses


@pytest.mark.timeout(240)
def test_fsdp2_checkpoint_resumes_under_pardsl_plans_and_back(pools, tmp_path):
    torch_folder, pardsl_folder = str(tmp_path / "fsdp2"), str(tmp_path / "pardsl")
    par = tmp_path / "hf_llama_dp2_tp2.par"
    par.write_text(DP2_TP2)
    four = pools(4)
    torch_run = four.run_on_every_rank(functools.partial(fsdp2_llama.train_save_continue, torch_folder,
                                                         BEFORE, AFTER))[0]
    # FSDP2 + TP → pardsl dp 2 × tp 2: the losses the torch run went on to have
    for losses in four.run_on_every_rank(functools.partial(_pardsl_run, str(par), torch_folder, None,
                                                           BEFORE, AFTER)):
        assert _close(losses, torch_run["after"]), (losses, torch_run)
    # FSDP2 + TP → a 2-stage pipeline: its last stage's losses
    pipelined = [losses for losses in pools(2).run_on_every_rank(
        functools.partial(_pardsl_run, PP2, torch_folder, None, BEFORE, AFTER)) if losses]
    assert len(pipelined) == 1 and _close(pipelined[0], torch_run["after"]), (pipelined, torch_run)
    # pardsl dp 2 × tp 2, from its own start, saved as DCP → FSDP2 + TP goes on as pardsl does
    ours = four.run_on_every_rank(functools.partial(_pardsl_run, str(par), None, pardsl_folder, 0,
                                                    BEFORE + AFTER, BEFORE))[0]
    assert os.path.isfile(os.path.join(pardsl_folder, ".metadata"))
    theirs = four.run_on_every_rank(functools.partial(fsdp2_llama.load_continue, pardsl_folder, BEFORE, AFTER))[0]
    assert _close(theirs, ours[BEFORE:]), (theirs, ours)
