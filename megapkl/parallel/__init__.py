"""Explicit process groups, the megatron-core CPU compatibility layer, vocab-parallel ops, the
model chunks inside their wrappers (chunks.py) and R3 routing replay per rank (replay.py)."""
