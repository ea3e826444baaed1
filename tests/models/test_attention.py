"""The `attention` key: the kernels equal the reference einsums (packed segments, padding, sliding
windows, GQA) where they have a CPU path, the platform rules, and the KV cache under a window."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import small_model_config
from unitrain import sharding
from unitrain.checks import load_checked
from unitrain.errors import ConfigError
from unitrain.models import attention, decoder
from unitrain.run import device_layout

B, T, H, K, D = 2, 100, 4, 2, 16  # T not a multiple of the splash block: the kernel pads it


def packed_inputs(seed=0):
    """q/k/v and one row of three packed sequences and padding, one row of one sequence."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, H, D)) * 2, jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, K, T, D)) * 2, jnp.float32) for _ in range(2))
    lengths = ([40, 35, 15], [T])
    segments = np.zeros((B, T), np.int32)
    positions = np.zeros((B, T), np.int32)
    for b, row in enumerate(lengths):
        start = 0
        for s, n in enumerate(row):
            segments[b, start : start + n], positions[b, start : start + n] = s + 1, np.arange(n)
            start += n
    return q, k, v, jnp.asarray(segments), jnp.asarray(positions)


def reference(q, k, v, segments, positions, window):
    mask = attention.attention_mask(segments, positions, segments, positions, window)
    return attention.attention(q, k, v, mask)


def loss_and_grads(attend, q, k, v):
    """A loss over the real (nonzero-segment) queries, its value and gradients in q, k, v."""
    weights = jnp.asarray(np.random.default_rng(9).normal(size=(B, T, H, D)), jnp.float32)
    real = (packed_inputs()[3] > 0)[:, :, None, None]
    return jax.jit(
        jax.value_and_grad(lambda q, k, v: jnp.sum(jnp.where(real, attend(q, k, v) * weights, 0)), argnums=(0, 1, 2))
    )(q, k, v)


def assert_same_on_real_tokens(out, expected, segments):
    real = np.asarray(segments) > 0
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(expected)[real], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 7])
def test_dot_product_attention_equals_reference(window):
    """The cudnn choice's code path (jax.nn.dot_product_attention) on its CPU implementation."""
    q, k, v, segments, positions = packed_inputs()
    mask = attention.attention_mask(segments, positions, segments, positions, window)
    fused = functools.partial(attention.dot_product_attention, mask=mask, implementation="xla")
    expected = functools.partial(attention.attention, mask=mask)
    assert_same_on_real_tokens(fused(q, k, v), expected(q, k, v), segments)
    (value, grads), (ref_value, ref_grads) = loss_and_grads(fused, q, k, v), loss_and_grads(expected, q, k, v)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 7])
def test_splash_attention_equals_reference(window):
    """The splash kernel in Pallas' interpreter: values and gradients on the real tokens."""
    q, k, v, segments, positions = packed_inputs()
    splash = functools.partial(attention.splash_attention, segment_ids=segments, window=window, interpret=True)
    expected = lambda q, k, v: reference(q, k, v, segments, positions, window)
    assert_same_on_real_tokens(jax.jit(splash)(q, k, v), expected(q, k, v), segments)
    (value, grads), (ref_value, ref_grads) = loss_and_grads(splash, q, k, v), loss_and_grads(expected, q, k, v)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 7])
def test_splash_attention_after_a_shared_prefix_equals_reference(window):
    """Queries whose keys are a left-padded prefix of 30 columns and then their own (GRPO's
    completions after their group's prompt): the causal offset, both paddings, the window."""
    q, k_own, v_own, segments, _ = packed_inputs()
    segments = jnp.asarray([[1] * 60 + [0] * (T - 60), [1] * T], jnp.int32)  # completions, padded
    P, real_p = 30, 24
    rng = np.random.default_rng(4)
    k_p, v_p = (jnp.asarray(rng.normal(size=(B, K, P, D)) * 2, jnp.float32) for _ in range(2))
    seg_p = jnp.asarray([[0] * (P - real_p) + [1] * real_p] * B, jnp.int32)
    pos_p = jnp.maximum(jnp.arange(P) - (P - real_p), 0)[None].repeat(B, 0)
    keys = lambda own, prefix: jnp.concatenate([prefix, own], axis=2)
    seg_k, pos_q = jnp.concatenate([seg_p, segments], 1), real_p + jnp.arange(T)[None].repeat(B, 0)
    mask = attention.attention_mask(segments, pos_q, seg_k, jnp.concatenate([pos_p, pos_q], 1), window)
    splash = lambda q, k, v: attention.splash_attention(
        q, keys(k, k_p), keys(v, v_p), segments, window, interpret=True, key_segment_ids=seg_k
    )
    expected = lambda q, k, v: attention.attention(q, keys(k, k_p), keys(v, v_p), mask)
    assert_same_on_real_tokens(jax.jit(splash)(q, k_own, v_own), expected(q, k_own, v_own), segments)
    weights = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32) * (segments > 0)[:, :, None, None]
    grads = lambda attend: jax.jit(jax.grad(lambda *a: jnp.sum(attend(*a) * weights), argnums=(0, 1, 2)))(
        q, k_own, v_own
    )
    for g, r in zip(grads(splash), grads(expected)):
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4)


