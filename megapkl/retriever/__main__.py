"""`python -m megapkl.retriever index|serve ...` (what a managed retriever runs)."""
import sys

from megapkl.retriever.cli import main

sys.exit(main())
