"""Context parallelism (models/context_parallel.py): the decoder's loss and gradients over rows split
on the `context` axis equal the unsplit ones for every axis size, both strategies, with and without
load balancing, on packed, padded and whole rows; the balanced order; the choice and the checks."""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import GEMMA3_ARCH, REPO
from unitrain import losses, sharding
from unitrain.checks import load_checked
from unitrain.errors import ConfigError
from unitrain.models import attention, context_parallel, decoder

B, T = 4, 48  # T: 2 chunks of 3 positions a device at 8 devices with load balancing
CFG = dict(
    vocab_size=64,
    emb_dim=32,
    mlp_dim=64,
    num_decoder_layers=2,
    num_query_heads=4,
    num_kv_heads=2,
    head_dim=8,
    platform="cpu",
    logical_axis_rules=sharding.DEFAULT_RULES,
    attention_chunk_size=4,  # a device's queries in chunks at every axis size: 24, 12 or 6 of them
)


def rows(T=T):
    """Whole, packed (three segments, one shorter than a chunk) and padded rows; positions restart
    with each segment."""
    rng = np.random.default_rng(0)
    segments = np.ones((B, T), np.int32)
    at = lambda column: column * T // 48  # the same places in longer rows
    segments[1, at(17) :] = 2
    segments[1, at(20) :] = 3
    segments[2, at(30) :] = 0
    segments[3, : at(5)] = 0  # left padding
    starts = np.diff(segments, axis=1, prepend=-1) != 0
    index = np.arange(T)[None].repeat(B, 0)
    positions = index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    tokens = rng.integers(1, 64, (B, T)).astype(np.int32)
    return tokens, positions.astype(np.int32), segments


def loss_and_grads(mesh, T=T, **cfg):
    """The mean next-token loss over the real tokens (the LM head 4 positions of a device's share at
    a time: losses.token_stats) and its gradients, on `mesh`."""
    model = decoder.create(decoder.ModelConfig(**{**CFG, **cfg}), 0)
    graphdef, state = nnx.split(model)

    def loss(state, tokens, positions, segments):
        model = nnx.merge(graphdef, state)
        stats = losses.token_stats(model.logits, model.hidden_states(tokens, positions, segments), tokens, 4)
        real = segments > 0
        return jnp.sum(jnp.where(real, stats.logprobs, 0)) / jnp.sum(real)

    data = sharding.batch_sharding(mesh, sharding.DEFAULT_RULES)
    with jax.set_mesh(mesh):
        value, grads = jax.jit(jax.value_and_grad(loss))(state, *(jax.device_put(a, data) for a in rows(T)))
    return float(value), jax.tree.map(np.asarray, grads)


@pytest.fixture(scope="module")
def unsplit():
    return loss_and_grads(sharding.create_mesh({"fsdp": 4, "tensor": 2}, {}))


# Every axis size with both strategies, every strategy and every size with and without load
# balancing (a pairwise cover of the three: six programs, not twelve).
CASES = [(2, "all_gather", True), (2, "ring", False), (4, "all_gather", False), (4, "ring", True)]
CASES += [(8, "all_gather", True), (8, "ring", False)]


