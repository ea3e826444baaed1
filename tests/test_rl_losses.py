"""RL losses (advantages, KL estimators, entropy, aggregation, PPO clipped loss) against NumPy float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from unitrain import losses, registry

B, T, V = 6, 9, 11
LENGTHS = [9, 1, 5, 0, 2, 7]  # ragged; row 3 fully masked


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, T), np.float32)
    for b, n in enumerate(LENGTHS):
        mask[b, :n] = 1.0
    logp = rng.normal(-1.5, 1.0, (B, T)).astype(np.float32)
    old = (logp + rng.normal(0, 0.4, (B, T))).astype(np.float32)
    ref = (logp + rng.normal(0, 0.6, (B, T))).astype(np.float32)
    ref[0, 0] = logp[0, 0] + 5.0  # k3 upper clamp: e^5 - 6 > 10
    ref[0, 1] = logp[0, 1] - 30.0  # log-ratio clamp at -20
    values = rng.normal(0, 1, (B, T)).astype(np.float32)
    adv = rng.normal(0, 1, (B,)).astype(np.float32)
    return dict(mask=mask, logp=logp, old=old, ref=ref, values=values, adv=adv)


# ------------------------------------------------------------------ NumPy references (float64)


def np_aggregate(v, m, mode, horizon=None):
    v, m = v.astype(np.float64), m.astype(np.float64)
    n = m.sum(-1)
    has = n > 0
    if mode == "token-mean":
        return (v * m).sum(), m.sum()
    if mode == "seq-mean-token-mean":
        return sum((v[b] * m[b]).sum() / n[b] for b in range(len(n)) if has[b]), has.sum()
    if mode == "seq-mean-token-sum":
        return sum((v[b] * m[b]).sum() for b in range(len(n)) if has[b]), has.sum()
    if mode == "seq-mean-token-sum-norm":
        return (v * m).sum() / horizon, has.sum()
    raise AssertionError(mode)


def np_kl(logp, ref, kind):
    logp, ref = logp.astype(np.float64), ref.astype(np.float64)
    if kind == "k1":
        return logp - ref
    if kind == "k2":
        return 0.5 * (logp - ref) ** 2
    d = np.clip(ref - logp, -20, 20)
    return np.clip(np.exp(d) - d - 1, -10, 10)


def np_advantages(r, g, estimator, norm_by_std=True, eps=1e-6, weights=None):
    """Loop-based mirror of verl's per-group dictionaries."""
    r = np.asarray(r, np.float64)
    out = np.zeros_like(r)
    groups = {k: [i for i in range(len(r)) if g[i] == k] for k in set(g)}
    for idx in groups.values():
        x = r[idx]
        n = len(x)
        mean = 0.0 if n == 1 else x.mean()
        std = 1.0 if n == 1 else x.std(ddof=1)
        for i in idx:
            if estimator == "grpo":
                out[i] = (r[i] - mean) / (std + eps) if norm_by_std else r[i] - mean
            elif estimator in ("drgrpo", "reinforce_pp"):
                out[i] = r[i] - mean
            elif estimator == "rloo":
                out[i] = 0.0 if n == 1 else r[i] - (x.sum() - r[i]) / (n - 1)
    if estimator == "reinforce_pp":
        # verl: tile over response tokens, masked_whiten (unbiased var, rsqrt(var + 1e-8))
        w = np.ones_like(r) if weights is None else np.asarray(weights, np.float64)
        tokens = np.repeat(out, w.astype(int))
        mean, var = tokens.mean(), tokens.var(ddof=1)
        out = (out - mean) / np.sqrt(var + 1e-8)
    return out


# ------------------------------------------------------------------ aggregation / KL / entropy


@pytest.mark.parametrize("mode", registry.LOSS_AGG_MODES)
def test_aggregate_matches_numpy(mode):
    d = _batch()
    s, n = jax.jit(losses.aggregate, static_argnums=(2, 3))(d["values"], d["mask"], mode, T)
    ref_s, ref_n = np_aggregate(d["values"], d["mask"], mode, T)
    np.testing.assert_allclose(float(s), ref_s, rtol=1e-5, atol=1e-6)
    assert float(n) == ref_n
    assert ref_n == (sum(LENGTHS) if mode == "token-mean" else 5)


