"""megapkl: off-policy RL post-training of LLMs on megatron-core."""

__version__ = "0.1.0"
