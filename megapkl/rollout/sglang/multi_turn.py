"""Multi-turn generation on SGLang servers: every trajectory at its own pace, one /generate per
turn.

Each trajectory is one task on the engine's request pool. A turn is one request whose
`input_ids` are exactly the trajectory's ids so far (`Trajectory.context_ids`: the prompt, what
the policy sampled, the observations' ids), so the server never tokenizes anything and the next
turn continues from the very ids that were sampled; with SGLang's radix cache the shared prefix
is not recomputed. The request asks for at most `driver.turn_tokens(traj)` new tokens, stops at
the environment's stop strings with `no_stop_trim` (the ids keep the stop string either way),
returns the log-probs of the new tokens only (and the top-K when asked) and, for routing replay,
the routed experts of the positions not covered yet (`routed_experts_start_len`): over the turns
of a trajectory, every fed token's row exactly once, `prompt + response - 1` rows in the end.
The answer becomes the trajectory's next action (with the weight version that produced it); the
driver runs the environment's step on its tool threads and appends the observation, and the
trajectory goes on. A trajectory waiting on its tool holds back no other: the others' requests go
on being sent and served meanwhile (no rounds).

Requests go through `SGLangEngine.answer` like single-turn groups: kept answers of an
interrupted batch, retries on another server, stale versions refused. Seeds: trajectory j of a
prompt seeded s draws from `sample_seed(s, j)`, its turn k from `sample_seed(that, k)` (n = 1 per
request), a function of the trajectory alone, so which server answers, when, and beside which
other requests changes nothing (on servers that draw from the seed: megapkl serve, or SGLang with
--enable-deterministic-inference).
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Optional, Sequence

from megapkl.rollout.engine import SamplingParams
from megapkl.rollout.sample import PromptItem, Sample
from megapkl.rollout.sglang.protocol import decode_response, generate_payload, sample_seed
from megapkl.rollout.turns import Trajectory


def generate_trajectories(engine: Any, prompts: Sequence[PromptItem], n: int,
                          sampling: SamplingParams, driver: Any, group_ids: list[int],
                          uids: list[int]) -> list[Sample]:
    """`n` multi-turn responses per prompt (prompt-major) from `engine` (the SGLangEngine whose
    pool, fleet and retries the requests use); `driver`: the TurnDriver."""
    trajs = [Trajectory(p, i) for i, p in enumerate(p for p in prompts for _ in range(n))]
    seeds = [None if sampling.seed_of(i // n) is None else sample_seed(sampling.seed_of(i // n),
                                                                      i % n)
             for i in range(len(trajs))]
    stop = threading.Event()  # a failure elsewhere: no trajectory asks for another turn
    futures = [engine._pool.submit(run_trajectory, engine, t, sampling, driver, seed, stop)
               for t, seed in zip(trajs, seeds)]
    engine.collect(futures, stop)
    return [t.to_sample(uids[i], group_ids[i // n], sampling.logprob_temperature,
                        text=driver.decode(t.response_ids)) for i, t in enumerate(trajs)]


def run_trajectory(engine: Any, traj: Trajectory, sampling: SamplingParams, driver: Any,
                   seed: Optional[int], stop: threading.Event) -> None:
    """Turns of one trajectory until the driver ends it (or `stop` is set)."""
    rows = 0  # routed-expert rows received so far: positions 0..rows-1 are covered
    while not stop.is_set():
        turn = turn_sampling(sampling, driver, traj)
        context = traj.context_ids().tolist()
        body = generate_payload(context, turn, 1,
                                seed=None if seed is None else sample_seed(seed, traj.turns),
                                routed_start=rows)
        d, = engine.answer(body, 1, lambda item: decode_response(
            item, prompt_len=len(context), sampling=turn, hf_config=engine.hf_config,
            routed_start=rows), direct=_direct(turn), what="a trajectory's turn")
        traj.add_action(d.response_ids, d.logp, version=d.version,
                        text=driver.decode(d.response_ids), finish=d.finish_reason,
                        matched=d.matched, topk_ids=d.topk_ids, topk_logp=d.topk_logp,
                        experts=d.routed_experts)
        if d.routed_experts is not None:
            rows += int(d.routed_experts.shape[0])
        if driver.react([traj])[0] is None:
            return


def turn_sampling(sampling: SamplingParams, driver: Any, traj: Trajectory) -> SamplingParams:
    """The sampling of the trajectory's next turn: its token budget, the environment's stop
    strings kept in the output; seeds go per request (generate_payload's `seed`)."""
    return dataclasses.replace(sampling, max_new_tokens=driver.turn_tokens(traj),
                               stop=tuple(driver.stop), no_stop_trim=bool(driver.stop),
                               seed=None, prompt_seeds=None)


def _direct(sampling: SamplingParams) -> bool:
    """sglang-router 0.3.2 drops `return_routed_experts` from the body it forwards: such turns
    go to a worker directly (as single-turn groups do)."""
    return sampling.return_routed_experts