@pytest.mark.parametrize("kind", registry.KL_TYPES)
def test_kl_penalty_matches_numpy(kind):
    d = _batch()
    kl = jax.jit(losses.kl_penalty, static_argnums=2)(d["logp"], d["ref"], kind)
    np.testing.assert_allclose(np.asarray(kl), np_kl(d["logp"], d["ref"], kind), rtol=1e-5, atol=1e-5)
    if kind in ("k3", "low_var_kl"):
        assert float(kl[0, 0]) == 10.0 and np.all(np.asarray(kl) >= 0)
    with pytest.raises(ValueError):
        losses.kl_penalty(d["logp"], d["ref"], "k4")


def test_logit_stats_entropy_matches_numpy():
    rng = np.random.default_rng(1)
    logits = (rng.normal(0, 3, (B, T, V))).astype(np.float32)
    x = logits.astype(np.float64)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = -(p * np.log(p)).sum(-1)
    ent = jax.jit(lambda l: losses.logit_stats(l, jnp.zeros(l.shape[:-1], jnp.int32), with_entropy=True).entropy)
    got32 = ent(logits)
    assert got32.dtype == jnp.float32 and got32.shape == (B, T)
    np.testing.assert_allclose(np.asarray(got32), want, rtol=1e-5, atol=1e-5)
    got16 = ent(jnp.asarray(logits, jnp.bfloat16))  # low-precision logits are computed in float32
    assert got16.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got16), want, atol=0.05)
    # -inf logits (masked vocabulary) contribute 0, with finite gradient
    masked = logits.copy()
    masked[..., 3:] = -np.inf
    x3 = logits[..., :3].astype(np.float64)
    p3 = np.exp(x3 - x3.max(-1, keepdims=True))
    p3 /= p3.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(ent(masked)), -(p3 * np.log(p3)).sum(-1), rtol=1e-5, atol=1e-5)
    g = jax.jit(jax.grad(lambda l: ent(l).sum()))(jnp.asarray(masked))
    assert np.all(np.isfinite(np.asarray(g)))


@pytest.mark.parametrize("with_entropy", [False, True])
def test_logit_stats_gradient_matches_finite_differences(with_entropy):
    """The gradient against central differences of a float64 NumPy forward, for a loss that
    weighs every statistic; masked (-inf) vocabulary entries get exactly zero gradient."""
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 2, (3, 4, V))
    logits[0, :, 7:] = -np.inf
    targets = rng.integers(0, 7, (3, 4))
    w = rng.normal(size=(3, 3, 4))

    def np_loss(x):
        finite = np.where(np.isfinite(x), x, -1e300)
        log_z = np.log(np.exp(finite - finite.max(-1, keepdims=True)).sum(-1)) + finite.max(-1)
        logp = finite - log_z[..., None]
        p = np.exp(logp)
        entropy = -(p * np.where(p > 0, logp, 0.0)).sum(-1)
        total = (w[0] * np.take_along_axis(logp, targets[..., None], -1)[..., 0] + w[1] * log_z).sum()
        return total + ((w[2] * entropy).sum() if with_entropy else 0.0)

    def loss(x):
        stats = losses.logit_stats(x, jnp.asarray(targets), with_entropy)
        total = (w[0] * stats.logprobs + w[1] * stats.log_z).sum()
        return total + ((w[2] * stats.entropy).sum() if with_entropy else 0.0)

    got = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(logits, jnp.float32)))
    want = np.zeros_like(logits)
    for i in zip(*np.nonzero(np.isfinite(logits))):
        step = np.zeros_like(logits)
        step[i] = 1e-6
        want[i] = (np_loss(logits + step) - np_loss(logits - step)) / 2e-6
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    assert np.all(got[0, :, 7:] == 0)


# ------------------------------------------------------------------ advantages

# groups: 0 -> 4 varied, 1 -> singleton, 2 -> zero-std (all equal), 3 -> two samples; 4 -> empty id
REWARDS = np.array([1.0, 0.0, 0.5, 1.0, 0.7, 1.0, 1.0, 1.0, 0.0, 2.0], np.float32)
GROUPS = np.array([0, 0, 0, 0, 1, 2, 2, 2, 3, 3], np.int32)
NUM_GROUPS = 5


