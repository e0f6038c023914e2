"""Training through the public API (`import pardsl`) as users do, on 2 and 4 gloo ranks (under torch's
launcher, or in the tests' worker pool where the launcher's start would only cost time): Hugging Face
models on their own losses with AdamW and clipping, equal to serial step by step; batch and sequence
length varying across steps; checkpoints saved under one mesh and loaded, resharded, under another, bit
for bit; the training example and the README's script."""

import functools
import json
import os
import re

import pytest
import torch

from examples.hf_models import gpt2_lm_head, llama_causal_lm
from tests.launch import REPO, torchrun
from tests.scripts.accumulate import accumulate
from tests.scripts.api_train import batches, train


def serial_training(factory) -> dict:
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


# In the tests' worker pool, which saves the launcher's and the ranks' start: the same script runs under
# torch's launcher as a user's does in the compiled-layers test, and the documented scripts below
@pytest.mark.parametrize("plan, factory, nproc, local_batch, logits", [
    ("examples/llama_train_tp2.par", llama_causal_lm, 2, False, [2, 6, 128]),  # logits split over the vocabulary
    ("examples/gpt2_train_dp2_tp2.par", gpt2_lm_head, 4, True, [1, 6, 256]),  # batch split over dp
    ("examples/llama_zero3.par", llama_causal_lm, 2, False, [1, 6, 256]),  # FSDP: weights gathered, batch split
], ids=["llama-tp2", "gpt2-dp2xtp2-local-batch", "llama-zero3"])
def test_adamw_on_the_models_own_loss_equals_serial_with_varying_shapes(pools, plan, factory, nproc, local_batch,
                                                                        logits):
    result = pools(nproc).run_on_every_rank(functools.partial(train, os.path.join(REPO, plan), local_batch))[0]
    expected = serial_training(factory)
    expected_output = "CausalLMOutputWithCrossAttentions" if factory is gpt2_lm_head else "CausalLMOutputWithPast"
    assert result["output"] == expected_output
    assert result["logits"] == logits  # the last step's (batch 2, seq 6), rank 0's local value
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(expected["norms"]), rtol=1e-5, atol=1e-6)


def test_training_with_dropout_through_the_api_equals_serial_training_with_it(pools, tmp_path):
    """GPT-2 with dropout 0.1 (embeddings, eager attention's weights, residuals) on dp 2 × tp 2, trained
    through the API from the seed serial starts from: every rank draws serial's masks, so the losses and
    clipped norms are serial's, step by step; and the masks matter (without them the losses differ)."""
    model = 'gpt2_lm_head(layers=2, attention="eager", dropout=0.1)'
    plan = tmp_path / "gpt2_dropout.par"
    plan.write_text(open(os.path.join(REPO, "examples/gpt2_train_dp2_tp2.par")).read()
                    .replace("gpt2_lm_head(layers=2)", model))
    result = pools(4).run_on_every_rank(functools.partial(train, str(plan)))[0]
    expected = serial_training(functools.partial(gpt2_lm_head, attention="eager", dropout=0.1))
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(expected["norms"]), rtol=1e-5, atol=1e-6)
    without = serial_training(functools.partial(gpt2_lm_head, attention="eager"))
    assert all(abs(a - b) > 1e-4 for a, b in zip(expected["losses"], without["losses"]))
    # in eval mode (`model.eval()`, as for serial) nothing is dropped: the loss is serial's eval loss
    ids = batches()[0]
    (train_loss, eval_loss), _ = pools(4).run_on_every_rank(
        functools.partial(_losses_in_both_modes, str(plan), {"input_ids": ids, "labels": ids}))[0]
    torch.manual_seed(0)
    serial = gpt2_lm_head(layers=2, attention="eager", dropout=0.1).eval()
    assert eval_loss == pytest.approx(serial(input_ids=ids, labels=ids).loss.item(), rel=1e-5)
    assert abs(train_loss - eval_loss) > 1e-4


