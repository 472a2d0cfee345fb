"""The lookup tool of the CPU toy task `lookup_kv` (`megapkl.rollout.synthetic.LookupKV`).

After the policy's first turn: a tool call (`LookupKV.calls_tool`) gets the prompt key's value
inserted as "=v"; any other first turn is the policy's answer, and the trajectory ends. The turn
budget (env.max_turns 2, env.max_turn_tokens 1) ends it after the second turn.
"""
from __future__ import annotations

from megapkl.envs.base import End, Environment, Observation, Turn
from megapkl.rollout.synthetic import LookupKV


class LookupEnv(Environment):
    stop = ()  # every turn is one token (env.max_turn_tokens)

    def __init__(self, task: LookupKV) -> None:
        self.task = task

    def step(self, turn: Turn) -> Observation | End:
        if turn.turn > 1 or not self.task.calls_tool(turn.last_action_ids.tolist()):
            return End("answer")
        key = self.task.key(turn.prompt_text or "")
        if key is None:
            return Observation("=?", source="invalid")
        return Observation(f"={self.task.value(key)}", tool="lookup")
