"""Offload (`offload optimizer`, `offload parameters`): masters, their gradients and the optimizer's state in
host memory, stepped there by a fused step; the device's copies made from them. Trained steps are bit-equal
to the same plan without offload, collectives included; the estimate counts host and device apart."""

import functools
import os

import pytest
import torch

from pardsl.language.diagnostics import CompileError

from .conftest import REPO, run_on

INPUT_IDS = {"input_ids": torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))}
ZERO3_INPUTS = {"input_ids": torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(3)),
                "labels": torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(4))}


def with_lines(example: str, *lines: str) -> str:
    text = open(os.path.join(REPO, "examples", example)).read()
    return text.replace("layout {", "\n".join(lines) + "\n\nlayout {", 1) if lines else text


def _train(path: str, inputs: dict, steps: int = 3) -> dict:
    """On every rank: `steps` training steps under a fused AdamW from serial's initial values; every
    output, gradient and parameter after each step (this rank's shards), where they live, and how many
    device copies of masters the module keeps."""
    import pardsl

    torch.manual_seed(0)
    plan = pardsl.load(path)
    model = plan.module()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model.rt.counter.reset()
    outputs, gradients, parameters = [], [], []
    for _ in range(steps):
        result = model(**plan.shard_inputs(**inputs))
        flat = [v for v in result.values()] if isinstance(result, dict) else [result]
        sum((t.float() ** 2).mean() if t.dim() else t.float() for t in flat).backward()
        outputs.append([t.detach().clone() for t in flat])
        gradients.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        parameters.append({name: p.detach().clone() for name, p in model.named_parameters()})
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {"outputs": outputs, "gradients": gradients, "parameters": parameters,
            "counts": model.rt.counter.summary()["collectives"],
            "devices": sorted({t.device.type for t in [*model.parameters(), *state]}),
            "device_copies": len(getattr(model.spmd, "device_copies", {}))}


def _bit_equal(a: dict, b: dict) -> bool:
    def same(xs, ys):
        return xs.keys() == ys.keys() and all(torch.equal(xs[k], ys[k]) for k in xs)
    return all(torch.equal(x, y) for xs, ys in zip(a["outputs"], b["outputs"]) for x, y in zip(xs, ys)) and \
        all(same(x, y) for x, y in zip(a["gradients"], b["gradients"])) and \
        all(same(x, y) for x, y in zip(a["parameters"], b["parameters"]))


@pytest.mark.parametrize("example, lines, offload, inputs", [
    # bf16 device copies kept between steps, written again after each (fused) optimizer step
    ("hf_llama_tp2.par", ("precision params bf16, reduce fp32",), "offload optimizer", INPUT_IDS),
    # ZeRO-3: each gather group's shards copied to the device for each gather, in forward and in backward
    ("llama_zero3.par", ("precision params bf16, reduce fp32",), "offload parameters", ZERO3_INPUTS),
    # one dtype: on CPU ranks the device copy is the master itself
    ("llama_zero3.par", (), "offload optimizer", ZERO3_INPUTS),
    # recomputed layers fetch their parameters again in backward
    ("hf_llama_tp2.par", ("precision params bf16, reduce fp32", "recompute model.model.layers.*"),
     "offload parameters", INPUT_IDS),
])
def test_offloaded_training_is_bit_equal_to_the_plan_without(pools, tmp_path, compile_par, example, lines,
                                                             offload, inputs):
    plain, offloaded = tmp_path / "plain.par", tmp_path / "offloaded.par"
    plain.write_text(with_lines(example, *lines))
    offloaded.write_text(with_lines(example, *lines, offload))
    ranks = compile_par(plain.read_text()).program.mesh.size
    before, after = (pools(ranks).run_on_every_rank(functools.partial(_train, str(path), inputs))
                     for path in (plain, offloaded))
    compiled = compile_par(offloaded.read_text())
    assert compiled.program.offload == offload.split()[1]
    for rank_before, rank_after in zip(before, after):
        assert _bit_equal(rank_before, rank_after)
        assert rank_after["counts"] == rank_before["counts"]
        assert rank_after["devices"] == ["cpu"]
    if offload == "offload optimizer" and lines:  # a bf16 copy of every master, kept
        assert after[0]["device_copies"] == len(compiled.program.parameters)
    else:
        assert after[0]["device_copies"] == 0


def _saved_and_loaded(offloaded: str, plain: str, folder: str) -> bool:
    """On every rank: a step of the offloaded plan, saved with its optimizer; loaded under the plan
    without offload, parameters and optimizer state equal."""
    import pardsl

    torch.manual_seed(0)
    plan = pardsl.load(offloaded)
    model = plan.module()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model(**plan.shard_inputs(**INPUT_IDS)).float().pow(2).mean().backward()
    optimizer.step()
    pardsl.save(model, folder, optimizer=optimizer)
    other = pardsl.load(plain)
    loaded = other.module(checkpoint=folder)
    loaded_optimizer = torch.optim.AdamW(loaded.parameters(), lr=1e-2)
    pardsl.load_optimizer_state(loaded_optimizer, loaded, folder)
    mine, theirs = dict(model.named_parameters()), dict(loaded.named_parameters())
    return mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine) and all(
        torch.equal(optimizer.state[mine[k]]["exp_avg"], loaded_optimizer.state[theirs[k]]["exp_avg"]) for k in mine)