def test_batch_norm_in_eval_mode_uses_the_running_statistics_as_serials_does(pools):
    """A ResNet with its batch split (synchronised batch norm in training): a forward in training mode
    updates the running statistics with the whole batch's, and after `model.eval()` the forward uses
    them, each loss serial's; batch norm counts the batch in training mode only (`num_batches_tracked`
    went on counting in eval mode)."""
    from examples.vision_models import HFResNet

    generator = torch.Generator().manual_seed(3)
    inputs = {"pixel_values": torch.randn(4, 3, 32, 32, generator=generator),
              "labels": torch.randint(0, 4, (4,), generator=generator)}
    got, counted = pools(2).run_on_every_rank(functools.partial(
        _losses_in_both_modes, os.path.join(REPO, "examples/hf_resnet_dp2.par"), inputs))[0]
    torch.manual_seed(0)
    serial = HFResNet()
    with torch.no_grad():
        expected = serial(**inputs).item(), serial.eval()(**inputs).item()
    assert got == pytest.approx(expected, rel=1e-5)
    assert counted == [int(b) for name, b in serial.named_buffers() if name.endswith("num_batches_tracked")] == \
        [1] * len(counted)
    assert abs(expected[0] - expected[1]) > 1e-4


def _losses_in_both_modes(path: str, inputs: dict) -> tuple[tuple[float, float], list[int]]:
    """On every rank: the model's loss on `inputs` in training mode, then after `.eval()`; and the batches
    each batch norm counted."""
    import pardsl

    torch.manual_seed(0)
    plan = pardsl.load(path)
    model = plan.module()
    local = plan.shard_inputs(**inputs)
    losses = []
    with torch.no_grad():
        for mode in (model.train, model.eval):
            mode()
            out = model(**local)
            losses.append((out.loss if hasattr(out, "loss") else out).item())
    return tuple(losses), [int(b) for name, b in model.named_buffers() if name.endswith("num_batches_tracked")]


@pytest.mark.parametrize("plan, nproc", [
    ("examples/llama_zero3.par", 2),  # gradients reduce-scattered in buckets
    ("examples/llama_train_dp2_tp2.par", 4),  # all-reduced in buckets over dp; Megatron's f over tp
], ids=["zero3", "dp2xtp2"])
def test_gradients_accumulated_over_micro_batches_equal_serial(pools, plan, nproc):
    """Two backwards before a step: each backward's buckets are reduced on their own and added to .grad."""
    result = pools(nproc).run_on_every_rank(functools.partial(accumulate, os.path.join(REPO, plan)))[0]
    assert result["error"] < 1e-5
    assert result["counts"] == [result["planned"], result["planned"]]


def _losses(path) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in map(json.loads, open(path))}