@pytest.mark.parametrize(
    "estimator,norm", [("grpo", True), ("grpo", False), ("drgrpo", True), ("rloo", True), ("reinforce_pp", True)]
)
def test_advantages_match_numpy(estimator, norm):
    fn = jax.jit(losses.compute_advantages, static_argnums=(2, 3, 4))
    got = np.asarray(fn(REWARDS, GROUPS, NUM_GROUPS, estimator, norm))
    want = np_advantages(REWARDS, GROUPS, estimator, norm_by_std=norm)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # zero-std group gives 0 for the group-relative estimators
    if estimator != "reinforce_pp":
        np.testing.assert_allclose(got[5:8], 0.0, atol=1e-6)


def test_advantages_hand_values():
    fn = losses.compute_advantages
    # singleton: grpo keeps r / (1 + eps) (verl mean 0, std 1); drgrpo keeps r; rloo gives 0
    assert float(fn(REWARDS, GROUPS, NUM_GROUPS, "grpo")[4]) == pytest.approx(0.7 / (1 + 1e-6))
    assert float(fn(REWARDS, GROUPS, NUM_GROUPS, "drgrpo")[4]) == pytest.approx(0.7)
    assert float(fn(REWARDS, GROUPS, NUM_GROUPS, "rloo")[4]) == 0.0
    # two samples {0, 2}: mean 1, unbiased std sqrt(2); rloo: 0 - 2 = -2 and 2 - 0 = 2
    np.testing.assert_allclose(
        np.asarray(fn(REWARDS, GROUPS, NUM_GROUPS, "grpo", eps=0.0))[8:], [-1 / np.sqrt(2), 1 / np.sqrt(2)], rtol=1e-6
    )
    np.testing.assert_allclose(np.asarray(fn(REWARDS, GROUPS, NUM_GROUPS, "rloo"))[8:], [-2.0, 2.0], rtol=1e-6)
    # drgrpo ignores norm_by_std
    np.testing.assert_array_equal(
        np.asarray(fn(REWARDS, GROUPS, NUM_GROUPS, "drgrpo", True)),
        np.asarray(fn(REWARDS, GROUPS, NUM_GROUPS, "drgrpo", False)),
    )
    with pytest.raises(ValueError):
        fn(REWARDS, GROUPS, NUM_GROUPS, "ppo")


def test_reinforce_pp_token_weighted_whitening():
    weights = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], np.float32)  # response lengths
    got = np.asarray(losses.compute_advantages(REWARDS, GROUPS, NUM_GROUPS, "reinforce_pp", weights=weights))
    want = np_advantages(REWARDS, GROUPS, "reinforce_pp", weights=weights)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    tok = np.repeat(got, weights.astype(int))
    assert abs(tok.mean()) < 1e-5 and tok.std(ddof=1) == pytest.approx(1.0, rel=1e-4)


# ------------------------------------------------------------------ PPO clipped loss

RATIOS = np.array([0.5, 0.9, 1.0, 1.1, 1.5, 4.0])


def _clip_inputs(a):
    old = np.full((2, 6), -1.0, np.float32)
    logp = (old + np.log(RATIOS)).astype(np.float32)
    mask = np.ones((2, 6), np.float32)
    adv = np.array([a, a], np.float32)
    return logp, old, adv, mask


def _per_token(a, **kw):
    """Per-token pg losses via the (linear) seq-mean-token-sum trick: one row, one token at a time."""
    logp, old, adv, mask = _clip_inputs(a)
    settings = losses.PolicyLossConfig(loss_agg_mode="seq-mean-token-sum", **kw)
    fn = jax.jit(lambda m: losses.policy_loss(logp, old, adv, m, settings))
    out = []
    for t in range(6):
        m = np.zeros_like(mask)
        m[0, t] = 1.0
        s, n, _ = fn(m)
        out.append(float(s) / float(n))
    _, _, met = fn(mask)
    return np.array(out), met


