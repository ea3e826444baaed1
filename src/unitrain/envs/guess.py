"""Guess-the-number (`env: guess_number`), the built-in multi-turn feedback game: the model guesses a
secret in [low, high], the environment answers "higher" or "lower" until it is right (reward 1). The
secret is a hash of the record's prompt, so any prompt dataset serves, and every process and every
episode of a group plays the same secret. The wording is short on purpose: the CPU demo's model is
character-level.
"""

from __future__ import annotations

import hashlib
import re

from unitrain.config import check
from unitrain.envs.base import AssistantTurn, StepResult
from unitrain.errors import ConfigError

_INTEGER = re.compile(r"-?\d+")


class GuessNumber:
    def __init__(self, low: int, high: int, max_guesses: int | None = None):
        """max_guesses: wrong guesses after which the episode ends with reward 0 (None: no limit here;
        the workflow's max_turns still ends it). Answers without a number count as no guess."""
        if low >= high:
            raise ValueError(f"the range's low end ({low}) must be below its high end ({high})")
        if max_guesses is not None and max_guesses < 1:
            raise ValueError(f"max_guesses must be at least 1, not {max_guesses}")
        self.low, self.high, self.max_guesses = low, high, max_guesses
        self.tools: list[dict] = []  # a game of words: no tools

    def secret(self, record: dict) -> int:
        """The record's number: the same on every process and Python version."""
        digest = int.from_bytes(hashlib.sha256(record["prompt"].encode()).digest()[:8], "little")
        return self.low + digest % (self.high - self.low + 1)

    def reset(self, record: dict) -> list[dict]:
        self._secret, self._wrong_guesses = self.secret(record), 0
        return [self._question()]

    def step(self, turn: AssistantTurn) -> StepResult:
        found = _INTEGER.search(turn.content)
        if found is None:
            return StepResult([_user(f"Answer with one number between {self.low} and {self.high}.")])
        guess = int(found.group())
        if guess == self._secret:
            return StepResult([], reward=1.0, done=True)
        self._wrong_guesses += 1
        if self.max_guesses is not None and self._wrong_guesses >= self.max_guesses:
            return StepResult([], reward=0.0, done=True)
        return StepResult([_user("higher" if guess < self._secret else "lower")])

    def demonstration(self, record: dict) -> list[dict]:
        """Binary search to the secret: at most floor(log2(high - low + 1)) + 1 guesses."""
        secret, low, high = self.secret(record), self.low, self.high
        messages = [self._question()]
        while True:
            guess = (low + high) // 2
            messages.append({"role": "assistant", "content": str(guess)})
            if guess == secret:
                return messages
            messages.append(_user("higher" if guess < secret else "lower"))
            low, high = (guess + 1, high) if guess < secret else (low, guess - 1)

    def _question(self) -> dict:
        return _user(f"{self.low}-{self.high}?")


def _user(content: str) -> dict:
    return {"role": "user", "content": content}


def make_guess_number(cfg) -> GuessNumber:
    """`env: guess_number`: the range is cfg.guess_number_low..cfg.guess_number_high."""
    try:
        return GuessNumber(cfg.guess_number_low, cfg.guess_number_high)
    except ValueError as e:
        raise ConfigError(f"config keys guess_number_low and guess_number_high: {e}") from None


@check("guess_number_low", "guess_number_high")
def _range(c) -> str | None:
    if c["guess_number_low"] < c["guess_number_high"]:
        return None
    return f"guess_number_low ({c['guess_number_low']}) must be below guess_number_high ({c['guess_number_high']})"


CONFIG_CHECKS = (_range,)
