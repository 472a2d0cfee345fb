"""Independent, naive float64 reference of docs/spec.md objectives (no imports from
megapkl.objectives)."""
