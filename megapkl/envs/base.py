"""The environment interface of multi-turn rollouts (docs/agents.md).

After each of the policy's turns (an action segment: what the engine sampled, ended by a stop
string, an end-of-sequence token or the turn's token budget), the turn driver
(`megapkl.rollout.turns`) hands the environment the trajectory so far as a `Turn` and gets back
either an `Observation`, whose text is tokenized by itself and appended for the next turn, or an
`End`. The environment never sees or produces token ids of the policy's own writing: generated
ids go from the engine to the trainer untouched.

    class Calculator(Environment):
        stop = ("</calc>", "</answer>")
        def step(self, turn):
            if "<answer>" in turn.last_action:
                return End("answer")
            expr = between(turn.last_action, "<calc>", "</calc>")
            if expr is None:
                return Observation("\\nNo tool call found.\\n", source="invalid")
            return Observation(f"<result>{eval_safely(expr)}</result>", closing="</result>")

A step is bounded in time by `env.timeout_s` and runs on the driver's tool threads, so it must be
safe to call from several threads at once for different trajectories; it should be a function of
the `Turn` it is given (the trajectory so far is all the state a trajectory has), which keeps a
resumed or asynchronous run's trajectories those of the synchronous one.
"""
from __future__ import annotations

import abc

# The types a step takes and returns live with the turn driver (the rollout layer runs them)
from megapkl.rollout.turns import End, EnvError, Observation, Step, Turn  # noqa: F401


class Environment(abc.ABC):
    """Base class of environments; see the module docstring."""

    # Stop strings that end the policy's turn (kept in the output, as SGLang's `no_stop_trim`)
    stop: tuple[str, ...] = ()

    @abc.abstractmethod
    def step(self, turn: Turn) -> Step:
        """An Observation to append, or End."""

    def close(self) -> None:
        """Release what the environment holds (connections, worker processes); idempotent."""

    def __enter__(self) -> "Environment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

