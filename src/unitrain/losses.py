"""Losses. Each returns (sum over tokens, number of tokens) so that gradient accumulation over
micro-batches, and averaging over hosts, is exact at token level: the step divides once, at the end.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from unitrain import plugins, sharding
from unitrain.config import check
from unitrain.registry import (
    GROUP_ESTIMATORS,
    KL_TYPES,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    REFERENCE_FREE_LOSSES,
    ROLLOUT_IS_LEVELS,
    ROLLOUT_IS_MODES,
)


class TokenStats(NamedTuple):
    """What the losses need of the logits at each position, float32 [B, T]."""

    logprobs: jax.Array  # log softmax(logits)[target]
    log_z: jax.Array  # logsumexp(logits)
    entropy: jax.Array | None  # -sum_v p log p, when asked for


def logit_stats(logits, targets, with_entropy: bool = False) -> TokenStats:
    """TokenStats of a block of logits [..., V] (any float dtype; computed in float32) at `targets` [...].

    Vocabulary entries with p == 0 (-inf logits) add 0 to the entropy, with no NaN in value or gradient.
    """
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    logprobs = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - log_z
    entropy = None
    if with_entropy:
        logp = logits - log_z[..., None]
        p = jnp.exp(logp)
        entropy = -jnp.sum(p * jnp.where(p > 0, logp, 0.0), axis=-1)
    return TokenStats(logprobs, log_z, entropy)


def chunked(fn, chunk_size: int, *xs):
    """fn(*xs) over `chunk_size` positions of every row at a time: xs are pytrees of [B, T, ...]
    arrays, fn's outputs a pytree of [B, t, ...] ones, put back together as [B, T, ...] (0, or >= T:
    all at once). The chunks run in a `lax.scan` under `jax.checkpoint`, so the backward pass
    recomputes one chunk at a time too: one chunk's intermediates (its logits) are the largest.
    Where the rows are split over the context axis (c devices), a chunk is `chunk_size` positions
    of each device's part, so that every device computes its own positions' (fn is per position)."""
    B, T = jax.tree.leaves(xs)[0].shape[:2]
    c = sharding.sequence_shards()
    c = c if T % c == 0 else 1
    local = T // c
    if not chunk_size or chunk_size >= local:
        return fn(*xs)
    n = -(-local // chunk_size)
    pad = n * chunk_size - local

    def chunks(x):  # [B, T, ...] -> [n, B, c * chunk_size, ...]: chunk i of every device's part
        x = jnp.pad(x.reshape(B, c, local, *x.shape[2:]), [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = jnp.moveaxis(x.reshape(B, c, n, chunk_size, *x.shape[3:]), 2, 0)
        return x.reshape(n, B, c * chunk_size, *x.shape[4:])

    def joined(x):
        x = jnp.moveaxis(x.reshape(n, B, c, chunk_size, *x.shape[3:]), 0, 2)
        return x.reshape(B, c, n * chunk_size, *x.shape[4:])[:, :, :local].reshape(B, T, *x.shape[4:])

    _, out = jax.lax.scan(jax.checkpoint(lambda _, c: (None, fn(*c))), None, jax.tree.map(chunks, xs))
    return jax.tree.map(joined, out)


def token_stats(
    head, hidden, targets, chunk_size: int, temperature: float = 1.0, with_entropy: bool = False
) -> TokenStats:
    """TokenStats of `head(hidden) / temperature` without ever holding the [B, T, V] float32 logits:
    `chunk_size` positions of every row at a time (`chunked`), forward and backward: [B, chunk_size, V]
    is the largest logits array, at the price of a second forward matmul of the head.

    head: hidden [B, t, E] -> logits [B, t, V] (the model's output head); hidden [B, T, E]; targets
    [B, T] int.
    """
    return chunked(
        lambda h, t: logit_stats(head(h).astype(jnp.float32) / temperature, t, with_entropy),
        chunk_size,
        hidden,
        targets,
    )


# ----------------------------------------------------------------------------------------------
# Offline distillation (mode=sft with teacher_path): a teacher's top-k tokens as soft targets.
# ----------------------------------------------------------------------------------------------


class SoftTargets(NamedTuple):
    """A teacher's soft targets at each position: its top-k token ids [B, T, k] int32 and their
    log-probs renormalised over those k, [B, T, k] float32 (the target distribution is 0 elsewhere)."""

    logprobs: jax.Array
    ids: jax.Array


def top_k_targets(logits, k: int, temperature: float) -> SoftTargets:
    """SoftTargets of a block of teacher logits [..., V]: the k largest of logits / temperature,
    their softmax over those k alone (top-k KD's renormalisation)."""
    values, ids = jax.lax.top_k(logits.astype(jnp.float32) / temperature, k)
    return SoftTargets(jax.nn.log_softmax(values, axis=-1), ids)


def _kl(logp, logq):
    """KL(p || q) over the last axis, from log-probs."""
    return jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)


def generalized_jsd(logp, logq, beta: float):
    """The generalised Jensen-Shannon divergence of GKD (Agarwal et al. 2024, eq. 1) as TRL's
    GKDTrainer.generalized_jsd_loss takes it, p the teacher's and q the student's log-probs over the
    last axis: beta * KL(p || m) + (1 - beta) * KL(q || m), m = beta * p + (1 - beta) * q, and at
    the ends the KLs themselves: beta 0 the forward KL(p || q), beta 1 the reverse KL(q || p)."""
    if beta == 0:
        return _kl(logp, logq)
    if beta == 1:
        return _kl(logq, logp)
    logm = jnp.logaddexp(logp + math.log(beta), logq + math.log1p(-beta))
    return beta * _kl(logp, logm) + (1 - beta) * _kl(logq, logm)


def soft_target_divergence(logits, targets: SoftTargets, temperature: float, beta: float | None = None):
    """The divergence of the student's q = softmax(logits / temperature) (logits [..., V]) from the
    soft targets p, per position, float32 [...]. beta None: KL(p || q), q over the full vocabulary
    (not renormalised over p's ids, so the student's mass off the teacher's top-k counts against
    it; >= 0, and 0 only where q = p). beta in [0, 1]: generalized_jsd(p, q), q renormalised over
    p's ids (the reverse KL and the mixture need both on one support)."""
    scaled = logits.astype(jnp.float32) / temperature
    logq = jnp.take_along_axis(scaled, targets.ids, axis=-1) - jax.nn.logsumexp(scaled, axis=-1, keepdims=True)
    if beta is None:
        return _kl(targets.logprobs, logq)
    return generalized_jsd(targets.logprobs, jax.nn.log_softmax(logq, axis=-1), beta)


def teacher_targets(head, hidden, chunk_size: int, k: int, temperature: float, vocab: int) -> SoftTargets:
    """A frozen teacher's SoftTargets over the first `vocab` entries of head(hidden) (the student's
    vocabulary), `chunk_size` positions at a time: [B, chunk_size, V] its largest logits. No gradient."""
    hidden = jax.lax.stop_gradient(hidden)
    return chunked(lambda h: top_k_targets(head(h)[..., :vocab], min(k, vocab), temperature), chunk_size, hidden)


def distill_token_stats(head, hidden, targets, soft: list[SoftTargets], chunk_size: int, temperature: float, beta=None):
    """TokenStats of head(hidden) at the labels `targets` (temperature 1: the labels' cross-entropy)
    and each teacher's soft_target_divergence (beta's) from its SoftTargets at `temperature`, a
    [B, T] array per teacher, from one chunk of the student's logits at a time (`chunked`)."""

    def stats(h, t, soft):
        logits = head(h).astype(jnp.float32)
        return logit_stats(logits, t), [soft_target_divergence(logits, s, temperature, beta) for s in soft]

    return chunked(stats, chunk_size, hidden, targets, soft)


def distill_cross_entropy(
    stats: TokenStats,
    divergences,
    teacher_weights,
    weights,
    coef: float,
    temperature: float,
    z_loss_weight: float = 0.0,
):
    """Offline distillation's loss (Hinton et al. 2015): per weighted position
        (1 - coef) * CE(label) + coef * temperature^2 * sum_i teacher_weights[i] * KL_i + z-loss
    KL_i = divergences[i], KL(teacher_i,T || student_T) [B, T] (T^2 keeps the KL's gradient on the
    CE's scale as the temperature softens both; GKD's divergence may stand in the KL's place).
    weights [B, T] {0, 1}. Returns (loss_sum, weight_sum, nll_sum, the weighted KL's sum, [each
    teacher's KL sum])."""
    loss_sum, count, nll_sum = cross_entropy(stats, weights, z_loss_weight)
    kl_sums = [jnp.where(weights > 0, kl, 0.0).sum() for kl in divergences]
    kl_sum = sum(w * s for w, s in zip(teacher_weights, kl_sums))
    return loss_sum - coef * nll_sum + coef * temperature**2 * kl_sum, count, nll_sum, kl_sum, kl_sums


def cross_entropy(stats: TokenStats, weights, z_loss_weight: float = 0.0):
    """Token-weighted next-token cross-entropy with optional z-loss (PaLM: z_loss_weight * logZ^2).

    weights [B,T] {0,1}. Returns (loss_sum, weight_sum, nll_sum): loss_sum includes the z-loss,
    nll_sum does not.
    """
    nll = -stats.logprobs * weights
    loss = nll + z_loss_weight * jnp.square(stats.log_z) * weights
    return loss.sum(), weights.sum(), nll.sum()


# ----------------------------------------------------------------------------------------------
# RL (GRPO / PPO family). Everything below is pure JAX and jit-able: string and int arguments are
# static (Python-level) choices, arrays are traced. Semantics mirror verl's core_algos.
# ----------------------------------------------------------------------------------------------


class Sequences(NamedTuple):
    """Which sequence each token of [B, T] arrays belongs to, for the per-sequence quantities of the
    losses (sequence sums, GSPO's ratio, sequence-level rollout_is, the seq-mean aggregations).
    `key` None: one sequence per row (GRPO's rows, [rows, C]). Else packed rows (rl_packing,
    data/rl_packing.py): `key` [B*T] int32 is row * (T + 1) + the token's segment id (at most T), so the sequences of a
    row are told apart by their segments (padding, segment 0, is one more key with no masked token)."""

    key: jax.Array | None = None

    def total(self, x) -> jax.Array:
        """[B, T] -> each sequence's sum: [B] (a row each) or [B*(T+1)] (by key; keys without a token get 0)."""
        if self.key is None:
            return x.sum(axis=-1)
        B, T = x.shape
        return jax.ops.segment_sum(x.reshape(-1), self.key, num_segments=B * (T + 1))

    def spread(self, per_sequence, shape) -> jax.Array:
        """A value per sequence (total's shape) -> the same value at each of its tokens, [B, T]."""
        if self.key is None:
            return jnp.broadcast_to(per_sequence[..., None], shape)
        return per_sequence[self.key].reshape(shape)


ROWS = Sequences()  # a row per sequence


def packed_sequences(segment_ids) -> Sequences:
    """The Sequences of packed rows from their segment ids [B, T] (distinct per sequence within a row)."""
    B, T = segment_ids.shape
    return Sequences((jnp.arange(B, dtype=jnp.int32)[:, None] * (T + 1) + segment_ids).reshape(-1))


_WHITEN_EPS = 1e-8  # verl's masked_whiten: (x - mean) * rsqrt(var + 1e-8)
_LOG_RATIO_CLAMP = 20.0  # verl clamps log-ratios to [-20, 20] before exp
_GSPO_LOG_RATIO_MAX = 10.0  # verl's compute_policy_loss_gspo clamps the log sequence ratio above at 10


def compute_advantages(
    rewards, group_ids, num_groups: int, estimator: str, norm_by_std: bool = True, eps: float = 1e-6, weights=None
):
    """Outcome advantages from scalar rewards, one per sample, grouped by prompt.

    rewards [N] float, group_ids [N] int32 in [0, num_groups) (samples of one prompt share a group),
    num_groups static. Returns advantages [N] float32. Per group g with n_g samples, mean_g = mean of
    its rewards and std_g = sqrt(sum (r - mean_g)^2 / (n_g - 1)) (unbiased, ddof=1, like torch.std
    in verl). Group ids with no sample are allowed (ignored).

    - "grpo":   a = (r - mean_g) / (std_g + eps)   if norm_by_std   else   a = r - mean_g.
                A singleton group uses mean_g = 0, std_g = 1 (verl), i.e. a = r / (1 + eps) (or r).
                A group with equal rewards (std_g = 0) gives a = 0.
    - "drgrpo": a = r - mean_g, never divided by std (Dr. GRPO); norm_by_std is ignored.
                Singleton group: mean_g = 0, so a = r (verl's GRPO with norm off).
    - "rloo":   a = r - mean of the OTHER samples of the group = n_g / (n_g - 1) * (r - mean_g).
                Singleton group: a = 0 (verl's vectorized RLOO).
    - "reinforce_pp": REINFORCE++-baseline (verl compute_reinforce_plus_plus_baseline_outcome_advantage):
                b = r - mean_g (singleton: mean_g = 0, so b = r), then whitened over the whole batch:
                a = (b - mean(b)) * rsqrt(var(b) + 1e-8), var unbiased (x W / (W - 1), W = total weight).
                verl whitens over response TOKENS (each sample counted once per token); pass
                `weights` = response lengths [N] to reproduce that exactly; by default each sample
                counts once. Samples with weight 0 are excluded from the batch statistics.
                norm_by_std and eps are not used (whitening is the normalisation).
    The result is a function of the batch it is given: call it on the whole rollout batch (all
    devices), not per micro-batch.
    """
    if estimator not in GROUP_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {GROUP_ESTIMATORS}")
    r = jnp.asarray(rewards, jnp.float32)
    gid = jnp.asarray(group_ids, jnp.int32)
    count = jax.ops.segment_sum(jnp.ones_like(r), gid, num_segments=num_groups)
    total = jax.ops.segment_sum(r, gid, num_segments=num_groups)
    mean_g = total / jnp.maximum(count, 1.0)
    n = count[gid]
    mean = mean_g[gid]
    single = n <= 1.0
    mean = jnp.where(single, 0.0, mean)  # verl: singleton groups have mean 0 (and std 1)
    centered = r - mean

    if estimator == "grpo":
        if not norm_by_std:
            return centered
        sq = jax.ops.segment_sum(jnp.square(r - mean_g[gid]), gid, num_segments=num_groups)
        std_g = jnp.sqrt(sq / jnp.maximum(count - 1.0, 1.0))
        std = jnp.where(single, 1.0, std_g[gid])
        return centered / (std + eps)
    if estimator == "drgrpo":
        return centered
    if estimator == "rloo":
        return jnp.where(single, 0.0, n / jnp.maximum(n - 1.0, 1.0) * centered)
    # reinforce_pp
    return masked_whiten(centered, jnp.ones_like(r) if weights is None else weights)


def masked_whiten(values, weights):
    """(x - mean) * rsqrt(var + 1e-8) under `weights` (verl's masked_whiten, shift_mean on): the mean
    and the unbiased variance (x W / (W - 1), W = the total weight) are weighted; entries of weight 0
    take no part in them but are whitened alike. float32, the shape of `values`."""
    x = jnp.asarray(values, jnp.float32)
    w = jnp.asarray(weights, jnp.float32)
    w_sum = w.sum()
    mean = (w * x).sum() / jnp.maximum(w_sum, 1e-12)
    var = (w * jnp.square(x - mean)).sum() / jnp.maximum(w_sum, 1e-12)
    var = jnp.where(w_sum > 1.0, var * w_sum / jnp.maximum(w_sum - 1.0, 1e-12), var)
    return (x - mean) * jax.lax.rsqrt(var + _WHITEN_EPS)


def kl_penalty(logprobs, ref_logprobs, kl_type: str = "low_var_kl"):
    """Per-token estimate of KL(pi || ref) from samples of pi (verl's kl_penalty).

    - "k1":                 logp - ref
    - "k2":                 0.5 * (logp - ref)^2
    - "k3" == "low_var_kl": with d = clip(ref - logp, -20, 20): exp(d) - d - 1, clipped to [-10, 10]
                            (non-negative, low variance; Schulman's k3).
    Inputs [...] any float dtype; returns float32 of the same shape (not masked).
    """
    logp = jnp.asarray(logprobs, jnp.float32)
    ref = jnp.asarray(ref_logprobs, jnp.float32)
    if kl_type == "k1":
        return logp - ref
    if kl_type == "k2":
        return 0.5 * jnp.square(logp - ref)
    if kl_type in ("k3", "low_var_kl"):
        d = jnp.clip(ref - logp, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return jnp.clip(jnp.exp(d) - d - 1.0, -10.0, 10.0)
    raise ValueError(f"unknown kl_type {kl_type!r}; expected one of {KL_TYPES}")


def aggregate(values, mask, loss_agg_mode: str = "token-mean", horizon: int | None = None, sequences: Sequences = ROWS):
    """Reduce per-token values [B,T] under mask [B,T] to (sum, denominator), float32 scalars.

    The loss is sum / denominator. With several micro-batches (and devices) the trainer adds the sums
    and the denominators and divides once, so the loss is that of the whole mini-batch: token-mean is
    the mean over all its tokens, the seq-* modes the mean over all its sequences. Let n_b =
    sum_t mask[b,t]; a sequence "with tokens" has n_b > 0 (fully masked rows are padding and are
    excluded from every denominator).

    - "token-mean":              (sum_{b,t} v*m,                    sum_{b,t} m)
    - "seq-mean-token-mean":     (sum_b [n_b>0] (sum_t v*m) / n_b,   #{b: n_b > 0})
    - "seq-mean-token-sum":      (sum_b sum_t v*m,                   #{b: n_b > 0})
    - "seq-mean-token-sum-norm": (sum_{b,t} v*m / horizon,           #{b: n_b > 0})   (Dr. GRPO)
      horizon = the constant maximum response length, so every token has the same weight
      1 / (num_seqs * horizon) whatever the lengths.
    With packed rows (`sequences`) b runs over the rows' sequences instead of the rows.
    """
    v = jnp.asarray(values, jnp.float32)
    m = jnp.asarray(mask, jnp.float32)
    vm = v * m
    if loss_agg_mode == "token-mean":
        return vm.sum(), m.sum()
    n = sequences.total(m)
    has = (n > 0).astype(jnp.float32)
    num_seqs = has.sum()
    seq_sums = sequences.total(vm)
    if loss_agg_mode == "seq-mean-token-mean":
        return (has * seq_sums / jnp.maximum(n, 1.0)).sum(), num_seqs
    if loss_agg_mode == "seq-mean-token-sum":
        return seq_sums.sum(), num_seqs
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if not horizon or horizon <= 0:
            raise ValueError("loss_agg_mode 'seq-mean-token-sum-norm' needs horizon > 0 (max response length)")
        return seq_sums.sum() / float(horizon), num_seqs
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; expected one of {LOSS_AGG_MODES}")


def token_log_ratio(logprobs, old_logprobs, mask, sequences: Sequences = ROWS):
    """policy_loss ppo: clip(logp - old, -20, 20), each token's own log-ratio (verl "vanilla")."""
    del mask, sequences  # the token's ratio reads no other token
    return jnp.clip(logprobs - old_logprobs, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def sequence_log_ratio(logprobs, old_logprobs, mask, sequences: Sequences = ROWS):
    """policy_loss gspo: GSPO's length-normalised sequence ratio s_i = exp(mean_t (logp - old)) over
    row i's masked tokens (Zheng et al. 2025), in verl's token-level form (compute_policy_loss_gspo):
    log s_i,t = sg(log s_i) + logp_t - sg(logp_t), clamped above at 10. Its value is log s_i at every
    token of the row; its gradient is that of logp_t alone, so with seq-mean-token-mean each row's
    gradient is s_i * A_i * mean_t grad logp_t = grad s_i * A_i. With packed rows (`sequences`) i runs
    over the rows' sequences."""
    m = jnp.asarray(mask, jnp.float32)
    seq = sequences.total((logprobs - old_logprobs) * m) / jnp.maximum(sequences.total(m), 1.0)
    sg = jax.lax.stop_gradient
    return jnp.minimum(sequences.spread(sg(seq), logprobs.shape) + logprobs - sg(logprobs), _GSPO_LOG_RATIO_MAX)


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """What policy_loss reads of the config (static: fixed for the run). The fields are the config
    keys of the same names, but for log_ratio (key `policy_loss`, as its function: registry.POLICY_LOSSES
    or a plugin `fn(logprobs, old_logprobs, mask, sequences) -> [B, T]`, the log importance ratio of
    the clipped surrogate) and horizon (the maximum response length, for
    seq-mean-token-sum-norm). kl_coef is the KL term's weight in the loss: 0 when there is none or
    it goes into the reward (use_kl_in_reward)."""

    eps_clip: float
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    loss_agg_mode: str = "token-mean"
    horizon: int | None = None
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"
    entropy_coef: float = 0.0
    log_ratio: Callable = token_log_ratio

    def __post_init__(self):
        if self.eps_clip_c is not None and not self.eps_clip_c > 1.0:
            raise ValueError(f"eps_clip_c (dual-clip constant) must be > 1, got {self.eps_clip_c}")
        if self.log_ratio is sequence_log_ratio and (
            self.loss_agg_mode != "seq-mean-token-mean" or self.eps_clip_c is not None
        ):
            raise ValueError("gspo needs loss_agg_mode 'seq-mean-token-mean' and no dual clip (eps_clip_c None)")

    @classmethod
    def from_config(cls, cfg) -> PolicyLossConfig:
        kl_in_loss = cfg.kl_coef > 0 and not cfg.use_kl_in_reward
        return cls(
            eps_clip=cfg.eps_clip,
            eps_clip_high=cfg.eps_clip_high,
            eps_clip_c=cfg.eps_clip_c,
            loss_agg_mode=cfg.loss_agg_mode,
            horizon=cfg.rollout_max_response_len,
            kl_coef=cfg.kl_coef if kl_in_loss else 0.0,
            kl_type=cfg.kl_type,
            entropy_coef=cfg.entropy_coef,
            log_ratio=plugins.resolve(
                cfg.policy_loss, POLICY_LOSSES, "policy_loss", "a log-ratio fn(logprobs, old_logprobs, mask, sequences)"
            ),
        )


def policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    settings: PolicyLossConfig,
    *,
    ref_logprobs=None,
    entropy=None,
    pg_weights=None,
    sequences: Sequences = ROWS,
):
    """PPO/GRPO clipped surrogate (verl compute_policy_loss "vanilla") or GSPO's sequence-level one
    (verl compute_policy_loss_gspo), plus optional KL and entropy terms; the names below are
    `settings`' fields.

    logprobs, old_logprobs, mask (and ref_logprobs, entropy, pg_weights when given) [B,T]; advantages
    [B] (broadcast over tokens) or [B,T]. Per token, with ratio = exp(settings.log_ratio(...)) (PPO:
    the token's ratio; GSPO: the row's length-normalised sequence ratio):
        pg1 = -A * ratio
        pg2 = -A * clip(ratio, 1 - eps_clip, 1 + (eps_clip_high or eps_clip))
        pg  = max(pg1, pg2)
        dual clip (eps_clip_c > 1 given): pg3 = -A * eps_clip_c; pg = min(pg3, pg) where A < 0.
        pg_weights given (the rollout correction's weights): pg = pg * pg_weights, as verl multiplies
                    pg_losses by rollout_is_weights; the KL and entropy terms are not weighted.
        loss_t = pg + kl_coef * kl_penalty(logp, ref, kl_type)   [when ref_logprobs given, kl_coef > 0]
                    - entropy_coef * entropy                      [when entropy given, entropy_coef != 0]
    then (loss_sum, denominator) = aggregate(loss_t, mask, loss_agg_mode, horizon). Aggregation is linear,
    so this equals verl's pg_loss + kl_coef * kl_loss - entropy_coef * entropy_loss, each aggregated alike.
    GSPO is a sequence-level objective: it takes loss_agg_mode "seq-mean-token-mean" (which verl's GSPO
    forces; the others would weight a sequence by its length) and no dual clip (verl has none for it);
    PolicyLossConfig refuses anything else with a ValueError (config.py refuses it before the run).
    `sequences`: which tokens make a sequence (packed rows); by default each row is one.

    Returns (loss_sum, denominator, metrics). metrics maps name -> (sum, count), float32 scalars with
    stop_gradient; the exact average over micro-batches/devices is sum(sums) / sum(counts):
      pg_loss            the policy-gradient part aggregated like the loss (its (sum, denominator))
      pg_clipfrac        tokens with pg2 > pg1 (the clip is active)                / tokens
      pg_clipfrac_lower  tokens with A < 0 and max(pg1, pg2) > pg3 (dual clip active) / tokens  (0 if off)
      approx_kl          k3 estimate of KL(old || new): ratio - 1 - log ratio, per token / tokens
                         (GSPO: of the sequence ratio, so the length-normalised KL of the row)
      ratio              ratio per token / tokens (GSPO: the row's sequence ratio at each of its tokens)
      kl                 kl_penalty(logp, ref, kl_type) per token / tokens     (only when ref_logprobs given)
      entropy            entropy per token / tokens                              (only when entropy given)
    """
    logp = jnp.asarray(logprobs, jnp.float32)
    m = jnp.asarray(mask, jnp.float32)
    adv = jnp.asarray(advantages, jnp.float32)
    if adv.ndim == logp.ndim - 1:
        adv = adv[..., None]
    adv = jnp.broadcast_to(adv, logp.shape)

    log_ratio = settings.log_ratio(logp, jnp.asarray(old_logprobs, jnp.float32), m, sequences)
    ratio = jnp.exp(log_ratio)
    high = settings.eps_clip if settings.eps_clip_high is None else settings.eps_clip_high
    pg1 = -adv * ratio
    pg2 = -adv * jnp.clip(ratio, 1.0 - settings.eps_clip, 1.0 + high)
    clipped = jnp.maximum(pg1, pg2)
    if settings.eps_clip_c is not None:
        pg3 = -adv * settings.eps_clip_c
        pg = jnp.where(adv < 0, jnp.minimum(pg3, clipped), clipped)
        lower = jnp.logical_and(adv < 0, clipped > pg3).astype(jnp.float32)
    else:
        pg = clipped
        lower = jnp.zeros_like(pg)
    if pg_weights is not None:
        pg = pg * jax.lax.stop_gradient(jnp.asarray(pg_weights, jnp.float32))

    loss_t = pg
    kl = None
    if ref_logprobs is not None:
        kl = kl_penalty(logp, ref_logprobs, settings.kl_type)
        if settings.kl_coef > 0:
            loss_t = loss_t + settings.kl_coef * kl
    if entropy is not None:
        entropy = jnp.asarray(entropy, jnp.float32)
        if settings.entropy_coef != 0:
            loss_t = loss_t - settings.entropy_coef * entropy
    loss_sum, denom = aggregate(loss_t, m, settings.loss_agg_mode, settings.horizon, sequences)

    sg = jax.lax.stop_gradient
    tokens = sg(m.sum())

    def tok(x):
        return sg((x * m).sum()), tokens

    metrics = {
        "pg_loss": tuple(sg(x) for x in aggregate(pg, m, settings.loss_agg_mode, settings.horizon, sequences)),
        "pg_clipfrac": tok((pg2 > pg1).astype(jnp.float32)),
        "pg_clipfrac_lower": tok(lower),
        "approx_kl": tok(ratio - 1.0 - log_ratio),
        "ratio": tok(ratio),
    }
    if kl is not None:
        metrics["kl"] = tok(kl)
    if entropy is not None:
        metrics["entropy"] = tok(entropy)
    return loss_sum, denom, metrics


def rollout_correction(
    old_logprobs,
    sampler_logprobs,
    mask,
    *,
    level: str,
    mode: str,
    threshold: float,
    threshold_lower: float | None = None,
    sequences: Sequences = ROWS,
):
    """Importance weights for the gap between the policy that sampled the tokens (the sampler's
    logprobs: another engine, other kernels, or a policy k versions old) and the trainer's old policy,
    as verl's compute_rollout_importance_weights (rollout_is) and slime's TIS/MIS do.

    old_logprobs, sampler_logprobs, mask [B,T]. With log w_t = old_t - sampler_t on masked tokens,
    the raw weight at each token is, by `level`:
      - "token":     w_t = exp(clip(log w_t, -20, 20))
      - "sequence":  w_i = exp(clip(sum_t log w_t, -20, 20)), the product of the row's token ratios
      - "geometric": w_i = exp(clip(mean_t log w_t, -20, 20)), their geometric mean
    (sequence levels: w_i at every token of row i; of sequence i with packed rows, `sequences`). With lower = threshold_lower or 1 / threshold,
    by `mode`:
      - "truncate" (TIS): weight = min(w, threshold); the mask is unchanged.
      - "mask" (MIS, rejection): tokens ("token") or whole rows (sequence levels) whose w lies outside
                  [lower, threshold] leave the mask; the kept ones keep their weight w (verl).
    Returns (weights, mask, metrics): weights [B,T] float32 (0 off the mask) for policy_loss's
    pg_weights, the mask the whole loss then aggregates under, and metrics name -> (sum, count) with
    stop_gradient, computed on the raw w over the tokens of the given mask:
      rollout_is_mean                 w per token / tokens
      rollout_is_max                  the largest w (count 1: over several micro-batches or updates,
                                      the mean of their maxima)
      rollout_is_fraction_high        tokens with w > threshold / tokens   (truncate: those truncated)
      rollout_is_fraction_low         tokens with w < lower / tokens
      rollout_is_masked_fraction      (mask) tokens taken out of the loss / tokens
      rollout_is_seq_masked_fraction  (mask) rows with a token taken out / rows with tokens
    The inputs are constants of the loss (the old logprobs may be the current ones under
    stop_gradient when the old pass is skipped): nothing here is differentiated.
    """
    sg = jax.lax.stop_gradient
    m = jnp.asarray(mask, jnp.float32)
    log_w = jnp.where(
        m > 0, sg(jnp.asarray(old_logprobs, jnp.float32)) - jnp.asarray(sampler_logprobs, jnp.float32), 0.0
    )
    if level == "sequence":
        log_w = sequences.spread(sequences.total(log_w), m.shape)
    elif level == "geometric":
        log_w = sequences.spread(sequences.total(log_w) / jnp.maximum(sequences.total(m), 1.0), m.shape)
    elif level != "token":
        raise ValueError(f"unknown rollout_is_level {level!r}; expected one of {ROLLOUT_IS_LEVELS}")
    w = jnp.exp(jnp.clip(log_w, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    lower = 1.0 / threshold if threshold_lower is None else threshold_lower
    high, low = (w > threshold).astype(jnp.float32), (w < lower).astype(jnp.float32)
    tokens = m.sum()
    metrics = {
        "rollout_is_mean": ((w * m).sum(), tokens),
        "rollout_is_max": ((w * m).max(), jnp.float32(1.0)),
        "rollout_is_fraction_high": ((high * m).sum(), tokens),
        "rollout_is_fraction_low": ((low * m).sum(), tokens),
    }
    if mode == "truncate":
        weights, kept = jnp.minimum(w, threshold) * m, m
    elif mode == "mask":
        kept = m * (1.0 - jnp.maximum(high, low))
        weights = w * kept
        rows = (sequences.total(m) > 0).astype(jnp.float32)
        metrics["rollout_is_masked_fraction"] = ((m - kept).sum(), tokens)
        metrics["rollout_is_seq_masked_fraction"] = ((rows * (sequences.total(m - kept) > 0)).sum(), rows.sum())
    else:
        raise ValueError(f"unknown rollout_is_mode {mode!r}; expected one of {ROLLOUT_IS_MODES}")
    return sg(weights), sg(kept), jax.tree.map(sg, metrics)


# ----------------------------------------------------------------------------------------------
# PPO with a critic: per-token rewards, GAE over the sampled tokens, the clipped value loss.
# ----------------------------------------------------------------------------------------------


def token_rewards(rewards, mask, kl=None, kl_coef: float = 0.0):
    """Per-token rewards [B,T] float32 from sequence rewards [B] and the sampled-token mask [B,T]: each
    row's reward on its last sampled token, minus kl_coef * kl on every sampled token when `kl` [B,T]
    is given (verl's apply_kl_penalty: the KL to the reference as a per-token reward). 0 off the mask;
    a row with no sampled token gets nothing. The reward sits on the last SAMPLED token even where an
    episode ends with environment tokens, so the recursion of `gae` (which skips those) sees it."""
    m = jnp.asarray(mask) > 0
    T = m.shape[-1]
    last = T - 1 - jnp.argmax(m[:, ::-1], axis=-1)
    at_last = (jnp.arange(T) == last[:, None]) & m.any(axis=-1, keepdims=True)
    out = jnp.where(at_last, jnp.asarray(rewards, jnp.float32)[:, None], 0.0)
    if kl is not None:
        out = out - kl_coef * jnp.where(m, jnp.asarray(kl, jnp.float32), 0.0)
    return out


def distill_advantages(
    advantages, logprobs, teacher_logprobs, weights, mask, coef: float, reward_weight: float, discount: float = 0.0
):
    """On-policy distillation's per-token advantages (verl's OPD; Thinking Machines' "On-Policy
    Distillation", 2025): (reward_weight * advantages - coef * D, KL), both [B, T] float32 and 0
    off `mask`. `advantages` are the estimator's, [B] (one a row, on each of its tokens) or [B, T];
    KL_t = sum_i weights[i] * (logprobs - teacher_logprobs[i]) at the sampled token (kl_penalty k1:
    the single-sample estimate of the reverse KL(student || teacher_i) at t, [B, T] each). D is KL
    itself with `discount` 0; else each sampled token's discounted sum of the KL from it to the row's
    end, D_t = KL_t + discount * D_t' (t' the row's next sampled token: environment tokens are
    skipped, as `gae` skips them), tinker-cookbook's kl_discount_factor: a token answers for the
    divergence of what it leads to."""
    m = jnp.asarray(mask) > 0
    kl = jnp.where(m, sum(w * kl_penalty(logprobs, t, "k1") for w, t in zip(weights, teacher_logprobs)), 0.0)
    outcome = jnp.asarray(advantages, jnp.float32)
    outcome = outcome[:, None] if outcome.ndim == 1 else outcome
    return jnp.where(m, reward_weight * outcome - coef * discounted_sum(kl, m, discount), 0.0), kl


def discounted_sum(values, mask, discount: float):
    """[B, T]: at each masked token the discounted sum of `values` over the row's masked tokens from
    it on, value_t + discount * sum_t' (t' the next masked token; none: 0); 0 off the mask."""
    if discount == 0:
        return jnp.where(mask, values, 0.0)

    def back(later, column):
        value, on = column
        here = value + discount * later
        return jnp.where(on, here, later), jnp.where(on, here, 0.0)

    _, out = jax.lax.scan(back, jnp.zeros(values.shape[:1], jnp.float32), (values.T, mask.T), reverse=True)
    return out.T


def gae(rewards, values, mask, gamma: float, lam: float):
    """Generalized advantage estimation (Schulman et al. 2016) over the sampled tokens of each row.

    rewards (token_rewards), values (the old critic's), mask [B,T]. The reverse recursion runs over
    the sampled tokens only: with t' the next SAMPLED token after t (none: V(t') = A(t') = 0),
        delta_t = r_t + gamma * V(t') - V(t),   A_t = delta_t + gamma * lam * A(t'),
    so an episode's environment tokens (mask 0 inside a row) are skipped: no TD step across them, the
    next sampled token's value bootstraps the one before them. Returns (advantages, returns) [B,T]
    float32, returns = advantages + values, both 0 off the mask; the advantages are not whitened
    (masked_whiten, over the whole batch).

    verl's compute_gae_advantage_return: its earlier form steps over every column (V(t+1), the next
    column's value, whatever it holds), which equals this on rows whose sampled tokens are contiguous
    from column 0 with the critic's values 0 after them; its later form carries V and A through
    columns of mask 0 ("skip values and TD-error on observation tokens"), which equals this on the
    sampled tokens where the rewards of unsampled tokens are 0 (here: always, token_rewards puts the
    reward on the last sampled token; verl puts it on the last token of the response, an observation
    token when an episode ends with one, whose reward its carry then drops).
    """
    r = jnp.asarray(rewards, jnp.float32)
    v = jnp.asarray(values, jnp.float32)
    m = jnp.asarray(mask) > 0

    def back(carry, column):
        next_value, next_adv = carry
        r_t, v_t, m_t = column
        adv = r_t + gamma * next_value - v_t + gamma * lam * next_adv
        carry = (jnp.where(m_t, v_t, next_value), jnp.where(m_t, adv, next_adv))
        return carry, jnp.where(m_t, adv, 0.0)

    zeros = jnp.zeros(r.shape[:1], jnp.float32)
    _, adv = jax.lax.scan(back, (zeros, zeros), (r.T, v.T, m.T), reverse=True)
    adv = adv.T
    return adv, jnp.where(m, adv + v, 0.0)


def value_loss(
    values,
    old_values,
    returns,
    mask,
    value_clip: float | None,
    loss_agg_mode: str = "token-mean",
    horizon=None,
    sequences: Sequences = ROWS,
):
    """The critic's clipped value loss (verl's compute_value_loss), in train_step's form.

    values (the critic's now), old_values (the critic's at rollout time), returns (gae's), mask
    [B,T]. Per token, with v_clip = clip(v, old - value_clip, old + value_clip) (value_clip None:
    v_clip = v, no clipping):
        loss_t = 0.5 * max((v - R)^2, (v_clip - R)^2)
    aggregated by `aggregate(loss_t, mask, loss_agg_mode, horizon, sequences)`. Returns (loss_sum, denominator,
    metrics), metrics name -> (sum, count) with stop_gradient:
      vf_clipfrac   tokens whose clipped error is the larger (the clip is active) / tokens
      vpred_mean    the critic's values / tokens
    """
    v = jnp.asarray(values, jnp.float32)
    old = jnp.asarray(old_values, jnp.float32)
    ret = jnp.asarray(returns, jnp.float32)
    m = jnp.asarray(mask, jnp.float32)
    # Clamping v itself (as verl and TRL do) returns v exactly where the clip does not bind; old + clip(v - old)
    # rounds in float32 and would count about half of those tokens as clipped.
    v_clip = v if value_clip is None else jnp.clip(v, old - value_clip, old + value_clip)
    unclipped, clipped = jnp.square(v - ret), jnp.square(v_clip - ret)
    loss_sum, denom = aggregate(0.5 * jnp.maximum(unclipped, clipped), m, loss_agg_mode, horizon, sequences)
    sg = jax.lax.stop_gradient
    tokens = sg(m.sum())
    metrics = {
        "vf_clipfrac": (sg(((clipped > unclipped) * m).sum()), tokens),
        "vpred_mean": (sg((v * m).sum()), tokens),
    }
    return loss_sum, denom, metrics


def explained_variance(returns, values, mask) -> jax.Array:
    """1 - Var(returns - values) / (Var(returns) + 1e-5) over the masked tokens, unbiased variances
    (verl's critic/vf_explained_var): 1 = the critic predicts the returns, 0 = no better than their mean."""
    m = jnp.asarray(mask, jnp.float32)
    ret = jnp.asarray(returns, jnp.float32)
    v = jnp.asarray(values, jnp.float32)

    def var(x):
        n = m.sum()
        mean = (x * m).sum() / jnp.maximum(n, 1.0)
        return (jnp.square(x - mean) * m).sum() / jnp.maximum(n - 1.0, 1.0)

    return 1.0 - var(ret - v) / (var(ret) + 1e-5)


# ----------------------------------------------------------------------------------------------
# Sequence log-probabilities and preference losses (mode=dpo's family, mode=rm's).
# ----------------------------------------------------------------------------------------------


def sequence_logprobs(logprobs, weights):
    """Summed log-probabilities of the weighted target tokens of each row: [B,T], [B,T] {0,1} -> [B]
    float32. Positions with weight 0 contribute exactly 0 (even a non-finite logit there)."""
    return jnp.where(weights > 0, logprobs, 0.0).sum(axis=-1)


@dataclasses.dataclass(frozen=True)
class PreferenceConfig:
    """The preference loss of mode=dpo (dpo_loss_type) and its constants, as the dpo_* keys set them.
    beta is each loss's beta (ORPO's lambda, as TRL's ORPOConfig.beta)."""

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    cpo_alpha: float = 1.0
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    @property
    def has_reference(self) -> bool:
        return self.loss_type not in REFERENCE_FREE_LOSSES

    @classmethod
    def from_config(cls, cfg) -> PreferenceConfig:
        return cls(
            loss_type=cfg.dpo_loss_type,
            beta=cfg.dpo_beta,
            label_smoothing=cfg.dpo_label_smoothing,
            simpo_gamma=cfg.simpo_gamma,
            cpo_alpha=cfg.cpo_alpha,
            desirable_weight=cfg.kto_desirable_weight,
            undesirable_weight=cfg.kto_undesirable_weight,
        )


def weighted_sums(weights, values: dict) -> dict:
    """{name: (sum of the value over entries of weight > 0, their number)}, with stop_gradient: the
    metrics' form, which adds up exactly over micro-batches and devices."""
    sg = jax.lax.stop_gradient
    count = sg(weights.sum())
    return {name: (sg(jnp.where(weights > 0, x, 0.0).sum()), count) for name, x in values.items()}


def _smoothed(z, label_smoothing: float):
    """-log sigmoid(z) with the label flipped with probability label_smoothing (cDPO)."""
    return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(-z)


def log1mexp(x):
    """log(1 - e^x) for x <= 0, stable at both ends (Maechler 2012: log(-expm1 x) above -log 2,
    log1p(-e^x) below), each branch fed only its own range so that neither gradient is NaN; x is
    kept below 0, so a completion of average log-prob exactly 0 stays finite."""
    x = jnp.minimum(x, -1e-30)
    near = x > -0.6931471805599453
    return jnp.where(near, jnp.log(-jnp.expm1(jnp.where(near, x, -1.0))), jnp.log1p(-jnp.exp(jnp.where(near, -1.0, x))))


# The paired losses: fn(pi, ref, nll, settings) -> (loss [P], rewards_chosen, rewards_rejected,
# {metric: [P]}); pi and ref are (chosen, rejected) log-probs, summed or averaged over the
# completion's tokens (AVERAGED_LOSSES), ref None without a reference; nll the chosen completion's
# per-token mean negative log-likelihood.


def _sigmoid(pi, ref, nll, s):
    """DPO (Rafailov et al. 2023), TRL DPOTrainer loss_type="sigmoid" with label_smoothing (cDPO,
    TRL 0.7.5 to 0.28; TRL 0.29 and later ignore label_smoothing there)."""
    rc, rr = s.beta * (pi[0] - ref[0]), s.beta * (pi[1] - ref[1])
    return _smoothed(rc - rr, s.label_smoothing), rc, rr, {}


def _ipo(pi, ref, nll, s):
    """IPO (Azar et al. 2023), TRL DPOTrainer loss_type="ipo": the squared distance of the log-ratio
    difference from 1 / (2 beta), on log-probs averaged over tokens."""
    rc, rr = s.beta * (pi[0] - ref[0]), s.beta * (pi[1] - ref[1])
    return jnp.square((pi[0] - ref[0]) - (pi[1] - ref[1]) - 1.0 / (2.0 * s.beta)), rc, rr, {}


def _simpo(pi, ref, nll, s):
    """SimPO (Meng et al. 2024), TRL CPOTrainer loss_type="simpo" with cpo_alpha 0: no reference,
    average log-probs, the target margin simpo_gamma."""
    rc, rr = s.beta * pi[0], s.beta * pi[1]
    return _smoothed(rc - rr - s.simpo_gamma, s.label_smoothing), rc, rr, {}


def _cpo(pi, ref, nll, s):
    """CPO (Xu et al. 2024), TRL CPOTrainer loss_type="sigmoid": DPO's loss without a reference on
    summed log-probs, plus cpo_alpha times the chosen completion's NLL."""
    rc, rr = s.beta * pi[0], s.beta * pi[1]
    return _smoothed(rc - rr, s.label_smoothing) + s.cpo_alpha * nll, rc, rr, {"nll_loss": nll}


def _orpo(pi, ref, nll, s):
    """ORPO (Hong et al. 2024), TRL ORPOTrainer: the chosen completion's NLL minus beta (lambda) times
    log sigmoid of the log odds ratio of the average log-probs, log odds(p) = log p - log(1 - p)."""
    log_odds = (pi[0] - pi[1]) - (log1mexp(pi[0]) - log1mexp(pi[1]))
    ratio = jax.nn.log_sigmoid(log_odds)
    extra = {"nll_loss": nll, "log_odds_ratio": ratio, "log_odds_chosen": log_odds}
    return nll - s.beta * ratio, s.beta * pi[0], s.beta * pi[1], extra


AVERAGED_LOSSES = ("ipo", "simpo", "orpo")  # read log-probs averaged over the completion's tokens, as TRL
PAIRED_LOSSES = {"sigmoid": _sigmoid, "ipo": _ipo, "simpo": _simpo, "cpo": _cpo, "orpo": _orpo}


def preference_loss(policy, ref, lengths, settings: PreferenceConfig, weights=None):
    """A paired preference loss (settings.loss_type, one of PAIRED_LOSSES) in train_step's loss_fn
    form. Inputs, each (chosen [P], rejected [P]) with one entry per pair: `policy` and `ref` the
    completions' summed log-probs under the policy and the frozen reference (ref None for the
    REFERENCE_FREE_LOSSES), `lengths` their numbers of tokens; `weights` [P] {0,1} marks real pairs
    (None = all real; padding rows of an eval batch get 0, and may have length 0). The losses of
    AVERAGED_LOSSES read log-probs averaged over each completion's tokens, as TRL does for them.
    Returns (sum of the loss over pairs, (number of pairs, metrics)), metrics name -> (sum, count)
    (weighted_sums), TRL's names in the singular this trainer has always logged:
      rewards/chosen, rewards/rejected   the implicit rewards (beta * log-ratio; without a
                                         reference beta * log-prob)
      rewards/accuracy                   rewards_c > rewards_r (strict, as TRL: a tie counts as wrong)
      rewards/margin                     rewards_c - rewards_r
      logps/chosen, logps/rejected       the policy's log-probs the loss reads
      nll_loss                           cpo, orpo: the chosen completion's NLL, a per-token mean
                                         per sequence (ORPO's paper; TRL's mean over the batch's
                                         tokens weighs long completions more, and would make
                                         gradient accumulation inexact)
      log_odds_ratio, log_odds_chosen    orpo: log sigmoid(log odds ratio), the log odds ratio
    """
    w = jnp.ones_like(jnp.asarray(policy[0], jnp.float32)) if weights is None else jnp.asarray(weights, jnp.float32)
    tokens = tuple(jnp.maximum(jnp.asarray(n, jnp.float32), 1.0) for n in lengths)
    pi = tuple(jnp.asarray(x, jnp.float32) for x in policy)
    ref = None if ref is None else tuple(jnp.asarray(x, jnp.float32) for x in ref)
    nll = -pi[0] / tokens[0]
    if settings.loss_type in AVERAGED_LOSSES:
        pi = (pi[0] / tokens[0], pi[1] / tokens[1])
        ref = None if ref is None else (ref[0] / tokens[0], ref[1] / tokens[1])
    per_pair, rc, rr, extra = PAIRED_LOSSES[settings.loss_type](pi, ref, nll, settings)
    metrics = {
        "rewards/chosen": rc,
        "rewards/rejected": rr,
        "rewards/accuracy": (rc > rr).astype(jnp.float32),
        "rewards/margin": rc - rr,
        "logps/chosen": pi[0],
        "logps/rejected": pi[1],
        **extra,
    }
    return jnp.where(w > 0, per_pair, 0.0).sum(), (jax.lax.stop_gradient(w.sum()), weighted_sums(w, metrics))


def kto_reference_point(policy_kl, ref_kl, weights):
    """KTO's reference point z (TRL KTOTrainer): max(0, the mean over the real records of the
    log-ratio policy - reference of their mismatched prompt/completion pairs), detached."""
    w = jnp.asarray(weights, jnp.float32)
    mean = jnp.where(w > 0, policy_kl - ref_kl, 0.0).sum() / jnp.maximum(w.sum(), 1.0)
    return jax.lax.stop_gradient(jnp.maximum(mean, 0.0))


def kto_loss(policy, ref, desirable, kl, settings: PreferenceConfig, weights=None):
    """KTO (Ethayarajh et al. 2024), TRL KTOTrainer loss_type="kto", in train_step's loss_fn form,
    one entry per unpaired record: `policy`, `ref` [P] its completion's summed log-probs, `desirable`
    [P] {0,1} its label, `kl` [P] the reference point z (kto_reference_point, the same in every
    entry), `weights` [P] {0,1} the real records. With r = policy - ref, per record
        desirable:    desirable_weight * (1 - sigmoid(beta * (r - z)))
        undesirable:  undesirable_weight * (1 - sigmoid(beta * (z - r)))
    Returns (sum over records, (number of records, metrics)): rewards/chosen, logps/chosen over the
    desirable records, rewards/rejected, logps/rejected over the undesirable ones (rewards beta * r),
    and kl, z. (TRL's rewards/margins, a difference of two means, has no (sum, count) form.)"""
    pi, ref, kl = (jnp.asarray(x, jnp.float32) for x in (policy, ref, kl))
    w = jnp.ones_like(pi) if weights is None else jnp.asarray(weights, jnp.float32)
    good = jnp.asarray(desirable) > 0
    r = pi - ref
    per_record = jnp.where(
        good,
        settings.desirable_weight * (1.0 - jax.nn.sigmoid(settings.beta * (r - kl))),
        settings.undesirable_weight * (1.0 - jax.nn.sigmoid(settings.beta * (kl - r))),
    )
    metrics = {
        **weighted_sums(w * good, {"rewards/chosen": settings.beta * r, "logps/chosen": pi}),
        **weighted_sums(w * ~good, {"rewards/rejected": settings.beta * r, "logps/rejected": pi}),
        **weighted_sums(w, {"kl": kl}),
    }
    return jnp.where(w > 0, per_record, 0.0).sum(), (jax.lax.stop_gradient(w.sum()), metrics)


def reward_model_loss(chosen, rejected, *, margin=None, center_coef: float = 0.0, weights=None):
    """The Bradley-Terry loss of a reward model on preference pairs, as TRL's RewardTrainer: per pair
        -log sigmoid(r_c - r_r - margin) + center_coef * (r_c + r_r)^2
    (its mean over pairs is TRL's loss with center_rewards_coefficient; the second term keeps the
    rewards centred on 0), in train_step's loss_fn form. Inputs [P]: the pooled rewards of the
    chosen and rejected sequences, `margin` [P] (None = 0), `weights` [P] {0,1} marking real pairs.
    Returns (sum over pairs, (number of pairs, metrics)), metrics name -> (sum, count):
      accuracy                            r_c > r_r (strict: a tie counts as wrong, as TRL)
      margin                              r_c - r_r
      rewards/chosen, rewards/rejected    r_c, r_r
    """
    r_c, r_r = jnp.asarray(chosen, jnp.float32), jnp.asarray(rejected, jnp.float32)
    w = jnp.ones_like(r_c) if weights is None else jnp.asarray(weights, jnp.float32)
    gap = r_c - r_r - (0.0 if margin is None else jnp.asarray(margin, jnp.float32))
    per_pair = -jax.nn.log_sigmoid(gap) + center_coef * jnp.square(r_c + r_r)
    metrics = weighted_sums(
        w,
        {
            "accuracy": (r_c > r_r).astype(jnp.float32),
            "margin": r_c - r_r,
            "rewards/chosen": r_c,
            "rewards/rejected": r_r,
        },
    )
    return jnp.where(w > 0, per_pair, 0.0).sum(), (jax.lax.stop_gradient(w.sum()), metrics)


@check("policy_loss", "loss_agg_mode", "eps_clip_c")
def _gspo(c) -> str | None:
    if c["policy_loss"] != "gspo":
        return None
    if c["loss_agg_mode"] != "seq-mean-token-mean":
        return f"policy_loss=gspo is a sequence-level objective and needs loss_agg_mode=seq-mean-token-mean, got {c['loss_agg_mode']}"
    return None if c["eps_clip_c"] is None else "policy_loss=gspo has no dual clip; set eps_clip_c=null"


@check("rollout_is", "rollout_is_mode", "rollout_is_threshold_lower", "rollout_decoding")
def _rollout_is(c) -> str | None:
    if c["rollout_is_threshold_lower"] is not None and c["rollout_is_mode"] != "mask":
        return "rollout_is_threshold_lower bounds rollout_is_mode=mask only (truncate caps above); set it to null or rollout_is_mode=mask"
    if c["rollout_is"] and c["rollout_decoding"] != "sample":
        return "rollout_is needs sampled rollouts: beam search (rollout_decoding=beam) draws from no distribution to correct for"
    return None


CONFIG_CHECKS = (_gspo, _rollout_is)
