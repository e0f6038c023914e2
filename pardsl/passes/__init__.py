"""Passes over the lowered program, one file each, each program -> program: FSDP's reshard after forward,
the cut into pipeline stages, fused norms and rotary embeddings, an early count, liveness. The order they
run in is compiler.PASSES_AFTER_LOWERING (and, before it, where a plan needs them, the reshard and the cut)."""
