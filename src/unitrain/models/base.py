"""The model interface: everything the trainer, the sampler, the losses and the tools know of a model.

Every model unitrain trains or samples from is a Flax NNX module with this interface, whatever
library it comes from (our decoder, Tunix's models through unitrain.adapters.tunix, MLLM_JAX's through
unitrain.adapters.mllm_jax, a plugin).
`nnx.split(model)` gives its graph and parameters; the train step differentiates the parameters as
a pure dict, and `nnx.merge(graphdef, params)` gives the callable back.

A model source builds one from the config with its parameters already placed in their shardings:

    source(cfg, mesh) -> Model          # config key model_source: unitrain | tunix | mllm_jax | pkg.module:fn

Training terms besides the logits (a mixture of experts' router losses) are not return values: a
forward without a cache reports them to the collector its caller opened in the same trace
(models/moe.py: `report`, `collect_router_stats`), which step.train_step does around every task's
loss; a model with none reports nothing.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax


@runtime_checkable
class Model(Protocol):
    vocab_size: int  # rows of the logits' last axis

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array, cache: Any = None
    ) -> tuple[jax.Array, Any]:
        """logits [B, T, V] (compute dtype) and the updated cache (None when `cache` is None).

        tokens, positions, segment_ids: int32 [B, T]. positions restart at 0 in every packed
        sequence and count up along its columns; segment 0 is padding; a token attends causally
        within its own nonzero segment (a model may skip the keys in later columns).
        With a cache (one sequence per row), a call adds its non-padding tokens at their positions
        and they attend to everything the row has cached before them: a prefill of a left- or
        right-padded prompt block, then one token per row per call at the next positions, gives the
        logits of the full forward.
        """

    def hidden_states(
        self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array, cache: Any = None
    ) -> jax.Array | tuple[jax.Array, Any]:
        """The call split before its output head: the final-normed hidden states [B, T, E] (compute
        dtype), such that `logits(hidden)` equals the call's logits. Without a cache, the hidden
        states alone: the losses compute the logits from them a chunk of positions at a time
        (losses.token_stats). With a cache, (hidden, the updated cache) as the call gives it: the
        sampler's prefill runs the head on the last column only, the one it samples from."""

    def logits(self, hidden: jax.Array) -> jax.Array:
        """The output head: hidden [B, T, E] -> logits [B, T, V] (compute dtype)."""

    def decode_weights(self, quantization: str = "none") -> Any:
        """What a sampler's token loop needs made from the parameters, as a pytree of arrays (None:
        nothing; our decoder: each layer's weights sliced out of the stacked ones, where XLA would
        copy the slices on every step). A sampler makes it in a program of its own once per
        weight version and passes it to `for_decoding` in every call with those weights.
        `quantization` (rollout_quantization, int8 | fp8): the weights the sampler samples with,
        weight-only quantised (our decoder's: qwix QArrays, models/quant.py); a sampler passes it
        only when set, so a model that does not quantise may take no argument."""

    def for_decoding(self, weights: Any) -> Model:
        """The model as a sampler's token loop calls it, given `decode_weights()` of the same
        parameters: it gives the same outputs for the same calls. One that needs nothing returns
        itself."""

    def init_cache(self, batch_size: int, max_length: int) -> Any:
        """An empty KV cache for `batch_size` rows of up to `max_length` positions (a pytree)."""

    def cache_axes(self) -> Any:
        """Logical axis names of init_cache's arrays: the same pytree with a tuple per array. Zeros
        appended along the `length` axis of every array are empty columns: the sampler grows a cache
        that way."""

    def param_axes(self) -> dict:
        """Logical axis names of every parameter: a pure dict like nnx.to_pure_dict(params), a tuple
        of names (`embed`, `mlp`, `heads`, `vocab`, ... or None) per array."""

    def decay_mask(self) -> dict:
        """Which parameters get weight decay: the same pure dict with a bool per array."""

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of one training step (forward + backward) per token at this sequence length."""

    def save_hf(self, path: str) -> None:
        """Writes a checkpoint that transformers.AutoModelForCausalLM loads; every process calls it.
        A model whose family has no HF export raises NotImplementedError with the reason."""


@runtime_checkable
class SharedPrefixModel(Model, Protocol):
    """A model that computes the columns a run of rows shares once per run (GRPO's group of copies of
    a prompt): checked once where a task plans its passes (tasks/rl.py)."""

    def hidden_states_shared_prefix(
        self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array, prefix_len: int, group_rows: int
    ) -> jax.Array:
        """hidden_states of rows in runs of `group_rows` sharing their first `prefix_len` columns, the
        prefix computed once per run (our decoder also takes routing replay's `routes=`)."""
