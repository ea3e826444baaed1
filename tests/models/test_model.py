"""The decoder itself: KV-cache decode, scan vs unrolled, remat, left padding."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import GEMMA3_ARCH, grpo_rows, small_model_config
from unitrain.models import attention, decoder, kv_cache

CFG = small_model_config(vocab_size=128, qkv_bias=True, qk_norm=True)


def sharp_model(cfg, seed=0):
    """Random weights scaled up so that attention is far from uniform (masks and RoPE matter)."""
    model = decoder.create(cfg, seed)
    for _, var in nnx_params(model):
        var.set_value(var.get_value() * 10.0)
    return model


def nnx_params(model):
    return nnx.to_flat_state(nnx.state(model, nnx.Param))


@nnx.jit
def call(model, tokens, positions, segment_ids, cache=None):
    return model(tokens, positions, segment_ids, cache)


def full_forward(model, seq):
    t = len(seq)
    logits, _ = call(model, jnp.asarray(seq)[None], jnp.arange(t)[None], jnp.ones((1, t), jnp.int32))
    return np.asarray(logits[0])


@pytest.mark.parametrize("copies", [True, False], ids=["cpu_route", "accelerator_route"])
@pytest.mark.parametrize(
    "scan_layers,dtype,tied",
    [(True, "float32", False), (False, "float32", False), (True, "bfloat16", False), (True, "float32", True)],
)
def test_kv_cache_decode_equals_full_forward(scan_layers, dtype, tied, copies, monkeypatch):
    """A left-padded prefill in two calls, then token-by-token decode, all through
    `for_decoding(decode_weights())` as the samplers call the model, give the logits of the
    unpadded full forward on either route: a `Decoding`'s decode weights and head (CPU, GPU), or
    the decoder itself on its stacked weights (TPU)."""
    monkeypatch.setattr(decoder, "copies_weight_slices", lambda platform: copies)
    call = nnx.jit(lambda model, *args: model.for_decoding(model.decode_weights())(*args))  # traced afresh per route
    cfg = dataclasses.replace(CFG, scan_layers=scan_layers, dtype=dtype, weight_dtype=dtype, tie_word_embeddings=tied)
    # bfloat16 rounding of the sharp weights' large logits would hide an error: plain weights there.
    model = sharp_model(cfg) if dtype == "float32" else decoder.create(cfg, 0)
    rng = np.random.default_rng(0)
    prompt_lens, prefill_len, decode_steps = (7, 4), 7, 5
    seqs = [rng.integers(0, 128, n + decode_steps) for n in prompt_lens]
    tokens = np.zeros((2, prefill_len), np.int32)
    positions = np.zeros((2, prefill_len), np.int32)
    segments = np.zeros((2, prefill_len), np.int32)
    for b, n in enumerate(prompt_lens):  # left padding: the prompt sits at the right end
        tokens[b, prefill_len - n :] = seqs[b][:n]
        positions[b, prefill_len - n :] = np.arange(n)
        segments[b, prefill_len - n :] = 1
    # Causal: the full forward of the whole sequence holds the expected logits of every prefix.
    expected = [full_forward(model, s) for s in seqs]
    cache = kv_cache.init_cache(model.cfg, batch_size=2, max_length=16)
    chunks = []
    for part in (slice(0, 4), slice(4, prefill_len)):  # the second attends to the first's keys in the cache
        logits, cache = call(model, *(jnp.asarray(a[:, part]) for a in (tokens, positions, segments)), cache)
        chunks.append(logits)
    logits = jnp.concatenate(chunks, axis=1)
    # The sharp weights give logits up to ~40: float32 reordering alone moves them by up to ~5e-4.
    close = functools.partial(np.testing.assert_allclose, atol=1e-3 if dtype == "float32" else 1e-2, rtol=1e-5)
    for b, n in enumerate(prompt_lens):
        close(np.asarray(logits[b, prefill_len - n :]), expected[b][:n])
    for step in range(decode_steps):
        pos = np.asarray(prompt_lens) + step
        tok = np.asarray([seqs[b][pos[b]] for b in range(2)])
        logits, cache = call(
            model, jnp.asarray(tok)[:, None], jnp.asarray(pos)[:, None], jnp.ones((2, 1), jnp.int32), cache
        )
        for b in range(2):
            close(np.asarray(logits[b, 0]), expected[b][pos[b]])
    filled = np.asarray(cache.segment_ids).sum(axis=1)
    np.testing.assert_array_equal(filled, np.asarray(prompt_lens) + decode_steps)


@nnx.jit
def prefill(model, tokens, positions, segment_ids, cache):
    """The sampler's prefill: hidden states with the cache filled, the output head applied apart."""
    hidden, cache = model.hidden_states(tokens, positions, segment_ids, cache)
    return hidden, model.logits(hidden), cache


@nnx.jit
def uncached_hidden(model, seq):
    t = len(seq)
    return model.hidden_states(seq[None], jnp.arange(t)[None], jnp.ones((1, t), jnp.int32))[0]


