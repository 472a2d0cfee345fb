"""Rollout stage of the train loop: prompts -> engine (at the scheduled versions) -> rewards ->
advantages -> dynamic sampling, for this data-parallel rank's share of a global batch.

Every rank walks the same prompt sequence; data-parallel rank d takes its contiguous slice of each
draw, so the global batch does not depend on the DP size. Within a model-parallel replica (the
ranks sharing a DP index) only the first rank runs the engine and broadcasts the samples. The
policy versions the schedule still needs are files of a `VersionStore` (Hugging Face names, block
FP8 when rollout.fp8), written once by global rank 0 and loaded by each engine through the disk
path, so stale protocols (controlled staleness, uniform stale) generate from exact old weights
without holding them in host memory.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megapkl.objectives.advantages import compute_advantages
from megapkl.objectives.sis import mix64_int
from megapkl.parallel.groups import group_device
from megapkl.rollout.data import PromptIterator, build_prompt_dataset
from megapkl.rollout.engine import RolloutEngineError, SamplingParams
from megapkl.rollout.rewards import build_reward
from megapkl.rollout.sample import Sample
from megapkl.train.version_store import VersionStore

MAX_ROUNDS = 64  # upper bound of advantage.max_fill_rounds: spaces the group ids of refill rounds


class RolloutError(RuntimeError):
    pass


class EnginesDown(RolloutError):
    """Raised on every rank together when some replica's rollout engine could not serve a batch
    (rollout.sglang.no_engine_timeout_s passed with no server up, ...). The message joins the
    failing engines' own, on one line; the prompt iterator is back where the batch began."""


@dataclasses.dataclass
class _Outage:
    """What a replica leader broadcasts instead of samples when its engine failed."""
    message: str


def build_tokenizer_and_data(cfg):
    """(tokenizer, dataset, task) for the run's data section."""
    task = None
    if cfg.data.synthetic:
        from megapkl.rollout.synthetic import make_synthetic_task

        task = make_synthetic_task(cfg.data.synthetic)
        tokenizer = task.tokenizer
    else:
        from transformers import AutoTokenizer

        source = cfg.model.tokenizer or cfg.model.hf_checkpoint
        if not source:
            raise RolloutError("data.train_path needs a tokenizer: set model.tokenizer or "
                               "model.hf_checkpoint to a local directory")
        tokenizer = AutoTokenizer.from_pretrained(source)
    dataset = build_prompt_dataset(cfg.data, tokenizer, max_prompt_len=cfg.rollout.max_prompt_len)
    return tokenizer, dataset, task


def build_run_engine(cfg, spec, tokenizer, replica: int = 0, replicas: int = 1):
    """The run's rollout engine (rollout.engine) on the device and in the dtype the trainer's
    model dtype calls for; empty: weights come through update_weights. `replica` of `replicas`:
    the data-parallel leader building it (each has its own engine)."""
    from megapkl.models.provider import engine_placement
    from megapkl.models.spec import hf_config_dict
    from megapkl.rollout.factory import build_engine

    device, dtype = engine_placement(cfg.model.dtype)
    return build_engine(cfg, hf_config_dict(spec, dtype=str(dtype).split(".")[-1]), tokenizer,
                        device=device, dtype=dtype, replica=replica, replicas=replicas)


