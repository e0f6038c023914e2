"""Does the cost model rank plans as they measure? Seven plans of one transformer layer — data parallel,
ZeRO-3, Megatron TP on 2 and 4 ranks, Megatron-SP, 2-D and data × tensor parallel — each estimated by
pardsl's cost model (pardsl/planning/cost.py, with this machine's calibration file when `pardsl calibrate` has
written one) and measured with `pardsl run`'s machinery (median compiled step over the steps, each rank
checked against serial). Prints both, their orders, and Spearman's rank correlation.

    python benchmarks/cost_model.py [--steps 6]
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = "examples.models:TransformerLayer(d_model=256, n_head=8, d_ff=1024)"
INPUT = "x : float32[8, 32, 256]"
MEGATRON = """    q.weight : S(0) @ {a}
    q.bias : S(0) @ {a}
    k.weight : S(0) @ {a}
    k.bias : S(0) @ {a}
    v.weight : S(0) @ {a}
    v.bias : S(0) @ {a}
    o.weight : S(1) @ {a}
    mlp.fc1.weight : S(0) @ {a}
    mlp.fc1.bias : S(0) @ {a}
    mlp.fc2.weight : S(1) @ {a}
"""
PLANS = {
    "data parallel (dp 2)": ("dp = 2", "    x : S(0) @ dp\n    output : S(0) @ dp\n"),
    "ZeRO-3 (dp 2)": ("dp = 2", "    x : S(0) @ dp\n    output : S(0) @ dp\n    *.weight : S(0) @ dp\n"
                      "    *.bias : S(0) @ dp\n    mlp.*.weight : S(0) @ dp\n    mlp.*.bias : S(0) @ dp\n"),
    "Megatron TP (tp 2)": ("tp = 2", "    x : B\n    output : B\n" + MEGATRON.format(a="tp")),
    "Megatron-SP (tp 2)": ("tp = 2", "    x : S(1) @ tp\n    output : S(1) @ tp\n" + MEGATRON.format(a="tp")),
    "Megatron TP (tp 4)": ("tp = 4", "    x : B\n    output : B\n" + MEGATRON.format(a="tp")),
    "dp 2 × tp 2": ("dp = 2, tp = 2", "    x : S(0) @ dp\n    output : S(0) @ dp\n" + MEGATRON.format(a="tp")),
    "2-D (r 2 × c 2)": ("r = 2, c = 2", "    x : [S(0), S(2)]\n    output : [S(0), S(2)]\n"
                        + "".join(f"    {w} : [S(1), S(0)]\n" for w in ("q.weight", "k.weight", "v.weight",
                                                                       "o.weight", "mlp.fc1.weight", "mlp.fc2.weight"))
                        + "    *.bias : [B, S(0)]\n    mlp.*.bias : [B, S(0)]\n"),
}


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        result = [0.0] * len(values)
        for rank, index in enumerate(order):
            result[index] = float(rank)
        return result

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    os.chdir(ROOT)

    from pardsl.compiler import compile_text
    from pardsl.planning.cost import estimate, load_machine
    from pardsl.tools.execution import job_for, launch

    machine = load_machine(None, "gloo")
    print(f"machine: {machine.source}")
    rows = []
    for name, (mesh, layout) in PLANS.items():
        text = f"mesh {mesh}\nmodel {MODEL}\ninput {INPUT}\nlayout {{\n{layout}}}\n"
        compiled = compile_text(text, f"<{name}>")
        predicted = estimate(compiled, machine, optimizer="sgd").step_s * 1000
        report = launch(job_for(compiled, steps=args.steps, timeout_s=120))
        assert report["ok"], (name, report["max_rel_err"])
        rows.append((name, compiled.program.mesh.size, predicted, report["step_ms"]["compiled"]))
        print(f"  {name:<22} {rows[-1][1]} ranks  predicted {predicted:8.2f} ms  measured "
              f"{rows[-1][3]:8.2f} ms", flush=True)
    predicted, measured = [r[2] for r in rows], [r[3] for r in rows]
    print()
    print("| plan | ranks | predicted ms | measured ms | predicted rank | measured rank |")
    print("|---|---|---|---|---|---|")
    order_p = sorted(range(len(rows)), key=lambda i: predicted[i])
    order_m = sorted(range(len(rows)), key=lambda i: measured[i])
    for i, (name, ranks, p, m) in enumerate(rows):
        print(f"| {name} | {ranks} | {p:.2f} | {m:.2f} | {order_p.index(i) + 1} | {order_m.index(i) + 1} |")
    print(f"\nSpearman rank correlation, predicted vs measured: {spearman(predicted, measured):.2f}")


if __name__ == "__main__":
    main()
