"""Cost-model figures that tests pin, so that what they expect does not move with the defaults."""

from pardsl.planning.cost import LinkCost, Machine
from pardsl.layouts.algebra import COLLECTIVE_KINDS

# gloo's defaults until 2026-11-25: round figures (α 100 µs per ring step and 1 GB/s for every collective,
# 20 GFLOP/s, 5 GB/s, half of a collective hidden behind compute). The search's own tests were worked
# out under them: their expected plans, estimates and counts check how the search decides (pair moves,
# memory, orders), not which figures a machine has. The defaults are now a measured machine's
# (pardsl/planning/cost.py); the tests of what the search finds on such a machine (rediscovery) use those.
ROUND_GLOO = Machine("gloo", {kind: LinkCost(1e-4, 1e-9) for kind in COLLECTIVE_KINDS}, 2e10, 5e9, 1e-5,
                     "round figures (gloo's defaults until 2026-11-25)", overlap=0.5)
