"""The batched driver of workflows (rollout/workflow.py): every group in flight served together.

    finish = start_groups(sampler, workflow, records, n, sampling, key, reward_fn)
    groups = finish()      # one Group per record not rejected, in record order
    driver = Driver(...); driver.start(records, key, tags); driver.dispatch(); driver.collect()

Each round of requests is served kind by kind, one call each: the Score requests in one reward call
(the texts of every group in order, so a GroupReward sees whole groups and a batch reward the
call's), the Rank requests in one beam search, the rows waiting on a turn in one generate call
(rows in order, finished rows leave, each row with its own token budget). `dispatch` submits the
generate call (engines/base.submit: it may sample while the trainer goes on), `collect` waits for it;
each token records the weights version that drew it. With `chunk_tokens` a turn takes several calls
(interruptible generation: a push between two continues it under the new weights). A call takes the
next key of the round of its first group: call c of a round, its key folded with c (the first: the
key itself). It runs on the main thread in a fixed order, so every process makes the same calls.
The executor (rollout/executor.py) keeps a Driver's groups in flight across steps.

A workflow that raises ends that group: one warning line, the group left out as a rejected one and
counted (`errors`); so many groups raising in a row that none comes out (`give_up_after`: a step's
worth, or every record of start_groups) is one WorkflowError line quoting the first. A broken
contract (a wrong request or result) and a UserError stop the run at once.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import jax
import numpy as np

from unitrain import plugins, registry
from unitrain.config import check
from unitrain.data import format_choice
from unitrain.engines.base import Completions, InterruptingSampler, SamplingParams, submit
from unitrain.errors import ConfigError, DataError, UserError
from unitrain.registry import RL_MODES
from unitrain.rollout.groups import Group
from unitrain.rollout.workflow import Generate, Rank, Sampled, Score, Trajectory, Workflow, WorkflowError, name_of

log = logging.getLogger("unitrain")


def start_groups(
    sampler, workflow, records: list, n: int, sampling: SamplingParams, key: jax.Array, reward_fn
) -> Callable[[], list[Group]]:
    """Every record's group, started; the function returned runs the rest and returns the groups.
    A group whose workflow raised is left out; all of them raising is one WorkflowError line."""
    driver = Driver(sampler, workflow, n, sampling, reward_fn, give_up_after=len(records))
    driver.start(records, key)
    driver.dispatch()
    return driver.groups


def run_groups(sampler, workflow, records: list, n: int, sampling: SamplingParams, key, reward_fn) -> list[Group]:
    """start_groups, waited for."""
    return start_groups(sampler, workflow, records, n, sampling, key, reward_fn)()


class Driver:
    """The runs of workflow groups in flight, served together. `start` begins a batch of records'
    runs (their round: a key whose sampler calls it numbers); `dispatch` serves the Score and Rank
    requests until every live run waits on a turn, then submits those turns in one generate call
    (`pending`); `collect` waits for it and hands each run its turns. A call takes the next key of
    the round of its first run: a round served alone numbers its calls as start_groups always did."""

    def __init__(
        self,
        sampler,
        workflow,
        n: int,
        sampling: SamplingParams,
        reward_fn,
        chunk_tokens: int = 0,
        give_up_after: int = 0,
    ):
        """`chunk_tokens` > 0 serves a turn at most that many tokens a call: a weight update between
        calls continues it under the new weights, re-prefilled from the tokens so far (interruptible
        generation); each token records the version that drew it. `give_up_after` > 0: that many
        groups in a row whose workflow raised stop the run (a broken plugin, not a bad record)."""
        self.sampler, self.workflow, self.n, self.sampling, self.reward_fn = sampler, workflow, n, sampling, reward_fn
        self.chunk_tokens, self.give_up_after = chunk_tokens, give_up_after
        self.interrupted_by_pushes = isinstance(sampler, InterruptingSampler) and sampler.interrupts
        self.name = name_of(workflow)  # for error lines
        self.runs: list[_Run] = []
        self.pending = (
            None  # the generate call in flight: (its runs, its turns, their budgets, whole turns?, its handle)
        )
        self.errors = 0  # groups whose workflow raised, of the runs taken out by `finished`
        self.in_a_row, self.first_in_row = 0, ""  # those since a run last returned, and the first's error

    def start(self, records: list, key: jax.Array, tags: list | None = None) -> list[_Run]:
        """Starts the records' runs (each up to its first request); each run carries its `tags` entry."""
        keys, tags = _Keys(key), tags or [None] * len(records)
        runs = [_Run(self.workflow.group(r, self.n), r, self.name, keys, tag) for r, tag in zip(records, tags)]
        for run in runs:
            run.advance(None)
        self.runs += runs
        return runs

    def finished(self) -> list[_Run]:
        """The runs that have ended (their result a list of trajectories, or None: rejected or raised),
        taken out and their errors counted."""
        done = [r for r in self.runs if r.request is None]
        self.runs = [r for r in self.runs if r.request is not None]
        for run in done:
            self._count(run)
        return done

    def groups(self) -> list[Group]:
        """Serves every run to its end: the groups of those that returned one, in the order they started."""
        while self.pending is not None:
            self.collect()
            self.dispatch()
        return [make_group(run.record, run.result) for run in self.finished() if run.result is not None]

    def _count(self, run: _Run) -> None:
        """Counts a run that raised; so many in a row that no group comes out is the plugin's fault."""
        if not run.error:
            self.in_a_row = 0
            return
        self.errors, self.in_a_row = self.errors + 1, self.in_a_row + 1
        self.first_in_row = run.error if self.in_a_row == 1 else self.first_in_row
        if self.give_up_after and self.in_a_row >= self.give_up_after:
            k = self.in_a_row
            raise WorkflowError(
                f"workflow {self.name} raised on {k} group{'s' * (k > 1)} in a row, so no group comes out; "
                f"the first error: {self.first_in_row}"
            )

    def drop(self, runs) -> None:
        """Ends runs without waiting for them (their episodes will never be trained on)."""
        self.runs = [r for r in self.runs if r not in runs]

    def serve(self) -> bool:
        """Serves Score and Rank requests until every live run waits on a turn; whether there were any."""
        served = False
        while True:
            scores = [r for r in self.runs if isinstance(r.request, Score)]
            ranks = [r for r in self.runs if isinstance(r.request, Rank)]
            if not scores and not ranks:
                return served
            if scores:
                _score(scores, self.reward_fn)
            if ranks:
                _rank(ranks, self.sampler, ranks[0].keys.next())
            served = True

    def dispatch(self, ahead: bool = False) -> None:
        """Serves the Score and Rank requests, then submits the turns the live runs wait on in one
        generate call (pending), or leaves pending None when no run waits on one. A call `ahead` of a
        weight update (it samples while the trainer updates) on a sampler whose pushes interrupt it
        asks for whole turns: the push ends it, where chunk_tokens would have left the engine idle."""
        self.serve()
        live = [r for r in self.runs if isinstance(r.request, list)]
        if not live:
            self.pending = None
            return
        rows = [row for run in live for row in run.turns(self.sampling.max_new_tokens) if not row.done]
        whole = not self.chunk_tokens or (ahead and self.interrupted_by_pushes)
        budgets = tuple(row.remaining if whole else min(row.remaining, self.chunk_tokens) for row in rows)
        call = dataclasses.replace(self.sampling, row_budgets=budgets)
        contexts, images = [row.context() for row in rows], [row.request.images for row in rows]
        handle = submit(self.sampler, contexts, call, live[0].keys.next(), images)
        self.pending = (live, rows, budgets, whole, handle)

    def collect(self) -> None:
        """Waits for the pending generate call, adds each row's tokens to its turn, and hands each run
        whose turns are all done its turns."""
        live, rows, budgets, whole, handle = self.pending
        self.pending = None
        out, stops = handle.result(), self.sampling.stop_token_ids
        for i, (row, budget) in enumerate(zip(rows, budgets)):
            cut = out.interrupted is not None and bool(out.interrupted[i])
            row.add(_row(out, i, budget, stops), budget, whole=whole, interrupted=cut)
        for run in live:
            if all(row.done for row in run.rows):
                run.advance([row.sampled() for row in run.rows])


