"""The RL train loop, protocol schedules, logging and plots.

`megapkl.train.run(cfg, ctx=None)` is the entry point every rank calls (the Slurm launcher's
default entry, `megapkl.train:run`); it imports torch and megatron only when called.
"""


def run(cfg, ctx=None):
    from megapkl.train.loop import run as _run

    return _run(cfg, ctx)
