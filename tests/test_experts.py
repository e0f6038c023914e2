"""transformers' mixture-of-experts families as the library writes them. Their experts are traced as one
op, `pardsl::experts`, which computes what the library's own experts do. A plan splits it three ways:
- the tokens (data parallel);
- the experts' intermediate dim (tensor parallel);
- the experts together with the tokens (expert parallel). Each (token, choice) pair goes to its expert's
  rank by an all-to-all whose splits the routing decides, and comes back the same way; a run reports the
  bytes as routed.
Every family trains equal to serial under a written plan and under the search, with exact counts."""

import pytest
import torch

from pardsl.language.diagnostics import CompileError
from pardsl.model.moe import experts_as_one_op

from examples.more_families import MOE_FAMILIES as FAMILIES
from examples.more_families import moe_plan

from .test_distributed import _nonzero, check


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_op_computes_what_the_librarys_experts_do(family):
    """Each family's experts module, called as the library calls it and as pardsl traces it: the same
    outputs and gradients."""
    import examples.more_families as families

    torch.manual_seed(0)
    overrides = eval(f"dict({FAMILIES[family][0]})")
    model = families.CausalLM(family, **overrides)
    experts = next(m for name, m in model.named_modules() if name.endswith("experts") and hasattr(m, "has_gate"))
    hidden = torch.randn(12, model.model.config.hidden_size, requires_grad=True)
    index = torch.stack([torch.randperm(4)[:2] for _ in range(12)])
    weights = torch.rand(12, 2, requires_grad=True)
    results = []
    for as_one_op in (False, True):
        with experts_as_one_op(model) if as_one_op else torch.enable_grad():
            out = experts(hidden, index, weights)
        grads = torch.autograd.grad(out.square().sum(), [hidden, weights, *experts.parameters()])
        results.append((out, grads))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for have, expected in zip(got_grads, want_grads):
        torch.testing.assert_close(have, expected, rtol=1e-4, atol=1e-5)
    assert experts.config._experts_implementation != "pardsl_experts"  # given back after the trace


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_is_expert_parallel_as_written(pools, compile_par, family):
    """ep = 2, the experts' weights split like the tokens: per layer the counts per expert and the pairs'
    rows each way forward, the rows' two exchanges reversed backward; equal to serial."""
    compiled = compile_par(moe_plan(family, "ep = 2", {"gate_up_proj": "S(0)", "down_proj": "S(0)"}))
    assert compiled.source.count("expert_parallel=('ep',)") == 1
    report = check(pools, compiled)
    by_axis = _nonzero(report["collectives_by_axis"])
    assert by_axis["forward"]["ep:all_to_all"] == 3 and by_axis["backward"]["ep:all_to_all"] == 2
    assert len(report["routed_bytes"]) == 2  # each rank's bytes as routed


@pytest.mark.parametrize("family, layouts", [
    # transposed [E, H, 2I] with gate and up interleaved: a plain split of 2I keeps the pairs together
    ("GptOss", {"gate_up_proj": "[S(0), S(2)]", "gate_up_proj_bias": "[S(0), S(1)]", "down_proj": "[S(0), S(1)]"}),
    ("DeepseekV3", {"gate_up_proj": "[S(0), S(1, blocks=2)]", "down_proj": "[S(0), S(2)]"}),
])
def test_expert_and_tensor_parallel_together(pools, compile_par, family, layouts):
    """ep = 2 × tp = 2: each rank holds half of its experts' intermediate dim; the experts' result is a
    partial sum over tp, reduced once."""
    compiled = compile_par(moe_plan(family, "ep = 2, tp = 2", layouts))
    assert "expert_parallel=('ep',), intermediate=('tp',)" in compiled.source
    report = check(pools, compiled)
    assert _nonzero(report["collectives_by_axis"])["forward"]["ep:all_to_all"] == 3


@pytest.mark.slow
def test_deepseek_v3_is_planned_by_the_search_unedited(pools, compile_par):
    """No layout written, a memory bound: the search lays DeepSeek-V3's experts out (shared experts, grouped
    routing), and the plan equals serial. Its MoE layer alone here, to keep the suite quick; with its
    dense layer, and every family on ep 2 and ep 2 × tp 2: benchmarks/moe_families.py."""
    text = moe_plan("DeepseekV3", "ep = 2", memory="60 %")
    compiled = compile_par(text.replace("first_k_dense_replace=1, num_hidden_layers=2",
                                        "first_k_dense_replace=0, num_hidden_layers=1"))
    assert "rt.experts(" in compiled.source and not [n for n in compiled.program.notes if n.code == "N005"]
    check(pools, compiled)


@pytest.mark.parametrize("prefer, forward", [("last", [1536, 1536]), ("own", [0, 0])])
def test_the_bytes_exchanged_follow_the_routing(pools, compile_par, prefer, forward):
    """24 tokens of 16 floats, top-2 of 4 experts on 2 ranks (12 tokens, 24 pairs each; planned for a
    balanced routing: half of each exchange's 1536 bytes leave). Every token choosing the second rank's
    experts: the first rank sends all 24 rows, the second sends all 24 results back (the first rank's
    experts get no row and still their zero gradients). Every token choosing its own rank's experts:
    nothing leaves."""
    compiled = compile_par(f"mesh ep = 2\nmodel tests.zoo:SkewedExperts(prefer=\"{prefer}\")\n"
                           "input x : float32[4, 6, 16]\nlayout {\n  x : S(0)\n  experts.gate_up_proj : S(0)\n"
                           "  experts.down_proj : S(0)\n}\n")
    assert compiled.program.routed_bytes() == {"forward": 1536, "backward": 1536}
    report = check(pools, compiled)
    assert [r["forward"] for r in report["routed_bytes"]] == forward
    assert [r["backward"] for r in report["routed_bytes"]] == forward


@pytest.mark.parametrize("post_norm", [False, True], ids=["gate", "gate_and_norm"])
def test_experts_with_a_gate_the_op_does_not_know_keep_it_between_grouped_matmuls(pools, compile_par, post_norm):
    """up · gate, no activation: the gate traced as written between the two projections, each one
    pardsl::grouped_mm over the pairs sorted by expert, whose intermediate dim splits as a dense MLP's
    does (one all-reduce of the partial sums forward); a norm after each expert (MuseSpark's) is traced
    as written too, after that all-reduce. Equal to serial."""
    compiled = compile_par(f"mesh tp = 2\nmodel tests.zoo:UnknownGateExperts(post_norm={post_norm})\n"
                           "input x : float32[4, 6, 16]\n"
                           "layout {\n  experts.gate_up_proj : S(1, blocks=2)\n  experts.down_proj : S(2)\n}\n")
    assert compiled.source.count("rt.grouped_mm(") == 2 and "rt.experts(" not in compiled.source
    report = check(pools, compiled)
    assert _nonzero(report["collectives"])["forward"] == {"all_reduce": 1}
