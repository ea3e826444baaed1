"""losses.token_stats: the logits a chunk of positions at a time, equal in value and gradient to the
whole-row computation and to NumPy, and without the [B, T, V] float32 logits in the compiled step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import small_model_config
from unitrain import losses, sharding
from unitrain.models import decoder

CFG = small_model_config(vocab_size=97)


def batch(rng, B=3, T=21):
    """Row 0 one sequence; row 1 three packed sequences then padding; row 2 all padding (masked)."""
    tokens = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    positions, segments = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    positions[0], segments[0] = np.arange(T), 1
    for seg, (start, n) in enumerate(((0, 7), (7, 5), (12, 6)), 1):
        positions[1, start : start + n], segments[1, start : start + n] = np.arange(n), seg
    targets = np.roll(tokens, -1, axis=1)
    weights = (segments > 0).astype(np.float32)
    weights[1, [6, 11, 17]] = 0  # the last token of each packed sequence predicts nothing
    return tuple(map(jnp.asarray, (tokens, positions, segments, targets, weights)))


def numpy_stats(logits, targets, temperature):
    x = np.asarray(logits, np.float64) / temperature
    log_z = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    logp = x - log_z[..., None]
    entropy = -(np.exp(logp) * logp).sum(-1)
    return np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0], log_z, entropy


@pytest.fixture(scope="module")
def model():
    return decoder.create(CFG, seed=3)


@pytest.mark.parametrize("chunk_size", [0, 1, 4, 7, 21, 64])
def test_values_equal_numpy_of_the_full_logits(model, chunk_size):
    tokens, positions, segments, targets, _ = batch(np.random.default_rng(0))
    hidden = model.hidden_states(tokens, positions, segments)
    got = jax.jit(lambda h: losses.token_stats(model.logits, h, targets, chunk_size, 0.7, with_entropy=True))(hidden)
    logits, _ = model(tokens, positions, segments)
    for ours, want in zip(got, numpy_stats(logits, targets, 0.7)):
        assert ours.shape == targets.shape and ours.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(ours), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 5, 8, 20])
def test_gradients_equal_the_whole_row(model, chunk_size):
    """A loss using every statistic: cross-entropy with z-loss, minus an entropy bonus, on masked and
    packed rows; its gradient with respect to every parameter, chunked and not."""
    tokens, positions, segments, targets, weights = batch(np.random.default_rng(1))
    graphdef, params = nnx.split(model)

    def loss(p, chunk):
        m = nnx.merge(graphdef, p)
        stats = losses.token_stats(
            m.logits, m.hidden_states(tokens, positions, segments), targets, chunk, 1.3, with_entropy=True
        )
        total, count, _ = losses.cross_entropy(stats, weights, z_loss_weight=1e-2)
        return (total - 0.1 * (stats.entropy * weights).sum()) / count

    whole = jax.jit(jax.value_and_grad(lambda p: loss(p, 0)))(params)
    chunked = jax.jit(jax.value_and_grad(lambda p: loss(p, chunk_size)))(params)
    np.testing.assert_allclose(float(chunked[0]), float(whole[0]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(chunked[1]), jax.tree.leaves(whole[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-4)


def test_the_compiled_gradient_holds_no_full_logits():
    """Vocabulary 16384, 16 rows of 128: full float32 logits are 128 MiB and the unchunked gradient
    needs two of them; with chunks of 16 positions (16 MiB of logits) the whole step needs less than
    one."""
    cfg = decoder.ModelConfig(
        vocab_size=16384,
        emb_dim=32,
        mlp_dim=64,
        num_decoder_layers=1,
        num_query_heads=2,
        num_kv_heads=2,
        head_dim=16,
        platform=sharding.target_platform(),
    )
    graphdef, params = nnx.split(nnx.eval_shape(lambda: decoder.create(cfg)))
    B, T = 16, 128
    ints = jax.ShapeDtypeStruct((B, T), jnp.int32)
    full_logits = B * T * cfg.vocab_size * 4

    def temp_bytes(chunk):
        def loss(p, tokens):
            m = nnx.merge(graphdef, p)
            positions = jnp.broadcast_to(jnp.arange(T), (B, T))
            hidden = m.hidden_states(tokens, positions, jnp.ones_like(tokens))
            return losses.cross_entropy(losses.token_stats(m.logits, hidden, tokens, chunk), jnp.ones((B, T)))[0]

        compiled = jax.jit(jax.grad(loss)).lower(params, ints).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp_bytes(0) > 2 * full_logits
    assert temp_bytes(16) < full_logits / 2
