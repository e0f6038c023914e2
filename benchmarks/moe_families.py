"""transformers' mixture-of-experts families as the library writes them, on ep = 2 and ep = 2 × tp = 2,
under a written plan (expert parallel over ep; on tp, tensor parallel inside every expert) and under the
search (`memory <= 60 %`, nothing written), each run for two training steps on gloo ranks against
serial. Printed per family and plan: equal to serial, whether the collectives and the fixed bytes
measured are the planned ones, how the experts were laid out, compile seconds, the collectives per step,
and each rank's all-to-all bytes as routed (planned for a balanced routing).

    python benchmarks/moe_families.py [--only Mixtral GptOss ...]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the experts' weights written split: over ep (expert parallel), and over tp inside every expert (gate and
# up concatenated: a blocked split; GPT-OSS's, stored transposed and interleaved: a plain one)
WRITTEN = {
    "ep = 2": lambda family: {"gate_up_proj": "S(0)", "down_proj": "S(0)"},
    "ep = 2, tp = 2": lambda family: {"gate_up_proj": "[S(0), S(2)]", "gate_up_proj_bias": "[S(0), S(1)]",
                                      "down_proj": "[S(0), S(1)]"} if family == "GptOss" else
    {"gate_up_proj": "[S(0), S(1, blocks=2)]", "down_proj": "[S(0), S(2)]"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="families to run (default: all)")
    args = parser.parse_args()
    os.chdir(ROOT)
    sys.path.insert(0, ROOT)
    from benchmarks.families import _nonzero
    from examples.more_families import MOE_FAMILIES, moe_plan
    from pardsl.compiler import compile_text
    from pardsl.language.diagnostics import CompileError
    from pardsl.tools.execution import job_for
    from pardsl.tools.pool import WorkerPool

    print("| family | mesh | plan | equal to serial | measured = planned | experts | compile (s) | "
          "collectives per step | all-to-all bytes as routed, forward (planned) |")
    print("|---|---|---|---|---|---|---|---|---|")
    pools = {}
    try:
        for mesh, ranks in (("ep = 2", 2), ("ep = 2, tp = 2", 4)):
            pools[ranks] = WorkerPool(ranks, timeout_s=300)
            for family in MOE_FAMILIES:
                if args.only and family not in args.only:
                    continue
                for plan in ("written", "search"):
                    text = moe_plan(family, mesh, WRITTEN[mesh](family)) if plan == "written" else \
                        moe_plan(family, mesh, memory="60 %")
                    started = time.perf_counter()
                    try:
                        compiled = compile_text(text, os.path.join(ROOT, "benchmarks", "moe.par"))
                    except CompileError as error:
                        print(f"| {family} | {mesh} | {plan} | compile error {error.diagnostics[0].code} |"
                              " — | — | — | — | — |", flush=True)
                        continue
                    seconds = time.perf_counter() - started
                    report = pools[ranks].run(job_for(compiled, steps=2, timeout_s=300))
                    program = compiled.program
                    planned = report["collectives"] == program.collective_counts() and report["bytes"] == program.fixed_bytes()
                    calls = [line for line in compiled.source.splitlines() if "rt.experts(" in line]
                    forms = sorted({form for line in calls
                                    for form in re.findall(r"(?:expert_parallel|intermediate)=\('\w+',\)", line)})
                    routed = ", ".join(str(r["forward"]) for r in report.get("routed_bytes", [])) or "—"
                    print(f"| {family} | {mesh} | {plan} | {'yes' if report['ok'] else 'NO'} | "
                          f"{'yes' if planned else 'NO'} | {' '.join(forms) or 'data parallel / whole'} | "
                          f"{seconds:.1f} | {_nonzero(program.collective_counts())} | {routed} "
                          f"({program.routed_bytes()['forward']}) |", flush=True)
    finally:
        for pool in pools.values():
            pool.close()


if __name__ == "__main__":
    main()