def test_an_offloaded_plans_checkpoint_loads_under_a_plan_without(pools, tmp_path):
    plain, offloaded = tmp_path / "plain.par", tmp_path / "offloaded.par"
    plain.write_text(with_lines("hf_llama_tp2.par"))
    offloaded.write_text(with_lines("hf_llama_tp2.par", "offload optimizer"))
    job = functools.partial(_saved_and_loaded, str(offloaded), str(plain), str(tmp_path / "ckpt"))
    assert pools(2).run_on_every_rank(job) == [True, True]


def test_the_module_says_where_parameters_live_and_fetches_each_once(compile_par):
    compiled = compile_par(with_lines("hf_llama_tp2.par", "precision params bf16, reduce fp32", "offload optimizer"))
    source = compiled.source
    assert 'OFFLOAD = "optimizer"' in source
    assert "nn.Parameter(rt.host_empty((32, 64), torch.float32))" in source
    fetches = [line for line in source.splitlines() if "= sync.fetch(" in line]
    assert len(fetches) == len(compiled.program.parameters)  # each master fetched where first read, once
    assert "model_model_layers_0_self_attn_q_proj_weight__bfloat16 = sync.fetch(" \
           "self.model_model_layers_0_self_attn_q_proj_weight, torch.bfloat16)" in source
    assert "rt.cast(self." not in source


def test_the_estimate_counts_host_and_device_apart(compile_par):
    from pardsl.planning.cost import default_machine, estimate, memory_per_rank
    from pardsl.tools.explain import report

    text = with_lines("hf_llama_tp2.par", "precision params bf16, reduce fp32")
    kept = memory_per_rank(compile_par(text).program)
    offloaded_compiled = compile_par(with_lines("hf_llama_tp2.par", "precision params bf16, reduce fp32",
                                                "offload optimizer"))
    offloaded = memory_per_rank(offloaded_compiled.program)
    # the device keeps bf16 copies (half the float32 masters); masters, gradients and state go to the host
    assert offloaded["parameters"] == offloaded["gradients"] == offloaded["optimizer_state"] == 0
    assert offloaded["compute_copies"] * 2 == kept["parameters"]
    assert (offloaded["host_parameters"], offloaded["host_gradients"], offloaded["host_optimizer_state"]) == \
        (kept["parameters"], kept["gradients"], kept["optimizer_state"])
    assert offloaded["total"] == kept["total"] - kept["parameters"] - kept["gradients"] - kept["optimizer_state"] \
        - kept["compute_copies"] + offloaded["compute_copies"]
    # under `offload parameters` nothing of them stays on the device between uses
    zero3 = memory_per_rank(compile_par(with_lines("llama_zero3.par", "offload parameters")).program)
    assert zero3["parameters"] == zero3["compute_copies"] == 0 and zero3["host_parameters"] > 0
    text = report(offloaded_compiled, estimate(offloaded_compiled, default_machine()))
    assert "\nhost memory per rank " in text and "(parameters " in text.split("host memory per rank")[1]


def test_pardsl_run_steps_offloaded_masters_and_matches_serial(pools, compile_par):
    compiled = compile_par(with_lines("llama_zero3.par", "precision params bf16, reduce fp32", "offload parameters"))
    report = run_on(pools, compiled, steps=2)
    assert report["ok"], report
    assert report["collectives"] == compiled.program.collective_counts()
    assert report["bytes"] == compiled.program.collective_bytes()


@pytest.mark.parametrize("lines, code, column, message", [
    (("offload gradients",), "E084", 9, "`gradients` is nothing pardsl offloads"),
    (("offload optimizer", "offload parameters"), "E003", 1, "`offload` declared twice"),
])
def test_an_offload_line_that_cannot_be_taken_says_where(compile_par, lines, code, column, message):
    with pytest.raises(CompileError) as error:
        compile_par(with_lines("hf_llama_tp2.par", *lines))
    (diagnostic,) = error.value.diagnostics
    assert (diagnostic.code, diagnostic.span.column, diagnostic.message) == (code, column, message)


def test_offload_names_every_target_on_one_line(compile_par):
    compiled = compile_par(with_lines("llama_zero3.par", "offload optimizer, parameters"))
    assert compiled.program.offload == "parameters"


def test_a_pipelined_plan_offloads_its_stages(pools, compile_par):
    text = open(os.path.join(REPO, "examples/hf_llama_pp2.par")).read()
    compiled = compile_par(text + "precision params bf16, reduce fp32\noffload optimizer\n")
    assert 'OFFLOAD = "optimizer"' in compiled.source and "= sync.fetch(self." in compiled.source
    from pardsl.planning.cost import pipelined_memory_per_rank
    memory = pipelined_memory_per_rank(compiled.stages, compiled.pipeline)
    assert memory["parameters"] == memory["optimizer_state"] == 0 and memory["host_optimizer_state"] > 0
    report = run_on(pools, compiled, steps=2)
    assert report["ok"], report