@pytest.mark.slow
def test_training_example_checkpoints_and_resumes_under_a_pipeline_bit_for_bit(tmp_path, monkeypatch):
    """examples/train.py: 4 steps serially; under tp 2 with a checkpoint after 2; resumed from it under
    the pipeline of examples/llama_train_pp2_tp2.par on 2 ranks (its two stages, the layouts left out: the
    4-rank run would only cost time, and the pipeline tests save under pp 2 x tp 2), which first saves what
    it loaded, each stage's rank its stage's tensors. Every step's loss equals serial's, and the resharded
    checkpoint holds the same bits as the one it was loaded from, optimizer state included. The checkpoint
    keeps the learning-rate schedule and the next batch: a resume under another --steps is refused."""
    import pardsl
    from examples.train import arguments, resume_point
    from examples.train import main as train
    from pardsl.runtime.checkpoint import CheckpointSource

    example = open(os.path.join(REPO, "examples/llama_train_pp2_tp2.par"), encoding="utf-8").read()
    pipelined = example.replace("pp = 2, tp = 2", "pp = 2").split("layout {")[0]
    assert "\nmesh     pp = 2\n" in pipelined
    (tmp_path / "pp2.par").write_text(pipelined)
    common = ["--steps", "4", "--seq", "32", "--batch", "4"]
    train(["--serial", *common, "--loss-log", str(tmp_path / "serial.jsonl")])
    torchrun(2, "examples/train.py", "--plan", "examples/llama_train_tp2.par", *common, "--save-at", "2",
             "--checkpoint-dir", str(tmp_path / "tp2"), "--loss-log", str(tmp_path / "tp2.jsonl"))

    checkpoint = str(tmp_path / "tp2" / "step-2")
    assert pardsl.checkpoint_metadata(checkpoint) == {
        "step": 2, "schedule": {"steps": 4, "lr": 3e-3, "min_lr": 3e-4, "warmup": 5}, "data": {"next_batch": 2}}
    # --steps also places the cosine's end: a resume under another is refused before any rank starts
    monkeypatch.delenv("RANK", raising=False)
    longer = ["--plan", "examples/llama_train_tp2.par", "--steps", "6", "--seq", "32", "--batch", "4",
              "--resume", checkpoint]
    with pytest.raises(SystemExit) as refused:
        train(longer)
    assert f"error: {checkpoint} was saved by a run with --steps 4 (this run: 6);" in str(refused.value.code)
    assert "--allow-schedule-change" in str(refused.value.code)
    assert resume_point(arguments([*longer, "--allow-schedule-change"])) == (2, 2)

    torchrun(2, "examples/train.py", "--plan", str(tmp_path / "pp2.par"), *common,
             "--resume", str(tmp_path / "tp2" / "step-2"), "--save-at", "2",
             "--checkpoint-dir", str(tmp_path / "pp2"), "--loss-log", str(tmp_path / "resumed.jsonl"))

    serial = _losses(tmp_path / "serial.jsonl")
    assert sorted(serial) == [0, 1, 2, 3]
    for name, steps in (("tp2.jsonl", [0, 1, 2, 3]), ("resumed.jsonl", [2, 3])):
        got = _losses(tmp_path / name)
        assert sorted(got) == steps
        for step in steps:
            assert got[step] == pytest.approx(serial[step], rel=1e-5), (name, step)
    straight, resumed = _losses(tmp_path / "tp2.jsonl"), _losses(tmp_path / "resumed.jsonl")
    assert [resumed[step] for step in (2, 3)] == pytest.approx([straight[step] for step in (2, 3)], rel=1e-5)

    saved, resharded = CheckpointSource(str(tmp_path / "tp2" / "step-2")), \
        CheckpointSource(str(tmp_path / "pp2" / "step-2"))
    assert saved.document["plan"]["mesh"] == {"tp": 2} and resharded.document["plan"]["mesh"] == {"pp": 2}
    assert set(saved.tensors) == set(resharded.tensors)
    assert any(name.startswith("optimizer.") and name.endswith(".exp_avg_sq") for name in saved.tensors)
    # each stage's rank writes its stage's tensors: the embedding is the first stage's, the head the last's
    assert {int(p.file[5:10]) for p in resharded.tensors["model.embed_tokens.weight"][1]} == {0}
    assert {int(p.file[5:10]) for p in resharded.tensors["optimizer.lm_head.weight.exp_avg"][1]} == {1}
    files = {p.file for _, pieces in resharded.tensors.values() for p in pieces}
    assert sorted(os.listdir(tmp_path / "pp2" / "step-2")) == sorted([*files, "pardsl.index.json"])
    for name in saved.tensors:
        assert torch.equal(saved.full(name), resharded.full(name)), name

    # one whole Hugging Face-compatible file: the library's own class loads it strictly
    from pardsl import cli

    assert cli.main(["export", str(tmp_path / "pp2" / "step-2"), "-o", str(tmp_path / "model.safetensors")]) == 0
    from safetensors.torch import load_file

    hf = llama_causal_lm(layers=2)
    hf.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True)
    assert torch.equal(hf.lm_head.weight, saved.full("lm_head.weight"))


@pytest.mark.slow
def test_the_documented_training_script_runs_as_written(tmp_path):
    """The training page's script, on 2 ranks as it says; the README shows the same script, word for word."""
    def script(page: str, section: str) -> str:
        text = open(os.path.join(REPO, page), encoding="utf-8").read()
        return re.search(r"```python\n(.*?)```", text.split(section, 1)[1], re.S).group(1)

    written = script("docs/training.md", "# Training with pardsl")
    assert script("README.md", "## Train your model") == written
    (tmp_path / "train.py").write_text(written)
    output = torchrun(2, str(tmp_path / "train.py"), "--checkpoint", str(tmp_path / "ckpt"))
    assert "step 3: loss" in output
    assert os.path.exists(tmp_path / "ckpt" / "pardsl.index.json")


