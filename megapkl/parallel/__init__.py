"""Explicit process groups, the megatron-core CPU compatibility layer and vocab-parallel ops."""
