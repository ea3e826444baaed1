"""The sampler interface: how rollouts and evaluations get completions, wherever they come from.

    sampler.update_weights(params, version)       # the policy to sample from from now on
    out = sampler.generate(prompt_ids, sampling, key)   # -> Completions

The colocated JAX sampler (engines/colocated.py) samples with the training parameters themselves;
a sampler on its own devices or an external engine (vLLM, SGLang) is one more implementation,
named in the config as `sampler: pkg.module:factory` with factory(run: RunContext) -> Sampler.
Nothing downstream depends on where the tokens came from: the trainer recomputes the logprobs it
needs and `Completions.version` says which policy produced them.

The contract, for the author of a sampler on another engine (vLLM, SGLang, a server):

  weights  The trainer calls `update_weights(params, version)` on every process after each optimizer
           update, before the next `generate`; `params` is the model's pure dict of global jax.Arrays
           in the trainer's shardings, `version` counts the updates (the GRPO step). The next train
           step donates these buffers: a sampler that reads them later than during this call, or
           from another thread, copies them first. An engine that loads HF checkpoints calls
           `unitrain.export.export_policy(run, params, version, root)`: every process calls it, it
           writes the policy as an HF folder (weights, config, the run's tokenizer, so token ids
           agree) at <root>/version_<version> with the version in `unitrain_version.json`, and
           returns the folder for the engine to load (vLLM: a new LLM or its weight reload;
           SGLang: update_weights_from_disk).
  generate Every process calls `generate(prompt_ids, sampling, key)` with the same prompts and key and
           must get the same whole result (an engine queried by process 0 broadcasts it, e.g.
           jax.experimental.multihost_utils.broadcast_one_to_all). It returns `Completions` with one
           row per prompt, in order, N = sampling.max_new_tokens columns: `tokens` int32 (any pad
           after a row's end), `mask` int32 1 on the generated tokens up to and including the stop
           token, `lengths` = mask.sum(1), and `logprobs` float32, each token's log-probability
           under the distribution it was drawn from (after temperature, top-k, top-p; 0 off the
           mask): `rollout_is` corrects the loss for their gap to the trainer's. A row ends after
           any of `sampling.stop_token_ids` or at `sampling.budget(row)` tokens (N unless the call
           gives `row_budgets`, as the episodes driver does); temperature 0 is greedy; `key` seeds
           the sampling (jax.random.key_data(key) gives integers for an engine's seed).
  version  `Completions.version` is the `version` of the weights the tokens were sampled with
           (the last update_weights the engine had applied when it began them), not the trainer's
           current one: a sampler that runs ahead reports the version it really used.
  submit   Optional (SubmittingSampler): `submit(prompt_ids, sampling, key)` starts what generate would compute and
           returns at once an object whose `.result()` gives those Completions. With it, rollouts
           sampled ahead of the trainer (max_staleness, rollout/executor.py) run while the trainer
           updates; without it they are generated when submitted. Calls to submit and result
           happen in the same order on every process.
  release  Optional (ReleasingSampler): `release()` frees what the sampler holds for sampling that the trainer's update
           could use instead (the colocated sampler: its decode layout of the weights, kept from a
           version's first generate for its later ones). The trainer calls it when it will not
           sample again before its next update_weights: after a GRPO step's rollouts are taken
           (rounds already submitted keep what they use) and after an evaluation.
  images   Optional: prompts with images (a vision-language model's) come as `images=`, one
           data.images.PromptImages or None per prompt, to generate and submit; only the colocated
           sampler takes them (the config refuses images with another).
  routes   Optional: with `sampling.record_routes` (routing replay of a mixture of experts), the
           experts each token ran, as `Completions.routes` and `prompt_routes` (the colocated and
           mesh samplers; an engine that cannot report them is refused by the config).
  interrupt Optional (InterruptingSampler): with `interrupts` true, update_weights does not wait for
           the submitted calls in flight: their rows end at once with the tokens they have, marked
           in `Completions.interrupted` (the driver continues them under the new weights).
  close    Optional (ClosingSampler): `close()` ends what the sampler started (an engine's server); the trainer calls it
           when the run ends, however it ends.
  metrics  Optional (MeasuredSampler): `metrics()`, {metric: value} of what the sampler did since the
           last call (vLLM: time_weight_export and time_weight_reload summed over its pushes, the
           servers' busy fraction and how many are up); GRPO logs them with each step.
  ranking  A sampler that can rank is a RankingSampler: it also has `beam_search(prompt_ids,
           beams, key)` (engines/beam.py: the `beams.width` best sequences of each prompt, or W
           samples, optionally constrained to a trie; -> beam.Ranked). Ranked rollouts and ranking
           evaluators (a data format's, e.g. the recommender's HR/NDCG) call it. The sampler's
           factory says so in its return annotation (`def from_run(run) -> ColocatedSampler`):
           rollout.check_ranking reads it when the config loads, so a run that ranks with a
           sampler that cannot stops with one line before anything compiles.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0.0 = greedy (argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    stop_token_ids: tuple[int, ...] = ()  # EOS and other stop ids; a row stops after emitting one
    row_budgets: tuple[
        int, ...
    ] = ()  # per prompt, the most tokens its row samples (each <= max_new_tokens); () = all max_new_tokens
    record_routes: bool = False  # routing replay: Completions.routes and prompt_routes (colocated/mesh samplers)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.row_budgets and not 1 <= min(self.row_budgets) <= max(self.row_budgets) <= self.max_new_tokens:
            raise ValueError(f"row budgets must be in [1, max_new_tokens={self.max_new_tokens}]")

    def budget(self, row: int) -> int:
        """The most tokens row `row` of a call samples."""
        return self.row_budgets[row] if self.row_budgets else self.max_new_tokens

    @classmethod
    def from_config(cls, cfg, stop_token_ids: tuple[int, ...], max_new_tokens: int | None = None) -> SamplingParams:
        """The config's rollout sampling (rollout_temperature, rollout_top_k, rollout_top_p), for
        max_new_tokens tokens (default rollout_max_response_len)."""
        return cls(
            max_new_tokens=cfg.rollout_max_response_len if max_new_tokens is None else max_new_tokens,
            temperature=cfg.rollout_temperature,
            top_k=cfg.rollout_top_k,
            top_p=cfg.rollout_top_p,
            stop_token_ids=stop_token_ids,
        )


@dataclasses.dataclass(frozen=True)
class Completions:
    """One row per prompt, numpy, on every process."""

    tokens: np.ndarray  # [B, N] int32, pad after the stop token
    mask: np.ndarray  # [B, N] int32, 1 for generated tokens up to and including the stop token
    logprobs: np.ndarray  # [B, N] float32, log-prob under the distribution each token was drawn from
    lengths: np.ndarray  # [B] int32
    version: int  # the policy version (update_weights) that produced them
    # Routing replay (SamplingParams.record_routes; None otherwise): the experts each token ran in
    # every MoE layer, [B, N, L, k] int32 for the sampled tokens (token j's as the input of the step
    # after it; -1 where no later step read it: a row's last token, and past its end) and
    # [B, P, L, k] for the prompt's tokens, left-padded as the prompt block (-1 on padding).
    routes: np.ndarray | None = None
    prompt_routes: np.ndarray | None = None
    # [B] bool: rows a weight update cut short (an engine that interrupts generation, vllm_interrupt);
    # the driver continues them under the new weights. None: none was.
    interrupted: np.ndarray | None = None

    @staticmethod
    def blank(rows: int, n: int, pad_id: int, version: int) -> Completions:
        """`rows` rows of `n` columns with no token yet (an engine's answers are put in by put_row)."""
        return Completions(
            np.full((rows, n), pad_id, np.int32),
            np.zeros((rows, n), np.int32),
            np.zeros((rows, n), np.float32),
            np.zeros((rows,), np.int32),
            version,
            interrupted=np.zeros((rows,), bool),
        )

    def put_row(self, r: int, tokens: list[int], logprobs: list[float], interrupted: bool) -> None:
        """Row `r` from one engine answer: its tokens and their logprobs, and whether it was interrupted."""
        length = len(tokens)
        self.tokens[r, :length], self.logprobs[r, :length] = tokens, logprobs
        self.mask[r, :length], self.lengths[r] = 1, length
        self.interrupted[r] = interrupted

    def __getitem__(self, rows) -> Completions:
        pick = lambda a: None if a is None else a[rows]  # noqa: E731
        return Completions(
            self.tokens[rows],
            self.mask[rows],
            self.logprobs[rows],
            self.lengths[rows],
            self.version,
            pick(self.routes),
            pick(self.prompt_routes),
            pick(self.interrupted),
        )


@runtime_checkable
class Sampler(Protocol):
    def update_weights(self, params: Any, version: int) -> None:
        """Sample from these parameters (a pure dict in the trainer's shardings) from now on."""

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, key: jax.Array) -> Completions:
        """`sampling.max_new_tokens` tokens after each prompt. Every process passes the same prompts
        and key and gets the whole result."""