def _shard_inputs_on_tp2():
    """On every rank of a tp 2 pool: shard_inputs at a size unlike the example, and two mistakes."""
    import pardsl

    plan = pardsl.load(os.path.join(REPO, "examples/llama_train_tp2.par"))
    ids = torch.zeros(3, 7, dtype=torch.int64)
    local = plan.shard_inputs(input_ids=ids, labels=ids)  # named dims, not split over tp: any size
    errors = []
    for call in (lambda: plan.shard_inputs(input_ids=ids[None], labels=ids[None]), lambda: plan.shard_inputs(ids)):
        try:
            call()
        except (TypeError, ValueError) as error:
            errors.append(str(error))
    return {k: list(v.shape) for k, v in local.items()}, errors, plan.data_parallel


def _dp_split_size_error():
    import pardsl

    plan = pardsl.load(os.path.join(REPO, "examples/llama_train_dp2_tp2.par"))
    try:
        plan.shard_inputs(input_ids=torch.zeros(3, 8, dtype=torch.int64), labels=torch.zeros(3, 8, dtype=torch.int64))
    except ValueError as error:
        return str(error), plan.data_parallel


def test_shard_inputs_takes_any_size_and_names_what_cannot_be_split(pools):
    shapes, errors, data_parallel = pools(2).run_on_every_rank(_shard_inputs_on_tp2)[0]
    assert shapes == {"input_ids": [3, 7], "labels": [3, 7]} and data_parallel == (0, 1)
    assert errors == ["input `input_ids` has 3 dims; the .par file declares 2",
                      "missing input(s) labels: the .par file declares input_ids, labels"]
    results = pools(4).run_on_every_rank(_dp_split_size_error)
    assert results[0][0] == ("input `input_ids`: dim 0 (`batch`) has size 3, which the mesh cannot split over "
                             "dp = 2: it needs a multiple of 2")
    assert [r[1] for r in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]


def test_bfloat16_llama_trains_equal_to_serial_within_its_tolerance(pools):
    from pardsl.compiler import compile_file
    from pardsl.tools.execution import job_for

    compiled = compile_file("examples/llama_bf16_tp2.par")
    assert all(p.dtype == "torch.bfloat16" for p in compiled.program.parameters)
    job = job_for(compiled, steps=2, timeout_s=60, optimizer="adamw", lr=1e-3)
    assert job.tolerance == 5e-2
    report = pools(2).run(job)
    assert report["ok"], report
    assert 0 < report["max_rel_err"]["grad"] < 2e-2  # bfloat16's rounding shows, far below a wrong plan's error


def _load_hf_folder(folder: str):
    """On every rank: the wrapper model of examples/hf_llama_tp2.par (names `model.model.…`) from a
    Hugging Face folder of LlamaForCausalLM tensors (names `model.…`) in two files with an index."""
    import pardsl
    from examples.hf_models import HFLlama

    plan = pardsl.load(os.path.join(REPO, "examples/hf_llama_tp2.par"))
    model = plan.module(checkpoint=folder)
    torch.manual_seed(0)
    serial = HFLlama(layers=2)
    full = dict(serial.named_parameters())
    rt = model.rt
    return all(torch.equal(local, rt.shard(full[name].detach(), layout)) for name, local, layout in model.named_shards())


def test_module_reads_its_slices_from_a_hugging_face_folder_or_file(pools, tmp_path):
    from safetensors.torch import save_file

    from examples.hf_models import HFLlama

    torch.manual_seed(0)
    state = {k: v.contiguous() for k, v in HFLlama(layers=2).model.state_dict().items()}
    names = sorted(state)
    files = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
             "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in files.items():
        save_file({n: state[n] for n in part}, str(tmp_path / file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in files.items() for n in part}}))
    assert pools(2).run_on_every_rank(functools.partial(_load_hf_folder, str(tmp_path))) == [True, True]
    single = tmp_path / "single"
    single.mkdir()
    save_file(state, str(single / "model.safetensors"))  # one file: given as the folder, or the file itself
    for path in (single, single / "model.safetensors"):
        assert pools(2).run_on_every_rank(functools.partial(_load_hf_folder, str(path))) == [True, True]


def test_inputs_are_bound_by_name_in_any_order(compile_par):
    compiled = compile_par("mesh tp = 2\nmodel examples.hf_models:llama_causal_lm(layers=1)\n"
                           "input labels : int64[2, 8] in [0, 256)\ninput input_ids : int64[2, 8] in [0, 256)\n")
    assert [slot.name for slot in compiled.program.inputs] == ["labels", "input_ids"]
    assert [o.path for o in compiled.program.outputs] == ["output.loss", "output.logits"]


