"""The layout search: how long it takes, and what it finds.

1. Search time after torch.export for Hugging Face LLaMA of 2 to 32 layers on a dp 2 × tp 4 mesh, with a
   memory bound and the input written `?` (nothing else written); the integer program's size does not
   grow with depth, because repeated layers share their choices.
2. Rediscovery: LLaMA, GPT-2 and BERT on tp 2 and 4 under `memory <= 60 %` and nothing else written,
   the searched plan's estimate (the cost model with gloo's defaults, or `--calibration FILE`) beside the
   Megatron plan of examples/hf_<model>_tp<n>.par, with each plan's collectives per step.
3. The same at hidden 512 (vocabulary 1024, batch 2 × 64), where bandwidth outweighs gloo's latency:
   bytes per rank per step beside the estimate, and whether the search met the bound Megatron's plan
   needs.
4. The same models returning their own causal-LM loss (given labels), against Megatron-LM's whole plan:
   the layers as above with the vocabulary-parallel embedding, head and loss (examples/hf_llama_loss_tp2.par's
   layouts; GPT-2's embedding is tied to its head).

    python benchmarks/search.py [--depths 2 8 32] [--calibration FILE]
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pardsl.planning import solver  # noqa: E402
from pardsl.compiler import compile_text  # noqa: E402
from pardsl.planning.cost import DEFAULTS, estimate, load_machine  # noqa: E402

LLAMA = """mesh   dp = 2, tp = 4
model  examples.hf_models:HFLlama(layers={layers}, hidden=256, heads=8, kv_heads=4, ffn=512, vocab=1024)
input  input_ids : int64[8, 64] in [0, 1024)
memory <= 25 %
layout {{
    input_ids : ?
}}
"""

# Megatron-LM's whole plan for a model trained on its own loss: column- and row-parallel layers, and the
# vocabulary split for the embedding, the head and the loss
TRAINED = {
    "llama": ('HFLlama(layers=2, hidden=512, vocab=1024, ffn=1024, attention="sdpa")',
              open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples/hf_llama_loss_tp2.par")).read().split("layout {\n")[1].rsplit("}", 1)[0]),
    "gpt2": ('HFGPT2(layers=2, hidden=512, vocab=1024, positions=128, attention="sdpa")',
             "    model.transformer.wte.weight : S(0)\n"  # tied with the head
             "    model.transformer.h.*.attn.c_attn.weight : S(1, blocks=3)\n"
             "    model.transformer.h.*.attn.c_attn.bias : S(0, blocks=3)\n"
             "    model.transformer.h.*.attn.c_proj.weight : S(0)\n"
             "    model.transformer.h.*.mlp.c_fc.weight : S(1)\n"
             "    model.transformer.h.*.mlp.c_fc.bias : S(0)\n"
             "    model.transformer.h.*.mlp.c_proj.weight : S(0)\n"),
}


def counts(compiled) -> str:
    result = []
    for phase, kinds in compiled.program.collective_counts().items():
        text = ", ".join(f"{n} {k.replace('_', '-')}" for k, n in kinds.items() if n) or "none"
        result.append(f"{phase} {text}")
    return "; ".join(result)


def rediscovery(text: str, name: str, machine):
    """The example's plan beside the search's for its mesh, model and inputs alone under `memory <= 60 %`:
    (searched, Megatron's, and each one's estimate)."""
    header = [line for line in text.splitlines(True) if line.split(" ", 1)[0] in ("mesh", "model", "input")]
    searched = compile_text("".join(header) + "memory <= 60 %\n", f"<{name}>", machine=machine)
    megatron = compile_text(text, f"<{name}, Megatron>", machine=machine)
    return searched, megatron, estimate(searched, machine), estimate(megatron, machine)


def bytes_row(model: str, tp: int, searched, megatron, mine, theirs) -> str:
    """A line of the hidden-512 tables: each plan's estimated step, bytes per step and memory."""
    def mib(compiled) -> float:
        return sum(compiled.program.collective_bytes().values()) / 2**20

    return (f"| {model} | {tp} | {mine.step_s * 1e3:.1f} | {mib(searched):.2f} MiB | {mine.memory['total'] / 2**20:.1f} / "
            f"{searched.memory_bound / 2**20:.1f} MiB | {theirs.step_s * 1e3:.1f} | {mib(megatron):.2f} MiB | "
            f"{theirs.memory['total'] / 2**20:.1f} MiB |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--calibration", help="a `pardsl calibrate` file (default: gloo's defaults)")
    args = parser.parse_args()
    machine = load_machine(args.calibration, "gloo") if args.calibration else DEFAULTS["gloo"]

    print("| LLaMA layers | search (s) | export (s) | everything after export (s) | collectives per step |")
    print("|---|---|---|---|---|")
    for depth in args.depths:
        # Every depth's programs are the same program (one layer's size): each row solves its own, as a
        # compile in a new process would, instead of reading the last depth's answers
        solver._ANSWERS.clear()
        compiled = compile_text(LLAMA.format(layers=depth), f"<llama {depth}>", machine=machine)
        print(f"| {depth} | {compiled.seconds['search']:.2f} | {compiled.seconds['export']:.2f} | "
              f"{compiled.seconds_after_export:.2f} | {counts(compiled)} |")

    print()
    print("| model | tp | searched: step (ms) | memory / bound | collectives | Megatron: step (ms) | memory | collectives |")
    print("|---|---|---|---|---|---|---|---|")
    for model in ("llama", "gpt2", "bert"):
        for tp in (2, 4):
            text = open(f"examples/hf_{model}_tp{tp}.par").read()
            searched, megatron, mine, theirs = rediscovery(text, f"{model} tp {tp}", machine)
            print(f"| {model} | {tp} | {mine.step_s * 1e3:.2f} | {mine.memory['total'] / 1024:.0f} / "
                  f"{searched.memory_bound / 1024:.0f} KiB | {counts(searched)} | {theirs.step_s * 1e3:.2f} | "
                  f"{theirs.memory['total'] / 1024:.0f} KiB | {counts(megatron)} |")

    print()
    print("| model (hidden 512) | tp | searched: step (ms) | bytes per step | memory / bound | Megatron: step (ms) | "
          "bytes per step | memory |")
    print("|---|---|---|---|---|---|---|---|")
    for model in ("llama", "gpt2", "bert"):
        for tp in (2, 4):
            path = f"examples/hf_{model}_tp{tp}.par"
            text = re.sub(r"\(layers=2", "(layers=2, hidden=512, vocab=1024, positions=128" +
                          (", ffn=1024" if model != "gpt2" else ""), open(path).read())
            text = text.replace("[2, 16]", "[2, 64]").replace("[0, 256)", "[0, 1024)")
            print(bytes_row(model, tp, *rediscovery(text, f"{model} tp {tp}", machine)))

    print()
    print("| model (hidden 512, own loss) | tp | searched: step (ms) | bytes per step | memory / bound | "
          "Megatron-LM: step (ms) | bytes per step | memory |")
    print("|---|---|---|---|---|---|---|---|")
    for model, (constructor, layouts) in TRAINED.items():
        for tp in (2, 4):
            text = (f"mesh tp = {tp}\nmodel examples.hf_models:{constructor}\n"
                    "input input_ids : int64[2, 64] in [0, 1024)\ninput labels : int64[2, 64] in [0, 1024)\n"
                    f"layout {{\n{layouts}}}\n")
            print(bytes_row(model, tp, *rediscovery(text, f"{model} tp {tp}, own loss", machine)))


if __name__ == "__main__":
    main()
