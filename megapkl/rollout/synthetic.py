"""Synthetic verifiable tasks a tiny random model can learn by RL on CPU (demo, tests).

`add_mod10`: prompt "a+b=" (a, b single digits, 100 prompts), answer the digit (a + b) mod 10.
`next_mod10`: prompt "d", answer (d + 1) mod 10 (a one-step table; the CPU demo's task).
`repeat_next_8`, `repeat_next_16`: prompt "d", answer (d + 1) mod 10 written L = 8 or 16 times,
with partial credit per position: long answers, where per-token and per-sequence off-policy
corrections differ (see `RepeatNext`).
`lookup_kv`: prompt a key "#k", answer its random value, which only a tool call returns (the
multi-turn toy: `LookupKV`).
The model has 128 output tokens and starts near uniform, so how a response is read decides whether
RL from a random init gets any signal (`answer_mode`):

- "token_class" (default): the FIRST response token is the answer. Token id v (any id but PAD, BOS,
  EOS) spells digit (v - 48) mod 10, so '0'..'9' are themselves and every other token is one of
  about 12 alternative spellings of some digit. A uniform policy is right 125/1280 = 9.8% of the
  time, every digit is equally reachable (no shared "write digit d" direction for the policy to
  collapse onto), and RL learns the table: see tests/rollout/sanity.py for the measured curves.
  Tokens after the first do not affect the reward but still enter a per-token policy gradient as
  noise: keep max_response_len small (measured for add_mod10 with REINFORCE, 100 prompts x 8:
  L = 1 or 2 learn within 250 updates, L = 4 and 8 stay at chance).
- "first_digit": the first '0'..'9' character before EOS is the answer (a lenient grader). Chance
  is (1 - (117/128)^L) / 11 = 4.7% for L = 8 tokens, but RL first learns "write some digit" and
  then collapses onto one digit for all prompts (measured: stuck at 10%).
- "strict": exactly one digit then EOS; chance (1/128)^2, for evaluating a trained policy only.

`CharTokenizer`: ids are ASCII code points (printable 32..126 and newline 10), plus PAD 0, BOS 1,
EOS 2, so any vocabulary >= 128 holds it and token ids read as text in a debugger.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_FIRST_CHAR, _LAST_CHAR = 32, 126  # printable ASCII
_NEWLINE = 10


def _is_char(i: int) -> bool:
    return _FIRST_CHAR <= i <= _LAST_CHAR or i == _NEWLINE


class CharTokenizer:
    """A character-level tokenizer over printable ASCII and newline, with PAD/BOS/EOS (vocab 128)."""

    vocab_size = 128
    pad_token_id, bos_token_id, eos_token_id = PAD_ID, BOS_ID, EOS_ID

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        bad = sorted({c for c in text if not _is_char(ord(c))})
        if bad:
            raise ValueError(f"CharTokenizer: characters outside printable ASCII: {bad}")
        ids = [ord(c) for c in text]
        return [BOS_ID] + ids if add_special_tokens else ids

    def decode(self, ids: Union[Sequence[int], torch.Tensor], skip_special_tokens: bool = True,
               stop_at_eos: bool = True) -> str:
        """Text of `ids`, cut at the first EOS; ids that are not characters decode to nothing."""
        out = []
        for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids):
            if i == EOS_ID and stop_at_eos:
                break
            if _is_char(i):
                out.append(chr(i))
            elif not skip_special_tokens:
                out.append({PAD_ID: "<pad>", BOS_ID: "<bos>", EOS_ID: "<eos>"}.get(i, f"<{i}>"))
        return "".join(out)


@dataclass(frozen=True)
class SyntheticProblem:
    prompt: str
    answer: str


class AddMod10:
    """(a + b) mod 10 for single digits a, b; see the module docstring for `answer_mode`."""

    name = "add_mod10"
    ANSWER_MODES = ("token_class", "first_digit", "strict")

    def __init__(self, answer_mode: str = "token_class", modulus: int = 10):
        if answer_mode not in self.ANSWER_MODES:
            raise ValueError(f"add_mod10: answer_mode must be one of {self.ANSWER_MODES}, got "
                             f"{answer_mode!r}")
        self.answer_mode = answer_mode
        self.modulus = modulus
        self.tokenizer = CharTokenizer()

    def problems(self) -> list[SyntheticProblem]:
        return [SyntheticProblem(f"{a}+{b}=", str((a + b) % self.modulus))
                for a in range(10) for b in range(10)]

    def extract(self, response_ids: Union[Sequence[int], torch.Tensor]) -> Optional[str]:
        """The digit the response answers, or None when it answers nothing."""
        ids = response_ids.tolist() if isinstance(response_ids, torch.Tensor) else list(response_ids)
        if not ids:
            return None
        if self.answer_mode == "token_class":
            return None if ids[0] in (PAD_ID, BOS_ID, EOS_ID) else str((ids[0] - ord("0")) % 10)
        if self.answer_mode == "strict":
            ok = len(ids) == 2 and ids[1] == EOS_ID and ord("0") <= ids[0] <= ord("9")
            return chr(ids[0]) if ok else None
        for i in ids:
            if i == EOS_ID:
                return None
            if ord("0") <= i <= ord("9"):
                return chr(i)
        return None

    def is_correct(self, response_ids, answer: str) -> bool:
        return self.extract(response_ids) == answer

    def chance_accuracy(self, max_response_len: int, vocab_size: int = 128) -> float:
        """Success probability of a uniform random policy (to check the initial accuracy)."""
        if self.answer_mode == "token_class":
            return (vocab_size - 3) / vocab_size / 10
        if self.answer_mode == "strict":
            return (1 / vocab_size) ** 2
        other = (vocab_size - 11) / vocab_size  # neither a digit nor EOS
        return sum(other ** t * (10 / vocab_size) for t in range(max_response_len)) / 10


class NextMod10(AddMod10):
    """Prompt: one digit d; answer: (d + 1) mod 10, read like add_mod10 (`answer_mode`).

    A one-step lookup table a tiny random model learns by RL in about a hundred updates (measured
    with the trainer: accuracy 0.10 -> 0.9 in 80 updates, lr 1e-2, periodic refresh N = 4), so the
    CPU demo shows learning within minutes; add_mod10 needs attention across two digits and stays
    near chance for hundreds of updates at this model size. Each digit appears 10 times, so the
    dataset has 100 prompts like add_mod10.
    """

    name = "next_mod10"

    def problems(self) -> list[SyntheticProblem]:
        return [SyntheticProblem(str(d), str((d + 1) % self.modulus))
                for _ in range(10) for d in range(10)]


class RepeatNext:
    """Prompt: one digit d; answer: the digit (d + 1) mod 10 written L times. Each of the first L
    response tokens is read as in add_mod10's "token_class" mode (token id v spells digit
    (v - 48) mod 10; PAD and BOS spell nothing); a response that stops early (EOS) misses the
    positions it did not write.

    The reward gives partial credit, `fraction_correct` = (positions equal to the answer) / L,
    scaled between the reward's incorrect and correct values (rewards -1 / +1: -1 + 2 * fraction);
    accuracy is all L positions correct. Chance per position is 125/1280, so a uniform policy earns
    fraction 0.098 and is all-correct with probability 0.098^L. Position 1 is next_mod10's table;
    every later one is best written by copying the token before it, so the response is L tokens
    that all move with the policy. That is what the off-policy mechanisms act on: the future-KL
    credit sums over the T - t + 1 tokens after t (Proximal KL), SIS's test compounds per-token
    ratios over the response, and sequence ratios (GSPO, TETPO, GEPO) and M2PO's second moment
    sum L log-ratios.

    Measured on CPU (REINFORCE on the tiny Qwen3, 32 prompts x 8, lr 3e-3, L = 8): this task goes
    from chance to accuracy ~0.99 in 80-120 updates. Counting up instead (answer d+1, d+2, ...,
    d+L) did not learn in minutes: each generated token must be mapped to its successor from any
    of its ~12 spellings; crediting positions against the answer left the fraction at 0.25 after
    300 updates (accuracy 0), crediting the correct prefix at 0.33 (accuracy 0, GRPO in the
    trainer), and crediting each digit against the one written before it was exploited by cycles
    that ignore the prompt (7 8 9 7 8 9 ...: 2/3 of the reward).

    rollout.max_response_len must be at least L (a shorter response cannot be all correct).
    """

    tokenizer = CharTokenizer()

    def __init__(self, length: int = 8):
        if length < 1:
            raise ValueError(f"repeat_next: the answer length must be >= 1, got {length}")
        self.length = length
        self.name = f"repeat_next_{length}"

    def problems(self) -> list[SyntheticProblem]:
        return [SyntheticProblem(str(d), str((d + 1) % 10) * self.length)
                for _ in range(10) for d in range(10)]

    def extract(self, response_ids: Union[Sequence[int], torch.Tensor]) -> Optional[str]:
        """The digits the first L response tokens spell ('?' for a token that spells none), up to
        EOS; None for an empty response."""
        ids = response_ids.tolist() if isinstance(response_ids, torch.Tensor) else list(response_ids)
        ids = ids[:self.length]
        if EOS_ID in ids:
            ids = ids[:ids.index(EOS_ID)]
        if not ids:
            return None
        return "".join("?" if i in (PAD_ID, BOS_ID) else str((i - ord("0")) % 10) for i in ids)

    def fraction_correct(self, response_ids, answer: str) -> float:
        got = self.extract(response_ids) or ""
        return sum(a == b for a, b in zip(got, answer)) / self.length

    def is_correct(self, response_ids, answer: str) -> bool:
        return self.extract(response_ids) == answer

    def chance_accuracy(self, max_response_len: int, vocab_size: int = 128) -> float:
        """All-correct probability of a uniform random policy."""
        if max_response_len < self.length:
            return 0.0
        return ((vocab_size - 3) / vocab_size / 10) ** self.length


class LookupKV:
    """A task only a tool call solves (multi-turn, env.type lookup: `megapkl/envs/lookup.py`).

    Prompt "#k" for a key k of `digits` digits (10**digits keys); answer: the key's value, a digit
    drawn at random per key from a table seeded with `seed` (the small corpus the tool looks in).
    The prompt says nothing about the value, and a tiny model cannot store 10,000 random digits,
    so answering straight from the prompt is right by chance alone.

    Each turn is one token, read as in add_mod10's "token_class" mode (token id v spells digit
    (v - 48) mod 10; PAD, BOS and EOS spell nothing). At the first turn, a token from the upper
    part of the vocabulary (id >= 80: 'P'..'~' and beyond) is instead the tool call: the
    environment inserts "=v" (the key's value) and the policy answers at a second turn. So a
    uniform policy calls the tool 38% of the time and is right 10% of the time either way; what
    RL must learn is to call the tool, then copy the digit it returned. `is_correct` reads the
    policy's last turn (the reward gets the last action's ids).
    """

    name = "lookup_kv"
    TOOL_FROM = 80  # first-turn tokens from this id on call the tool
    tokenizer = CharTokenizer()

    def __init__(self, digits: int = 4, seed: int = 1234):
        if not 1 <= digits <= 6:
            raise ValueError(f"lookup_kv: digits must be in 1..6, got {digits}")
        self.digits, self.seed = digits, seed
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randint(0, 10, (10 ** digits,), generator=g).tolist()

    def key(self, prompt: str) -> Optional[int]:
        """The key a prompt asks for, or None when it is not "#<digits>"."""
        body = prompt[1:] if prompt.startswith("#") else ""
        return int(body) if len(body) == self.digits and body.isdigit() else None

    def value(self, key: int) -> str:
        return str(self.table[key])

    def problems(self) -> list[SyntheticProblem]:
        return [SyntheticProblem(f"#{k:0{self.digits}d}", self.value(k))
                for k in range(10 ** self.digits)]

    def calls_tool(self, first_turn: Sequence[int]) -> bool:
        """Is this first turn the tool call?"""
        return bool(first_turn) and int(first_turn[0]) >= self.TOOL_FROM

    @staticmethod
    def digit(token: int) -> Optional[str]:
        return None if token in (PAD_ID, BOS_ID, EOS_ID) else str((token - ord("0")) % 10)

    def extract(self, response_ids: Union[Sequence[int], torch.Tensor]) -> Optional[str]:
        """The digit a turn answers (its first token's), or None (nothing, or a tool call that
        got no answer: a one-turn response)."""
        ids = response_ids.tolist() if isinstance(response_ids, torch.Tensor) else list(response_ids)
        return self.digit(ids[0]) if ids else None

    def is_correct(self, response_ids, answer: str) -> bool:
        return self.extract(response_ids) == answer

    def chance_accuracy(self, max_response_len: int = 4, vocab_size: int = 128) -> float:
        """A uniform policy's accuracy: one in ten either way (spelling tokens only)."""
        return (vocab_size - 3) / vocab_size / 10


SYNTHETIC_TASKS = {"add_mod10": AddMod10, "next_mod10": NextMod10,
                   "repeat_next_8": functools.partial(RepeatNext, 8),
                   "repeat_next_16": functools.partial(RepeatNext, 16),
                   "lookup_kv": LookupKV}


def make_synthetic_task(name: str, **kwargs):
    """A synthetic task by name (data.synthetic); kwargs go to the task's constructor."""
    try:
        cls = SYNTHETIC_TASKS[name]
    except KeyError:
        raise ValueError(f"unknown synthetic task '{name}'; known: {sorted(SYNTHETIC_TASKS)}") from None
    return cls(**kwargs)