def _mlp_gradient_error(model, x, d_model: int = 256, d_ff: int = 1024) -> float:
    """The largest difference between a compiled examples MLP's gradient shards (after one backward of
    `sum()`) and serial's, the serial MLP made from seed 0 as plan.module() makes it."""
    from examples.models import MLP

    torch.manual_seed(0)
    serial = MLP(d_model=d_model, d_ff=d_ff)
    serial(x).sum().backward()
    expected = dict(serial.named_parameters())
    return max((p.grad - model.rt.shard(expected[name].grad, layout)).abs().max().item()
               for name, p, layout in model.named_shards())


def _a_backward_that_raises_then_one_that_does_not():
    """On every rank of a dp 2 pool: a backward stopped by an exception after some of its gradient buckets
    were issued, then a whole one. The second's gradients are serial's: nothing of the first is left."""
    import pardsl

    plan = pardsl.load(os.path.join(REPO, "examples/mlp_dp.par"))
    torch.manual_seed(0)
    model = plan.module()
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(3))
    stopped = plan.shard_inputs(x=x)["x"].requires_grad_()
    stopped.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("stopped")))
    try:
        model(x=stopped).sum().backward()
        raised = False
    except RuntimeError:
        raised = True
    model.zero_grad(set_to_none=True)
    model(**plan.shard_inputs(x=x)).sum().backward()
    error = _mlp_gradient_error(model, x)
    return raised, error


def test_gradient_buckets_recover_from_a_backward_that_raised(pools):
    for raised, error in pools(2).run_on_every_rank(_a_backward_that_raises_then_one_that_does_not):
        assert raised and error < 1e-5


def _gradients_held_while_their_bucket_fills(example: str, x_shape: tuple, d_model: int, d_ff: int):
    """On every rank: one backward of a compiled MLP whose gradients are synchronised in buckets, watching
    each gradient that arrives at its bucket. Returns, per arrival, how many gradients that arrived before
    it in this backward are still alive, and the gradients' error against serial."""
    import weakref

    import pardsl
    from pardsl.runtime.parameter_sync import ParameterSync

    plan = pardsl.load(os.path.join(REPO, example))
    torch.manual_seed(0)
    model = plan.module()
    x = torch.randn(*x_shape, generator=torch.Generator().manual_seed(3))
    arrived, alive = [], []
    arrive = ParameterSync.arrive

    def watched(self, bucket, member, grad):
        alive.append(sum(gradient() is not None for gradient in arrived))
        arrived.append(weakref.ref(grad))
        arrive(self, bucket, member, grad)

    ParameterSync.arrive = watched
    try:
        model(**plan.shard_inputs(x=x)).sum().backward()
    finally:
        ParameterSync.arrive = arrive
    return alive, _mlp_gradient_error(model, x, d_model, d_ff)


@pytest.mark.parametrize("example, x_shape, d_model, d_ff", [
    ("examples/mlp_dp.par", (16, 256), 256, 1024),  # two all-reduce buckets of two gradients
    ("examples/mlp_zero3.par", (512, 64), 64, 256),  # one reduce-scatter bucket of four
])
def test_a_gradient_is_copied_into_its_bucket_as_it_arrives_and_not_held(pools, example, x_shape, d_model, d_ff):
    """DDP's copy: each gradient goes into its place in the bucket's one buffer as backward makes it, and
    is freed, where holding a bucket's gradients until the last came, then concatenating them, kept two
    copies of the bucket alive at once (and the concatenation, 3.7 ms of a 39 ms data-parallel LLaMA step
    here, copied them cold)."""
    job = functools.partial(_gradients_held_while_their_bucket_fills, example, x_shape, d_model, d_ff)
    for alive, error in pools(2).run_on_every_rank(job):
        assert alive == [0, 0, 0, 0]
        assert error < 1e-4  # gradients of a sum over up to 512 rows


