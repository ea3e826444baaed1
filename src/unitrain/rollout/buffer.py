"""Rollouts sampled ahead of the trainer, by at most `max_staleness` policy versions.

    buffer = RolloutBuffer(cfg, prompt_stream, start_round, keep)
    groups, stats = buffer.take(step, push)   # the groups step `step` trains on

A round is one batch of prompts from the stream, submitted to the sampler (rollout/base.submit):
it samples on the sampler's devices while the trainer goes on, tagged with the version of the
weights it samples with and the stream's position before its prompts. Step s takes rounds in
order until `rollout_batch_size` groups pass the dynamic-sampling filter (or max_sampling_rounds
were taken): first the rounds in flight, then rounds it submits itself with its own weights. It
then submits rounds until `max_staleness` are in flight, with its weights (version s), before its
update: those sample while the trainer updates, for the steps after. Every step takes at least
one round, so a round submitted at step s is taken by step s + max_staleness: no sample is more
than max_staleness versions old. With 0 nothing is in flight between steps: each step samples
with its own weights, as a synchronous trainer does.

The schedule depends only on the step and the rewards, so every process submits and waits in the
same order (a sampler's collectives then match across processes). The checkpoint records the
stream's position before the first round in flight: a resumed run samples those prompts again
(with its weights) and neither skips nor repeats any. Each round's key is the seed folded with
the step that submits it and its index among that step's rounds.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from unitrain.rollout.groups import select_groups


@dataclasses.dataclass(frozen=True)
class Round:
    groups: Callable[[], list]  # waits for the round's completions and returns its scored groups
    position: Any  # the prompt stream's state before its prompts
    num_dropped: int  # prompts the stream dropped while making it (too long)


class RolloutBuffer:
    """The rounds in flight; `get_state`/`set_state` are the prompt position a checkpoint records."""

    def __init__(self, cfg, prompts, start_round: Callable, keep: Callable | None):
        """`prompts`: the prompt stream (next() -> {"prompts", "num_dropped"}, get_state, set_state);
        `start_round(prompts, key)`: submits a batch of prompts, -> the function that waits for and
        returns its scored groups; `keep(group)`: the dynamic-sampling filter (None = keep all)."""
        self.cfg, self.prompts, self.start_round, self.keep = cfg, prompts, start_round, keep
        self.in_flight: collections.deque[Round] = collections.deque()

    def get_state(self):
        return self.in_flight[0].position if self.in_flight else self.prompts.get_state()

    def set_state(self, state) -> None:
        if self.in_flight:
            raise RuntimeError("the prompt position can only be restored before rollouts start")
        self.prompts.set_state(state)

    def take(self, step: int, push: Callable[[int], None]) -> tuple[list, dict]:
        """The step's groups and what it took to get them. `push(version)` puts this step's weights
        on the sampler; it is called once, before the first round this step submits."""
        cfg = self.cfg
        submitted = 0

        def submit() -> bool:
            """Submits the next round (the first one pushes the step's weights); False if the
            prompt stream has none left."""
            nonlocal submitted
            position = self.prompts.get_state()
            try:
                batch = next(self.prompts)
            except StopIteration:
                return False
            if not submitted:
                push(step)
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(cfg.seed), step), submitted)
            submitted += 1
            self.in_flight.append(Round(self.start_round(batch["prompts"], key), position, batch["num_dropped"]))
            return True

        kept, dropped, taken = [], [], []
        while len(kept) < cfg.rollout_batch_size and len(taken) < cfg.max_sampling_rounds:
            if not self.in_flight and not submit():
                break  # the prompt stream ran out: select_groups says so if the step is short
            taken.append(self.in_flight.popleft())
            for group in taken[-1].groups():
                (kept if self.keep is None or self.keep(group) else dropped).append(group)
        # No more ahead than the remaining steps can take (or the stream has).
        while len(self.in_flight) < min(cfg.max_staleness, cfg.steps - 1 - step) and submit():
            pass
        groups, discarded, refilled = select_groups(kept, dropped, cfg.rollout_batch_size)
        staleness = np.asarray([step - g.version for g in groups])
        return groups, {
            "sampling_rounds": len(taken),
            "groups_discarded": discarded,
            "groups_refilled": refilled,
            "prompts_dropped": sum(r.num_dropped for r in taken),
            "rollout_staleness_mean": float(staleness.mean()),
            "rollout_staleness_max": int(staleness.max()),
            "rollouts_in_flight": len(self.in_flight),
        }
