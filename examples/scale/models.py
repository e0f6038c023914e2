"""The model factory of the plans in this folder.

pardsl imports a plan's model module from the plan's folder, and from the folder above its package only
where the plan's folder lies inside that package: a plan in examples/scale/ naming `examples.hf_models`
would find nothing, while `examples.scale.models` puts the repository root on the path, from which
this module imports the factory.
"""

from examples.hf_models import llama_causal_lm

__all__ = ["llama_causal_lm"]
