"""Training through the public API (`import pardsl`) as users do, under torch's launcher on 2 and 4 gloo
ranks: Hugging Face models on their own losses with AdamW and clipping, equal to serial step by step;
batch and sequence length varying across steps; checkpoints saved under one mesh and loaded, resharded,
under another, bit for bit; the training example and the README's script."""

import json
import os
import re

import pytest
import torch

from examples.hf_models import gpt2_lm_head, llama_causal_lm
from tests.launch import REPO, torchrun
from tests.scripts.api_train import batches


def serial_training(factory, local_batch_parts: int = 1) -> dict:
    torch.manual_seed(0)
    model = factory(layers=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for batch in batches():
        out = model(input_ids=batch, labels=batch)
        out.loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
    return {"losses": losses, "norms": norms}


@pytest.mark.parametrize("plan, factory, nproc, extra, logits", [
    ("examples/llama_train_tp2.par", llama_causal_lm, 2, (), [2, 6, 128]),  # logits split over the vocabulary
    ("examples/gpt2_train_dp2_tp2.par", gpt2_lm_head, 4, ("--local-batch",), [1, 6, 256]),  # batch split over dp
], ids=["llama-tp2", "gpt2-dp2xtp2-local-batch"])
def test_adamw_on_the_models_own_loss_equals_serial_with_varying_shapes(tmp_path, plan, factory, nproc, extra, logits):
    out = tmp_path / "result.json"
    torchrun(nproc, "tests/scripts/api_train.py", plan, str(out), *extra)
    result = json.loads(out.read_text())
    expected = serial_training(factory)
    assert result["output"] == "CausalLMOutputWithCrossAttentions" if factory is gpt2_lm_head else "CausalLMOutputWithPast"
    assert result["logits"] == logits  # the last step's (batch 2, seq 6), this rank's local value
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(expected["norms"]), rtol=1e-5, atol=1e-6)


def _losses(path) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in map(json.loads, open(path))}


def test_training_example_checkpoints_and_resumes_under_another_mesh_bit_for_bit(tmp_path):
    """examples/train.py: 4 steps serially; under tp 2 with a checkpoint after 2; resumed from it under
    dp 2 × tp 2, which first saves what it loaded. Every step's loss equals serial's, and the resharded
    checkpoint holds the same bits as the one it was loaded from, optimizer state included."""
    from examples.train import main as train
    from pardsl.checkpoint import CheckpointSource

    common = ["--steps", "4", "--seq", "32", "--batch", "4"]
    train(["--serial", *common, "--loss-log", str(tmp_path / "serial.jsonl")])
    torchrun(2, "examples/train.py", "--plan", "examples/llama_train_tp2.par", *common, "--save-at", "2",
             "--checkpoint-dir", str(tmp_path / "tp2"), "--loss-log", str(tmp_path / "tp2.jsonl"))
    torchrun(4, "examples/train.py", "--plan", "examples/llama_train_dp2_tp2.par", *common,
             "--resume", str(tmp_path / "tp2" / "step-2"), "--save-at", "2",
             "--checkpoint-dir", str(tmp_path / "dp2tp2"), "--loss-log", str(tmp_path / "resumed.jsonl"))

    serial = _losses(tmp_path / "serial.jsonl")
    assert sorted(serial) == [0, 1, 2, 3]
    for name, steps in (("tp2.jsonl", [0, 1, 2, 3]), ("resumed.jsonl", [2, 3])):
        got = _losses(tmp_path / name)
        assert sorted(got) == steps
        for step in steps:
            assert got[step] == pytest.approx(serial[step], rel=1e-5), (name, step)

    saved, resharded = CheckpointSource(str(tmp_path / "tp2" / "step-2")), \
        CheckpointSource(str(tmp_path / "dp2tp2" / "step-2"))
    assert saved.document["plan"]["mesh"] == {"tp": 2} and resharded.document["plan"]["mesh"] == {"dp": 2, "tp": 2}
    assert set(saved.tensors) == set(resharded.tensors)
    assert any(name.startswith("optimizer.") and name.endswith(".exp_avg_sq") for name in saved.tensors)
    files = {p.file for _, pieces in resharded.tensors.values() for p in pieces}
    # each element once: the parameters are B over dp, so the ranks at dp coordinate 0 hold them all
    assert files == {"rank-00000-of-00004.safetensors", "rank-00001-of-00004.safetensors"}
    for name in saved.tensors:
        assert torch.equal(saved.full(name), resharded.full(name)), name

    # one whole Hugging Face-compatible file: the library's own class loads it strictly
    from pardsl import cli

    assert cli.main(["export", str(tmp_path / "dp2tp2" / "step-2"), "-o", str(tmp_path / "model.safetensors")]) == 0
    from safetensors.torch import load_file

    hf = llama_causal_lm(layers=2)
    hf.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True)
    assert torch.equal(hf.lm_head.weight, saved.full("lm_head.weight"))


def test_readme_training_script_runs_as_written(tmp_path):
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    section = readme.split("## Train your model", 1)[1]
    script = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "train.py").write_text(script)
    output = torchrun(2, str(tmp_path / "train.py"), "--checkpoint", str(tmp_path / "ckpt"))
    assert "step 3: loss" in output and "saved" in output
    assert os.path.exists(tmp_path / "ckpt" / "pardsl.index.json")
