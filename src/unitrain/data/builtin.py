"""The built-in task: integer arithmetic with exact answers, so the default run needs no files.

Problem i of a split is drawn from its own random stream ("123+45=" -> "168"; the operators of
`builtin_task_ops`, of operands with up to `digits` digits). A hash of the problem text decides which split may use it,
so train and eval are disjoint by construction whatever the streams draw. The problem streams use
fixed seeds, not the run seed: every run evaluates on the same problems.
"""

from __future__ import annotations

import hashlib

import numpy as np

SPLITS = {"train": 0, "eval": 1}
EVAL_FRACTION_PERCENT = 10  # share of all possible problems reserved for eval
NUM_PROBLEMS = 1 << 20  # length of each split's stream; the train stream is reshuffled per epoch


def problem_split(prompt: str) -> str:
    """'eval' or 'train' for a problem text; stable across processes and Python versions."""
    digest = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "little")
    return "eval" if digest % 100 < EVAL_FRACTION_PERCENT else "train"


def builtin_problem(index: int, split: str, digits: int, ops: str) -> tuple[str, str]:
    """Problem `index` of `split` as (prompt, answer), e.g. ("12*3=", "36"), its operator one of `ops`
    (with ops="+-*" the draws of every earlier version)."""
    for attempt in range(10_000):  # rejection: ~1.1 draws for train, ~10 for eval
        rng = np.random.default_rng([SPLITS[split], index, attempt])
        a, b = (int(x) for x in rng.integers(0, 10**digits, size=2))
        op = ops[int(rng.integers(0, len(ops)))]
        prompt = f"{a}{op}{b}="
        if problem_split(prompt) == split:
            return prompt, str(a + b if op == "+" else a - b if op == "-" else a * b)
    raise RuntimeError("unreachable: no problem of the requested split was drawn")


def max_builtin_length(digits: int) -> int:
    """Upper bound on BOS + prompt + answer + EOS tokens for the character tokenizer."""
    return 1 + (2 * digits + 2) + (2 * digits + 1) + 1
