"""In-training evaluation every `eval.every` updates (and before the first with `eval.at_start`).

Training pauses for it: every rank takes part in the weight export (a collective), each data-
parallel replica's engine rank evaluates every dp_size-th prompt of each benchmark with the
current weights, the records are gathered on rank 0, which writes RUN_DIR/eval/step_XXXXXX.json
(+ .samples.jsonl) and returns the scalars that go into that update's metrics.jsonl row and
TensorBoard (`eval/<benchmark>/<metric>`, `eval/micro_avg/accuracy`, `eval/version`). The engine
gets its previous weights back afterwards, so the rollout schedule (and a resumed run) sees the
same engine state as without evaluation; eval sampling uses its own seeds and leaves the training
generators alone.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist


def eval_tokenizer(cfg) -> Any:
    """The synthetic task's tokenizer, or the model's HF tokenizer (a local directory)."""
    if cfg.data.synthetic:
        from megapkl.rollout.synthetic import make_synthetic_task

        return make_synthetic_task(cfg.data.synthetic).tokenizer
    source = cfg.model.tokenizer or cfg.model.hf_checkpoint
    if not source:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


class Evaluator:
    """Owned by the trainer; `after_update(u)` returns the metrics to merge into update u's row."""

    def __init__(self, trainer) -> None:
        from megapkl.eval.runner import Scoring, load_benchmarks

        self.t = trainer
        cfg = trainer.cfg
        self.cfg = cfg.eval
        self.benchmarks = load_benchmarks(cfg.eval, cfg.data, trainer.rollouts.tokenizer)
        self.scoring = Scoring(tokenizer=None if cfg.data.synthetic else trainer.rollouts.tokenizer,
                               timeout_s=cfg.eval.verify_timeout_s)
        self.out_dir = Path(cfg.run_dir) / "eval"
        self.pending: dict[str, float] = {}

    @classmethod
    def create(cls, trainer) -> Optional["Evaluator"]:
        """None when evaluation is off; with eval.at_start, evaluates the initial policy now."""
        if trainer.cfg.eval.every == 0 and not trainer.cfg.eval.at_start:
            return None
        ev = cls(trainer)
        if trainer.cfg.eval.at_start and trainer.start == 0:
            ev.pending = ev.run(0)
        return ev

    def after_update(self, u: int) -> dict[str, float]:
        out, self.pending = self.pending, {}
        every = self.cfg.every
        if every > 0 and (u + 1) % every == 0:  # (every 1 + at_start: version 0 only in its file)
            out = self.run(u + 1)
        return out

    def run(self, version: int) -> dict[str, float]:
        """Collective. An engine failure on any rank raises EnginesDown on every rank (after the
        gather, so no rank is left alone in a collective)."""
        from megapkl.eval.runner import flat_metrics, settings, summarize_records, write_results
        from megapkl.train.rollouts import EnginesDown

        t = self.t
        failure, records = self._evaluate_here(version)
        gathered = [(failure, records)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (failure, records))
        failures = [f for f, _ in gathered if f]
        if failures:
            raise EnginesDown("; ".join(dict.fromkeys(failures)))
        if t.rank != 0:
            return {}
        everything = [r for _, part in gathered for r in part]
        summary = {"step": version, **summarize_records(self.benchmarks, everything),
                   "settings": settings(self.cfg, t.cfg.rollout, self.benchmarks)}
        write_results(self.out_dir, version, summary, everything)
        return flat_metrics(summary)

    def _evaluate_here(self, version: int) -> tuple[Optional[str], list]:
        """(None, this rank's records) or (the engine's failure on one line, [])."""
        from megapkl.eval.runner import evaluate
        from megapkl.rollout.engine import RolloutEngineError
        from megapkl.train.rollouts import one_line

        t = self.t
        stage = t.rollouts
        export = t.learner.export()  # collective: every rank iterates it to the end
        if stage.engine is None:
            for _ in export:
                pass
            return None, []
        previous = stage.engine.version
        try:
            # FP8 rollouts: the engine only ever gets FP8
            weights = stage.transform(export) if stage.transform is not None else export
            stage.engine.update_weights(weights, version=version)
            records = evaluate(stage.engine, self.benchmarks, self.cfg, t.cfg.rollout, step=version,
                               seed=t.cfg.seed, scoring=self.scoring,
                               share=(t.groups.dp_rank, t.groups.dp_size))
            if previous is not None and previous != version and previous in stage.store.versions():
                stage._use_version(previous)  # back to the version rollouts were using
            return None, records
        except RolloutEngineError as exc:
            for _ in export:  # the rest of the export, which the other ranks are iterating
                pass
            stage.checkpoint_engine_at(previous)  # the version rollouts were using, not the eval's
            return one_line(str(exc)), []

    def close(self) -> None:
        self.scoring.close()
