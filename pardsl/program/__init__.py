"""The program: its IR, lowering a typed graph to it, and rendering it as one SPMD module."""
