"""The rollout executor: AReaLite's verbs over a stream of workflow groups.

    executor = RolloutExecutor(cfg, prompts, driver, shape, keep)
    groups, stats = executor.prepare_batch(step, push)   # the groups step `step` trains on

Prompts come from the stream a round at a time (`over_sampling_batch_size or rollout_batch_size`
records). `submit` starts a round's groups on the driver (rollout/driver.py: every group in flight
is served together, one sampler call per kind of request); `wait` serves requests until a number
of groups has finished. A finished group is reshaped (the reward shapers) and judged by the
dynamic-sampling filter at once; those that pass wait, in the order they were submitted, for a
step to take them.

Staleness (`max_staleness`, AReaL's max_head_offpolicyness): a group's version is the oldest
weights version of its tokens, and step s trains on none older than s - max_staleness. Capacity:
beyond the rounds a step needs for itself, a round starts ahead only while the groups not yet
consumed (in flight or waiting) leave it room within what the next max_staleness steps will take
(max_staleness rounds' worth after the step's batch, one more before it), and, with
`max_concurrent_rollouts`, while fewer groups than that are in flight. A step has its batch when
`rollout_batch_size` groups have passed the filter, and still waits for the groups in flight that
the next step could not take (too stale by then). So with max_staleness 0 a step starts a round only when nothing runs, waits
for its rounds, and trains on the first groups in submission order: synchronous GRPO exactly.
With k >= 1, groups still running when a step has its batch go on sampling in the next steps (their
later turns with the newer weights), a step takes groups as soon as enough have passed, and, before
its update, a step tops the rounds up and submits their first generate, which samples while the
trainer updates (on a sampler of its own devices or an engine).

A step starts at most `max_sampling_rounds` rounds; still short when they are done, it takes
groups the filter dropped (select_groups). Every process makes the same calls in the same order.

Nothing is lost on a kill: the checkpoint records the stream's position before the oldest round
with a group not yet consumed (trained on, filtered out, rejected, raised or discarded), and the
indices consumed in each open round; a resumed run re-reads those rounds, skips what was consumed
and samples the rest again: no prompt skipped, none trained twice.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from unitrain.config import check
from unitrain.errors import CheckpointError
from unitrain.rollout.driver import Driver, make_group
from unitrain.rollout.groups import select_groups


@dataclasses.dataclass
class _Round:
    """One batch of prompts from the stream: its place among the rounds, where the stream was before
    it, its size, and the indices of its groups consumed so far."""

    number: int
    position: Any
    size: int
    consumed: set = dataclasses.field(default_factory=set)

    @property
    def open(self) -> bool:
        return len(self.consumed) < self.size


@dataclasses.dataclass(frozen=True)
class _Tag:
    """What a group carries: its round, its index there, and the weights version it started with."""

    round: _Round
    index: int
    version: int

    def consume(self) -> None:
        self.round.consumed.add(self.index)


class RolloutExecutor:
    """The groups in flight and the rounds they came from; `get_state`/`set_state` are the prompt
    position a checkpoint records (module docstring)."""

    def __init__(self, cfg, prompts, driver: Driver, shape: Callable, keep: Callable | None):
        """`prompts`: the prompt stream (next() -> {"prompts", "num_dropped"}, get_state, set_state);
        `shape(group) -> group`: the reward shapers; `keep(group)`: the dynamic-sampling filter
        (None = keep all)."""
        self.cfg, self.prompts, self.driver, self.shape, self.keep = cfg, prompts, driver, shape, keep
        self.bound, self.concurrency = cfg.max_staleness, cfg.max_concurrent_rollouts
        self.round_size = cfg.over_sampling_batch_size or cfg.rollout_batch_size
        self.rounds: collections.deque[_Round] = collections.deque()  # the open ones, oldest first
        self.skip: list[set] = []  # consumed indices of the rounds a restore re-reads, in order
        self.accepted: list = []  # (group, tag) that passed the filter, in submission order
        self.dropped: list = []  # (group, tag) the filter dropped during the current step
        self.submitted = 0  # rounds the current step started
        self.started = 0  # rounds started, ever
        self.num_dropped = 0  # prompts the stream dropped (too long) in the current step's rounds

    # -- checkpoint position
    def get_state(self):
        position = self.rounds[0].position if self.rounds else self.prompts.get_state()
        return {"position": position, "consumed": [sorted(r.consumed) for r in self.rounds]}

    def set_state(self, state) -> None:
        if self.rounds:
            raise RuntimeError("the prompt position can only be restored before rollouts start")
        if not (isinstance(state, dict) and {"position", "consumed"} <= set(state)):
            raise CheckpointError(
                "the checkpoint's prompt position is not the rollout executor's ({position, consumed}: a checkpoint "
                "of an earlier unitrain, which recorded rounds); start a new run from its weights: another "
                "run_name and load_parameters_path=<its checkpoints folder>"
            )
        self.prompts.set_state(state["position"])
        self.skip = [set(c) for c in state["consumed"]]

    # -- the verbs
    def submit(self, step: int, push: Callable[[int], None]) -> bool:
        """Starts the next round's groups with this step's weights (pushed before the step's first
        round); False if the prompt stream has none left."""
        position = self.prompts.get_state()
        try:
            batch = next(self.prompts)
        except StopIteration:
            return False
        push(step)
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.cfg.seed), step), self.submitted)
        self.submitted += 1
        self.num_dropped += batch["num_dropped"]
        round_ = _Round(self.started, position, len(batch["prompts"]), self.skip.pop(0) if self.skip else set())
        self.started += 1
        self.rounds.append(round_)
        fresh = [i for i in range(round_.size) if i not in round_.consumed]  # a restore's re-read skips the consumed
        self.driver.start([batch["prompts"][i] for i in fresh], key, [_Tag(round_, i, step) for i in fresh])
        return True

    def wait(self) -> None:
        """Moves the groups in flight one step: collects the pending generate call; or serves the Score
        and Rank requests; or, with none, submits the next generate call. Then files the groups that
        finished: a group scored is taken (and the step may end) before another call is sent, which
        then samples while the trainer updates."""
        if self.driver.pending is not None:
            self.driver.collect()
        elif not self.driver.serve():
            self.driver.dispatch()
        self._file(self.driver.finished())

    def prepare_batch(self, step: int, push: Callable[[int], None]) -> tuple[list, dict]:
        """The step's groups and what it took to get them. `push(version)` puts this step's weights
        on the sampler (idempotent within a step)."""
        cfg, stale_before = self.cfg, step - self.bound
        self.submitted, self.num_dropped, self.dropped = 0, 0, []
        errors_before = self.driver.errors  # the groups filed in this step's waits
        stale = self._discard(lambda version: version < stale_before)
        while len(self.accepted) < cfg.rollout_batch_size or self._in_flight(older_than=step + 1 - self.bound):
            if self.driver.runs or self.driver.pending is not None:
                self.wait()
            elif self.submitted >= cfg.max_sampling_rounds or not self.submit(step, push):
                break  # out of rounds (select_groups refills) or of prompts (select_groups says so)
            while (
                self._room(ahead=1 + self._steps_ahead(step))
                and self.submitted < cfg.max_sampling_rounds
                and self.submit(step, push)
            ):
                pass
        taken = sorted(self.accepted, key=_order)
        kept, self.accepted = taken[: cfg.rollout_batch_size], taken[cfg.rollout_batch_size :]
        rounds = cfg.max_sampling_rounds if self.submitted >= cfg.max_sampling_rounds else 0
        groups, discarded, refilled = select_groups(
            [g for g, _ in kept], [g for g, _ in self.dropped], cfg.rollout_batch_size, rounds
        )
        for _, tag in kept + self.dropped:
            tag.consume()
        self._retire()
        stale += self._discard(lambda version: version < step + 1 - self.bound)  # the next step could not take them
        staleness = np.asarray([step - g.version for g in groups])
        stats = {
            "sampling_rounds": self.submitted,
            "groups_discarded": discarded,
            "groups_refilled": refilled,
            "prompts_dropped": self.num_dropped,
            "rollout_workflow_errors": self.driver.errors - errors_before,
            "rollout_staleness_mean": float(staleness.mean()),
            "rollout_staleness_max": int(staleness.max()),
        }
        if self.bound:  # on-policy, a step's extra groups are simply unused
            stats["groups_stale"] = stale
        self.run_ahead(step, push)
        return groups, {**stats, "rollouts_in_flight": len(self.driver.runs) + len(self.accepted)}

    def run_ahead(self, step: int, push: Callable[[int], None]) -> None:
        """With max_staleness >= 1, before the step's update: tops the groups in flight up with new
        rounds (within capacity; none at the last step) and submits their next generate call, which
        samples while the trainer updates."""
        ahead = self._steps_ahead(step)
        while ahead and self._room(ahead) and self.submit(step, push):
            pass
        if ahead and self.driver.pending is None and self.driver.runs:
            self.driver.dispatch(ahead=True)

    # -- bookkeeping
    def _steps_ahead(self, step: int) -> int:
        """The later steps that may train on what is sampled now: max_staleness, or the steps left."""
        return min(self.bound, self.cfg.steps - 1 - step)

    def _room(self, ahead: int) -> bool:
        """Whether one more round fits in `ahead` rounds' worth of groups not yet consumed, and under
        max_concurrent_rollouts' groups in flight (0 = no such bound)."""
        waiting = len(self.driver.runs) + len(self.accepted)
        running = not self.concurrency or len(self.driver.runs) < self.concurrency
        return waiting + self.round_size <= ahead * self.round_size and running

    def _in_flight(self, older_than: int) -> bool:
        """Whether a group in flight started with weights older than `older_than`."""
        return any(run.tag.version < older_than for run in self.driver.runs)

    def _file(self, runs) -> None:
        """Finished runs: rejected ones (and those whose workflow raised) consumed; groups reshaped,
        then accepted or dropped."""
        for run in runs:
            if run.result is None:
                run.tag.consume()
                continue
            group = self.shape(make_group(run.record, run.result))
            (self.accepted if self.keep is None or self.keep(group) else self.dropped).append((group, run.tag))
        self._retire()

    def _discard(self, too_old: Callable[[int], bool]) -> int:
        """Drops the accepted groups and the groups in flight whose version is too old: how many."""
        stale = [tag for group, tag in self.accepted if too_old(group.version)]
        self.accepted = [(group, tag) for group, tag in self.accepted if not too_old(group.version)]
        running = [run for run in self.driver.runs if too_old(run.tag.version)]
        self.driver.drop(running)
        for tag in stale + [run.tag for run in running]:
            tag.consume()
        self._retire()
        return len(stale) + len(running)

    def _retire(self) -> None:
        """Forgets the oldest rounds once every group of theirs is consumed."""
        while self.rounds and not self.rounds[0].open:
            self.rounds.popleft()


def _order(entry) -> tuple:
    """Submission order: rounds in the order they started, a round's groups in record order."""
    _, tag = entry
    return tag.round.number, tag.index


@check("max_concurrent_rollouts", "rollout_chunk_tokens", "max_staleness")
def _stream_keys(c) -> str | None:
    """The stream's keys act where groups sample across steps."""
    if c["max_staleness"]:
        return None
    if c["max_concurrent_rollouts"]:
        return "max_concurrent_rollouts bounds the groups in flight of the stream (max_staleness >= 1); on-policy (max_staleness 0) a step runs one round at a time"
    if c["rollout_chunk_tokens"]:
        return "rollout_chunk_tokens lets a weight update interrupt a generation, which happens only when groups sample across steps (max_staleness >= 1)"
    return None


CONFIG_CHECKS = (_stream_keys,)