@pytest.mark.parametrize("context,strategy,balance", CASES)
def test_split_rows_give_the_unsplit_loss_and_gradients(unsplit, context, strategy, balance):
    mesh = sharding.create_mesh({"fsdp": 8 // context, "context": context}, {})
    value, grads = loss_and_grads(mesh, context_parallel_strategy=strategy, context_load_balance=balance)
    # float32: the split attention sums its softmax in other orders (the ring block by block).
    assert value == pytest.approx(unsplit[0], rel=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(unsplit[1])):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("context,balance", [(2, True), (4, False)])
def test_splash_on_the_gathered_keys_gives_the_unsplit_loss_and_gradients(monkeypatch, context, balance):
    """attention=splash (Pallas' interpreter) under the split: each device's queries over the keys
    gathered in the columns' order (balanced: the second halves turned back), its kernels' causal
    masks offset by its place on the axis. Rows of 512 columns: four chunks of one splash block,
    every one holding real tokens."""
    small = dict(T=512, num_decoder_layers=1, num_query_heads=2, num_kv_heads=1, attention_chunk_size=0)
    want = loss_and_grads(sharding.create_mesh({"fsdp": 4, "tensor": 2}, {}), **small)
    monkeypatch.setattr(context_parallel, "kernel", lambda cfg, c: "splash")
    monkeypatch.setattr(context_parallel, "splash_rows", functools.partial(attention.splash_rows, interpret=True))
    mesh = sharding.create_mesh({"fsdp": 8 // context, "context": context}, {})
    value, grads = loss_and_grads(mesh, context_load_balance=balance, **small)
    assert value == pytest.approx(want[0], rel=1e-5)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


@pytest.fixture(scope="module")
def gemma3_unsplit():
    return loss_and_grads(sharding.create_mesh({"fsdp": 4, "tensor": 2}, {}), **GEMMA3_ARCH)


@pytest.mark.parametrize("context,strategy,balance", [(2, "ring", True), (4, "all_gather", False)])
def test_gemma3_split_rows_give_the_unsplit_loss_and_gradients(gemma3_unsplit, context, strategy, balance):
    want = gemma3_unsplit
    mesh = sharding.create_mesh({"fsdp": 8 // context, "context": context}, {})
    value, grads = loss_and_grads(mesh, context_parallel_strategy=strategy, context_load_balance=balance, **GEMMA3_ARCH)
    assert value == pytest.approx(want[0], rel=1e-5)
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_balanced_order_puts_both_ends_of_the_row_on_each_device():
    c = 4
    mesh = sharding.create_mesh({"fsdp": 2, "context": c}, {})
    cfg = decoder.ModelConfig(**CFG)
    x = np.arange(2 * 16, dtype=np.int32).reshape(2, 16)  # 8 chunks of 2 columns
    with jax.set_mesh(mesh):
        placed = jax.device_put(x, sharding.batch_sharding(mesh, sharding.DEFAULT_RULES))
        balanced = jax.jit(lambda a: context_parallel.balance(cfg, a, c))(placed)
        back = jax.jit(lambda a: context_parallel.balance(cfg, a, c, inverse=True))(balanced)
    np.testing.assert_array_equal(back, x)
    for shard in balanced.addressable_shards:
        i = shard.index[1].start // 4  # the device's place on the context axis
        columns = [2 * i, 2 * i + 1, 2 * (7 - i), 2 * (7 - i) + 1]  # chunks i and 7 - i
        np.testing.assert_array_equal(shard.data, x[shard.index[0]][:, columns])


def test_auto_strategy_by_each_devices_share_and_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="unitrain"):
        assert context_parallel.strategy("auto", 8 * 256, 8) == "ring"
        assert context_parallel.strategy("auto", 8 * 255, 8) == "all_gather"
        assert context_parallel.strategy("ring", 64, 8) == "ring"
    assert "auto: ring for rows of 2048 positions over 8 devices (256 each" in caplog.text


def config_error(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_checked([str(REPO / "configs" / "base.yml"), *overrides])
    return str(e.value)


def test_start_checks_name_the_keys():
    assert "max_target_length (60) must be a multiple of the 4 context devices x 2" in config_error(
        "ici_context_parallelism=4", "max_target_length=60"
    )
    assert "max_target_length (60) must be a multiple of the 8 context devices: 8" in config_error(
        "ici_context_parallelism=4", "dcn_context_parallelism=2", "context_load_balance=false", "max_target_length=60"
    )
    assert "attention_chunk_size (24) must divide each context device's 32" in config_error(
        "ici_context_parallelism=2", "max_target_length=64", "attention_chunk_size=24"
    )
    assert "logical_axis_rules needs [length, context], not [length, None]" in config_error(
        "ici_context_parallelism=2",
        "logical_axis_rules=[[batch, [data, fsdp]], [length, null], [embed, fsdp], [mlp, tensor], [heads, tensor],"
        " [kv_heads, tensor], [kv, null], [vocab, tensor], [layers, null], [expert, null], [norm, null],"
        " [activation_embed, null]]",
    )
    assert "needs model_source unitrain, not tunix" in config_error("ici_context_parallelism=2", "model_source=tunix")
    assert "context_parallel_strategy" in config_error("context_parallel_strategy=ulysses")


def test_splash_runs_gathered_and_cudnn_not_at_all_under_a_split():
    with pytest.raises(ValueError, match="attention=cudnn has no context-parallel form"):
        attention.attention_kernel("cudnn", "gpu", "bfloat16", context=2)
    with pytest.raises(ValueError, match="set context_parallel_strategy to all_gather or auto, not ring"):
        attention.attention_kernel("splash", "tpu", "bfloat16", context=2, strategy="ring")
    assert attention.attention_kernel("splash", "tpu", "bfloat16", context=2) == "splash"
    assert attention.attention_kernel("auto", "tpu", "bfloat16", context=2) == "splash"
    assert attention.attention_kernel("auto", "tpu", "bfloat16", context=2, strategy="ring") == "xla"
    assert attention.attention_kernel("auto", "gpu", "bfloat16", context=2) == "xla"
    assert context_parallel.strategy("auto", 8 * 256, 8, splash=True) == "all_gather"
    assert attention.attention_kernel("auto", "tpu", "bfloat16") == "splash"


@pytest.mark.parametrize("context,strategy,balance", [(2, "ring", True), (4, "all_gather", False)])
def test_split_prefill_fills_the_cache_as_the_unsplit_one(monkeypatch, context, strategy, balance):
    """A cached call of rows split on the context axis (the samplers' prefill) attends by the
    split attention and gives the unsplit call's hidden states and KV cache (every layer's keys and
    values, the columns' segments and positions, the next column), its cache split along the
    context axis as the decode steps read it."""
    from unitrain.engines.programs import sharded_cache

    split_calls = []
    traced = context_parallel.sharded_attention_fn
    monkeypatch.setattr(
        context_parallel,
        "sharded_attention_fn",
        lambda cfg, segments, positions, c, length: (
            split_calls.append((c, length)) or traced(cfg, segments, positions, c, length)
        ),
    )

    def prefill(mesh, **cfg):
        model = decoder.create(decoder.ModelConfig(**{**CFG, **cfg}), 0)
        graphdef, state = nnx.split(model)

        def call(state, tokens, positions, segments):
            model = nnx.merge(graphdef, state)
            rules = None if mesh is None else sharding.DEFAULT_RULES
            return model.hidden_states(tokens, positions, segments, sharded_cache(model, B, T + 8, rules))

        if mesh is None:
            return jax.jit(call)(state, *rows())
        data = sharding.batch_sharding(mesh, sharding.DEFAULT_RULES)
        with jax.set_mesh(mesh):
            return jax.jit(call)(state, *(jax.device_put(a, data) for a in rows()))

    want_hidden, want_cache = prefill(None)
    mesh = sharding.create_mesh({"fsdp": 8 // context, "context": context}, {})
    hidden, cache = prefill(mesh, context_parallel_strategy=strategy, context_load_balance=balance)
    assert split_calls == [(context, T)]
    # Padding columns attend to nothing (segment 0): their states are no one's, and no key reads them.
    real = np.pad(rows()[2] > 0, [(0, 0), (0, 8)])
    np.testing.assert_allclose(
        np.asarray(hidden)[real[:, :T]], np.asarray(want_hidden)[real[:, :T]], rtol=1e-5, atol=1e-5
    )
    for got, want in zip(cache.k + cache.v, want_cache.k + want_cache.v):
        by_column = lambda a: np.moveaxis(np.asarray(a), -1 if a.shape[-1] == T + 8 else 2, 1)[real]
        np.testing.assert_allclose(by_column(got), by_column(want), rtol=1e-5, atol=1e-6)
    for got, want in ((cache.segment_ids, want_cache.segment_ids), (cache.positions, want_cache.positions)):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(cache.end, T)
    decode_reads = sharding.logical_shardings(
        decoder.create(decoder.ModelConfig(**CFG)).cache_axes(), mesh, sharding.DEFAULT_RULES
    )
    for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(decode_reads)):
        assert got.sharding.is_equivalent_to(want, got.ndim), (got.sharding, want)
    assert cache.k[0].sharding.spec[3] == "context"
