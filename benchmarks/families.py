"""Model breadth: Hugging Face families compiled under the layout search and run against serial.

Each family (examples/more_families.py, examples/hf_models.py, examples/vision_models.py) is written
with its mesh, model and inputs and `memory <= 60 %` (40 % on the 4-rank mesh), nothing else, compiled,
and run for two training steps on gloo ranks, every step checked against serial (outputs, every
gradient, updated buffers). Printed per family: equal to serial, whether the collectives and bytes
measured are the planned ones, compile seconds, the collectives per step and the notes compile gave.

    python benchmarks/families.py [--mesh "dp = 2, tp = 2"] [--only Falcon Swin ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDS = "input input_ids : int64[2, 16] in [0, 128)\n"
PIXELS = "input pixel_values : float32[2, 3, 32, 32]\n"
M = "examples.more_families"
FAMILIES = {
    "GPT-J": (f'{M}:CausalLM(family="GPTJ", rotary_dim=4, n_inner=128)', IDS),
    "CodeGen": (f'{M}:CausalLM(family="CodeGen", rotary_dim=4, n_inner=128)', IDS),
    "Phi-3": (f'{M}:CausalLM(family="Phi3", pad_token_id=0)', IDS),
    "GPTBigCode": (f'{M}:CausalLM(family="GPTBigCode", attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, '
                   'n_inner=128)', IDS),
    "OLMo-2": (f'{M}:CausalLM(family="Olmo2")', IDS),
    "Gemma-2": (f'{M}:CausalLM(family="Gemma2")', IDS),
    "Gemma-3": (f'{M}:CausalLM(family="Gemma3Text")', IDS),
    "Falcon": (f'{M}:CausalLM(family="Falcon")', IDS),
    "Bloom": (f'{M}:CausalLM(family="Bloom")', IDS),
    "OPT": (f'{M}:CausalLM(family="OPT", ffn_dim=128, dropout=0.0)', IDS),
    "Mamba": (f'{M}:CausalLM(family="Mamba", state_size=4, expand=2, conv_kernel=4)', IDS),
    "RoBERTa": (f'{M}:Encoder(family="Roberta", pad_token_id=1)', IDS),
    "DistilBERT": (f'{M}:Encoder(family="DistilBert", dim=64, hidden_dim=128, n_layers=1, n_heads=8, dropout=0.0, '
                   'attention_dropout=0.0)', IDS),
    "ALBERT": (f'{M}:Encoder(family="Albert", embedding_size=32, num_hidden_layers=2)', IDS),
    "ELECTRA": (f'{M}:Encoder(family="Electra", embedding_size=64)', IDS),
    "DeBERTa-v2": (f'{M}:Encoder(family="DebertaV2")', IDS),
    "BART": (f'{M}:Seq2Seq(family="Bart")', IDS + "input decoder_input_ids : int64[2, 8] in [0, 128)\n"),
    "Marian": (f'{M}:Seq2Seq(family="Marian", pad_token_id=0, decoder_start_token_id=0)',
               IDS + "input decoder_input_ids : int64[2, 8] in [0, 128)\n"),
    "Whisper": ("examples.hf_models:HFWhisper()",
                "input input_features : float32[2, 16, 32]\ninput decoder_input_ids : int64[2, 8] in [0, 128)\n"),
    "ViT": ("examples.vision_models:HFViT()", PIXELS),
    "DINOv2": (f'{M}:ImageClassifier(family="Dinov2", hidden_size=64, intermediate_size=128, num_hidden_layers=1, '
               'num_attention_heads=8, image_size=32, patch_size=8)', PIXELS),
    "Swin": ("examples.vision_models:HFSwin()", PIXELS),
    "ConvNeXt": (f'{M}:ImageClassifier(family="ConvNext", hidden_sizes=[16, 32], depths=[1, 1], num_stages=2)', PIXELS),
    "Segformer": (f'{M}:ImageClassifier(family="Segformer", num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], '
                  'hidden_sizes=[16, 32], num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2], '
                  'mlp_ratios=[2, 2])', PIXELS),
    "MobileNetV2": (f'{M}:ImageClassifier(family="MobileNetV2", depth_multiplier=0.25, image_size=64)',
                    "input pixel_values : float32[8, 3, 64, 64]\n"),
    "Wav2Vec2": (f'{M}:Audio(family="Wav2Vec2", hidden_size=32, num_hidden_layers=1, num_attention_heads=4, '
                 'intermediate_size=64, conv_dim=[16, 16], conv_stride=[5, 2], conv_kernel=[10, 3], '
                 'num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, hidden_dropout=0.0, '
                 'attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0, '
                 'mask_time_prob=0.0)', "input input_values : float32[2, 400]\n"),
}


def _nonzero(counts: dict) -> str:
    return "; ".join(f"{phase} " + ", ".join(f"{n} {kind}" for kind, n in kinds.items() if n)
                     for phase, kinds in counts.items() if any(kinds.values())) or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="tp = 2", help='the mesh (default "tp = 2")')
    parser.add_argument("--only", nargs="*", help="families to run (default: all)")
    args = parser.parse_args()
    os.chdir(ROOT)
    sys.path.insert(0, ROOT)
    from pardsl.compiler import compile_text
    from pardsl.language.diagnostics import CompileError
    from pardsl.tools.execution import job_for
    from pardsl.tools.pool import WorkerPool

    ranks = 1
    for axis in args.mesh.split(","):
        ranks *= int(axis.split("=")[1])
    bound = 60 if ranks <= 2 else 40
    print("| family | equal to serial | measured = planned | compile (s) | collectives per step | notes |")
    print("|---|---|---|---|---|---|")
    pool = WorkerPool(ranks, timeout_s=300)
    try:
        for family, (model, inputs) in FAMILIES.items():
            if args.only and family not in args.only:
                continue
            text = f"mesh {args.mesh}\nmodel {model}\n{inputs}memory <= {bound} %\n"
            started = time.perf_counter()
            try:
                compiled = compile_text(text, os.path.join(ROOT, "benchmarks", "families.par"))
            except CompileError as error:
                print(f"| {family} | compile error | — | — | — | {error.diagnostics[0].code} |", flush=True)
                continue
            seconds = time.perf_counter() - started
            report = pool.run(job_for(compiled, steps=2, timeout_s=300))
            # a run counts the bytes a routing decides apart (routed_bytes)
            planned = (report["collectives"] == compiled.program.collective_counts()
                       and report["bytes"] == compiled.program.fixed_bytes())
            notes = ", ".join(sorted({n.code for n in compiled.program.notes})) or "—"
            print(f"| {family} | {'yes' if report['ok'] else 'NO'} | {'yes' if planned else 'NO'} | {seconds:.1f} | "
                  f"{_nonzero(compiled.program.collective_counts())} | {notes} |", flush=True)
    finally:
        pool.close()


if __name__ == "__main__":
    main()
