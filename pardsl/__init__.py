"""pardsl: a declarative model-parallel compiler for PyTorch."""

__version__ = "0.1.0"
