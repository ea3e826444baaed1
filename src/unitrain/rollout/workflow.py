"""The rollout seam: every rollout is a workflow (AReaLite's `arun_episode`, written as a generator).

A workflow turns one prompt record into its group: `group(record, n)` is a generator that yields
requests whenever it needs the model or the reward, receives each answer back, and returns the
group's trajectories, or None (the record is rejected, as AReaL's workflows may reject one):

    def group(self, record, n):
        turns = yield [Generate(list(record.ids))] * n      # n sampled answers -> [Sampled] * n
        texts = [decode(t.tokens) for t in turns]
        total, per_reward = yield Score(record, texts)     # the run's rewards -> ([n], {name: [n]})
        return [sampled_trajectory(record, t, text, ...) for ...]

The requests: a list of `Generate` (a sampled turn per row), a `Rank` (the sampler's beam search:
a prompt's ranked sequences) or a `Score` (the run's reward function on a group's texts). The driver
(rollout/driver.py) runs every record of a round together and serves each kind of request in one
batched call: one generate call for all rows waiting on a turn, one beam search, one reward call.
A workflow whose episodes are independent writes `episode(record)` instead (a generator yielding one
`Generate` at a time and returning one Trajectory or None); `Workflow.group` runs n of them in
lockstep and rejects the group if any episode is rejected.

An exception a workflow raises ends that record's group, logged, counted (rollout_workflow_errors)
and left out as a rejected one: a bad record or a flaky service costs its group, not the run. A
broken contract (a wrong request or result: WorkflowError) and a UserError stop the run with one
line, as do so many groups raising in a row that no group comes out (rollout/driver.py).

The built-in workflows (registry.WORKFLOWS): single_turn (one answer per row, scored by `reward`),
multi_turn (a conversation with an environment, rollout/multi_turn.py) and ranked (the sampler's
ranked beams, rollout/ranked.py); `workflow: pkg.module:Class` is any Workflow subclass, made as
Class(run).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from unitrain.errors import UserError

log = logging.getLogger("unitrain")

# How a trajectory ended: its stop token (a single answer), the environment said done, its turns or
# tokens ran out, the environment raised, the environment took longer than the episode's env_timeout.
END_REASONS = ("stop", "env_done", "max_turns", "length", "env_error", "env_timeout")


class WorkflowError(UserError):
    """A workflow plugin broke its contract, or raised on every group a step needed: one line naming
    it, exit 2."""


def name_of(workflow) -> str:
    """A workflow as its error lines name it: module:Class."""
    return f"{type(workflow).__module__}:{type(workflow).__qualname__}"


@dataclasses.dataclass(frozen=True)
class Generate:
    """A request for the model's next turn of one row."""

    context: list[int]  # every id so far: the prompt and all turns
    max_new_tokens: int | None = None  # None: as many as the call samples
    images: object = None  # the prompt's data.images.PromptImages (its image pads' pixels), if any


@dataclasses.dataclass(frozen=True)
class Rank:
    """A request for the `beams.width` best sequences after `context` (the sampler's beam_search)."""

    context: list[int]
    beams: object  # rollout.beam.BeamParams


@dataclasses.dataclass(frozen=True)
class Score:
    """A request for the run's rewards of a group's completions: -> (total [n], {name: [n]}) float32."""

    record: object  # data.prompts.Prompt: its text and label go to the reward
    completions: list[str]


@dataclasses.dataclass(frozen=True)
class Sampled:
    """One turn (or one ranked sequence) as the sampler produced it."""

    tokens: np.ndarray  # [n] int32, the stop token included when it stopped
    logprobs: np.ndarray  # [n] float32, under the distribution each token was drawn from
    versions: np.ndarray  # [n] int32, the weights version that sampled each token
    stopped: bool  # ended by one of the call's stop tokens (else cut at its token budget)
    routes: np.ndarray | None = None  # [n, L, k]: routing replay's experts of each token
    prompt_routes: np.ndarray | None = None  # [P, L, k]: of the call's left-padded prompt block


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """One rollout, token in and token out. The arrays cover everything after the prompt."""

    prompt_ids: tuple[int, ...]  # the first prompt (the same for every trajectory of a record)
    ids: np.ndarray  # [L] int32: every sampled turn and every environment message, in order
    loss_mask: np.ndarray  # [L] int32: 1 exactly on the sampled tokens
    logprobs: np.ndarray  # [L] float32: the sampler's logprobs on sampled tokens, 0 elsewhere
    versions: np.ndarray  # [L] int32: the weights version of each sampled token, -1 elsewhere
    turn_index: np.ndarray  # [L] int32: the turn of each sampled token, -1 elsewhere
    reward: float
    turns: int
    end: str  # one of END_REASONS
    per_reward: dict = dataclasses.field(default_factory=dict)  # each reward's raw value, the task's first
    text: str = ""  # everything after the prompt as text, for logs and filters
    tool_calls: int = 0
    invalid_tool_calls: int = 0
    messages: tuple[dict, ...] = ()  # the conversation as text, for logs
    routes: np.ndarray | None = None  # [L, layers, k]: routing replay's experts of the sampled tokens
    prompt_routes: np.ndarray | None = None  # [len(prompt_ids), layers, k]: of the prompt's tokens

    @property
    def success(self) -> bool:
        return self.reward >= 1.0