class RolloutStage:
    def __init__(self, cfg, spec, *, dp_rank: int, dp_size: int, leader: bool,
                 replica_group: Any, dp_group: Any) -> None:
        r = cfg.rollout
        if r.prompts_per_batch % (dp_size * r.minibatches_per_batch):
            raise RolloutError(
                f"rollout.prompts_per_batch ({r.prompts_per_batch}) must be divisible by the "
                f"data-parallel size ({dp_size}) x rollout.minibatches_per_batch "
                f"({r.minibatches_per_batch}) so every rank holds whole prompt groups")
        self.cfg, self.dp_rank, self.dp_size, self.leader = cfg, dp_rank, dp_size, leader
        self.replica_group, self.dp_group = replica_group, dp_group
        self.tokenizer, self.dataset, task = build_tokenizer_and_data(cfg)
        self.reward = build_reward(cfg.reward, cfg.data, self.tokenizer, task)
        self.prompts = PromptIterator(len(self.dataset), seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        self.per_rank = r.prompts_per_batch // dp_size
        self.group_size = r.responses_per_prompt
        k = r.topk_logprobs or 0
        self.sampling = SamplingParams.from_rollout_config(r, topk_logprobs=k,
                                                           return_routed_experts=cfg.model.routing_replay)
        writer = not dist.is_initialized() or dist.get_rank() == 0
        self.store = VersionStore(Path(cfg.run_dir) / "policy_versions", writer=writer)
        self.transform = None
        if r.fp8:  # versions are stored (and pushed) already quantized
            from megapkl.rollout.fp8 import FP8Transform

            self.transform = FP8Transform()
        self.loads = {"rollout/versions_loaded": 0.0, "time/version_load_s": 0.0}
        self.engine = None
        self._checkpoint_version: Optional[tuple[Optional[int]]] = None  # set by an outage
        if leader:
            self.engine = build_run_engine(cfg, spec, self.tokenizer, dp_rank, dp_size)

    # ------------------------------------------------------------------ weights

    def remember(self, version: int, weights) -> None:
        """Save the weights of `version` (an iterator of (HF name, tensor); consumed on every rank
        because the export is collective, written only by the store's writer). Collective."""
        if self.transform is not None and self.store.writer:
            weights = self.transform(weights)
        self.store.save(version, weights)
        if dist.is_initialized():
            dist.barrier()  # every engine rank may read the file from here on

    def forget_before(self, version: int) -> None:
        self.store.delete_before(version)
        held, cap = len(self.store.versions()), self.cfg.rollout.snapshot_pool
        if held > cap:
            raise RolloutError(f"rollout.snapshot_pool ({cap}): the schedule needs {held} policy "
                               "versions at once; raise rollout.snapshot_pool")

    def _use_version(self, version: int) -> None:
        if self.engine.version == version:
            return
        t0 = time.perf_counter()
        self.engine.update_weights(self.store.load(version), version)
        self.loads["rollout/versions_loaded"] += 1
        self.loads["time/version_load_s"] += time.perf_counter() - t0

    def load_metrics(self) -> dict[str, float]:
        """Versions this engine loaded from disk, and seconds spent, for the current batch."""
        return dict(self.loads) if self.leader else {}

    # ------------------------------------------------------------------ batches

    def collect(self, batch: int, group_versions: Sequence[int]) -> list[Sample]:
        """This rank's `per_rank` prompt groups of global batch `batch`, with rewards and
        advantages (Sample.advantage). Collective; EnginesDown on every rank when an engine
        failed, with the rollout state as it was before the batch (a checkpoint taken then is
        the one of the last finished update, and a resume regenerates the batch exactly)."""
        prompts, held = self.prompts.state_dict(), self.engine.version if self.leader else None
        if self.leader:
            self.engine.new_batch()
        try:
            return self._collect(batch, group_versions)
        except EnginesDown:
            if self.leader:  # what this rank's engine answered is there for the resumed run
                self.engine.keep_answers()
            self.prompts.load_state_dict(prompts)
            self.checkpoint_engine_at(held)
            raise

    def checkpoint_engine_at(self, version: Optional[int]) -> None:
        """After an engine failure: checkpoints taken from now on record `version` (the one the
        engine held before the failed batch or evaluation) as the engine's, if the store still has
        it (the loop forgets versions the schedule no longer needs at the start of an update);
        else a resume loads what the next batch needs, as the uninterrupted run did."""
        self._checkpoint_version = (version if version in self.store.versions() else None,)

    def _collect(self, batch: int, group_versions: Sequence[int]) -> list[Sample]:
        kept: list[list[Sample]] = []
        drawn = 0
        self.loads = dict.fromkeys(self.loads, 0.0)
        rounds = self.cfg.advantage.max_fill_rounds
        for rnd in range(rounds):
            idx = self.prompts.next_indices(self.cfg.rollout.prompts_per_batch)
            drawn += len(idx)
            mine = range(self.dp_rank * self.per_rank, (self.dp_rank + 1) * self.per_rank)
            groups = self._generate(batch, rnd, [(idx[g], g, group_versions[g]) for g in mine])
            outage = groups.message if isinstance(groups, _Outage) else None
            for members in groups if outage is None else ():
                if self.cfg.advantage.filter_constant_groups and _constant(members):
                    continue
                kept.append(members)
            if self._all_ranks_full(len(kept) >= self.per_rank, outage):
                break
        else:
            raise RolloutError(
                f"dynamic sampling: fewer than {self.per_rank} prompt groups with non-constant "
                f"rewards after {drawn} prompts ({rounds} draws, advantage.max_fill_rounds); the task is too easy or too "
                "hard for the policy (advantage.filter_constant_groups)")
        samples = [s for members in kept[: self.per_rank] for s in members]
        self._advantages(samples)
        return samples

    def _generate(self, batch: int, rnd: int, todo: list[tuple[int, int, int]]
                  ) -> "list[list[Sample]] | _Outage":
        """[(dataset index, global group slot, version)] -> samples per group, on every replica
        rank; an engine failure travels the same way, as an `_Outage`, so that no rank is left
        alone in a collective."""
        out: list[Any] = [None]
        if self.leader:
            try:
                out = [self._generate_here(batch, rnd, todo)]
            except RolloutEngineError as exc:
                out = [_Outage(one_line(str(exc)))]
        if self.replica_group is not None and dist.get_world_size(self.replica_group) > 1:
            dist.broadcast_object_list(out, src=dist.get_global_rank(self.replica_group, 0),
                                       group=self.replica_group)
        return out[0]

    def _generate_here(self, batch: int, rnd: int, todo: list[tuple[int, int, int]]
                       ) -> list[list[Sample]]:
        """The leader's part of `_generate`: run the engine at each scheduled version."""
        groups: dict[int, list[Sample]] = {}
        held = self.engine.version  # first: a refill round starts without a reload
        for version in sorted({v for _, _, v in todo}, key=lambda v: (v != held, v)):
            part = [(i, slot) for i, slot, v in todo if v == version]
            self._use_version(version)
            seed = mix64_int(mix64_int(mix64_int(self.cfg.seed) + batch) + rnd * 7919 + version) >> 1
            sampling = _with_seed(self.sampling, seed)
            samples = self.engine.generate([self.dataset[i] for i, _ in part], self.group_size, sampling)
            self.reward(samples)
            for j, (_, slot) in enumerate(part):
                members = samples[j * self.group_size:(j + 1) * self.group_size]
                self._label(members, batch, rnd, slot)
                groups[slot] = members
        return [groups[slot] for _, slot, _ in todo]

    def _label(self, members: list[Sample], batch: int, rnd: int, slot: int) -> None:
        """Global uid and group id: unique over batches, refill rounds and DP ranks."""
        p, g = self.cfg.rollout.prompts_per_batch, self.group_size
        group_id = (batch * MAX_ROUNDS + rnd) * p + slot
        for j, s in enumerate(members):
            s.group_id, s.uid = group_id, group_id * g + j

    def _all_ranks_full(self, mine: bool, outage: Optional[str] = None) -> bool:
        """Collective over DP: do all ranks hold enough groups? EnginesDown on every rank if any
        replica's engine failed (the replicas learnt it from their leaders' broadcasts)."""
        flag = torch.tensor([0 if mine else 1, 0 if outage is None else 1], dtype=torch.int64,
                            device=group_device(self.dp_group))
        many = self.dp_group is not None and dist.get_world_size(self.dp_group) > 1
        if many:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.dp_group)
        if flag[1].item():
            said: list[Optional[str]] = [outage]
            if many:
                said = [None] * dist.get_world_size(self.dp_group)
                dist.all_gather_object(said, outage, group=self.dp_group)
            raise EnginesDown("; ".join(dict.fromkeys(m for m in said if m)))
        return not flag[0].item()

    def _advantages(self, samples: list[Sample]) -> None:
        a = self.cfg.advantage
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        groups = torch.tensor([s.group_id for s in samples])
        adv = compute_advantages(rewards, groups, a.mode, a.perturb_baseline, a.std_eps)
        for s, v in zip(samples, adv.tolist()):
            s.advantage = v

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self, checkpoint: Optional[Path] = None) -> dict:
        """The versions are referenced by the checkpoint (hard links under
        `<checkpoint>/policy_versions`), never pickled into it."""
        if checkpoint is not None and self.store.writer:
            self.store.link_into(Path(checkpoint) / "policy_versions", self.store.versions())
        held = self.engine.version if self.leader else None
        if self._checkpoint_version is not None:  # after an outage: the version before the batch
            held = self._checkpoint_version[0]
        return {"prompts": self.prompts.state_dict(), "engine_version": held}

    def load_state_dict(self, state: dict, checkpoint: Optional[Path] = None) -> None:
        self.prompts.load_state_dict(state["prompts"])
        if checkpoint is not None and (self.leader or self.store.writer):
            src = Path(checkpoint) / "policy_versions"
            self.store.restore_from(src, VersionStore(src, writer=False).versions())
        v = state["engine_version"]
        if self.leader and v is not None:
            self._use_version(v)


def one_line(text: str) -> str:
    """An engine's multi-line message (a header, then one engine a line) as one line."""
    out = ""
    for line in (" ".join(ln.split()) for ln in text.splitlines()):
        if line:
            out += ("" if not out else " " if out.endswith(":") else "; ") + line
    return out


def _constant(members: Sequence[Sample]) -> bool:
    return len({s.reward for s in members}) == 1


def _with_seed(sampling: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(sampling, seed=seed)