class _Turn:
    """One Generate request's turn, sampled in one call or (chunk_tokens) several: its pieces so far."""

    def __init__(self, request: Generate, max_new_tokens: int):
        self.request, self.pieces, self.done = request, [], False
        self.budget = min(request.max_new_tokens or max_new_tokens, max_new_tokens)

    @property
    def remaining(self) -> int:
        return self.budget - sum(len(p.tokens) for p in self.pieces)

    def context(self) -> list[int]:
        return [*self.request.context, *(int(t) for p in self.pieces for t in p.tokens)]

    def add(self, piece: Sampled, call_budget: int, whole: bool, interrupted: bool) -> None:
        """A call's tokens; the turn is done at a stop token, at its budget, and, unless a weight update
        interrupted the call (it goes on under the new weights), when the call was to be the whole
        turn or the engine ended the row short of the call's budget."""
        self.pieces.append(piece)
        short = whole or len(piece.tokens) < call_budget
        self.done = piece.stopped or self.remaining == 0 or (short and not interrupted)

    def sampled(self) -> Sampled:
        """The whole turn: its pieces joined (the prompt's routes are the first call's)."""
        if len(self.pieces) == 1:
            return self.pieces[0]

        def joined(field):
            parts = [getattr(p, field) for p in self.pieces]
            return None if parts[0] is None else np.concatenate(parts)

        return Sampled(
            joined("tokens"),
            joined("logprobs"),
            joined("versions"),
            self.pieces[-1].stopped,
            joined("routes"),
            self.pieces[0].prompt_routes,
        )