class Transcript:
    """A trajectory being built: the ids so far and, per id, whether the model sampled it."""

    def __init__(self, prompt_ids):
        self.prompt_ids = tuple(int(i) for i in prompt_ids)
        self.ids, self.mask, self.logprobs, self.versions, self.turn = [], [], [], [], []
        self.turns = 0

    def __len__(self) -> int:
        """Ids after the prompt."""
        return len(self.ids)

    def context(self) -> list[int]:
        return [*self.prompt_ids, *self.ids]

    def add_sampled(self, turn: Sampled) -> None:
        n = len(turn.tokens)
        self.ids += [int(t) for t in turn.tokens]
        self.mask += [1] * n
        self.logprobs += [float(x) for x in turn.logprobs]
        self.versions += [int(v) for v in turn.versions]
        self.turn += [self.turns] * n
        self.turns += 1

    def add_context(self, ids) -> None:
        n = len(ids)
        self.ids += [int(t) for t in ids]
        self.mask += [0] * n
        self.logprobs += [0.0] * n
        self.versions += [-1] * n
        self.turn += [-1] * n

    def trajectory(self, reward: float, end: str, **fields) -> Trajectory:
        if end not in END_REASONS:
            raise ValueError(f"end reason {end!r} is not one of {END_REASONS}")
        return Trajectory(
            self.prompt_ids,
            np.asarray(self.ids, np.int32),
            np.asarray(self.mask, np.int32),
            np.asarray(self.logprobs, np.float32),
            np.asarray(self.versions, np.int32),
            np.asarray(self.turn, np.int32),
            float(reward),
            self.turns,
            end,
            **fields,
        )


def scored_answers(record, turns: list[Sampled], tokenizer):
    """A group of one-turn answers (sampled or ranked) scored by the run's reward: yields the Score
    request, returns the trajectories (end: `stop` or `length`)."""
    texts = [tokenizer.decode(t.tokens) for t in turns]
    total, per_reward = yield Score(record, texts)
    out = []
    for i, (turn, text) in enumerate(zip(turns, texts)):
        transcript = Transcript(record.ids)
        transcript.add_sampled(turn)
        prompt_routes = None if turn.prompt_routes is None else turn.prompt_routes[-len(record.ids) :]
        out.append(
            transcript.trajectory(
                total[i],
                "stop" if turn.stopped else "length",
                per_reward={k: float(v[i]) for k, v in per_reward.items()},
                text=text,
                routes=turn.routes,
                prompt_routes=prompt_routes,
            )
        )
    return out


class Workflow:
    """The base of a workflow: `group(record, n)` (module docstring). A workflow of independent
    episodes writes `episode(record)` and inherits `group`. `metrics` and `markdown` are what the
    step logs of its trajectories (the scalars, the TensorBoard text)."""

    def __init__(self, run):
        self.cfg, self.tokenizer = run.cfg, run.tokenizer
        # The most ids after the prompt that a trajectory holds (the completion columns of GRPO's rows).
        self.max_tokens = run.cfg.episode_max_tokens

    def group(self, record, n: int):
        """n episodes of the record in lockstep: each request of the driver is the live episodes'
        Generate list; None if any episode is rejected."""
        name = name_of(self)
        episodes = [self.episode(record) for _ in range(n)]
        requests = [_send(e, None, name) for e in episodes]
        while any(isinstance(r, Generate) for r in requests):
            live = [i for i, r in enumerate(requests) if isinstance(r, Generate)]
            turns = yield [requests[i] for i in live]
            for i, turn in zip(live, turns):
                requests[i] = _send(episodes[i], turn, name)
        results = [r.value for r in requests]
        if wrong := next((t for t in results if t is not None and not isinstance(t, Trajectory)), None):
            raise WorkflowError(
                f"workflow {name}: an episode returned a {type(wrong).__name__}; it returns a Trajectory or None"
            )
        if any(t is None for t in results):
            log.info("a record's group is left out: %d of its %d episodes were rejected", results.count(None), n)
            return None
        return results

    def episode(self, record):
        raise NotImplementedError(f"{type(self).__name__} writes neither group(record, n) nor episode(record)")

    def metrics(self, trajectories: list[Trajectory], prefix: str = "") -> dict:
        return {}

    def markdown(self, groups: list) -> str:
        """The first answer of the first few groups as TensorBoard markdown."""
        return "\n\n".join(
            f"**prompt** {g.prompt.text}\n\n**completion** {g.trajectories[0].text}\n\n**label** {g.prompt.label}\n\n"
            f"**reward** {g.rewards[0]:.3f}"
            for g in groups[:4]
        )


@dataclasses.dataclass(frozen=True)
class _Returned:
    value: object


def _send(episode, turn, name: str):
    """The episode's next request, or _Returned(its result); a wrong request is the workflow's
    broken contract (its own exceptions pass through: the driver records them)."""
    try:
        request = episode.send(turn)
    except StopIteration as stop:
        return _Returned(stop.value)
    if not isinstance(request, Generate):
        raise WorkflowError(
            f"workflow {name}: an episode yielded {request!r:.120}; it must yield Generate(context ids, max_new_tokens)"
        )
    return request