CFG = small_model_config(sliding_window=5)


def use_kernel_on_cpu(monkeypatch, model, kernel):
    """`model` set to `kernel`, which then runs on its CPU path (Pallas' interpreter, XLA's)."""
    monkeypatch.setattr(attention, "attention_kernel", lambda *_: kernel)
    monkeypatch.setattr(attention, "splash_attention", functools.partial(attention.splash_attention, interpret=True))
    fused = attention.dot_product_attention
    monkeypatch.setattr(
        attention, "dot_product_attention", lambda q, k, v, mask, implementation: fused(q, k, v, mask, "xla")
    )
    model.cfg = dataclasses.replace(CFG, attention=kernel)


@pytest.mark.parametrize("kernel", ["splash", "cudnn"])
def test_model_with_a_kernel_equals_the_reference(monkeypatch, kernel):
    """The decoder's plumbing of each kernel (layouts, segment ids, window), run on its CPU path."""
    model = decoder.create(CFG, 0)
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, 64, (2, 12)), jnp.int32)
    segments = jnp.asarray([[1] * 7 + [2] * 4 + [0], [1] * 12], jnp.int32)
    positions = jnp.asarray([list(range(7)) + list(range(4)) + [0], list(range(12))], jnp.int32)
    expected = model(tokens, positions, segments)[0]
    use_kernel_on_cpu(monkeypatch, model, kernel)
    assert_same_on_real_tokens(model(tokens, positions, segments)[0], expected, segments)


@pytest.mark.parametrize("kernel", ["splash", "cudnn"])
def test_shared_prefix_with_a_kernel_equals_the_reference(monkeypatch, kernel):
    """hidden_states_shared_prefix's plumbing of each kernel: 2 groups of 2 rows sharing a left-padded
    prompt, then their own completions, against hidden_states by the reference."""
    model = decoder.create(CFG, 0)
    rng = np.random.default_rng(2)
    P, C = 6, 5
    tokens, positions, segments = (np.zeros((4, P + C), np.int32) for _ in range(3))
    for r, (prompt_len, completion_len) in enumerate([(6, 5), (6, 2), (3, 4), (3, 5)]):
        if r % 2 == 0:
            prompt = rng.integers(1, 64, prompt_len)
        start, end = P - prompt_len, P + completion_len
        tokens[r, start:end] = np.concatenate([prompt, rng.integers(1, 64, completion_len)])
        positions[r, start:end], segments[r, start:end] = np.arange(end - start), 1
    expected = model.hidden_states(tokens, positions, segments)
    use_kernel_on_cpu(monkeypatch, model, kernel)
    got = model.hidden_states_shared_prefix(tokens, positions, segments, P, 2)
    assert_same_on_real_tokens(got, expected, segments)


def test_kernel_choice_by_platform():
    pick = attention.attention_kernel
    assert pick("auto", "cpu", "float32") == "xla" and pick("auto", "tpu", "float32") == "splash"
    assert pick("auto", "gpu", "bfloat16") == "cudnn" and pick("auto", "gpu", "float32") == "xla"
    assert pick("xla", "tpu", "bfloat16") == "xla" and pick("cudnn", "gpu", "bfloat16") == "cudnn"
    for choice, platform, dtype in [
        ("cudnn", "cpu", "bfloat16"),
        ("splash", "gpu", "bfloat16"),
        ("cudnn", "gpu", "float32"),
    ]:
        with pytest.raises(ValueError, match=f"attention={choice}"):
            pick(choice, platform, dtype)