class _Keys:
    """A round's key and the number of sampler calls made with it: call c takes the key folded with
    c (the first: the key itself)."""

    def __init__(self, key):
        self.key, self.calls = key, 0

    def next(self):
        c, self.calls = self.calls, self.calls + 1
        return self.key if c == 0 else jax.random.fold_in(self.key, c)


def _score(runs, reward_fn) -> None:
    """One reward call per group size over the runs' Score requests, in run order."""
    for size in dict.fromkeys(len(r.request.completions) for r in runs):
        same = [r for r in runs if len(r.request.completions) == size]
        prompts = [r.request.record.text for r in same for _ in range(size)]
        labels = [r.request.record.label for r in same for _ in range(size)]
        texts = [t for r in same for t in r.request.completions]
        total, per_reward = reward_fn(prompts, texts, labels, group_size=size)
        for i, run in enumerate(same):
            part = slice(i * size, (i + 1) * size)
            run.advance((total[part], {k: v[part] for k, v in per_reward.items()}))


def _rank(runs, sampler, key) -> None:
    """One beam search over the runs' Rank requests (they share their BeamParams)."""
    beams = runs[0].request.beams
    if any(r.request.beams is not beams for r in runs):
        raise WorkflowError(f"workflow {runs[0].name} asked for beam searches of different settings in one round")
    out = sampler.beam_search([r.request.context for r in runs], beams, key).completions()
    for i, run in enumerate(runs):
        run.advance([_row(out, i * beams.width + j, None, beams.stop_token_ids) for j in range(beams.width)])


def _row(out: Completions, row: int, budget: int | None, stop_ids: tuple[int, ...]) -> Sampled:
    """Row `row` of a call's completions as one Sampled turn (cut at its budget, if any)."""
    n = int(out.lengths[row]) if budget is None else min(int(out.lengths[row]), budget)
    tokens = out.tokens[row, :n].astype(np.int32)
    stopped = n > 0 and int(tokens[-1]) in stop_ids
    return Sampled(
        tokens,
        out.logprobs[row, :n].astype(np.float32),
        np.full(n, out.version, np.int32),
        stopped,
        None if out.routes is None else out.routes[row, :n],
        None if out.prompt_routes is None else out.prompt_routes[row],
    )


