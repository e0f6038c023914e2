"""The layout search's descent: what deciding axes again finds beyond the best order's plan.

For each case, the estimated step (the cost model with gloo's defaults) of the plan of the best order of
the mesh's axes, of compile's plan (the descent from it: one axis alone, then pairs of axes), whether
each is within the memory bound, and compile's time after torch.export. Nothing is written but the
mesh, model, inputs and the bound (an input of the 2-D layer written `?`), except `layer_3d` as written.

    python benchmarks/descent.py
"""

from __future__ import annotations

import itertools
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pardsl.planning import search  # noqa: E402
from pardsl.compiler import _Candidate, _lowered, compile_file, compile_text  # noqa: E402
from pardsl.planning.cost import DEFAULTS, estimate  # noqa: E402
from pardsl.planning.cost import DEFAULT_BUCKET_MB  # noqa: E402

GLOO = DEFAULTS["gloo"]


def bounded(path: str, percent: int) -> str:
    """The example with its layouts left to the search under `memory <= percent %`."""
    text = open(os.path.join(ROOT, path)).read()
    if "tp_schemes/layer" in path:  # the layer's input written `?`, as in tests/test_search.py
        return text.split("layout {")[0] + f"memory <= {percent} %\nlayout {{\n  x : ?\n}}\n"
    return re.sub(r"layout \{.*\}", "", text, flags=re.S) + f"memory <= {percent} %\n"


CASES = [("examples/tp_schemes/layer_2d.par", 30), ("examples/tp_schemes/layer_2d.par", 60),
         ("examples/tp_schemes/layer_2p5d.par", 60), ("examples/tp_schemes/layer_3d.par", 60),
         ("examples/gpt_dp2_tp2.par", 30), ("examples/hf_mixtral_ep2_tp2.par", 30),
         ("examples/llama_train_dp2_tp2.par", 30), ("examples/gpt2_train_dp2_tp2.par", 30),
         ("examples/hf_resnet_dp2_tp2.par", 60), ("examples/tp_schemes/layer_3d.par", None)]


def main() -> None:
    os.chdir(ROOT)
    print("| file, bound | best order | compile's plan (descent) | compile after export (s) |")
    print("|---|---|---|---|")
    for path, percent in CASES:
        compiled = compile_file(path) if percent is None else compile_text(bounded(path, percent), path)
        bound = compiled.bound
        limit = search.memory_limit(bound)

        def rated(typed) -> tuple[bool, float]:  # as compile rates plans: within the bound first
            plan = estimate(_Candidate(typed, _lowered(typed, DEFAULT_BUCKET_MB, limit)), GLOO)
            return limit is not None and plan.memory["total"] > limit, plan.step_s

        def shown(over: bool, step_s: float) -> str:
            return f"{step_s * 1e3:.2f} ms" + (" (over the bound)" if over else "")

        sized = [a for a in range(bound.mesh.ndim) if bound.mesh.axis_sizes[a] > 1]
        orders = []
        for order in itertools.permutations(sized):
            try:
                orders.append(rated(search.search(bound, GLOO, limit, order=order)))
            except search.NoPlanFound:  # HiGHS found no plan in its time
                continue
        best = shown(*min(orders)) if orders else "no plan"
        after = sum(v for k, v in compiled.seconds.items() if k not in ("build", "export"))
        name = os.path.basename(path).removesuffix(".par")
        what = f"`{name}`, `memory <= {percent} %`" if percent is not None else f"`{name}` as written"
        ours = estimate(compiled, GLOO)
        over = limit is not None and ours.memory["total"] > limit
        print(f"| {what} | {best} | {shown(over, ours.step_s)} | {after:.1f} |", flush=True)


if __name__ == "__main__":
    main()