def test_the_default_is_the_platforms_fused_kernel():
    """As MaxText picks its kernel by platform: a TPU run of base.yml gets splash, a bf16 GPU run cuDNN."""
    cfg = load_checked(["configs/base.yml"])
    assert attention.attention_kernel(cfg.attention, "tpu", cfg.dtype) == "splash"
    assert attention.attention_kernel(cfg.attention, "gpu", "bfloat16") == "cudnn"
    assert attention.attention_kernel(cfg.attention, "cpu", cfg.dtype) == "xla"


@pytest.mark.parametrize(
    "value, message",
    [
        ("cudnn", "attention=cudnn runs on a GPU, and this platform is cpu; use xla or auto"),
        ("splash", "attention=splash runs on a TPU, and this platform is cpu; use xla or auto"),
        ("flash", "config key 'attention' expects one of auto | xla | cudnn | splash"),
    ],
)
def test_an_unsupported_choice_is_one_config_line(value, message):
    with pytest.raises(ConfigError) as e:
        device_layout(load_checked(["configs/base.yml", f"attention={value}"]))  # the platform's check: devices
    assert message in str(e.value) and "\n" not in str(e.value)


def test_cache_decode_under_a_sliding_window_equals_full_forward():
    """Left-padded prefill, then one token per call: the window is measured in positions, so the
    padding columns the cache holds do not count."""
    model = decoder.create(CFG, 2)
    rng = np.random.default_rng(3)
    lens, prefill, steps = (9, 3), 9, 6
    seqs = [rng.integers(1, 64, n + steps) for n in lens]
    tokens, positions, segments = (np.zeros((2, prefill), np.int32) for _ in range(3))
    for b, n in enumerate(lens):
        tokens[b, prefill - n :], positions[b, prefill - n :], segments[b, prefill - n :] = seqs[b][:n], np.arange(n), 1
    call = jax.jit(lambda *a: model(*a))
    logits, cache = call(tokens, positions, segments, model.init_cache(2, prefill + steps))
    got = [[np.asarray(logits[b, -1])] for b in range(2)]
    for i in range(steps - 1):
        pos = np.asarray(lens) + i
        tok = np.asarray([seqs[b][p] for b, p in enumerate(pos)])
        logits, cache = call(tok[:, None], pos[:, None], np.ones((2, 1), np.int32), cache)
        for b in range(2):
            got[b].append(np.asarray(logits[b, 0]))
    for b, n in enumerate(lens):
        full = np.asarray(
            model(
                jnp.asarray(seqs[b][None, :-1]),
                jnp.arange(n + steps - 1)[None],
                jnp.ones((1, n + steps - 1), jnp.int32),
            )[0][0]
        )
        np.testing.assert_allclose(np.stack(got[b]), full[n - 1 :], atol=1e-4, rtol=1e-5)


def test_splash_attention_under_a_mesh_runs_per_shard():
    """Batch over data x fsdp, heads over tensor (shard_map): the same values as the reference."""
    mesh = sharding.create_mesh({"data": 2, "fsdp": 2, "tensor": 2}, {"data": 1, "fsdp": 1, "tensor": 1})
    rules = sharding.rules_from_config(sharding.DEFAULT_RULES)
    q, k, v, segments, positions = (jnp.concatenate([a, a]) for a in packed_inputs())
    splash = jax.jit(functools.partial(attention.splash_attention, window=7, rules=rules, interpret=True))
    with jax.set_mesh(mesh):
        out = splash(q, k, v, segments)
    assert_same_on_real_tokens(out, reference(q, k, v, segments, positions, 7), segments)


@pytest.mark.parametrize("causal_columns", [False, True])
@pytest.mark.parametrize("chunk, window", [(16, None), (37, 7), (99, None)])
def test_query_chunks_equal_whole_rows(chunk, window, causal_columns):
    """attention_chunk_size: chunks that divide T or not (padding queries), packed rows, a window,
    all keys or the causal prefix; values and the gradients in q, k, v against the whole rows."""
    q, k, v, segments, positions = packed_inputs()
    mask = attention.attention_mask(segments, positions, segments, positions, window)
    chunked = functools.partial(attention.attention, mask=mask, chunk_size=chunk, causal_columns=causal_columns)
    whole = functools.partial(attention.attention, mask=mask)
    assert_same_on_real_tokens(jax.jit(chunked)(q, k, v), whole(q, k, v), segments)
    (value, grads), (ref_value, ref_grads) = loss_and_grads(chunked, q, k, v), loss_and_grads(whole, q, k, v)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4)