class _Run:
    """One record's workflow generator and the request it waits on (None: it has returned), with its
    round's keys and what the caller tagged it with; `rows`: the turns of a Generate request."""

    def __init__(self, gen, record, name: str, keys: _Keys, tag):
        self.gen, self.record, self.name, self.keys, self.tag = gen, record, name, keys, tag
        self.request, self.rows = None, None
        self.result: list[Trajectory] | None = None
        self.error = ""  # what the workflow raised, in one line ("": it did not)

    def turns(self, max_new_tokens: int) -> list[_Turn]:
        """The turns its Generate request asks for, made when first served."""
        if self.rows is None:
            self.rows = [_Turn(g, max_new_tokens) for g in self.request]
        return self.rows

    def advance(self, answer) -> None:
        self.rows = None
        try:
            request = self.gen.send(answer)
        except StopIteration as stop:
            self.request, self.result = None, self._checked(stop.value)
            return
        except UserError:
            raise
        except Exception as e:  # the workflow's own failure ends its group, as a rejection does, and is counted
            self.request, self.error = None, plugins.one_line(e)
            log.warning(
                "workflow %s raised on prompt %r, its group left out: %s", self.name, self.record.text[:80], self.error
            )
            return
        self.request = self._valid(request)

    def _valid(self, request):
        if isinstance(request, (Score, Rank)):
            return request
        if isinstance(request, list) and request and all(_is_turn(g) for g in request):
            return request
        raise WorkflowError(
            f"workflow {self.name} yielded {request!r:.120}; it must yield a list of Generate(context ids, "
            "max_new_tokens >= 1 or None), a Rank or a Score"
        )

    def _checked(self, value):
        if value is None:
            return None
        if not isinstance(value, list) or not value or not all(isinstance(t, Trajectory) for t in value):
            raise WorkflowError(
                f"workflow {self.name} returned {type(value).__name__}; a group is a non-empty list of Trajectory or None"
            )
        return value


def _is_turn(g) -> bool:
    return isinstance(g, Generate) and bool(g.context) and (g.max_new_tokens is None or g.max_new_tokens >= 1)


def make_group(record, trajectories: list[Trajectory]) -> Group:
    """A record's trajectories as its Group, the rewards as float32 arrays."""
    if len({t.prompt_ids for t in trajectories}) > 1:
        raise DataError(
            f"the episodes of one record start from different prompts (prompt {record.text[:80]!r}): an "
            "environment's reset must depend on the record only (seed its randomness from it)"
        )
    rewards = np.asarray([t.reward for t in trajectories], np.float32)
    per_reward = {
        k: np.asarray([t.per_reward[k] for t in trajectories], np.float32) for k in trajectories[0].per_reward
    }
    prompt = dataclasses.replace(record, ids=trajectories[0].prompt_ids)  # as the workflow prompted (a chat template)
    return Group(prompt, tuple(trajectories), rewards, per_reward)


def make_workflow(run, name: str | None = None) -> Workflow:
    """The workflow `name` (default: the one the config's GRPO rollouts take, data format included)."""
    cfg = run.cfg
    name = name or format_choice.data_format(cfg).workflow(cfg)
    cls = plugins.resolve(name, registry.WORKFLOWS, "workflow", "a workflow class (run)")
    if not (isinstance(cls, type) and issubclass(cls, Workflow)):
        raise ConfigError(f"workflow {name} is not a subclass of unitrain.rollout.workflow.Workflow")
    return cls(run)


@check("workflow", "mode", "rollout_decoding", "env", "dataset_path")
def _episodes(c) -> str | None:
    """A workflow other than single_turn rolls out RL episodes; multi_turn talks to an environment;
    an environment under sft is the source of its demonstrations."""
    workflow, mode = c["workflow"], c["mode"]
    if workflow != "single_turn" and mode in ("sft", "dpo", "rm"):
        return f"workflow {workflow} rolls out RL episodes; mode={mode} trains on none (use workflow single_turn)"
    if workflow != "single_turn" and c["rollout_decoding"] != "sample":
        return f"workflow {workflow} samples its turns; rollout_decoding={c['rollout_decoding']} is single-turn only"
    if workflow == "multi_turn" and not c["env"]:
        return "workflow multi_turn needs an environment: set env (calculator | guess_number | reasoning_gym | pkg.module:make_env)"
    if c["env"] and mode == "sft" and c["dataset_path"] != "builtin":
        return f"env={c['env']} under mode=sft trains on its demonstrations of dataset_path builtin; dataset_path is {c['dataset_path']}"
    if c["env"] and mode in (*RL_MODES, "online_dpo") and workflow == "single_turn":  # the modes that roll out
        return f"env={c['env']} is the environment of workflow multi_turn; workflow is single_turn"
    if c["env"] and mode in ("dpo", "rm"):
        return f"env names an environment for multi_turn episodes or sft demonstrations; mode={mode} uses none"
    return None


CONFIG_CHECKS = (_episodes,)