def test_cached_hidden_states_equal_the_uncached_forward_and_fill_the_calls_cache():
    model = sharp_model(CFG)
    rng = np.random.default_rng(3)
    seqs, width = [rng.integers(0, 128, n) for n in (7, 4)], 8
    columns = [slice(width - len(s), width) for s in seqs]  # left padding, as the sampler lays prompts out
    tokens, positions, segments = (np.zeros((2, width), np.int32) for _ in range(3))
    for b, (s, real) in enumerate(zip(seqs, columns)):
        tokens[b, real], positions[b, real], segments[b, real] = s, np.arange(len(s)), 1
    block = tuple(map(jnp.asarray, (tokens, positions, segments)))
    empty = kv_cache.init_cache(model.cfg, batch_size=2, max_length=12)
    hidden, logits, cache = prefill(model, *block, empty)
    for b, (s, real) in enumerate(zip(seqs, columns)):
        np.testing.assert_allclose(
            np.asarray(hidden[b, real]), np.asarray(uncached_hidden(model, jnp.asarray(s))), atol=1e-4, rtol=1e-5
        )
        np.testing.assert_allclose(np.asarray(logits[b, real]), full_forward(model, s), atol=1e-4, rtol=1e-5)
    _, call_cache = call(model, *block, empty)
    jax.tree.map(functools.partial(np.testing.assert_allclose, atol=1e-6, rtol=0), cache, call_cache)
    assert int(cache.end[0]) == width and np.asarray(cache.segment_ids).sum() == sum(map(len, seqs))


def test_packed_row_equals_separate_rows():
    model = sharp_model(CFG)
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 128, 9), rng.integers(0, 128, 6)
    tokens = np.concatenate([a, b, [0]])[None]
    positions = np.concatenate([np.arange(9), np.arange(6), [0]])[None]
    segments = np.asarray([[1] * 9 + [2] * 6 + [0]])
    logits, _ = call(model, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments))
    np.testing.assert_allclose(np.asarray(logits[0, :9]), full_forward(model, a), atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(logits[0, 9:15]), full_forward(model, b), atol=1e-4, rtol=1e-5)


def test_sliding_window_limits_attention():
    cfg = dataclasses.replace(CFG, sliding_window=4)
    model = sharp_model(cfg)
    seq = np.random.default_rng(2).integers(0, 128, 12)
    windowed = full_forward(model, seq)
    # Window 4, two layers: the last token sees back 2 * (4 - 1) = 6 tokens, no further. RoPE is
    # relative, so those 7 tokens alone at positions 0..6 give the same logits; 6 tokens do not.
    np.testing.assert_allclose(windowed[-1], full_forward(model, seq[-7:])[-1], atol=1e-4, rtol=1e-5)
    assert np.abs(full_forward(model, seq[-6:])[-1] - windowed[-1]).max() > 1e-3
    model.cfg = CFG
    assert np.abs(full_forward(model, seq)[-1] - windowed[-1]).max() > 1e-3


def loss_and_grads(cfg):
    graphdef, params = nnx.split(decoder.create(cfg, seed=3))
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 128, (1, 10)))

    def loss(params):
        logits, _ = nnx.merge(graphdef, params)(tokens, jnp.arange(10)[None], jnp.ones((1, 10), jnp.int32))
        return jax.nn.logsumexp(logits, -1).mean() - logits[..., 0].mean()

    return jax.jit(jax.value_and_grad(loss))(params), str(jax.make_jaxpr(jax.grad(loss))(params))


@functools.cache
def reference_loss_and_grads():
    return loss_and_grads(dataclasses.replace(CFG, scan_layers=True, remat_policy="none"))


@pytest.mark.parametrize(
    "policy, scan_layers", [("full", True), ("save_dots", False), ("save_dots_no_batch", True), ("none", False)]
)
def test_remat_and_scan_keep_values_and_change_the_program(policy, scan_layers):
    (ref_loss, ref_grads), ref_jaxpr = reference_loss_and_grads()
    (loss, grads), jaxpr = loss_and_grads(dataclasses.replace(CFG, remat_policy=policy, scan_layers=scan_layers))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, atol=1e-6, rtol=1e-5)
    assert ("checkpoint" in jaxpr or "remat" in jaxpr) == (policy != "none")
    assert ("scan" in jaxpr) == scan_layers
    assert "scan" in ref_jaxpr and "checkpoint" not in ref_jaxpr and "remat" not in ref_jaxpr


def plain_attention(q, k, v, mask):
    """Attention as autodiff sees it without the custom VJP: einsums, mask, softmax."""
    B, T, H, D = q.shape
    K = k.shape[1]
    q = q.reshape(B, T, K, H // K, D).transpose(0, 2, 3, 1, 4)
    scores = jnp.einsum("bkgtd,bksd->bkgts", q, k) / np.sqrt(D)
    probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min), axis=-1)
    return jnp.einsum("bkgts,bksd->bkgtd", probs, v).transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)


