"""`env: reasoning_gym`: reasoning-gym's procedurally generated, verifiable tasks as a multi-turn
environment (the optional extra `unitrain[envs]`). The prompt record only picks the task entry (a
hash of its prompt modulo the dataset's size, so any prompt dataset drives it and every process draws
the same entry for the same record); the user message is the entry's question, each answer is scored
by the dataset's own `score_answer`, and a wrong one gets a short feedback message and another try
until the workflow's max_turns.
"""

from __future__ import annotations

import difflib
import functools
import hashlib

from unitrain.envs.base import AssistantTurn, StepResult
from unitrain.errors import ConfigError

FEEDBACK = "That is not correct. Try again."


def make_reasoning_gym(cfg) -> ReasoningGymEnv:
    """The environment of dataset `cfg.reasoning_gym_task` drawn with seed `cfg.reasoning_gym_seed`."""
    try:
        from reasoning_gym.factory import DATASETS
    except ModuleNotFoundError as e:
        raise ConfigError(
            f"env reasoning_gym needs the reasoning-gym package (module {e.name!r} is missing): "
            "pip install 'unitrain[envs]'"
        ) from None
    task = cfg.reasoning_gym_task
    if task not in DATASETS:
        close = difflib.get_close_matches(task, DATASETS, n=3) or sorted(DATASETS)[:5]
        raise ConfigError(
            f"reasoning_gym_task {task!r} is not a reasoning-gym dataset ({len(DATASETS)} are, e.g. {', '.join(close)})"
        )
    try:
        dataset = _dataset(task, int(cfg.reasoning_gym_seed))
    except Exception as e:  # e.g. composite, which needs a config of its own
        raise ConfigError(f"reasoning-gym cannot make dataset {task!r} with its defaults: {e}") from None
    return ReasoningGymEnv(task, dataset)


@functools.lru_cache(maxsize=8)
def _dataset(task: str, seed: int):
    """One dataset per (task, seed) and process: the workflow makes an environment per episode, and an
    entry depends only on the seed and its index, so the episodes may share it."""
    import reasoning_gym

    return reasoning_gym.create_dataset(task, seed=seed)


def entry_index(prompt: str, size: int) -> int:
    """The record's entry: a hash of its prompt that is the same in every process (unlike hash())."""
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % size


def answer_of(text: str) -> str:
    """The answer in a reply: the last <answer>...</answer> (reasoning-gym's convention), else the reply."""
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(text)
    return text.strip() if tagged is None else tagged


class ReasoningGymEnv:
    """One episode on one entry of a reasoning-gym dataset; reward 1 for a correct answer, else 0."""

    def __init__(self, task: str, dataset):
        self.task = task
        self.tools: list[dict] = []  # reasoning-gym tasks are answered in text
        self.dataset = dataset
        self.entry: dict | None = None

    def _entry(self, record: dict) -> dict:
        return self.dataset[entry_index(record["prompt"], len(self.dataset))]

    def reset(self, record: dict) -> list[dict]:
        self.entry = self._entry(record)
        return [{"role": "user", "content": self.entry["question"]}]

    def step(self, turn: AssistantTurn) -> StepResult:
        if self.entry is None:
            raise RuntimeError("step before reset")
        if self._score(answer_of(turn.content)) >= 1.0:
            return StepResult(messages=[], reward=1.0, done=True)
        return StepResult(messages=[{"role": "user", "content": FEEDBACK}], reward=0.0, done=False)

    def _score(self, answer: str) -> float:
        # The answer is whatever the model wrote; a scorer that cannot parse it has found it wrong, and
        # that is feedback for the model, not the end of its episode.
        try:
            return float(self.dataset.score_answer(answer, self.entry))
        except Exception:
            return 0.0

    def demonstration(self, record: dict) -> list[dict]:
        """The record's question answered right at once, in the <answer> tags the scorer reads."""
        entry = self._entry(record)
        if entry["answer"] is None:  # boxnet, rubiks_cube...: the scorer checks a solution, knows none
            raise ConfigError(f"reasoning-gym's {self.task} has no reference answers to demonstrate")
        return [
            {"role": "user", "content": entry["question"]},
            {"role": "assistant", "content": f"<answer>{entry['answer']}</answer>"},
        ]
