"""Rollouts: the engine interface, the embedded torch engine, Samples, rewards and prompt data.

    from megapkl.rollout import EmbeddedEngine, SamplingParams, PromptDataset, PromptIterator
    engine = EmbeddedEngine(hf_config_dict(spec), seed=0)
    engine.update_weights(exported_hf_tensors, version=0)
    samples = engine.generate([ds[i] for i in it.next_indices(32)], n=8, sampling=SamplingParams())
    rewards = reward(samples)   # the trainer packs samples: megapkl.parallel.batching

Heavy dependencies (transformers, math-verify, pyarrow) load only when the class that needs them
is used, so importing this package stays cheap.
"""
from megapkl.rollout.data import (DataError, PromptDataset, PromptIterator, PromptRecord,
                                  build_prompt_dataset, read_prompt_file, render_prompt)
from megapkl.rollout.engine import (RolloutEngine, RolloutEngineError, SamplingParams,
                                    WeightUpdateError)
from megapkl.rollout.rewards import MathReward, Reward, SyntheticReward, build_reward, last_boxed
from megapkl.rollout.sample import PromptItem, Sample
from megapkl.rollout.synthetic import CharTokenizer, make_synthetic_task


def __getattr__(name):
    # The embedded engine imports transformers lazily inside its methods, but keep even the
    # module import on demand so `import megapkl.rollout` never touches it.
    if name == "EmbeddedEngine":
        from megapkl.rollout.embedded import EmbeddedEngine
        return EmbeddedEngine
    raise AttributeError(name)


__all__ = ["RolloutEngine", "RolloutEngineError", "WeightUpdateError", "SamplingParams",
           "EmbeddedEngine", "PromptItem", "Sample",
           "Reward", "MathReward", "SyntheticReward", "build_reward", "last_boxed",
           "PromptDataset", "PromptIterator", "PromptRecord", "DataError", "build_prompt_dataset",
           "read_prompt_file", "render_prompt", "CharTokenizer", "make_synthetic_task"]
