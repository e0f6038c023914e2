"""A pipeline stage makes what it builds from buffers and constants alone (the causal mask, the rotary
tables) once, and every micro-batch reads that copy (pardsl/passes/shared_constants.py)."""

import os

import torch

from pardsl.runtime.core import Runtime

from .conftest import REPO, run_on


def _pipelined_llama(schedule: str = "GPipe", microbatches: int = 4, seq: int = 256) -> str:
    text = open(os.path.join(REPO, "examples/hf_llama_pp2.par")).read()
    text = text.replace("layers=2)", 'layers=2, attention="sdpa")').replace("int64[8, 16]", f"int64[8, {seq}]")
    return text.replace("schedule 1F1B, microbatches 4", f"schedule {schedule}, microbatches {microbatches}") + \
        "recompute model.model.layers.*\n"


def test_each_stage_makes_its_mask_once_and_the_rank_holds_it_once(pools, compile_par, monkeypatch):
    """GPipe over two stages, four micro-batches: each rank holds every micro-batch's layer inputs in
    flight, and one mask and one pair of rotary tables, which its stage made from positions and its
    buffer once. Measured on 2 ranks against the same plan with the pass left out (each micro-batch's
    own mask, kept by its attentions): each rank's peak is lower by what the estimate says, and both run
    equal to serial."""
    from pardsl import compiler
    from pardsl.planning.cost import pipeline_rank_memory

    text = _pipelined_llama(seq=512)
    assert "schedule GPipe, microbatches 4" in text
    compiled = compile_par(text)
    for rank, stage in enumerate(compiled.stages):
        (made,) = [s for s in stage.statements if s.instruction.kind == "constants"]
        assert made.instruction.reads() == ["self.model_model_rotary_emb_inv_freq"]  # its one buffer, no parameter
        assert stage.statements[0] is made  # before the layers: no recomputed region takes it in
        assert not any(inside.instruction.kind == "constants" for s in stage.statements for inside in s.body)
        shapes = [stage.values[name]["shape"] for name in made.targets if name in stage.values]
        assert any(shape[-2:] == [512, 512] for shape in shapes)
        memory = stage.memory()
        once, again = memory["activations_shared_by_micro_batches_per_rank"], memory["activations_made_again_per_rank"]
        assert once >= 512 * 512  # the mask's booleans
        held = pipeline_rank_memory(list(compiled.stages), compiled.pipeline, rank)
        assert held["activations"] == 4 * (memory["activations_per_rank"] - again - once) + once + again
    assert compiled.source.count("= rt.made_from_constants(self, made_from_constants, "
                                 "self.model_model_rotary_emb_inv_freq)") == 2
    shared = run_on(pools, compiled, steps=2)
    assert shared["ok"], shared

    monkeypatch.setattr(compiler, "PASSES_AFTER_LOWERING", tuple(
        step for step in compiler.PASSES_AFTER_LOWERING if not step[0].startswith("make what a pipeline stage")))
    apart = compile_par(text, "apart.par")
    assert "rt.made_from_constants" not in apart.source
    separate = run_on(pools, apart, steps=2)
    assert separate["ok"], separate
    for rank in range(2):
        estimated = pipeline_rank_memory(list(apart.stages), apart.pipeline, rank)["peak"] - \
            pipeline_rank_memory(list(compiled.stages), compiled.pipeline, rank)["peak"]
        measured = separate["memory"]["peak_bytes"][rank] - shared["memory"]["peak_bytes"][rank]
        assert estimated >= 3 * 512 * 512 and abs(measured - estimated) <= 0.05 * estimated, (rank, measured, estimated)


def test_what_is_made_from_constants_is_made_again_only_when_a_buffer_changes():
    """The first micro-batch makes it; later ones get the same tensors; a buffer written in place (a
    checkpoint loaded) makes it again. Made under inference mode, it still serves a training step."""
    module = torch.nn.Module()
    module.register_buffer("inv_freq", torch.tensor([1.0, 0.5]))
    made = []

    def make():
        made.append(1)
        return (torch.arange(4.0)[:, None] * module.inv_freq,)

    with torch.inference_mode():
        (first,) = Runtime.made_from_constants(module, make, module.inv_freq)
    assert not first.is_inference() and not first.requires_grad
    (again,) = Runtime.made_from_constants(module, make, module.inv_freq)
    assert again is first and len(made) == 1
    weight = torch.ones(2, requires_grad=True)
    (again * weight).sum().backward()  # kept for a backward: an ordinary tensor
    with torch.no_grad():
        module.inv_freq.copy_(torch.tensor([2.0, 1.0]))
    (changed,) = Runtime.made_from_constants(module, make, module.inv_freq)
    assert len(made) == 2 and changed is not first
    assert torch.equal(changed, torch.arange(4.0)[:, None] * torch.tensor([2.0, 1.0]))
    module.inv_freq = module.inv_freq.double()  # a buffer replaced (a module moved or cast): made again
    (cast,) = Runtime.made_from_constants(module, make, module.inv_freq)
    assert len(made) == 3 and cast.dtype == torch.float64
    Runtime.made_from_constants(module, make, module.inv_freq)
    assert len(made) == 3
