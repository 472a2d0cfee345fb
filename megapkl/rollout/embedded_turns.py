"""Multi-turn generation on the embedded engine: a batch of trajectories in rounds, one KV cache.

A round decodes one turn of every trajectory still going, in lock step as single-turn decoding
does; a row whose turn ends (an end-of-sequence token, a stop string, its turn's token budget)
waits, masked, for the others. When every row has ended its turn, the `TurnDriver` runs the
environment's steps for all of them at once (its tool threads) and the rows that go on are fed
their last action token and their observation's tokens in one block, right-aligned so that every
row's next-token logits sit in the block's last column. The KV cache is never rebuilt: what was
fed once is attended to again, never recomputed, so each token's log-probs (and, for MoE, its
routed experts) are those of the one forward that fed it, as with SGLang's prefix cache.

Rounds keep generation a pure function of the call: which rows share a forward never depends on
timing, so an asynchronous or resumed run generates what the synchronous one does. The price is
that a round waits for its slowest tool call (docs/agents.md: what would hide it). Each row draws
its k-th sampled token from step k of its own random stream (`seeds.uniforms_at`), so a response
does not depend on how long the other rows' turns were.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from megapkl.rollout.engine import SamplingParams
from megapkl.rollout.sample import PromptItem, Sample
from megapkl.rollout.sampling import draw, step_logprobs
from megapkl.rollout.seeds import uniforms_at
from megapkl.rollout.stops import StopStrings
from megapkl.rollout.turns import Trajectory, TurnDriver


def generate_trajectories(engine: Any, prompts: Sequence[PromptItem], n: int,
                          sampling: SamplingParams, driver: TurnDriver, draws: Tensor,
                          group_ids: list[int], uids: list[int]) -> list[Sample]:
    """`n` multi-turn responses per prompt (prompt-major), chunked by the engine's batch size;
    `engine`: the EmbeddedEngine (its forward, prefill and records; this module is its part)."""
    trajs = [Trajectory(p, i) for i, p in enumerate(p for p in prompts for _ in range(n))]
    for start in range(0, len(trajs), engine.max_batch_size):
        chunk = trajs[start:start + engine.max_batch_size]
        firsts = [r for r in range(len(chunk)) if r == 0 or (start + r) % n == 0]
        _Rounds(engine, chunk, sampling, driver, draws[start:start + len(chunk)], firsts).run()
    return [t.to_sample(uids[i], group_ids[i // n], sampling.logprob_temperature,
                        text=driver.decode(t.response_ids)) for i, t in enumerate(trajs)]


class _Rounds:
    """One batch of trajectories decoded round by round (see the module docstring)."""

    def __init__(self, engine: Any, trajs: list[Trajectory],
                 sampling: SamplingParams, driver: TurnDriver, draws: Tensor,
                 firsts: list[int]) -> None:
        self.e, self.trajs, self.sampling, self.driver = engine, trajs, sampling, driver
        self.draws, self.firsts = draws, firsts
        self.batch = len(trajs)
        self.stop_ids = engine._stop_ids(sampling)
        self.stops = StopStrings(driver.stop, driver.tokenizer)  # SGLang's rule (rollout/stops.py)
        self.experts: Optional[list[list[Tensor]]] = None

    def run(self) -> None:
        e, b = self.e, self.batch
        if e._recorder is not None:
            e._recorder.reset(active=self.sampling.return_routed_experts)
            if self.sampling.return_routed_experts:
                self.experts = [[] for _ in range(b)]
        prompt_ids = [t.prompt.prompt_ids for t in self.trajs]
        out, self.mask, pos = e._prefill(prompt_ids, self.firsts)
        self.cache, self.logits = out.past_key_values, out.logits[:, -1]
        self.last_pos = pos[:, -1].clone()
        if self.experts is not None:
            width = int(self.mask.shape[1])
            for r, p in enumerate(prompt_ids):
                self.experts[r].append(e._recorder.forwards[-1][r, width - int(p.numel()):])
        going = list(range(b))
        while going:
            ended = self._turn(going)
            observations = self.driver.react([self.trajs[r] for r in ended])
            going = [r for r, obs in zip(ended, observations) if obs is not None]
            if going:
                self._feed_observations(going, [observations[ended.index(r)] for r in going])
        if self.experts is not None:
            for t, rows in zip(self.trajs, self.experts):
                t.experts = [torch.cat(rows).contiguous()]

    def _turn(self, rows: list[int]) -> list[int]:
        """Decode one turn of every row in `rows`; returns them (each has a new action)."""
        e, b, sampling = self.e, self.batch, self.sampling
        dev = self.logits.device
        active = torch.zeros(b, dtype=torch.bool, device=dev)
        active[rows] = True
        budget = {r: self.driver.turn_tokens(self.trajs[r]) for r in rows}
        record: dict[int, list[dict]] = {r: [] for r in rows}
        while True:
            logp = step_logprobs(self.logits, sampling)
            steps = torch.tensor([t.sampled + len(record.get(r, ())) for r, t in
                                  enumerate(self.trajs)], dtype=torch.int64)
            token = draw(logp, sampling, None if sampling.greedy else uniforms_at(self.draws, steps))
            step = e._record_step(logp, token, sampling)
            for r in active.nonzero().flatten().tolist():
                record[r].append({k: v[r] for k, v in step.items()})
                if self._turn_over(r, record[r], budget[r]):
                    active[r] = False
            if not bool(active.any()):
                return rows
            self._forward(torch.where(active, token, torch.full_like(token, e.pad_token_id))[:, None],
                          active[:, None])

    def _turn_over(self, r: int, steps: list[dict], budget: int) -> bool:
        """Did row r's turn just end? If so its action goes into its trajectory."""
        last = int(steps[-1]["token"])
        ids = torch.stack([s["token"] for s in steps])
        matched = self.stops.match(ids.tolist())  # a stop string first, as SGLang checks
        finish = "stop" if matched is not None else None
        if finish is None and self.stop_ids.numel() and last in self.stop_ids.tolist():
            finish = "stop"
        if finish is None and len(steps) >= budget:
            finish = "length"
        if finish is None:
            return False
        topk = "topk_ids" in steps[0]
        self.trajs[r].add_action(
            ids, torch.stack([s["logp"] for s in steps]), version=int(self.e.version),
            text=self.driver.decode(ids), finish=finish, matched=matched,
            topk_ids=torch.stack([s["topk_ids"] for s in steps]) if topk else None,
            topk_logp=torch.stack([s["topk_logp"] for s in steps]) if topk else None)
        return True

    def _feed_observations(self, rows: list[int], observations: list[Tensor]) -> None:
        """Feed each row's last action token and observation, right-aligned in one block."""
        e, b = self.e, self.batch
        pieces = {r: torch.cat([self.trajs[r].ids[-2][-1:], obs]) for r, obs in zip(rows, observations)}
        width = max(int(p.numel()) for p in pieces.values())
        ids = torch.full((b, width), e.pad_token_id, dtype=torch.long)
        real = torch.zeros(b, width, dtype=torch.bool)
        for r, p in pieces.items():
            ids[r, width - p.numel():] = p
            real[r, width - p.numel():] = True
        self._forward(ids.to(e.device), real.to(e.device))

    def _forward(self, ids: Tensor, real: Tensor) -> None:
        """Feed [B, L] tokens where `real` is set (other columns are masked padding), with the
        positions continuing each row's own count; update the cache, logits and experts."""
        dev = self.mask.device
        real = real.to(dev)
        pos = self.last_pos[:, None] + torch.cumsum(real.long(), dim=1)
        self.mask = torch.cat([self.mask, real.long()], dim=1)
        out = self.e._forward(ids.to(dev), self.mask, pos, cache=self.cache)
        self.cache, self.logits = out.past_key_values, out.logits[:, -1]
        self.last_pos = pos[:, -1].clone()
        if self.experts is not None:
            fed = self.e._recorder.forwards[-1]
            for r in real.any(dim=1).nonzero().flatten().tolist():
                self.experts[r].append(fed[r][real[r].cpu()])
