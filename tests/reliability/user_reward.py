"""Reward functions given by dotted path in the reliability tests (`reward.type: python`); they
run in megapkl's reward worker process, which imports this module."""
import os

_calls = 0


def first_char(prompts, responses, answers, fields):
    """+1 when a response starts with its answer (the synthetic tasks' rule), else -1."""
    return [1.0 if r.strip()[:1] == a else -1.0 for r, a in zip(responses, answers)]


def fails_later(prompts, responses, answers, fields):
    """`first_char`, until the process's environment says MEGAPKL_TEST_REWARD_FAILS_AFTER=N:
    then the (N+1)-th call raises."""
    global _calls
    _calls += 1
    limit = os.environ.get("MEGAPKL_TEST_REWARD_FAILS_AFTER")
    if limit is not None and _calls > int(limit):
        raise ZeroDivisionError(f"call {_calls}: the user's reward function is broken")
    return first_char(prompts, responses, answers, fields)