def _plans_of_a_search_that_answers_differently_on_rank_1():
    """examples/tp_schemes/mlp_2d.par (2 x 2 mesh, every intermediate searched). Rank 1's machine was
    calibrated apart from rank 0's (its own calibration file: every byte a collective moves a thousand
    times dearer, a congested link), so its search rates plans otherwise: compiled alone it gets another
    module, and rank 0's answers replayed with its own figures ask for programs rank 0's compile did not (the descent compares
    plans by their estimates). Through `pardsl.load` it gets rank 0's plan, compiled again on rank 0's
    answers and figures without running HiGHS, and its step equals serial."""
    import dataclasses
    import hashlib
    import json
    import tempfile

    import torch.distributed as dist

    import pardsl
    from pardsl.planning import solver
    from pardsl.compiler import compile_text
    from pardsl.planning.cost import DEFAULTS, LinkCost

    text = open(os.path.join(REPO, "examples/tp_schemes/mlp_2d.par")).read()
    solve, cache_dir = solver.IntegerProgram._solve, os.environ["PARDSL_CACHE_DIR"]
    solved_while_replaying = []

    def counted(self, *args):
        if solver.SolutionLog.active is not None and solver.SolutionLog.active.replaying:
            solved_while_replaying.append(len(self.cost))
        return solve(self, *args)

    with tempfile.TemporaryDirectory() as folder:
        try:
            solver.IntegerProgram._solve = counted
            if dist.get_rank() == 1:
                gloo = DEFAULTS["gloo"]  # rank 1's calibration measured a congested link
                congested = {kind: LinkCost(link.alpha_s, 1000 * link.beta_s_per_byte)
                             for kind, link in gloo.collectives.items()}
                calibrated = dataclasses.replace(gloo, collectives=congested)
                os.environ["PARDSL_CACHE_DIR"] = folder
                with open(os.path.join(folder, "calibration-gloo.json"), "w") as handle:
                    json.dump(calibrated.to_json(), handle)
            alone = hashlib.sha256(compile_text(text, "mlp_2d.par").source.encode()).hexdigest()
            path = os.path.join(folder, "mlp_2d.par")
            with open(path, "w") as handle:
                handle.write(text)
            plan = pardsl.load(path)
            torch.manual_seed(0)
            model = plan.module()
        finally:
            solver.IntegerProgram._solve = solve
            os.environ["PARDSL_CACHE_DIR"] = cache_dir
    loaded = hashlib.sha256(plan.compiled.source.replace(path, "mlp_2d.par").encode()).hexdigest()
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    model(**plan.shard_inputs(x=x)).sum().backward()
    error = _mlp_gradient_error(model, x, d_model=64, d_ff=256)
    return alone, loaded, solved_while_replaying, error


def test_a_rank_whose_search_answers_differently_is_given_rank_0s_plan(pools):
    results = pools(4).run_on_every_rank(_plans_of_a_search_that_answers_differently_on_rank_1)
    alone, loaded, replayed, errors = zip(*results)
    assert alone[1] != alone[0]  # rank 1's own search chose another plan
    assert alone[2] == alone[3] == alone[0]
    assert set(loaded) == {alone[0]}  # every rank runs rank 0's
    assert replayed == ([],) * 4  # rank 1 compiled again on rank 0's answers, HiGHS not run
    assert max(errors) < 1e-4


def _modules_from_files_that_differ_by_rank():
    """Each rank writes the file in a folder of its own, as machines may hold it at different paths: the
    same text agrees; then rank 1's copy splits the MLP the other way, as a stale copy on one machine
    would."""
    import torch.distributed as dist

    messages = []
    for differ in (False, True):
        first, second = ("S(1)", "S(0)") if differ and dist.get_rank() == 1 else ("S(0)", "S(1)")
        text = (f"mesh tp = 2\nmodel examples.models:MLP(d_model=16, d_ff=32)\ninput x : float32[4, 16]\n"
                f"layout {{\n  fc1.weight : {first}\n  fc2.weight : {second}\n}}\n")
        messages.append(_error_loading_a_copy_of(text, lambda plan: plan.module()))
    return messages


def _error_loading_a_copy_of(text: str, then=lambda plan: None) -> str | None:
    """The error of `pardsl.load` (and `then` on its plan) on this rank's copy of `text`, in a folder of
    its own, as each machine holds its file at a path of its own; None if there is none."""
    import tempfile

    import pardsl

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "mlp.par")
        with open(path, "w") as handle:
            handle.write(text)
        try:
            then(pardsl.load(path))
        except RuntimeError as error:
            return str(error)
    return None