@pytest.mark.parametrize("a", [1.0, -1.0])
def test_clip_region(a):
    got, met = _per_token(a, eps_clip=0.2)
    clipped = np.clip(RATIOS, 0.8, 1.2)
    want = np.maximum(-a * RATIOS, -a * clipped)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    if a > 0:  # loss = -min(r, clip(r)): clip active for r > 1.2
        np.testing.assert_allclose(got, [-0.5, -0.9, -1.0, -1.1, -1.2, -1.2], rtol=1e-6)
        n_clip = 2
    else:  # loss = max(r, clip(r)): clip active for r < 0.8
        np.testing.assert_allclose(got, [0.8, 0.9, 1.0, 1.1, 1.5, 4.0], rtol=1e-6)
        n_clip = 1
    s, c = met["pg_clipfrac"]
    assert float(s) == 2 * n_clip and float(c) == 12
    assert float(met["pg_clipfrac_lower"][0]) == 0.0


def test_asymmetric_clip_high():
    got, met = _per_token(1.0, eps_clip=0.2, eps_clip_high=0.28)
    np.testing.assert_allclose(got, [-0.5, -0.9, -1.0, -1.1, -1.28, -1.28], rtol=1e-6)
    got, _ = _per_token(-1.0, eps_clip=0.2, eps_clip_high=0.28)
    np.testing.assert_allclose(got, [0.8, 0.9, 1.0, 1.1, 1.5, 4.0], rtol=1e-6)


@pytest.mark.parametrize("a", [1.0, -1.0])
def test_dual_clip_region(a):
    got, met = _per_token(a, eps_clip=0.2, eps_clip_c=3.0)
    if a > 0:  # dual clip only acts on A < 0
        np.testing.assert_allclose(got, [-0.5, -0.9, -1.0, -1.1, -1.2, -1.2], rtol=1e-6)
        assert float(met["pg_clipfrac_lower"][0]) == 0.0
    else:  # max(r, clip(r)) capped at c = 3: ratio 4 -> 3
        np.testing.assert_allclose(got, [0.8, 0.9, 1.0, 1.1, 1.5, 3.0], rtol=1e-6)
        s, c = met["pg_clipfrac_lower"]
        assert float(s) == 2 and float(c) == 12
    with pytest.raises(ValueError):
        losses.policy_loss(*_clip_inputs(a), losses.PolicyLossConfig(eps_clip=0.2, eps_clip_c=1.0))


def test_ratio_one_gradient_is_plain_policy_gradient():
    d = _batch()
    adv = d["adv"]

    def loss(lp):
        s, n, _ = losses.policy_loss(
            lp, d["logp"], adv, d["mask"], losses.PolicyLossConfig(eps_clip=0.2, eps_clip_c=3.0)
        )
        return s / n

    g = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(d["logp"])))
    want = -adv[:, None] * d["mask"] / d["mask"].sum()
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)
    assert float(loss(d["logp"])) == pytest.approx(float(-(adv[:, None] * d["mask"]).sum() / d["mask"].sum()), rel=1e-5)


@pytest.mark.parametrize("mode", registry.LOSS_AGG_MODES)
@pytest.mark.parametrize("kind", ["k1", "low_var_kl"])
def test_policy_loss_full_matches_numpy(mode, kind):
    d = _batch()
    eps, eps_hi, c, kl_coef, ent_coef = 0.2, 0.3, 3.0, 0.05, 0.01
    ent = np.abs(d["values"])
    settings = losses.PolicyLossConfig(
        eps_clip=eps,
        eps_clip_high=eps_hi,
        eps_clip_c=c,
        loss_agg_mode=mode,
        horizon=T,
        kl_coef=kl_coef,
        kl_type=kind,
        entropy_coef=ent_coef,
    )
    fn = jax.jit(lambda lp, old, a, m, ref, e: losses.policy_loss(lp, old, a, m, settings, ref_logprobs=ref, entropy=e))
    s, n, met = fn(d["logp"], d["old"], d["adv"], d["mask"], d["ref"], ent)

    lp, old, m = (x.astype(np.float64) for x in (d["logp"], d["old"], d["mask"]))
    A = np.broadcast_to(d["adv"].astype(np.float64)[:, None], lp.shape)
    r = np.exp(np.clip(lp - old, -20, 20))
    pg1, pg2 = -A * r, -A * np.clip(r, 1 - eps, 1 + eps_hi)
    cl = np.maximum(pg1, pg2)
    pg = np.where(A < 0, np.minimum(-A * c, cl), cl)
    kl = np_kl(d["logp"], d["ref"], kind)
    tok = pg + kl_coef * kl - ent_coef * ent
    want_s, want_n = np_aggregate(tok, m, mode, T)
    np.testing.assert_allclose(float(s), want_s, rtol=1e-5, atol=1e-6)
    assert float(n) == want_n
    nt = m.sum()
    np.testing.assert_allclose([float(x) for x in met["pg_loss"]], np_aggregate(pg, m, mode, T), rtol=1e-5)
    checks = {
        "pg_clipfrac": (pg2 > pg1),
        "pg_clipfrac_lower": (A < 0) & (cl > -A * c),
        "approx_kl": r - 1 - np.log(r),
        "ratio": r,
        "kl": kl,
        "entropy": ent,
    }
    for k, v in checks.items():
        ms, mc = met[k]
        np.testing.assert_allclose(float(ms), (v * m).sum(), rtol=1e-5, atol=1e-6, err_msg=k)
        assert float(mc) == nt, k

    # [B,T] advantages equal broadcast [B]
    s2, n2, _ = fn(d["logp"], d["old"], np.broadcast_to(d["adv"][:, None], (B, T)), d["mask"], d["ref"], ent)
    assert float(s2) == pytest.approx(float(s), rel=1e-6) and float(n2) == float(n)


