"""Long sequences split over ranks: a LLaMA whose tokens are written split (`input_ids : S(1)`) and left
to the search under a memory bound keeps its sequence split, attention computed with the heads split
instead (an all-to-all each way around it: DeepSpeed-Ulysses' form), and holds a share of the
activations; at a short sequence the same file runs equal to serial."""

from pardsl.compiler import compile_text

from .test_distributed import check


def _llama(ranks: int, tokens: int, bound: str, batch: int = 1) -> str:
    return (f"mesh cp = {ranks}\nmodel examples.hf_models:HFLlama(layers=2, attention=\"sdpa\")\n"
            f"input input_ids : int64[{batch}, {tokens}] in [0, 256)\nmemory <= {bound}\n"
            "layout {\n    input_ids : S(1)\n}\n")


def _activation_share(compiled) -> float:
    memory = compiled.program.memory()
    return memory["activations_per_rank"] / memory["activations_total"]


def test_the_sequence_stays_split_around_attention():
    at_2k = compile_text(_llama(2, 2048, "60 %"), "examples/long.par")
    assert _activation_share(at_2k) <= 0.6
    attention = [line for line in at_2k.source.splitlines() if "scaled_dot_product_attention.default(" in line]
    assert attention and all("S(1)@cp" in line for line in attention)  # heads split at the attention
    assert at_2k.program.collective_counts_by_axis()["forward"].get("cp:all_to_all", 0) >= 2
    at_16k = compile_text(_llama(4, 16384, "30 %"), "examples/long.par")
    assert _activation_share(at_16k) <= 0.3


def test_a_split_sequence_trains_equal_to_serial(pools):
    check(pools, compile_text(_llama(2, 64, "60 %", batch=2), "examples/long.par"))
