"""Multi-turn episodes: the workflow seam, the batched turn driver and trajectories.

A workflow turns a record into a `Trajectory`. It is written as straight-line Python: its
`episode(record)` is a generator that yields a `Generate` request whenever it needs the model's
next turn, receives that turn back as `Sampled`, and returns the Trajectory (or None: the episode
is rejected, as AReaL's workflows may reject one):

    def episode(self, record):
        transcript = Transcript(prompt_ids)
        turn = yield Generate(transcript.context(), max_new_tokens)
        transcript.add_sampled(turn)          # the sampled ids, kept as sampled
        transcript.add_context(more_ids)      # a tool result, the user's reply, the template's glue
        ...
        return transcript.trajectory(reward, end="env_done")

`workflow: multi_turn` is rollout/multi_turn.py (an environment, envs/base.py, and a chat template);
`workflow: pkg.module:Class` is any class made as Class(run) with that episode method;
`workflow: single_turn` is the one-prompt, one-completion path of rollout/groups.py.

The driver (`start_episodes`) runs all episodes of a round together: each turn, the requests of the
live episodes go to the sampler in one generate call, rows in episode order (finished episodes
leave), and each episode gets its row back. It runs on the main thread in a fixed order, so every
process makes the same sampler calls (the Sampler contract, rollout/base.py). The first turn is
submitted at once (sampling runs ahead with `max_staleness`); the later turns are sampled when the
round is taken, with the weights the sampler has then: each sampled token records its version.
A call compiles for `sampling.max_new_tokens` tokens (one shape) and gives each row its own request's
budget (`row_budgets`): a row that reaches it ends there, and the sampler's compaction stops its cost.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable

import jax
import numpy as np

from unitrain import plugins, registry
from unitrain.data.prompts import Prompt
from unitrain.errors import ConfigError, DataError, UserError
from unitrain.rollout.base import Completions, Sampler, SamplingParams, submit
from unitrain.rollout.groups import Group

log = logging.getLogger("unitrain")

END_REASONS = ("env_done", "max_turns", "length", "env_error")


class WorkflowError(UserError):
    """A workflow plugin broke its contract: one line naming it, exit 2."""


@dataclasses.dataclass(frozen=True)
class Generate:
    """A workflow's request for the model's next turn."""

    context: list[int]  # every id so far: the prompt and all turns
    max_new_tokens: int


@dataclasses.dataclass(frozen=True)
class Sampled:
    """One turn as the sampler produced it."""

    tokens: np.ndarray  # [n] int32, the stop token included when it stopped
    logprobs: np.ndarray  # [n] float32, under the distribution each token was drawn from
    version: int  # the weights version that sampled it
    stopped: bool  # ended by one of the call's stop tokens (else cut at its token budget)


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """One episode, token in and token out. The arrays cover everything after the prompt."""

    prompt_ids: tuple[int, ...]  # the first prompt (the same for every episode of a record)
    ids: np.ndarray  # [L] int32: every sampled turn and every environment message, in order
    loss_mask: np.ndarray  # [L] int32: 1 exactly on the sampled tokens
    logprobs: np.ndarray  # [L] float32: the sampler's logprobs on sampled tokens, 0 elsewhere
    versions: np.ndarray  # [L] int32: the weights version of each sampled token, -1 elsewhere
    turn_index: np.ndarray  # [L] int32: the turn of each sampled token, -1 elsewhere
    reward: float
    turns: int
    end: str  # one of END_REASONS
    tool_calls: int = 0
    invalid_tool_calls: int = 0
    messages: tuple[dict, ...] = ()  # the conversation as text, for logs

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
        self.versions += [turn.version] * n
        self.turn += [self.turns] * n
        self.turns += 1

    def add_context(self, ids) -> None:
        n = len(ids)
        self.ids += [int(t) for t in ids]
        self.mask += [0] * n
        self.logprobs += [0.0] * n
        self.versions += [-1] * n
        self.turn += [-1] * n

    def trajectory(self, reward: float, end: str, **counts) -> Trajectory:
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
            **counts,
        )


def make_workflow(run):
    """The configured workflow; None for single_turn (rollout/groups.py's path)."""
    if run.cfg.workflow == "single_turn":
        return None
    cls = plugins.resolve(run.cfg.workflow, registry.WORKFLOWS, "workflow", "a workflow class (run)")
    workflow = cls(run)
    if not callable(getattr(workflow, "episode", None)):
        raise ConfigError(f"workflow {run.cfg.workflow} has no episode(record) method (rollout/episodes.py)")
    return workflow


# ---------------------------------------------------------------- the driver


def start_episodes(
    sampler: Sampler, workflow, records: list, sampling: SamplingParams, key: jax.Array
) -> Callable[[], list[Trajectory | None]]:
    """Every record's episode, started: the first turn is submitted now; the function returned runs the
    later turns and returns the trajectories in record order (None where rejected)."""
    name = f"{type(workflow).__module__}:{type(workflow).__qualname__}"  # for error lines
    episodes = [_Episode(workflow.episode(r), name) for r in records]
    for e in episodes:
        e.advance(None)
    first = _submit_turn(sampler, episodes, sampling, key)

    def finish() -> list[Trajectory | None]:
        pending, turn = first, 0
        while pending is not None:
            live, handle = pending
            out = handle.result()
            for row, e in enumerate(live):
                e.advance(_row(out, row, e.request.max_new_tokens, sampling.stop_token_ids))
            turn += 1
            pending = _submit_turn(sampler, episodes, sampling, jax.random.fold_in(key, turn))
        return [e.result for e in episodes]

    return finish


def _submit_turn(sampler, episodes: list, sampling: SamplingParams, key):
    """One sampler call for the live episodes' requests -> (those episodes, its handle); None if none is live."""
    live = [e for e in episodes if e.request is not None]
    if not live:
        return None
    budgets = tuple(min(e.request.max_new_tokens, sampling.max_new_tokens) for e in live)
    sampling = dataclasses.replace(sampling, row_budgets=budgets)
    return live, submit(sampler, [e.request.context for e in live], sampling, key)


def _row(out: Completions, row: int, budget: int, stop_ids) -> Sampled:
    n = min(int(out.lengths[row]), budget)
    tokens = out.tokens[row, :n].astype(np.int32)
    stopped = n > 0 and int(tokens[-1]) in stop_ids
    return Sampled(tokens, out.logprobs[row, :n].astype(np.float32), out.version, stopped)


class _Episode:
    """One workflow generator and what it waits for."""

    def __init__(self, gen, name: str):
        self.gen, self.name = gen, name
        self.request: Generate | None = None
        self.result: Trajectory | None = None

    def advance(self, turn: Sampled | None) -> None:
        try:
            request = self.gen.send(turn)
        except StopIteration as stop:
            self.request, self.result = None, self._checked(stop.value)
            return
        except UserError:
            raise
        except Exception as e:
            raise WorkflowError(f"workflow {self.name} raised {plugins.one_line(e)}") from None
        if not isinstance(request, Generate) or not request.context or request.max_new_tokens < 1:
            raise WorkflowError(
                f"workflow {self.name} yielded {request!r:.120}; it must yield Generate(context ids, max_new_tokens >= 1)"
            )
        self.request = request

    def _checked(self, value):
        if value is not None and not isinstance(value, Trajectory):
            raise WorkflowError(
                f"workflow {self.name} returned a {type(value).__name__}; an episode returns a Trajectory or None"
            )
        return value


# ---------------------------------------------------------------- trajectories as GRPO groups


def start_episode_groups(
    sampler: Sampler, workflow, prompts: list, n: int, sampling: SamplingParams, key, tokenizer
) -> Callable[[], list[Group]]:
    """n episodes of every prompt record, started (start_episodes); the function returned waits for
    them and returns one group per record, in order. A record with a rejected episode gives no group."""
    finish = start_episodes(sampler, workflow, [p for p in prompts for _ in range(n)], sampling, key)

    def groups() -> list[Group]:
        episodes = finish()
        out = []
        for g, prompt in enumerate(prompts):
            group = episodes[g * n : (g + 1) * n]
            if any(t is None for t in group):
                log.info("a record's group is left out: %d of its %d episodes were rejected", group.count(None), n)
                continue
            out.append(episode_group(prompt, group, tokenizer))
        return out

    return groups


def episode_group(prompt: Prompt, episodes: list[Trajectory], tokenizer) -> Group:
    """A record's n trajectories as one group (rollout/groups.Group): the completion columns are
    everything after the prompt, `mask` is the loss mask (sampled tokens only), `version` the oldest
    sampled token's."""
    if len({t.prompt_ids for t in episodes}) > 1:
        raise DataError(
            f"the episodes of one record start from different prompts (prompt {prompt.text[:80]!r}): an "
            "environment's reset must depend on the record only (seed its randomness from it)"
        )
    width = max(1, max(len(t.ids) for t in episodes))

    def padded(field, dtype, fill=0):
        out = np.full((len(episodes), width), fill, dtype)
        for i, t in enumerate(episodes):
            out[i, : len(t.ids)] = getattr(t, field)
        return out

    versions = [int(t.versions[t.loss_mask == 1].min()) for t in episodes if t.loss_mask.any()]
    completions = Completions(
        tokens=padded("ids", np.int32, tokenizer.pad_id),
        mask=padded("loss_mask", np.int32),
        logprobs=padded("logprobs", np.float32),
        lengths=np.asarray([len(t.ids) for t in episodes], np.int32),
        version=min(versions, default=0),
    )
    rewards = np.asarray([t.reward for t in episodes], np.float32)
    texts = [tokenizer.decode(t.ids, skip_special_tokens=False) for t in episodes]
    head = Prompt(episodes[0].prompt_ids, prompt.text, prompt.label)
    return Group(head, completions, texts, rewards, {"env": rewards}, tuple(episodes))


def episode_metrics(episodes: list[Trajectory], prefix: str = "") -> dict:
    """Success rate, turns, tool calls and their validity, sampled tokens, the sampler's live rows,
    and why episodes ended."""
    if not episodes:
        return {}
    calls = sum(t.tool_calls for t in episodes)
    ends = collections.Counter(t.end for t in episodes)
    metrics = {
        "episode_success_rate": np.mean([t.success for t in episodes]),
        "episode_turns_mean": np.mean([t.turns for t in episodes]),
        "episode_tool_calls_mean": calls / len(episodes),
        "episode_tool_call_valid_rate": 1.0 - sum(t.invalid_tool_calls for t in episodes) / calls if calls else 1.0,
        "episode_sampled_tokens_mean": np.mean([int(t.loss_mask.sum()) for t in episodes]),
        # The driver's rows that were live episodes over a round's turns (1: none waited on another);
        # exact for a step of one round, whose sampler calls are its longest episode's turns.
        "episode_live_rows_fraction": sum(t.turns for t in episodes)
        / (len(episodes) * max(t.turns for t in episodes) or 1),
        **{f"episode_end_{reason}": ends[reason] / len(episodes) for reason in END_REASONS},
    }
    return {prefix + k: float(v) for k, v in metrics.items()}


def episodes_markdown(episodes: list[Trajectory], count: int = 2) -> str:
    """A few whole episodes as TensorBoard markdown, each message under its role (tool and
    environment messages marked as such)."""
    parts = []
    for i, t in enumerate(episodes[:count]):
        lines = [f"**episode {i}** reward {t.reward:.3f}, {t.turns} turns, ended: {t.end}"]
        lines += [f"**[{m['role']}]** {m.get('content', '')}" for m in t.messages]
        parts.append("\n\n".join(lines))
    return "\n\n---\n\n".join(parts)
