"""What a multi-turn trajectory talks to between the policy's turns (docs/agents.md).

`base`: the environment interface (`Environment.step(turn) -> Observation | End`); `lookup`: the
tool of the CPU toy task lookup_kv; `search`: the SIS paper's search agent (Search-R1's tags),
with `retriever_client` (HTTP, Search-R1's contract) and `retriever_service` (a retriever the run
starts and owns); `python`: a user's environment, run as a user's reward is.
`build_turn_driver` makes the `megapkl.rollout.turns.TurnDriver` an engine generates with from
the env section.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional


def build_retriever(env: Any, run_dir: str | Path, launcher: Any = None) -> Optional[Any]:
    """The retriever the run serves itself (env.type search with env.search.index), not started
    yet: hold it in the run context, then `.start()` it before the first rollout (it waits until
    the server answers). None when the run uses a running retriever (env.search.url) or no
    search. `launcher`: on a Slurm job, the job step that runs it (LaunchContext's
    `retriever_launcher()`); None: a process on this host."""
    if env.type != "search" or env.search.index is None:
        return None
    from megapkl.envs.retriever_service import ManagedRetriever

    s = env.search
    return ManagedRetriever(s.index, log_path=Path(run_dir) / "retriever.log", host=s.host,
                            port=s.port, topk=s.topk, args=s.serve_args, launcher=launcher,
                            health_deadline_s=s.health_deadline_s, key="env.search")


def build_search_env(search: Any, retriever: Any = None):
    """The search environment over env.search.url, or over the run's own `retriever`
    (build_retriever, started). Sends one query first: a dead or wrong retriever fails here,
    before any rollout, in one line naming the URL and the key."""
    from megapkl.envs.retriever_client import RetrieverClient
    from megapkl.envs.search import SearchEnv

    if search.url is None and retriever is None:
        raise ValueError("env.search.index: the run's retriever must be built and started "
                         "(megapkl.envs.build_retriever) before the search environment")
    url, key = (search.url, "env.search.url") if search.url else (retriever.url,
                                                                  "env.search.index")
    client = RetrieverClient(url, topk=search.topk, timeout_s=search.timeout_s,
                             max_retries=search.max_retries, concurrency=search.concurrency,
                             max_batch=search.max_batch, batch_wait_s=search.batch_wait_ms / 1000,
                             key=key)
    try:
        client.check()
    except BaseException:
        client.close()
        raise
    return SearchEnv(client.search, close=client.close)


def build_env(env: Any, task: Any = None, retriever: Any = None):
    """The environment of the env section (`megapkl.config.sections_env.EnvConfig`); `task`: the
    synthetic task (type lookup); `retriever`: the run's started retriever (type search with
    env.search.index)."""
    if env.type == "lookup":
        from megapkl.envs.lookup import LookupEnv

        if task is None or getattr(task, "name", None) != "lookup_kv":
            raise ValueError("env.type lookup needs data.synthetic: lookup_kv")
        return LookupEnv(task)
    if env.type == "search":
        return build_search_env(env.search, retriever)
    if env.type == "python":
        from megapkl.envs.python import PythonEnv

        return PythonEnv(env.function, timeout_s=env.timeout_s, workers=env.workers,
                         stop=env.stop)
    raise ValueError(f"env.type: unknown {env.type!r}")


def stop_strings(env: Any) -> tuple[str, ...]:
    """The stop strings that end the policy's turns under the env section: env.stop, else the
    environment's own (the search agent's tags). An engine's servers must match them, which
    SGLang does only with the model's tokenizer (rollout/sglang/launch.py)."""
    if not env.multi_turn:
        return ()
    if env.stop is not None:
        return tuple(env.stop)
    if env.type == "search":
        from megapkl.envs.search import STOP

        return tuple(STOP)
    return ()


def build_turn_driver(env: Any, max_response_len: int, tokenizer: Any, task: Any = None,
                      retriever: Any = None) -> Optional[Any]:
    """The engine's `TurnDriver` for the env section, or None when responses are single-turn
    (env.type unset). `max_response_len`: rollout.max_response_len, the response budget;
    `retriever`: see build_env."""
    if not env.multi_turn:
        return None
    from megapkl.rollout.turns import Budgets, TurnDriver

    environment = build_env(env, task, retriever)
    environment.stop = stop_strings(env)
    budgets = Budgets(max_turns=env.max_turns, max_response_tokens=max_response_len,
                      max_turn_tokens=env.max_turn_tokens,
                      max_observation_tokens=env.max_observation_tokens)
    return TurnDriver(environment, tokenizer, budgets, timeout_s=env.timeout_s,
                      on_error=env.on_error, concurrency=env.concurrency)