def _a_searched_file_one_rank_holds_otherwise():
    """A file whose layouts are searched, rank 1's copy with one layout more written (a stale copy): its
    search asks other programs than rank 0's, so it cannot replay rank 0's answers."""
    import torch.distributed as dist

    written = "  fc1.weight : S(0)\n" if dist.get_rank() == 1 else ""
    text = ("mesh tp = 2\nmodel examples.models:MLP(d_model=16, d_ff=32)\ninput x : float32[4, 16]\n"
            f"memory <= 60 %\nlayout {{\n  x : ?\n{written}}}\n")
    return _error_loading_a_copy_of(text)


def test_a_rank_that_cannot_compile_as_rank_0_did_fails_every_rank_at_load(pools):
    # not rank 1 alone, with rank 0 waiting for it at its first collective until the timeout
    for rank, message in enumerate(pools(2).run_on_every_rank(_a_searched_file_one_rank_holds_otherwise)):
        assert message is not None and "rank 1 cannot compile" in message and "as rank 0 did" in message
        assert "integer program 1 has" in message and f"(this is rank {rank})" in message


def _a_file_one_rank_holds_with_a_mistake():
    """Rank 1's copy of the file names a layer the model does not have (a stale copy): its compile
    fails; rank 0's does not."""
    import torch.distributed as dist

    from pardsl.language.diagnostics import CompileError

    name = "fc3" if dist.get_rank() == 1 else "fc1"
    text = ("mesh tp = 2\nmodel examples.models:MLP(d_model=16, d_ff=32)\ninput x : float32[4, 16]\n"
            f"layout {{\n  {name}.weight : S(0)\n}}\n")
    try:
        return _error_loading_a_copy_of(text)
    except CompileError as error:
        return "CompileError: " + error.render()


def test_a_rank_whose_copy_does_not_compile_fails_every_rank_at_load(pools):
    # its own diagnostics on rank 1; rank 0 told which rank failed, not left waiting at the broadcast
    own, told = pools(2).run_on_every_rank(_a_file_one_rank_holds_with_a_mistake)[::-1]
    assert own.startswith("CompileError: ") and "fc3" in own
    assert told is not None and "rank 1 cannot compile" in told and "(CompileError)" in told
    assert "(this is rank 0)" in told


def test_ranks_whose_modules_differ_are_told_so_before_the_first_step(pools):
    # each rank compiles the file itself: different modules would hang, or sum the wrong things
    for rank, (same, differing) in enumerate(pools(2).run_on_every_rank(_modules_from_files_that_differ_by_rank)):
        assert same is None, same  # the same file at different paths is the same module
        assert differing is not None and "the ranks compiled" in differing and "into different modules" in differing
        assert f"this is rank {rank}" in differing and "rank 0:" in differing and "rank 1:" in differing


@pytest.mark.slow
def test_a_run_whose_rank_is_killed_mid_step_resumes_from_the_last_complete_checkpoint(tmp_path):
    """Two torchrun agents on this host, as two machines, each with one rank, restarts allowed once.
    Rank 1 is killed (SIGKILL) between forward and backward of step 5; torchrun restarts both ranks,
    which resume from the newest complete checkpoint (after step 3) and train on: the steps trained again
    (3 and 4) log the losses the run logged before the kill, bit for bit."""
    from tests.launch import torchrun_agents

    common = ["--plan", "examples/llama_train_tp2.par", "--steps", "8", "--seq", "32", "--batch", "4",
              "--save-every", "3", "--resume", "auto"]
    outputs = torchrun_agents(2, 1, "examples/train.py", *common, "--checkpoint-dir", str(tmp_path / "killed"),
                              "--loss-log", str(tmp_path / "killed.jsonl"), "--kill-rank", "1", "--kill-at", "5",
                              max_restarts=1)
    output = "\n".join(outputs)
    assert "failed (exitcode: -9)" in output, output[-3000:]  # the rank was killed, and torchrun restarted it
    assert f"resuming from {tmp_path / 'killed' / 'step-3'} at step 3" in output
    logged = [json.loads(line) for line in open(tmp_path / "killed.jsonl")]
    assert [entry["step"] for entry in logged] == [0, 1, 2, 3, 4, 3, 4, 5, 6, 7]
    before, after = logged[3:5], logged[5:7]
    assert [entry["loss"] for entry in before] == [entry["loss"] for entry in after], logged
    assert sorted(os.listdir(tmp_path / "killed")) == ["step-3", "step-6"]
