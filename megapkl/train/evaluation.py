"""In-training evaluation every `eval.every` updates (and before the first with `eval.at_start`).

Training pauses for it: every rank takes part in writing the current weights into the version
store (the collective export; the next update does not export them again), each engine (a
data-parallel replica's, or one per node of a replica with colocated fleets there) loads them
from there and evaluates its share (every n-th prompt of each benchmark, n the run's engines),
the records are gathered on rank 0, which writes (agreed: a failed write stops every rank)
RUN_DIR/eval/step_XXXXXX.json (+ .samples.jsonl) and returns the scalars that go into that update's metrics.jsonl row and
TensorBoard (`eval/<benchmark>/<metric>`, `eval/micro_avg/accuracy`, `eval/version`). The engine
gets its previous weights back afterwards, so the rollout schedule (and a resumed run) sees the
same engine state as without evaluation; eval sampling uses its own seeds and leaves the training
generators alone. A failure on any rank (the engine, the weight push) is agreed: RanksFailed on
every rank, the engine recorded at the version rollouts were using.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import torch.distributed as dist

from megapkl.train.agree import agree, attempt


class Evaluator:
    """Owned by the trainer; handed the sections, the policy versions, the engine slot and the
    export."""

    def __init__(self, eval_cfg: Any, rollout_cfg: Any, data_cfg: Any, *, seed: int,
                 tokenizer: Any, out_dir: Path, dp: tuple[int, int], versions: Any, slot: Any,
                 export: Callable[[], Iterable], turns: Any = None) -> None:
        from megapkl.eval.runner import Scoring, load_benchmarks

        self.cfg, self.rollout_cfg, self.seed = eval_cfg, rollout_cfg, seed
        self.benchmarks = load_benchmarks(eval_cfg, data_cfg, tokenizer)
        self.scoring = Scoring(tokenizer=None if data_cfg.synthetic else tokenizer,
                               timeout_s=eval_cfg.verify_timeout_s)
        self.out_dir, self.dp, self.export = Path(out_dir), dp, export
        self.versions, self.slot = versions, slot
        self.turns = turns  # multi-turn: the rollouts' environment driver (engines only)

    def due(self, u: int) -> bool:
        """Is the evaluation after update u due (eval.every)?"""
        every = self.cfg.every
        return every > 0 and (u + 1) % every == 0

    def run(self, version: int) -> dict[str, float]:
        """Collective: the eval/* metrics of the current weights (rank 0; {} elsewhere)."""
        from megapkl.eval.runner import flat_metrics, settings, summarize_records, write_results

        error, records = self._evaluate_here(version)
        agree(error, what="the evaluation")
        gathered = [records]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, records)
        summary: dict = {}

        def results() -> None:  # rank 0: the files; agreed, so a full disk stops every rank
            everything = [r for part in gathered for r in part]
            summary.update({"step": version, **summarize_records(self.benchmarks, everything),
                            "settings": settings(self.cfg, self.rollout_cfg, self.benchmarks)})
            write_results(self.out_dir, version, summary, everything)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        _, error = attempt(results) if rank0 else (None, None)
        agree(error, what="writing the evaluation's results")
        return flat_metrics(summary) if rank0 else {}

    def _evaluate_here(self, version: int):
        """(None, this rank's records), or (what failed here, [])."""
        from megapkl.eval.runner import evaluate

        self.versions.remember(version, self.export)  # collective: into the store, as rollouts
        self.slot.make_room()  # collective: the servers' memory comes back for the evaluation
        if not self.slot.has_engine:
            return None, []

        def records() -> list:  # between generations ahead of training (rollout.async_batches)
            with self.slot.borrowed(version) as engine:  # back at the rollouts' version after
                return evaluate(engine, self.benchmarks, self.cfg, self.rollout_cfg, step=version,
                                seed=self.seed, scoring=self.scoring, share=self.dp,
                                turns=self.turns)
        got, error = attempt(records)
        return error, got or []

    def close(self) -> None:
        self.scoring.close()