def test_attention_vjp_equals_autodiff_of_the_plain_form():
    """Grouped queries, a packed row and right padding (queries with no key at all), and a cotangent
    on every query, padding included."""
    rng = np.random.default_rng(5)
    B, T, H, K, D = 2, 12, 4, 2, 8
    q = jnp.asarray(rng.normal(size=(B, T, H, D)) * 2, jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, K, T, D)) * 2, jnp.float32) for _ in range(2))
    segments = jnp.asarray([[1] * 5 + [2] * 4 + [0] * 3, [1] * T], jnp.int32)
    positions = jnp.asarray([list(range(5)) + list(range(4)) + [0] * 3, list(range(T))], jnp.int32)
    mask = attention.attention_mask(segments, positions, segments, positions, None)
    weights = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)
    grad = lambda attend: jax.jit(
        jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v, mask) * weights), argnums=(0, 1, 2))
    )(q, k, v)
    np.testing.assert_allclose(attention.attention(q, k, v, mask), plain_attention(q, k, v, mask), rtol=1e-6, atol=1e-6)
    for g, r in zip(grad(attention.attention), grad(plain_attention)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_dense_equals_the_einsum_and_its_gradients():
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(2, 3, 4, 5)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 5, 6)), jnp.float32)
    dense = lambda x, w: jnp.sum(decoder._dense(x, w, n_in=2) ** 2)
    plain = lambda x, w: jnp.sum(jnp.einsum("btij,ijo->bto", x, w) ** 2)
    np.testing.assert_allclose(jax.grad(dense)(x, w), jax.grad(plain)(x, w), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(dense, argnums=1)(x, w), jax.grad(plain, argnums=1)(x, w), rtol=1e-5)


@pytest.mark.parametrize("matmuls", [False, True], ids=["multiply_and_sum", "matmuls"])
def test_decode_step_attention_matches_numpy(matmuls):
    """A decode step's attention over a transposed key cache, either route of `cached_attention`,
    equals softmax(q k^T / sqrt(D)) v over each row's unmasked columns, grouped-query heads shared."""
    rng = np.random.default_rng(0)
    B, K, G, D, S = 3, 2, 3, 8, 11
    q = rng.normal(size=(B, 1, K * G, D)).astype(np.float32)
    k, v = (rng.normal(size=(B, K, S, D)).astype(np.float32) for _ in range(2))
    mask = rng.random((B, 1, S)) < 0.6
    mask[:, 0, 0] = True  # every row attends somewhere
    out = attention.cached_attention(
        jnp.asarray(q), jnp.asarray(k).swapaxes(2, 3), jnp.asarray(v), jnp.asarray(mask), matmuls=matmuls
    )
    expected = np.zeros((B, 1, K * G, D), np.float32)
    for b in range(B):
        for h in range(K * G):
            kv = h // G
            scores = k[b, kv] @ q[b, 0, h] / np.sqrt(D)
            scores = np.where(mask[b, 0], scores, -np.inf)
            p = np.exp(scores - scores.max())
            expected[b, 0, h] = (p / p.sum()) @ v[b, kv]
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "scan_layers, remat_policy, arch",
    [(True, "full", {}), (False, "none", dict(sliding_window=5)), (True, "none", GEMMA3_ARCH)],
    ids=["plain", "window", "gemma3"],
)
def test_shared_prefix_hidden_states_equal_the_plain_ones_with_their_gradients(scan_layers, remat_policy, arch):
    """Groups of 3 rows share a prompt (computed once); values and parameter gradients of a loss
    over the completion columns equal hidden_states' (attention chunked, sliding window too, and
    Gemma 3's layers of two kinds)."""
    cfg = dataclasses.replace(CFG, scan_layers=scan_layers, remat_policy=remat_policy, attention_chunk_size=4, **arch)
    model = sharp_model(cfg)
    rng = np.random.default_rng(0)
    P, C, n = 8, 6, 3
    prompts = [rng.integers(1, 128, size) for size in (8, 3)]
    tokens, positions, segments = grpo_rows(rng, prompts, n, P, C, 128)
    weights = jnp.asarray(rng.normal(size=(len(tokens), P + C, cfg.emb_dim)).astype(np.float32)) * (
        segments[..., None] > 0
    )

    def loss(model, shared):
        hidden = (
            model.hidden_states_shared_prefix(tokens, positions, segments, P, n)
            if shared
            else model.hidden_states(tokens, positions, segments)
        )
        return jnp.sum(hidden[:, P - 1 :] * weights[:, P - 1 :]), hidden

    (value, hidden), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True), static_argnums=1)(model, True)
    (ref_value, ref_hidden), ref_grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True), static_argnums=1)(model, False)
    real = segments > 0
    np.testing.assert_allclose(np.asarray(hidden)[real], np.asarray(ref_hidden)[real], rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(value, ref_value, rtol=1e-4)
    for (path, g), (_, ref) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)):
        # Float32 rounding, amplified by the sharp weights, reaches 3e-5 of a gradient's largest entry.
        scale = np.abs(ref.get_value()).max()
        np.testing.assert_allclose(g.get_value(), ref.get_value(), rtol=0, atol=2e-4 * scale, err_msg=str(path))
