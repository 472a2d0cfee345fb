"""Rollouts: the engine interface, the embedded torch engine, Samples, rewards and prompt data.

    from megapkl.rollout import EmbeddedEngine, SamplingParams, PromptDataset, PromptIterator
    engine = EmbeddedEngine(hf_config_dict(spec), seed=0)
    engine.update_weights(exported_hf_tensors, version=0)
    samples = engine.generate([ds[i] for i in it.next_indices(32)], n=8, sampling=SamplingParams())
    rewards = reward(samples)   # the trainer packs samples: megapkl.parallel.batching

Heavy dependencies (transformers, math-verify, pyarrow) load only when the class that needs them
is used, so importing this package stays cheap.
"""
_HOMES = {
    "DataError": "data", "PromptDataset": "data", "PromptIterator": "data", "PromptRecord": "data",
    "build_prompt_dataset": "data", "read_prompt_file": "data", "render_prompt": "data",
    "RolloutEngine": "engine", "RolloutEngineError": "engine", "SamplingParams": "engine",
    "WeightUpdateError": "engine", "MathReward": "rewards", "Reward": "rewards",
    "SyntheticReward": "rewards", "build_reward": "rewards", "last_boxed": "rewards",
    "PromptItem": "sample", "Sample": "sample", "CharTokenizer": "synthetic",
    "make_synthetic_task": "synthetic", "EmbeddedEngine": "embedded",
}


def __getattr__(name):
    # Every name on demand: `import megapkl.rollout.<module>` (the reward worker process, for
    # one) then imports only that module, not torch and transformers with the rest.
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f"megapkl.rollout.{_HOMES[name]}"), name)
    raise AttributeError(name)


__all__ = ["RolloutEngine", "RolloutEngineError", "WeightUpdateError", "SamplingParams",
           "EmbeddedEngine", "PromptItem", "Sample",
           "Reward", "MathReward", "SyntheticReward", "build_reward", "last_boxed",
           "PromptDataset", "PromptIterator", "PromptRecord", "DataError", "build_prompt_dataset",
           "read_prompt_file", "render_prompt", "CharTokenizer", "make_synthetic_task"]
