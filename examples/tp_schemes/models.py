"""The models of the plans in this folder, by a name their folder reaches.

pardsl imports a plan's model module from the plan's folder, and from the folder above its package only
where the plan's folder lies inside that package: a plan in examples/tp_schemes/ naming `examples.models`
would find nothing, while `examples.tp_schemes.models` puts the repository root on the path, from which
this module imports the models.
"""

from examples.models import MLP, TransformerLayer

__all__ = ["MLP", "TransformerLayer"]
