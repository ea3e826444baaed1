"""Rewards for RL with verifiable rewards: built-ins and `pkg.module:function` plugins.

`make_reward_fn(cfg)` reads `reward` (a comma list of names) and `reward_weights` and returns a
RewardFn; `reward_fn(prompts, completions, labels)` gives the weighted total per sample and each
reward's raw values. Every reward is a plain `f(prompt, completion, label) -> float`, evaluated on
the host, one sample at a time, a GroupReward that scores a whole group, or a BatchReward that
scores every sample of a call at once (the reward model, reward_model.py: `rm`). The built-in names
are registry.REWARDS (each a factory(cfg) -> reward; the recommender's sid_hit and sid_rank are in
recsys/rewards.py). Built-ins here:

  math         1.0 if math-verify finds the completion's final answer equal to the label (LaTeX,
               \\boxed{}, plain numbers and expressions); a GSM8K label "... #### 72" counts as "72"
  gsm8k        1.0 if the number of the completion's final answer equals the label's #### number
               (or its last number); commas ignored
  exact_match  1.0 if completion.strip() == label.strip()
  format       1.0 if re.search(format_reward_pattern, completion, re.DOTALL) matches

The final answer (`final_answer`) is what the completion states last of: a \\boxed{...}, a
"#### ..." line, "the answer is ..." / "Answer: ..."; or the whole completion when it is nothing but
a number or one math expression. A completion that states none scores 0 with math and gsm8k,
whatever numbers its reasoning holds: an intermediate "= 20" is no answer.
"""

from __future__ import annotations

import logging
import math
import numbers
import re
import threading
from collections.abc import Callable
from functools import lru_cache

import numpy as np

from unitrain import plugins, registry
from unitrain.errors import ConfigError, UserError
from unitrain.plugins import did_you_mean, one_line

log = logging.getLogger("unitrain")

Reward = Callable[[str, str, str], float]  # (prompt, completion, label) -> reward


class RewardError(UserError):
    """A reward failed on a sample: the entry prints one line naming it and exits 2."""


# ---------------------------------------------------------------- the final answer

# Where a completion states its answer; only these count, so a number met on the way is no answer.
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES = re.compile(r"####")
_ANSWER_PHRASE = re.compile(r"(?:final answer|the answer) is\s*:?|^[ \t]*(?:final )?answer\s*:", re.I | re.M)
# A stated answer is one math environment, or runs until its sentence, its line or prose goes on
# (a word of two letters or more that is no LaTeX command): "is 17, since 4*5=20" states 17.
_MATH_ENV = re.compile(r"\$\$?.+?\$\$?|\\\(.+?\\\)|\\\[.+?\\\]", re.S)
_ANSWER_END = re.compile(r"\n|[.;!?](?=\s|$)|,\s|(?<![\\A-Za-z])[A-Za-z]{2,}")
# A completion that is nothing but its answer: one number or one math environment.
_BARE = re.compile(r"\s*(?:-?[\d,]*\.?\d+|\$[^$]+\$|\\\(.+?\\\)|\\\[.+?\\\])\s*\.?\s*", re.S)


def final_answer(completion: str) -> str | None:
    """The text of the answer the completion states last (see the module docstring); None = none."""
    if _BARE.fullmatch(completion):
        return completion.strip().rstrip(".")
    markers = [(m.start(), m.end(), True) for m in _BOXED.finditer(completion)]
    markers += [
        (m.start(), m.end(), False) for pattern in (_HASHES, _ANSWER_PHRASE) for m in pattern.finditer(completion)
    ]
    for _, end, boxed in sorted(markers, reverse=True):  # the last one that states something
        answer = _braced(completion, end) if boxed else _stated(completion[end:])
        if answer:
            return answer
    return None