@runtime_checkable
class RankingSampler(Sampler, Protocol):
    def beam_search(self, prompt_ids: list[list[int]], beams, key: jax.Array):
        """The `beams.width` best sequences of each prompt, best first, as a rollout.beam.Ranked
        (beams: a rollout.beam.BeamParams). Every process passes the same prompts and key."""


@runtime_checkable
class SubmittingSampler(Sampler, Protocol):
    def submit(self, prompt_ids: list[list[int]], sampling: SamplingParams, key: jax.Array):
        """generate, started: returns at once a handle whose result() gives the Completions."""


@runtime_checkable
class InterruptingSampler(SubmittingSampler, Protocol):
    interrupts: bool  # whether update_weights cuts the calls in flight short (Completions.interrupted)


@runtime_checkable
class ReleasingSampler(Protocol):
    def release(self) -> None:
        """Frees what the sampler keeps for sampling between calls of a version."""


@runtime_checkable
class ClosingSampler(Protocol):
    def close(self) -> None:
        """Ends what the sampler started (an engine's server)."""


@runtime_checkable
class MeasuredSampler(Protocol):
    def metrics(self) -> dict[str, float]:
        """What the sampler did since the last call."""


@dataclasses.dataclass(frozen=True)
class Done:
    """The `submit` handle of completions already generated."""

    completions: Completions

    def result(self) -> Completions:
        return self.completions


def submit(sampler: Sampler, prompt_ids: list[list[int]], sampling: SamplingParams, key: jax.Array, images=None):
    """The sampler's submit where it has one (sampling runs on while the caller goes on), else generate
    now; `images` (prompts with images: one PromptImages or None each) only where some prompt has them."""
    extra = {"images": images} if images is not None and any(i is not None for i in images) else {}
    if isinstance(sampler, SubmittingSampler):
        return sampler.submit(prompt_ids, sampling, key, **extra)
    return Done(sampler.generate(prompt_ids, sampling, key, **extra))


def close(sampler: Sampler) -> None:
    """The sampler's close where it has one (the contract above)."""
    if isinstance(sampler, ClosingSampler):
        sampler.close()


def release(sampler: Sampler) -> None:
    """The sampler's release where it has one (the contract above)."""
    if isinstance(sampler, ReleasingSampler):
        sampler.release()
