"""Every example's plan left to the layout search, run against serial: a sweep for crashes.

Each example file has its layout block (and any `memory` line) removed and a bound written instead,
`memory <= P %` for each P of `--bounds`. With `--mesh`, the mesh is replaced too and the inputs are
written `?` (the search may split the batch). Each plan is then run by `pardsl run` on as many gloo
ranks as its mesh has, for `--steps` training steps, every step checked against serial (a pipelined
file's through its schedule).

The sweep prints one line per plan: whether it ran equal to serial, compile and run time, and the last
line of the run's output where it did not. The search found three defects this way (2026-11-23): a
conversion's variable name, a strided all-gather the exported graph viewed, and a split's list of
parts converted as if it were a tensor.

    python benchmarks/searched_examples.py [--bounds 50 25] [--mesh "dp = 2, tp = 2"] [--steps 2]
                                           [--optimizer sgd] [--only SUBSTRING ...] [--nproc-max 4]
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def searched_text(text: str, percent: int, mesh: str | None) -> str:
    """The file with its layouts left to the search under `memory <= percent %`; with `mesh`, on that
    mesh with its inputs written `?`."""
    text = re.sub(r"layout \{.*?\n\}", "", text, flags=re.S)
    text = re.sub(r"^memory.*$", "", text, flags=re.M).rstrip() + "\n"
    if mesh is None:
        return text + f"memory <= {percent} %\n"
    text = re.sub(r"^mesh .*$", f"mesh {mesh}", text, flags=re.M)
    inputs = re.findall(r"^input\s+(\w+)", text, flags=re.M)
    return text + "layout {\n" + "".join(f"    {name} : ?\n" for name in inputs) + f"}}\nmemory <= {percent} %\n"


def ranks(text: str) -> int:
    mesh = re.search(r"^mesh (.*)$", text, flags=re.M).group(1)
    return math.prod(int(size) for size in re.findall(r"=\s*(\d+)", mesh))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bounds", type=int, nargs="+", default=[50, 25])
    parser.add_argument("--mesh", help='replace every file\'s mesh, its inputs written `?` ("dp = 2, tp = 2")')
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw"])
    parser.add_argument("--only", nargs="+", help="files whose path contains one of these")
    parser.add_argument("--nproc-max", type=int, default=4, help="skip meshes of more ranks (2 cores here)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per plan, compile and run")
    args = parser.parse_args()

    files = sorted(glob.glob(os.path.join(ROOT, "examples", "*.par"))
                   + glob.glob(os.path.join(ROOT, "examples", "tp_schemes", "*.par")))
    if args.only:
        files = [f for f in files if any(s in f for s in args.only)]
    failed = 0
    with tempfile.TemporaryDirectory() as folder:
        for path in files:
            original = open(path).read()
            pipeline = re.search(r"^pipeline\s+(\w+)", original, flags=re.M)
            if args.mesh and pipeline and not re.search(rf"\b{pipeline.group(1)}\s*=", args.mesh):
                print(f"skipped  {os.path.relpath(path, ROOT)}: --mesh has no axis {pipeline.group(1)} for its pipeline")
                continue
            for percent in args.bounds:
                text = searched_text(original, percent, args.mesh)
                nproc = ranks(text)
                name = f"{os.path.relpath(path, ROOT)} at {percent} %"
                if nproc > args.nproc_max:
                    print(f"skipped  {name}: {nproc} ranks")
                    continue
                plan = os.path.join(folder, "plan.par")
                with open(plan, "w") as handle:
                    handle.write(text)
                start = time.perf_counter()
                command = [sys.executable, "-m", "pardsl.cli", "run", plan, "--nproc", str(nproc), "--steps",
                           str(args.steps), "--optimizer", args.optimizer, "--timeout", "120"]
                try:
                    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
                    output, ok = result.stdout + result.stderr, result.returncode == 0
                except subprocess.TimeoutExpired:
                    output, ok = f"no result within {args.timeout} s", False
                seconds = time.perf_counter() - start
                if ok and "equivalent to serial" in output:
                    print(f"ok       {name}: {nproc} ranks, {seconds:.0f} s")
                else:
                    failed += 1
                    last = [line for line in output.splitlines() if line.strip()][-1:] or ["(no output)"]
                    print(f"FAILED   {name}: {nproc} ranks, {seconds:.0f} s: {last[0][:200]}")
    print(f"{failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