def test_micro_batch_accumulation_is_exact():
    """Sum of (sum, denom) over two micro-batches == the loss of the whole batch, for every mode."""
    d = _batch()

    every_mode = [
        losses.PolicyLossConfig(eps_clip=0.2, loss_agg_mode=mode, horizon=T) for mode in registry.LOSS_AGG_MODES
    ]

    @jax.jit
    def f(lp, old, adv, m):
        return [losses.policy_loss(lp, old, adv, m, settings)[:2] for settings in every_mode]

    whole = f(d["logp"], d["old"], d["adv"], d["mask"])
    first = f(*(d[k][:3] for k in ("logp", "old", "adv", "mask")))
    second = f(*(d[k][3:] for k in ("logp", "old", "adv", "mask")))
    for mode, (s, n), (s1, n1), (s2, n2) in zip(registry.LOSS_AGG_MODES, whole, first, second):
        assert float((s1 + s2) / (n1 + n2)) == pytest.approx(float(s / n), rel=1e-6), mode


def test_optional_metrics_and_errors():
    d = _batch()
    _, _, met = losses.policy_loss(d["logp"], d["old"], d["adv"], d["mask"], losses.PolicyLossConfig(eps_clip=0.2))
    assert set(met) == {"pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "approx_kl", "ratio"}
    with pytest.raises(ValueError):
        losses.aggregate(d["values"], d["mask"], "seq-mean-token-sum-norm")
    with pytest.raises(ValueError):
        losses.aggregate(d["values"], d["mask"], "sum")


# ------------------------------------------------------------------ GSPO (sequence-level ratio)


def np_gspo(logp, old, adv, mask, eps_lo, eps_hi):
    """GSPO by its definition, float64: per row s = exp(mean_t (logp - old)), loss_i = max(-A s,
    -A clip(s)), averaged over rows with tokens; d loss_i / d logp_t = -A s / n_i where unclipped, else 0."""
    logp, old, m = (x.astype(np.float64) for x in (logp, old, mask))
    n = m.sum(-1)
    rows = n > 0
    s = np.exp(((logp - old) * m).sum(-1) / np.maximum(n, 1))
    A = adv.astype(np.float64)
    pg1, pg2 = -A * s, -A * np.clip(s, 1 - eps_lo, 1 + eps_hi)
    loss = np.where(rows, np.maximum(pg1, pg2), 0.0).sum() / rows.sum()
    grad = np.where((pg1 >= pg2) & rows, -A * s / np.maximum(n, 1), 0.0)[:, None] * m / rows.sum()
    return loss, grad, s, pg2 > pg1


def test_gspo_loss_and_gradient_match_numpy():
    d = _batch()
    # Rows 0 and 4 move out of the clip range in the direction their advantage's sign clips; the others stay inside.
    shift = np.where(np.arange(B) % 4 == 0, 0.08 * np.sign(d["adv"]), 0.004)
    old = (d["logp"] - shift[:, None] + np.random.default_rng(1).normal(0, 0.004, (B, T))).astype(np.float32)
    eps_lo, eps_hi = 0.02, 0.03

    def loss(lp):
        settings = losses.PolicyLossConfig(
            eps_clip=eps_lo,
            eps_clip_high=eps_hi,
            loss_agg_mode="seq-mean-token-mean",
            log_ratio=losses.sequence_log_ratio,
        )
        s, n, met = losses.policy_loss(lp, old, d["adv"], d["mask"], settings)
        return s / n, met

    (value, met), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(jnp.asarray(d["logp"]))
    want, want_grad, s, clipped = np_gspo(d["logp"], old, d["adv"], d["mask"], eps_lo, eps_hi)
    assert clipped.any() and not clipped[np.asarray(LENGTHS) > 0].all()  # both branches exercised
    np.testing.assert_allclose(float(value), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-7)
    m = d["mask"].astype(bool)
    tok = lambda x: np.broadcast_to(x[:, None], (B, T))[m].sum()
    np.testing.assert_allclose(float(met["ratio"][0]), tok(s), rtol=1e-5)  # the row's ratio at its tokens
    assert float(met["pg_clipfrac"][0]) == tok(clipped.astype(float))


def test_gspo_refuses_token_level_aggregation_and_dual_clip():
    d = _batch()
    for kw in ({"loss_agg_mode": "token-mean"}, {"loss_agg_mode": "seq-mean-token-mean", "eps_clip_c": 3.0}):
        with pytest.raises(ValueError, match="gspo"):
            losses.policy_loss(
                d["logp"],
                d["old"],
                d["adv"],
                d["mask"],
                losses.PolicyLossConfig(eps_clip=0.2, log_ratio=losses.sequence_log_ratio, **kw),
            )


# ------------------------------------------------------------------ rollout/trainer mismatch correction


def np_rollout_is(old, sampler, mask, level, mode, upper, lower):
    """verl's compute_rollout_importance_weights, float64, row by row."""
    old, sampler, m = (x.astype(np.float64) for x in (old, sampler, mask))
    w = np.zeros_like(old)
    for b in range(len(m)):
        lw = (old[b] - sampler[b]) * m[b]
        n = max(m[b].sum(), 1)
        lw = {"token": lw, "sequence": np.full(T, lw.sum()), "geometric": np.full(T, lw.sum() / n)}[level]
        w[b] = np.exp(np.clip(lw, -20, 20))
    outside = (w > upper) | (w < lower)
    if mode == "truncate":
        return np.minimum(w, upper) * m, m, w
    kept = m * ~outside
    return w * kept, kept, w


@pytest.mark.parametrize("level", registry.ROLLOUT_IS_LEVELS)
@pytest.mark.parametrize("mode, lower", [("truncate", None), ("mask", None), ("mask", 0.7)])
def test_rollout_correction_matches_numpy(level, mode, lower):
    d = _batch()
    # The sampler's logprobs: the old ones shifted per row plus noise, so that weights land below,
    # inside and above [lower, 2] at every level.
    shift = np.array([-1.0, 0.9, 0.2, 0.0, -0.1, 0.5])[:, None]
    noise = np.random.default_rng(2).uniform(-0.5, 0.5, (B, T)) * (0.2 if level == "sequence" else 1.0)
    sampler = (d["old"] - shift - noise).astype(np.float32)
    upper = 2.0
    weights, kept, met = jax.jit(
        lambda o, s, m: losses.rollout_correction(
            o, s, m, level=level, mode=mode, threshold=upper, threshold_lower=lower
        )
    )(d["old"], sampler, d["mask"])
    low = 1 / upper if lower is None else lower
    want_w, want_kept, raw = np_rollout_is(d["old"], sampler, d["mask"], level, mode, upper, low)
    np.testing.assert_allclose(np.asarray(weights), want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(kept), want_kept)
    m = d["mask"] > 0
    assert (raw[m] > upper).any() and (raw[m] <= upper).any()  # truncation / masking really happens
    tokens = m.sum()
    expect = {
        "rollout_is_mean": (raw[m].sum(), tokens),
        "rollout_is_max": (raw[m].max(), 1),
        "rollout_is_fraction_high": ((raw[m] > upper).sum(), tokens),
        "rollout_is_fraction_low": ((raw[m] < low).sum(), tokens),
    }
    if mode == "mask":
        dropped = d["mask"] - want_kept
        rows = m.any(-1)
        expect["rollout_is_masked_fraction"] = (dropped.sum(), tokens)
        expect["rollout_is_seq_masked_fraction"] = ((dropped.sum(-1) > 0)[rows].sum(), rows.sum())
        assert 0 < dropped.sum() < tokens
    assert set(met) == set(expect)
    for k, (s, c) in expect.items():
        np.testing.assert_allclose([float(met[k][0]), float(met[k][1])], [s, c], rtol=1e-5, err_msg=k)

    # In the loss: each token's pg term times its weight, aggregated over the kept tokens only.
    lp = d["logp"]
    settings = losses.PolicyLossConfig(eps_clip=0.2, loss_agg_mode="seq-mean-token-mean")
    s, n, _ = losses.policy_loss(lp, d["old"], d["adv"], kept, settings, pg_weights=weights)
    r = np.exp(lp.astype(np.float64) - d["old"])
    A = d["adv"].astype(np.float64)[:, None]
    pg = np.maximum(-A * r, -A * np.clip(r, 0.8, 1.2)) * want_w
    want_s, want_n = np_aggregate(pg, want_kept, "seq-mean-token-mean")
    np.testing.assert_allclose([float(s), float(n)], [want_s, want_n], rtol=1e-5)


def test_rollout_correction_weights_are_constants():
    """With the old pass skipped the old logprobs are the loss's own: the weights must not carry a gradient."""
    d = _batch()

    def loss(lp):
        w, kept, _ = losses.rollout_correction(lp, d["old"], d["mask"], level="token", mode="truncate", threshold=2.0)
        settings = losses.PolicyLossConfig(eps_clip=0.2)
        s, n, _ = losses.policy_loss(lp, jax.lax.stop_gradient(lp), d["adv"], kept, settings, pg_weights=w)
        return s / n

    g = np.asarray(jax.grad(loss)(jnp.asarray(d["logp"])))
    w = np.minimum(np.exp(np.clip(d["logp"].astype(np.float64) - d["old"], -20, 20)), 2.0) * d["mask"]
    np.testing.assert_allclose(g, -d["adv"][:, None] * w / d["mask"].sum(), rtol=1e-5, atol=1e-7)


def test_a_plugin_policy_loss_is_the_surrogate_s_log_ratio():
    """policy_loss: pkg.module:fn names the log-ratio of the clipped surrogate; the loss is then the
    NumPy recomputation with that ratio (tests/plugin_policy_loss.py clamps it to +-0.05)."""
    from helpers import make_cfg
    from plugin_policy_loss import BOUND, tight_log_ratio

    settings = losses.PolicyLossConfig.from_config(
        make_cfg(mode="grpo", policy_loss="plugin_policy_loss:tight_log_ratio")
    )
    assert settings.log_ratio is tight_log_ratio
    d = _batch()
    old = (d["logp"] - np.random.default_rng(2).normal(0, 0.2, (B, T))).astype(np.float32)
    s, n, _ = losses.policy_loss(jnp.asarray(d["logp"]), old, d["adv"], d["mask"], settings)
    ratio = np.exp(np.clip(d["logp"] - old, -BOUND, BOUND))
    adv = np.broadcast_to(d["adv"][:, None], (B, T))
    clipped = np.clip(ratio, 1 - settings.eps_clip, 1 + (settings.eps_clip_high or settings.eps_clip))
    per_token = np.maximum(-adv * ratio, -adv * clipped)
    m = d["mask"].astype(bool)
    np.testing.assert_allclose(float(s / n), per_token[m].mean(), rtol=1e-5)
    plain = losses.policy_loss(
        jnp.asarray(d["logp"]),
        old,
        d["adv"],
        d["mask"],
        losses.PolicyLossConfig(eps_clip=settings.eps_clip, eps_clip_high=settings.eps_clip_high),
    )
    assert abs(float(plain[0] / plain[1]) - float(s / n)) > 1e-4  # the plugin's ratio, not the built-in's
