"""From prompts to scored groups: the one path GRPO's rollouts and the task evaluations share.

    groups = collect_groups(sampler, prompts, n, sampling, key, tokenizer, reward_fn)
    kept = [g for g in groups if keep(g)]           # a dynamic-sampling filter sees whole groups

A group is one prompt's n completions with their decoded texts and rewards. Filters are
`dynamic_sampling_filter`: a built-in name from registry.FILTERS or a plugin `pkg.module:fn(group) -> bool`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from unitrain import plugins, registry
from unitrain.errors import RunEndedEarly
from unitrain.rollout.base import Completions, Sampler, SamplingParams, submit


@dataclasses.dataclass(frozen=True)
class Group:
    prompt: object  # unitrain.data.prompts.Prompt: ids, text, label
    completions: Completions  # n rows
    texts: list[str]  # decoded completions
    rewards: np.ndarray  # [n] float32, the weighted total
    per_reward: dict[str, np.ndarray]  # each reward's raw [n] values
    episodes: tuple = ()  # multi-turn: the n rollout.episodes.Trajectory the rows were made of


def collect_groups(
    sampler: Sampler, prompts: list, n: int, sampling: SamplingParams, key: jax.Array, tokenizer, reward_fn
) -> list[Group]:
    """n completions of every prompt in one generate call, decoded and scored."""
    return start_groups(sampler, prompts, n, sampling, key, tokenizer, reward_fn)()


def start_groups(
    sampler: Sampler, prompts: list, n: int, sampling: SamplingParams, key: jax.Array, tokenizer, reward_fn
) -> Callable[[], list[Group]]:
    """collect_groups, started: the sampler samples (rollout/base.submit) while the caller goes on;
    the function returned waits for the completions and scores them."""
    pending = submit(sampler, [list(p.ids) for p in prompts for _ in range(n)], sampling, key)
    return lambda: _scored_groups(prompts, n, pending.result(), tokenizer, reward_fn)


def collect_ranked_groups(sampler, prompts: list, beams, key: jax.Array, tokenizer, reward_fn) -> list[Group]:
    """Each prompt's `beams.width` sequences from the sampler's beam_search (rollout/beam.py: beams or
    samples, optionally constrained to a trie), best first, decoded and scored: the group of a prompt
    is its ranked list, so a GroupReward sees the ranks."""
    out = sampler.beam_search([list(p.ids) for p in prompts], beams, key).completions()
    return _scored_groups(prompts, beams.width, out, tokenizer, reward_fn)


def _scored_groups(prompts: list, n: int, out: Completions, tokenizer, reward_fn) -> list[Group]:
    rows = [p for p in prompts for _ in range(n)]
    texts = [tokenizer.decode(t[:l]) for t, l in zip(out.tokens, out.lengths)]
    total, per_reward = reward_fn([p.text for p in rows], texts, [p.label for p in rows], group_size=n)
    groups = []
    for g, prompt in enumerate(prompts):
        r = slice(g * n, (g + 1) * n)
        groups.append(Group(prompt, out[r], texts[r], total[r], {k: v[r] for k, v in per_reward.items()}))
    return groups


def samples_markdown(groups: list[Group], count: int = 4) -> str:
    """The first completion of the first `count` groups as TensorBoard markdown."""
    return "\n\n".join(
        f"**prompt** {g.prompt.text}\n\n**completion** {g.texts[0]}\n\n**label** {g.prompt.label}\n\n"
        f"**reward** {g.rewards[0]:.3f}"
        for g in groups[:count]
    )


def nonzero_std(group: Group) -> bool:
    """Keep a group only if its rewards differ: equal rewards give zero advantage, hence no signal."""
    return bool(np.std(group.rewards) > 0)


def make_filter(spec: str):
    """ "" (keep every group), a registry.FILTERS name or a plugin `pkg.module:fn(group) -> bool`."""
    if spec == "":
        return None
    return plugins.resolve(spec, registry.FILTERS, "dynamic_sampling_filter", "a function (group) -> bool")


def select_groups(kept: list, dropped: list, batch_size: int) -> tuple[list, int, int]:
    """The step's groups: those that passed the filter, topped up with dropped ones when the
    sampling rounds ran out (shapes stay static; a zero-std group only adds zero advantages).
    Returns (groups, number discarded, number refilled)."""
    refilled = min(max(0, batch_size - len(kept)), len(dropped))
    groups = (kept + dropped[:refilled])[:batch_size]
    if len(groups) < batch_size:
        raise RunEndedEarly(
            f"the prompt stream ran out before a rollout batch of {batch_size} groups was full; "
            "raise num_epochs or lower steps"
        )
    return groups, len(dropped) - refilled, refilled
