"""A rank's measured memory (pardsl/tools/memory.py): what a step makes on top of what it held, views and
in-place writes not counted twice."""

import torch

from pardsl.tools.memory import held_bytes, peak_measured


def test_the_cpu_peak_counts_what_a_step_makes_and_not_its_views():
    x = torch.ones(1024)  # 4 KiB, held as the step begins
    with peak_measured(torch.device("cpu"), held_bytes([x, x[:10]])) as peak:
        y = x * 2  # 4 KiB made
        z = y.view(32, 32).t()  # a view: nothing made
        z.mul_(3)  # in place: nothing made
        del y, z
        w = torch.empty(2048)  # 8 KiB made, once the 4 KiB are freed
        del w
    assert peak == [4096 + 8192]
