"""Rollout stage of the train loop: prompts -> engine (at the scheduled versions) -> rewards ->
advantages -> dynamic sampling, for this data-parallel rank's share of a global batch.

Every rank walks the same prompt sequence; data-parallel rank d takes its contiguous slice of each
draw, so the global batch does not depend on the DP size. Within a model-parallel replica (the
ranks sharing a DP index) the first rank runs the engine, or with colocated SGLang fleets on every
node of the replica each node's first rank runs that node's (placement.py): each generates a
contiguous share of the replica's prompt groups (by its servers) and every rank of the replica
gets all the samples. A group's draws depend on its global slot and version only, so how the
groups are shared changes no sample.

The trainer builds the two parts the stage shares with the evaluator and hands them to both: the
policy versions the schedule still needs (train/policy_versions.py: files written once, loaded by
every engine), which it drives (remember, drop, forget_before) as its Schedule says, and this
rank's engine slot (train/engine_slot.py: one unit of work or one evaluation at a time, and the
version a checkpoint records), the only way to the engine. The stage here is the batch collector
(prompts, draw rounds, rewards, advantages, the producer).

Whatever fails on a rank that runs an engine (the engine, a version file, a weight update, the
server's answer, the reward function) is agreed over the data-parallel ranks
(`megapkl.train.agree`): every rank raises the same RanksFailed, with the stage back at the start
of the batch.

Under rollout.async_batches a leader's producer thread (train/producer.py) generates the next
batches' first draws while the trainer trains: each a unit of work (batch, round, [(prompt, slot,
version)]) whose result is a pure function of its key, taken by `_generate` only for exactly the key
the synchronous run would generate (docs/async.md).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megapkl.objectives.advantages import compute_advantages
from megapkl.objectives.sis import mix64_int
from megapkl.parallel.groups import ParallelGroups, replica_group
from megapkl.rollout.engine import RolloutError, SamplingParams
from megapkl.rollout.sample import Sample
from megapkl.rollout.seeds import prompt_seed
from megapkl.rollout.turns import ENV_ERROR_KEY
from megapkl.train.agree import RankError, RanksFailed, agree, attempt
from megapkl.train.engine_slot import EngineSlot, load_order
from megapkl.train.policy_versions import PolicyVersions
from megapkl.train.producer import Producer
from megapkl.train.timers import Timers

MAX_ROUNDS = 64  # upper bound of advantage.max_fill_rounds: spaces the group ids of refill rounds


@dataclasses.dataclass(frozen=True)
class Replica:
    """Where this rank sits among the rollout engines: data-parallel replica `dp_rank` of
    `dp_size`, whose `leader` is its first rank; `owners` (global ranks, in node order) run its
    engines, generating shares of its prompt groups in proportion to `shares` (their servers),
    and the samples reach every rank of the replica over `group`. `eval_share`: this rank's
    share of an evaluation among every engine of the run."""
    dp_rank: int = 0
    dp_size: int = 1
    leader: bool = True
    group: Any = None      # the ranks of this replica
    dp_group: Any = None   # one rank of each replica... every rank's data-parallel peers
    rank: int = 0          # this rank's global rank
    owners: tuple[int, ...] = (0,)
    shares: tuple[int, ...] = (1,)
    eval_share: tuple[int, int] = (0, 1)

    @property
    def engine(self) -> bool:
        """Does this rank run an engine?"""
        return self.rank in self.owners

    def part(self, todo: Sequence[Any], owner: Optional[int] = None) -> list[Any]:
        """The contiguous share of `todo` the engine of `owner` (default: this rank) generates."""
        i = self.owners.index(self.rank if owner is None else owner)
        total, n = sum(self.shares), len(todo)
        bounds = [n * sum(self.shares[:k]) // total for k in range(len(self.shares) + 1)]
        return list(todo[bounds[i]:bounds[i + 1]])

    @classmethod
    def of(cls, g: ParallelGroups, owners: Optional[Sequence[Sequence[tuple[int, int]]]] = None
           ) -> "Replica":
        """Collective over the world (every rank builds every replica's group). `owners`: per
        replica, [(global rank, servers)] of its engines (rollout.factory.engine_owners; default:
        the leader's alone)."""
        leader = g.tp_rank == 0 and g.pp_rank == 0 and g.cp_rank == 0
        group, rank = replica_group(g), dist.get_rank()
        members = dist.get_process_group_ranks(group)
        mine = [(members[0], 1)] if owners is None else list(owners[g.dp_rank])
        if any(r not in members for r, _ in mine):
            raise RolloutError(
                f"the engines of data-parallel replica {g.dp_rank} belong to trainer ranks "
                f"{[r for r, _ in mine]}, but its ranks are {members}: the ranks are not laid out "
                "as the placement assumes (LOCAL_WORLD_SIZE ranks per node, block by block)")
        every = [r for fleets in owners for r, _ in fleets] if owners else []
        share = (every.index(rank), len(every)) if rank in every else (g.dp_rank, g.dp_size)
        return cls(g.dp_rank, g.dp_size, leader, group, g.dp, rank,
                   tuple(r for r, _ in mine), tuple(n for _, n in mine), share)


@dataclasses.dataclass(frozen=True)
class Ahead:
    """Asynchronous rollouts (rollout.async_batches): how many batches to generate ahead, the
    behavior version of each group of a batch (the schedule's) and the run's number of batches."""
    batches: int
    versions_of: Callable[[int], Sequence[int]]
    total: int

    @classmethod
    def of(cls, rollout: Any, schedule: Any, steps: int) -> "Optional[Ahead]":
        """From the rollout section, the run's schedule (train/schedule.py) and its updates
        (train.steps); None without rollout.async_batches."""
        if not rollout.async_batches:
            return None
        return cls(rollout.async_batches, schedule.group_versions,
                   -(-steps // rollout.minibatches_per_batch))


def check_batch_shares(rollout: Any, dp_size: int) -> None:
    """Every data-parallel rank holds whole prompt groups of every minibatch."""
    r = rollout
    if r.prompts_per_batch % (dp_size * r.minibatches_per_batch):
        raise RolloutError(
            f"rollout.prompts_per_batch ({r.prompts_per_batch}) must be divisible by the "
            f"data-parallel size ({dp_size}) x rollout.minibatches_per_batch "
            f"({r.minibatches_per_batch}) so every rank holds whole prompt groups")


class RolloutStage:
    """The batch collector: prompts, draw rounds, rewards, advantages and the generation ahead.
    The trainer hands it the policy versions and this rank's engine slot, which the evaluator
    uses as well; the stage reaches the engine through the slot alone."""

    def __init__(self, rollout: Any, advantage: Any, data: Any, *, dataset: Any, reward: Any,
                 versions: PolicyVersions, slot: EngineSlot, replica: Replica, seed: int,
                 routed_experts: bool = False, turns: Any = None, ahead: Optional[Ahead] = None,
                 timers: Optional[Timers] = None) -> None:
        """The rollout, advantage and data sections (the prompts' order); `dataset`: the prompts;
        `reward`: the scorer (None on a rank without an engine: the replica's engines score);
        `routed_experts`: model.routing_replay, the engine returns its routing; `turns`: the
        multi-turn environment's turn driver (engines only), or None; `ahead`: generation ahead
        of training (rollout.async_batches, engines only)."""
        from megapkl.rollout.data import PromptIterator

        self.rollout, self.advantage, self.seed = rollout, advantage, seed
        self.dataset, self.reward, self.turns = dataset, reward, turns
        self.versions, self.slot, self.replica = versions, slot, replica
        self.sampling = SamplingParams.from_rollout_config(
            rollout, topk_logprobs=rollout.topk_logprobs or 0, return_routed_experts=routed_experts)
        self.timers = timers or Timers()
        self.prompts = PromptIterator(len(dataset), seed=data.seed, shuffle=data.shuffle)
        self.per_rank = rollout.prompts_per_batch // replica.dp_size
        self.group_size = rollout.responses_per_prompt
        self.versions_loaded = 0
        self.ahead = ahead  # generation ahead (engines only): one unit of work at a time
        self.producer: Optional[Producer] = None

    def load_metrics(self) -> dict[str, float]:
        """Versions this replica's engine switched to for the current batch, counted from the one
        the previous batch left it at (an evaluation or generation ahead may load more)."""
        return {"rollout/versions_loaded": float(self.versions_loaded)} if self.replica.leader \
            else {}

    # ------------------------------------------------------------------ batches

    def collect(self, batch: int, group_versions: Sequence[int]) -> list[Sample]:
        """This rank's `per_rank` prompt groups of global batch `batch`, with rewards and
        advantages (Sample.advantage). Collective; on a failure anywhere, RanksFailed on every
        rank with the rollout state as it was before the batch (a checkpoint taken then is the one
        of the last finished update, and a resume regenerates the batch exactly)."""
        prompts, held = self.prompts.state_dict(), self.slot.held
        self.versions_loaded = 0
        self.slot.make_room()
        try:
            samples = self._collect(batch, group_versions)
            self._plan_ahead(batch)
            return samples
        except RanksFailed:
            self.stop_ahead()  # the run stops: no more generation ahead
            self.slot.keep_answers()  # what it answered is there for the resumed run
            self.prompts.load_state_dict(prompts)
            self.slot.failed_with(held)
            raise

    def _collect(self, batch: int, group_versions: Sequence[int]) -> list[Sample]:
        kept: list[list[Sample]] = []
        drawn = 0
        rounds = self.advantage.max_fill_rounds
        for rnd in range(rounds):
            idx = self.prompts.next_indices(self.rollout.prompts_per_batch)
            drawn += len(idx)
            r = self.replica
            mine = range(r.dp_rank * self.per_rank, (r.dp_rank + 1) * self.per_rank)
            groups = self._generate(batch, rnd, [(idx[g], g, group_versions[g]) for g in mine])
            failure = groups if isinstance(groups, RankError) else None
            for members in groups if failure is None else ():
                if self.advantage.filter_constant_groups and _constant(members):
                    continue
                kept.append(members)
            short, = agree(failure, r.dp_group, what="the rollout",
                           flags=[int(len(kept) < self.per_rank)])
            if not short:
                break
        else:
            raise RolloutError(
                f"dynamic sampling: fewer than {self.per_rank} prompt groups with non-constant "
                f"rewards after {drawn} prompts ({rounds} draws, advantage.max_fill_rounds); the "
                "task is too easy or too hard for the policy (advantage.filter_constant_groups)")
        samples = [s for members in kept[: self.per_rank] for s in members]
        self._advantages(samples)
        return samples

    def _generate(self, batch: int, rnd: int, todo: list[tuple[int, int, int]]
                  ) -> "list[list[Sample]] | RankError":
        """[(dataset index, global group slot, version)] -> samples per group, on every replica
        rank; what an engine raised travels the same way, as a RankError, so that no rank is
        left alone in a collective."""
        r, g = self.replica, self.replica.group
        mine = None
        if r.engine:
            mine = self._unit_here((batch, rnd, tuple(r.part(todo))), todo)
        if g is None or dist.get_world_size(g) == 1:
            return mine
        if len(r.owners) == 1:
            out = [mine]
            dist.broadcast_object_list(out, src=r.owners[0], group=g)
            return out[0]
        parts: list[Any] = [None] * dist.get_world_size(g)
        dist.all_gather_object(parts, mine, group=g)
        shares = [parts[dist.get_group_rank(g, o)] for o in r.owners]
        failed = [p for p in shares if isinstance(p, RankError)]
        return failed[0] if failed else [members for p in shares for members in p]

    # ------------------------------------------------------------------ units of work (leader)

    def _unit_here(self, key: tuple, whole: Sequence[tuple[int, int, int]]
                   ) -> "list[list[Sample]] | RankError":
        """An engine's part of `_generate`: the unit `key` (batch, round, its share of `whole`),
        generated ahead if it was (rollout.async_batches), else here; its time goes to this
        batch. The versions loaded are counted for `whole` from the one the previous unit left
        (the slot's): what one synchronous engine loads, however the engines were used in between
        and however the replica's groups were shared."""
        if not key[2]:  # more engines than groups: nothing here
            self._count_loads(whole)
            return []
        got = None
        if self.ahead is not None:
            with self.timers("wait"):
                got = self.producer.take(key) if self.producer is not None else None
        if got is None:
            try:
                got = self._work(key)
            except Exception as exc:  # noqa: BLE001 - as the producer thread: agreed by _generate
                got = self._failed_unit(exc)
        groups, error, timers = got
        self.timers.absorb(timers)
        if error is not None:
            return error
        self._count_loads(whole)
        return groups

    def _count_loads(self, whole: Sequence[tuple[int, int, int]]) -> None:
        self.versions_loaded += self.slot.count_loads(v for _, _, v in whole)

    def _work(self, key: tuple) -> tuple:
        """(groups, error, its timers) of one unit, with the engine held; the groups are a pure
        function of `key` (seeded sampling at the named versions)."""
        batch, rnd, todo = key
        timers = Timers()

        def run(engine):
            if rnd == 0:
                engine.new_batch()  # the answered-groups store follows the batch
            return self._generate_here(engine, batch, rnd, todo, timers)
        with self.slot.unit() as engine:
            groups, error = attempt(lambda: run(engine))
        return groups, error, timers

    @staticmethod
    def _failed_unit(exc: BaseException) -> tuple:
        """What escaped `_work` (outside its engine call), as a failed unit's result: a rank that
        raised here would leave its peers waiting in the rollout's agreement."""
        return None, RankError.of(exc), Timers()

    def _plan_ahead(self, batch: int) -> None:
        """After batch `batch`: the first draw of each of the next `ahead.batches` batches, as the
        prompt iterator and the schedule name them, for the producer (started here, after a resume
        has loaded the engine's version)."""
        if self.ahead is None:
            return
        if self.producer is None:
            self.producer = Producer(
                self._work, versions=lambda k: [v for _, _, v in k[2]],
                failed=lambda r: r[1] is not None,
                on_error=self._failed_unit, published=self.versions.kept)
            self.versions.watch(self.producer)
        prompts, keys = copy.deepcopy(self.prompts), []
        r = self.replica
        for b in range(batch + 1, min(batch + 1 + self.ahead.batches, self.ahead.total)):
            idx, versions = prompts.next_indices(self.rollout.prompts_per_batch), \
                self.ahead.versions_of(b)
            keys.append((b, 0, tuple(r.part([(idx[g], g, versions[g]) for g in
                                             range(r.dp_rank * self.per_rank,
                                                   (r.dp_rank + 1) * self.per_rank)]))))
        self.producer.plan([k for k in keys if k[2]])  # an empty share is generated by nobody

    def _generate_here(self, engine: Any, batch: int, rnd: int,
                       todo: Sequence[tuple[int, int, int]], timers: Timers
                       ) -> list[list[Sample]]:
        """Run the engine (held: `EngineSlot.unit`) at each scheduled version: samples per
        group."""
        groups: dict[int, list[Sample]] = {}
        for version in load_order((v for _, _, v in todo), engine.version):
            part = [(i, slot) for i, slot, v in todo if v == version]
            self.slot.use(version, timers)
            seed = mix64_int(mix64_int(mix64_int(self.seed) + batch) + rnd * 7919 + version) >> 1
            # per global slot: a group's draws do not depend on the DP size or the call's other
            # prompts, so a layout changes no sample
            sampling = dataclasses.replace(self.sampling, prompt_seeds=tuple(
                prompt_seed(seed, slot) for _, slot in part))
            with timers("generate"):
                samples = engine.generate([self.dataset[i] for i, _ in part],
                                          self.group_size, sampling, turns=self.turns)
            with timers("reward"):
                self.reward(samples)
                for s in samples:  # an environment's failure (env.on_error: incorrect)
                    if ENV_ERROR_KEY in s.metadata:
                        s.reward = self.reward.incorrect
            for j, (_, slot) in enumerate(part):
                members = samples[j * self.group_size:(j + 1) * self.group_size]
                self._label(members, batch, rnd, slot)
                groups[slot] = members
        return [groups[slot] for _, slot, _ in todo]

    def _label(self, members: list[Sample], batch: int, rnd: int, slot: int) -> None:
        """Global uid and group id: unique over batches, refill rounds and DP ranks."""
        p, g = self.rollout.prompts_per_batch, self.group_size
        group_id = (batch * MAX_ROUNDS + rnd) * p + slot
        for j, s in enumerate(members):
            s.group_id, s.uid = group_id, group_id * g + j

    def _advantages(self, samples: list[Sample]) -> None:
        a = self.advantage
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        groups = torch.tensor([s.group_id for s in samples])
        adv = compute_advantages(rewards, groups, a.mode, a.perturb_baseline, a.std_eps)
        for s, v in zip(samples, adv.tolist()):
            s.advantage = v

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> dict:
        """The prompt iterator and the engine's version (rank 0's are every engine's)."""
        return {"prompts": self.prompts.state_dict(), "engine_version": self.slot.recorded()}

    def load_state_dict(self, state: dict) -> None:
        """Collective: the prompt iterator, then the engines load the saved version (after the
        versions' files); a failure of either on any rank is agreed."""
        _, error = attempt(lambda: self.prompts.load_state_dict(state["prompts"]))
        agree(error, what="loading the rollout state")
        self.slot.load(state["engine_version"])

    def stop_ahead(self) -> None:
        """No more generation ahead, within seconds: a unit in progress has its engine calls cut
        (the engine closes right after: the run is ending) and the thread is joined with a
        bound (train/producer.py)."""
        if self.producer is not None:
            self.producer.stop(interrupt=self.slot.interrupt)


def _constant(members: Sequence[Sample]) -> bool:
    return len({s.reward for s in members}) == 1
