"""Independent, naive float64 reference of SPEC.md objectives (no imports from megapkl.objectives)."""