def test_query_chunks_bound_the_backward_memory():
    """The compiled gradient holds one chunk's float32 scores, not the whole [T, S] ones."""
    n, heads = 1024, 4
    q = jax.ShapeDtypeStruct((1, n, heads, D), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, heads, n, D), jnp.float32)
    mask = jnp.tril(jnp.ones((n, n), bool))[None]

    def temp_bytes(chunk):
        loss = lambda q, k, v: jnp.sum(attention.attention(q, k, v, mask, chunk))
        return (
            jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes
        )

    whole, chunked = temp_bytes(0), temp_bytes(128)
    assert whole >= 2 * heads * n * n * 4 and chunked < whole / 4


def test_causal_chunks_skip_the_blocks_above_the_diagonal():
    """512 queries in chunks of 128, each reading only its causal prefix of keys: the compiler
    counts 1 + 2 + 3 + 4 of 16 key blocks' FLOPs against the whole rows'."""
    n, heads = 512, 4
    q = jax.ShapeDtypeStruct((1, n, heads, 64), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, heads, n, 64), jnp.float32)
    mask = jax.ShapeDtypeStruct((1, n, n), jnp.bool_)

    def flops(chunk):
        forward = lambda q, k, v, m: attention.attention(q, k, v, m, chunk, causal_columns=True)
        return jax.jit(forward).lower(q, kv, kv, mask).compile().cost_analysis()["flops"]

    np.testing.assert_allclose(flops(128) / flops(0), 10 / 16, rtol=0.02)


def test_the_backward_keeps_no_probabilities():
    """What the forward keeps for the backward (the VJP's residuals): the inputs, the output, the
    mask and per-query statistics; no float array of the [T, S] probabilities (recomputed instead)."""
    q, k, v, segments, positions = packed_inputs()
    mask = attention.attention_mask(segments, positions, segments, positions, None)
    _, backward = jax.vjp(functools.partial(attention.attention, mask=mask), q, k, v)
    kept = [x for x in jax.tree.leaves(backward) if jnp.issubdtype(x.dtype, jnp.floating)]
    T = q.shape[1]
    assert kept and all(x.size < q.size * T // q.shape[-1] for x in kept), [x.shape for x in kept]


def test_model_with_query_chunks_equals_whole_rows():
    """attention_chunk_size through the decoder: logits and parameter gradients of packed rows, and
    a cached prefill (the sampler's) followed by one decode step."""
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, 64, (2, 12)), jnp.int32)
    segments = jnp.asarray([[1] * 7 + [2] * 4 + [0], [1] * 12], jnp.int32)
    positions = jnp.asarray([list(range(7)) + list(range(4)) + [0], list(range(12))], jnp.int32)
    real = np.asarray(segments) > 0

    def run(chunk):
        model = decoder.create(dataclasses.replace(CFG, attention_chunk_size=chunk), 0)

        def loss(m):
            logits = m(tokens, positions, segments)[0]
            return jnp.sum(jnp.where(segments[..., None] > 0, logits, 0) ** 2), logits

        (_, logits), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
        call = nnx.jit(lambda m, *a: m(*a))
        prefill, cache = call(model, tokens, positions, segments, model.init_cache(2, 13))
        step, _ = call(model, tokens[:, :1], positions[:, -1:] + 1, jnp.ones((2, 1), jnp.int32), cache)
        graphdef, state = nnx.split(model)
        forward = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(tokens, positions, segments)[0])(state)
        return logits, grads, prefill, step, str(forward).count("dot_general")

    got, expected = run(5), run(0)
    assert got[4] > expected[4]  # the chunks are there
    assert_same_on_real_tokens(got[0], expected[0], segments)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4),
        nnx.to_pure_dict(got[1]),
        nnx.to_pure_dict(expected[1]),
    )
    np.testing.assert_allclose(np.asarray(got[2])[real], np.asarray(expected[2])[real], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(got[3], expected[3], atol=2e-5, rtol=2e-5)