def _braced(text: str, start: int) -> str | None:
    """The text from `start` to the brace that closes the one just before it; None if none does."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip()
    return None


def _stated(text: str) -> str:
    text = text.lstrip()
    if env := _MATH_ENV.match(text):
        return env.group(0)
    end = _ANSWER_END.search(text)
    return text[: end.start() if end else len(text)].strip()


# ---------------------------------------------------------------- gsm8k

# A number as GSM8K writes it: optional minus, thousands commas, optional decimals ("-1,234.5", ".5").
_NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")


def _final_number(text: str) -> float | None:
    """The first number after the last '####' if there is one (the GSM8K answer line), else the last
    number in the text; None when there is none."""
    _, hashes, tail = text.rpartition("####")
    found = _NUMBER.findall(tail if hashes else text)
    if not found:
        return None
    return float((found[0] if hashes else found[-1]).replace(",", ""))


def gsm8k_reward(prompt: str, completion: str, label: str) -> float:
    gold = _final_number(label)
    if gold is None:  # a wrong data set or label key, not a bad sample: stop rather than train on zeros
        raise ValueError("the label has no number (a GSM8K label ends with '#### <number>')")
    stated = final_answer(completion)
    answer = None if stated is None else _final_number(stated)
    return float(answer is not None and math.isclose(answer, gold, rel_tol=1e-9, abs_tol=1e-9))


def make_gsm8k_reward(cfg) -> Reward:
    return gsm8k_reward


# ---------------------------------------------------------------- math (math-verify)

_LATEX_ENV = ("$", "\\(", "\\[", "\\boxed", "\\begin")


def _parse_math(text: str, timeout: int | None) -> list:
    """math-verify's parse of a label or a stated answer: [] when nothing parses."""
    from math_verify import parse

    # math-verify extracts LaTeX only inside a math environment: a bare "\sqrt{2}/2" or "3\sqrt{3}"
    # parses to nothing or to "3" unless wrapped; plain text that fails wrapped is parsed as is.
    wrapped = text if any(env in text for env in _LATEX_ENV) else f"${text}$"
    return parse(wrapped, parsing_timeout=timeout) or parse(text, parsing_timeout=timeout)


@lru_cache(maxsize=4096)  # a group of G completions shares one label: parse it once
def _parse_gold(label: str, timeout: int | None) -> tuple:
    if "####" in label:  # GSM8K: only the final answer, without thousands commas
        label = label.rpartition("####")[2].strip().replace(",", "")
    gold = _parse_math(label, timeout)
    if not gold:
        log.warning("math reward: math-verify cannot parse the label %r; its samples score 0", label[:200])
    return tuple(gold)


def make_math_reward(cfg) -> Reward:
    import math_verify  # sympy and antlr load here, once, and only when the math reward is used

    # math-verify times out with signal.alarm, which works only in the main thread; elsewhere it
    # would raise, so there a slow sample runs to the end instead.
    limit = cfg.math_reward_timeout or None

    def math_reward(prompt: str, completion: str, label: str) -> float:
        timeout = limit if threading.current_thread() is threading.main_thread() else None
        gold, stated = _parse_gold(label, timeout), final_answer(completion)
        if not gold or stated is None:
            return 0.0
        answer = _parse_math(stated, timeout)
        return float(math_verify.verify(list(gold), answer, timeout_seconds=timeout))  # gold first: not symmetric

    return math_reward


# ---------------------------------------------------------------- exact match and format


def exact_match_reward(prompt: str, completion: str, label: str) -> float:
    return float(completion.strip() == label.strip())


def make_exact_match_reward(cfg) -> Reward:
    return exact_match_reward


def make_format_reward(cfg) -> Reward:
    try:
        pattern = re.compile(cfg.format_reward_pattern, re.DOTALL)
    except re.error as e:
        raise ConfigError(f"config key 'format_reward_pattern' is not a valid regular expression: {e}") from None

    def format_reward(prompt: str, completion: str, label: str) -> float:
        return float(pattern.search(completion) is not None)

    return format_reward


# ---------------------------------------------------------------- rewards that score a whole group


class GroupReward:
    """A reward that scores a whole group at once, in the group's order (ranked rollouts: best
    first): fn(prompts, completions, labels) -> one value per completion."""

    def __init__(self, fn: Callable[[list, list, list], list]):
        self.fn = fn


class BatchReward(GroupReward):
    """A reward that scores all samples of a call at once, whatever their groups (a reward model:
    one forward per length bucket over the whole round). `metrics()` gives what it measured since
    it was last asked (RewardFn.metrics: the mode logs it)."""

    def __init__(self, fn: Callable[[list, list, list], list], metrics: Callable[[], dict]):
        super().__init__(fn)
        self.metrics = metrics


# ---------------------------------------------------------------- length (DAPO)


def overlong_penalty(lengths, max_len: int, buffer_len: int, factor: float) -> np.ndarray:
    """DAPO's soft overlong punishment (Yu et al. 2025; verl's DAPO reward manager), a reward term
    from completion lengths in tokens (stop token included) [N] -> float32 [N]: with L_max = max_len
    and L_cache = buffer_len, 0 for length <= L_max - L_cache, then falling linearly to -factor at
    L_max: min(0, -(length - (L_max - L_cache)) / L_cache) * factor."""
    exceed = np.asarray(lengths, np.float64) - (max_len - buffer_len)
    return (np.minimum(0.0, -exceed / buffer_len) * factor).astype(np.float32)


# ---------------------------------------------------------------- resolution and the reward function


