"""The engine context a one-process run of `cfg` gives its engine (the trainer builds it from the
model section, the run directory, the seed and the layout: megapkl.rollout.factory)."""
import dataclasses

from megapkl.config.layout import Layout
from megapkl.rollout.factory import engine_context
from megapkl.rollout.sglang.placement import ranks_per_node


def context_of(cfg, hf_config: dict, *, replicas: int = 1, **kw):
    """`replicas`: the data-parallel size of the context's layout (whatever parallel.data says:
    a test builds one replica's engine); the ranks per node are this process's
    (LOCAL_WORLD_SIZE), as in the trainer; the environment's stop strings are the run's
    (megapkl.envs.stop_strings), as the trainer hands them to its engine."""
    from megapkl.envs import stop_strings

    kw.setdefault("stop", stop_strings(cfg.env))
    lay = dataclasses.replace(Layout.of(cfg.parallel, per_node=ranks_per_node()), dp=replicas)
    return engine_context(cfg.model, hf_config, work_dir=cfg.run_dir, seed=cfg.seed, layout=lay,
                          **kw)
