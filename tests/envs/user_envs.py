"""User environments for tests/envs (imported by name in the workers: env.function)."""
import time


def calculator(turn):
    """<calc>a+b</calc> -> <result>a+b</result>; <answer> ends; anything else is invalid."""
    text = turn["last_action"]
    if "<answer>" in text:
        return {"end": "answer"}
    if "<calc>" in text and "</calc>" in text:
        expr = text.split("<calc>", 1)[1].split("</calc>", 1)[0]
        a, b = expr.split("+")
        return {"observation": f"<result>{int(a) + int(b)}</result>", "closing": "</result>",
                "tool": "calc"}
    return {"observation": "invalid", "source": "invalid"}


def sleepy(turn):
    time.sleep(60)


def wrong(turn):
    return {"observe": "typo"}


def noisy(turn):
    print("a user's print goes to stderr, never into the answers")
    return {"end": True}