def _resolve(name: str, cfg) -> Reward:
    """A built-in by its name in registry.REWARDS (a factory(cfg) -> reward) or a plugin reward."""
    if name in registry.REWARDS:
        return plugins.load(registry.REWARDS[name], "reward", "a reward factory (cfg) -> reward")(cfg)
    if ":" in name:
        return plugins.load(name, "reward", "a function (prompt, completion, label) -> float")
    raise ConfigError(
        f"config key 'reward' names unknown reward '{name}'{did_you_mean(name, registry.REWARDS)} "
        f"(built-ins: {', '.join(registry.REWARDS)}; a plugin is written pkg.module:function)"
    )


class RewardFn:
    """The configured rewards: `total, per_reward = reward_fn(prompts, completions, labels)`.

    total is float32 [N] = sum_i weights[i] * per_reward[names[i]]; per_reward holds each reward's raw
    float32 [N] values, for logging.
    """

    def __init__(self, names: tuple[str, ...], fns: tuple[Reward, ...], weights: tuple[float, ...]):
        self.names, self.fns, self.weights = names, fns, weights

    def __call__(
        self, prompts: list[str], completions: list[str], labels: list[str], group_size: int = 1
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        n = len(completions)
        if len(prompts) != n or len(labels) != n:
            raise ValueError(
                f"reward inputs differ in length: {len(prompts)} prompts, {n} completions, {len(labels)} labels"
            )
        per_reward = {
            name: self._evaluate(name, fn, prompts, completions, labels, group_size)
            for name, fn in zip(self.names, self.fns)
        }
        total = np.zeros(n, np.float32)
        for name, weight in zip(self.names, self.weights):
            total += np.float32(weight) * per_reward[name]
        return total, per_reward

    def metrics(self) -> dict:
        """What the batch rewards measured since the last call (a reward model's raw score mean and
        std, its scoring time), for the step's metrics; {} when none did."""
        return {k: v for fn in self.fns if isinstance(fn, BatchReward) for k, v in fn.metrics().items()}

    @staticmethod
    def _evaluate(name, fn, prompts, completions, labels, group_size: int) -> np.ndarray:
        """Each sample's value; a GroupReward is called once per `group_size` consecutive samples, a
        BatchReward once on them all."""
        values = np.empty(len(completions), np.float32)
        size = (
            max(len(completions), 1)
            if isinstance(fn, BatchReward)
            else group_size
            if isinstance(fn, GroupReward)
            else 1
        )
        for start in range(0, len(completions), size):
            part = slice(start, start + size)
            try:
                got = (
                    fn.fn(prompts[part], completions[part], labels[part])
                    if isinstance(fn, GroupReward)
                    else [fn(prompts[start], completions[start], labels[start])]
                )
            except Exception as e:
                raise RewardError(
                    _sample_error(name, f"raised {one_line(e)}", (prompts[start], completions[start], labels[start]))
                ) from e
            if len(got) != len(completions[part]):
                raise RewardError(
                    f"reward '{name}' returned {len(got)} values for {len(completions[part])} completions"
                )
            for i, value in enumerate(got, start):
                # A NaN or a string would silently poison the advantages: stop at the sample that made it.
                if not isinstance(value, numbers.Real) or not math.isfinite(value):
                    raise RewardError(
                        _sample_error(
                            name,
                            f"returned {one_line(repr(value))}, not a finite number",
                            (prompts[i], completions[i], labels[i]),
                        )
                    )
                values[i] = value
        return values


def make_reward_fn(cfg) -> RewardFn:
    """The RewardFn of cfg.reward and cfg.reward_weights; name errors raise ConfigError before any work."""
    names = tuple(entry.strip() for entry in cfg.reward.split(","))
    if "" in names:
        raise ConfigError(
            f"config key 'reward' has an empty entry in '{cfg.reward}'; separate names with single commas"
        )
    if len(set(names)) < len(names):
        raise ConfigError(
            f"config key 'reward' names a reward twice in '{cfg.reward}'; give it a larger weight instead"
        )
    weights = (1.0,) * len(names) if cfg.reward_weights is None else tuple(float(w) for w in cfg.reward_weights)
    if len(weights) != len(names):
        raise ConfigError(
            f"config key 'reward_weights' has {len(weights)} weights but config key 'reward' names "
            f"{len(names)} rewards ({', '.join(names)})"
        )
    return RewardFn(names, tuple(_resolve(name, cfg) for name in names), weights)


def _sample_error(name: str, what: str, sample: tuple[str, str, str]) -> str:
    prompt, completion, label = (_clip(s) for s in sample)
    return f"reward '{name}' {what} on the sample prompt={prompt}, completion={completion}, label={label}"


def _clip(text, limit: int = 200) -> str:
    text = str(text)
    return repr(text[:limit] + "...") if len(text) > limit else repr(text)
