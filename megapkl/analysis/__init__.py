"""What reads finished runs: method comparisons (paired statistics), plots, diagnostics, the demo and
`megapkl eval` of a run directory. Nothing in training imports this package."""
