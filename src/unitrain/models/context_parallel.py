"""Context parallelism: the decoder's forward over rows whose sequence is split along the `context`
mesh axis (the `length` rule), and its attention there.

Every activation [B, T, ...] holds T / c positions a device. The queries stay where they are; the
keys and values reach them by `context_parallel_strategy`:

- all_gather: each layer gathers the axis' keys and values whole (the gradient goes back by a
  reduce-scatter), and attention.py's reference attention runs over them, its queries in chunks,
  or the splash kernel (TPU) over them put back in the columns' order;
- ring: the keys and values go around the axis a block at a time (ppermute), each device folding a
  block into its queries' softmax online (FlashAttention's running maximum and sum) while the next
  block is on its way, so no device holds them whole. The backward goes around the ring again, each
  block's key and value gradients travelling with it until they are home.

The masks come from segment ids and positions, which travel with the keys, so packed rows, padding
and any order of the columns are right, and RoPE reads each column's own position. Load balancing
(`context_load_balance`) uses that: under a causal mask the late positions attend to many more keys
than the early ones, so the forward reorders the columns, device i holding chunks i and 2c-1-i of
the 2c chunks of a row, and restores the order of its final hidden states: the losses never see it.

The samplers' prefill takes the same forward (decoder.Decoder._split_prefill), its keys and values
restored to the columns' order with the hidden states, to fill the KV cache the decode steps read.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from unitrain import sharding
from unitrain.config import check
from unitrain.models.attention import (
    SPLASH_BLOCK,
    attention,
    attention_fns,
    attention_kernel,
    attention_mask,
    layer_kinds,
    masked_scores,
    softmax_grads,
    splash_rows,
)
from unitrain.registry import RL_MODES

log = logging.getLogger("unitrain")

AXIS = "context"
# auto: the ring where a device's share of a row has at least this many positions. On 8 CPU devices
# at 256 a device the ring's step took 1.09-1.16x the unsplit one's, the gather's 1.67x
# (docs/PERFORMANCE.md): the ring skips half of each block the mask hides, the gather a quarter.
# Below it, c - 1 transfers of tiny blocks cost more than one gather.
RING_FROM = 256


def shards(cfg) -> int:
    """How many devices the sequence is split over in the current mesh (1 outside one, or for a
    model built without rules)."""
    return sharding.sequence_shards() if cfg.logical_axis_rules else 1


def forward(cfg, run, x, positions, segment_ids, rope, routes):
    """run(x, positions, segment_ids, rope, routes, attend) -> hidden [B, T, E] (or any pytree of
    [B, T, ...] arrays: a prefill's keys and values beside it), the layer stack over the embeddings
    x given the attention of these columns, one per layer kind (attention.layer_kinds; `rope`: the
    positions RoPE reads); under context parallelism the columns padded to a whole number of chunks
    (padding is segment 0), load-balanced, and every output back in their order afterwards."""
    c = shards(cfg)
    if c == 1:
        return run(x, positions, segment_ids, rope, routes, attention_fns(cfg, segment_ids, positions))
    T = x.shape[1]
    chunks = 2 * c if cfg.context_load_balance else c
    pad = -T % (chunks * (SPLASH_BLOCK if kernel(cfg, c) == "splash" else 1))  # splash: whole blocks a chunk
    columns = [x, positions, segment_ids, rope] + ([] if routes is None else [routes])
    columns = [jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) for a in columns]
    if cfg.context_load_balance:
        columns = [balance(cfg, a, c) for a in columns]
    x, positions, segment_ids, rope, *rest = columns
    attend = tuple(sharded_attention_fn(kind, segment_ids, positions, c, T + pad) for kind in layer_kinds(cfg))
    out = run(x, positions, segment_ids, rope, rest[0] if rest else None, attend)
    if cfg.context_load_balance:
        out = jax.tree.map(lambda a: balance(cfg, a, c, inverse=True), out)
    return jax.tree.map(lambda a: a[:, :T], out)


def kernel(cfg, c: int) -> str:
    """The attention kernel of the decoder's ModelConfig `cfg` over c context devices."""
    return attention_kernel(cfg.attention, cfg.platform, cfg.dtype, c, cfg.context_parallel_strategy)


def strategy(choice: str, length: int, c: int, splash: bool = False) -> str:
    """The strategy of `choice` for rows of `length` columns over c devices: auto is one gather for
    the splash kernel (it needs the keys whole), else the ring where each device's share is at least
    RING_FROM positions, else one gather."""
    if choice != "auto":
        return choice
    chosen = "all_gather" if splash else "ring" if length // c >= RING_FROM else "all_gather"
    _log_choice(chosen, length, c)
    return chosen


@functools.cache
def _log_choice(chosen: str, length: int, c: int) -> None:
    log.info(
        "context_parallel_strategy auto: %s for rows of %d positions over %d devices (%d each; the ring from %d)",
        chosen,
        length,
        c,
        length // c,
        RING_FROM,
    )


def sharded_attention_fn(cfg, segment_ids, positions, c: int, length: int):
    """attend(q, k, v) over the context axis: q [B, T, H, D], k/v [B, K, T, D], all split along T."""
    rules = cfg.logical_axis_rules
    spec = lambda *axes: sharding.logical_to_spec(axes, rules)
    q_spec, kv_spec, rows = (
        spec("batch", "length", "heads", "kv"),
        spec("batch", "kv_heads", "length", "kv"),
        spec("batch", "length"),
    )
    window, chunk, splash = cfg.sliding_window, cfg.attention_chunk_size, kernel(cfg, c) == "splash"
    chosen = strategy(cfg.context_parallel_strategy, length, c, splash)  # not the ring with splash (attention_kernel)
    if splash:
        body = functools.partial(_gathered_splash, window=window, c=c, balanced=cfg.context_load_balance)
    elif chosen == "all_gather":
        body = functools.partial(_gathered, window=window, chunk=chunk, balanced=cfg.context_load_balance)
    else:
        body = functools.partial(_ring, window=window, chunk=chunk, c=c, balanced=cfg.context_load_balance)
    run = jax.shard_map(
        body,
        in_specs=(q_spec, kv_spec, kv_spec, rows, rows),
        out_specs=q_spec,
        check_vma=False,
    )
    return lambda q, k, v: run(q, k, v, segment_ids, positions)


def _gathered(q, k, v, segments, positions, window, chunk, balanced):
    """The queries over the row's keys gathered whole, their masks doing the causality. Balanced,
    a device's first chunk (i < c) sees none of the row's second half, the c chunks that are
    every device's second: it attends to the first halves alone (a quarter of the work spared)."""
    gather = lambda arrays: tuple(
        jax.lax.all_gather(a, AXIS, axis=ax, tiled=True) for a, ax in zip(arrays, _BLOCK_AXES)
    )
    attend = lambda q, seg, pos, keys: attention(
        q, keys[0], keys[1], attention_mask(seg, pos, *keys[2:], window), chunk
    )
    block = (k, v, segments, positions)
    if not balanced:
        return attend(q, segments, positions, gather(block))
    early, late = gather(_half(block, _BLOCK_AXES, 0)), gather(_half(block, _BLOCK_AXES, 1))
    whole = tuple(jnp.concatenate(pair, axis=ax) for pair, ax in zip(zip(early, late), _BLOCK_AXES))
    (q1, q2), (seg1, seg2), (pos1, pos2) = (jnp.split(a, 2, axis=1) for a in (q, segments, positions))
    return jnp.concatenate([attend(q1, seg1, pos1, early), attend(q2, seg2, pos2, whole)], axis=1)


def _gathered_splash(q, k, v, segments, positions, window, c, balanced):
    """splash_rows over the row's keys gathered whole, in the columns' order: the kernel reads
    causality from that order, its mask offset by where this device's queries sit in the row (a
    static kernel for each place on the axis, lax.switch running this device's). Balanced, device i
    holds chunks i and 2c-1-i, so the second halves arrive last chunk first and are turned back; a
    first chunk attends to the row's first half alone, as in _gathered."""
    del positions  # the columns' order is the positions' (splash_attention)
    place, axes = jax.lax.axis_index(AXIS), _BLOCK_AXES[:3]  # keys, values, segments
    gather = lambda arrays: [jax.lax.all_gather(a, AXIS, axis=ax, tiled=True) for a, ax in zip(arrays, axes)]

    def attend(q, q_segments, keys, offsets):
        kernels = [functools.partial(splash_rows, window=window, offset=o) for o in offsets]
        return jax.lax.switch(place, kernels, q, keys[0], keys[1], q_segments, keys[2])

    block, T = (k, v, segments), q.shape[1]
    if not balanced:
        return attend(q, segments, gather(block), [i * T for i in range(c)])
    early = gather(_half(block, axes, 0))
    late = [
        jnp.concatenate(jnp.split(a, c, axis=ax)[::-1], axis=ax) for a, ax in zip(gather(_half(block, axes, 1)), axes)
    ]
    whole = [jnp.concatenate(pair, axis=ax) for pair, ax in zip(zip(early, late), axes)]
    (q1, q2), (seg1, seg2) = (jnp.split(a, 2, axis=1) for a in (q, segments))
    first = attend(q1, seg1, early, [i * T // 2 for i in range(c)])
    second = attend(q2, seg2, whole, [(2 * c - 1 - i) * T // 2 for i in range(c)])
    return jnp.concatenate([first, second], axis=1)


# ---------------------------------------------------------------- the ring

# The query axis of each query-side array (queries, segments, positions; the running or final
# softmax figures and d_out, all [B, K, G, T, ...]) and the key axis of a block's arrays.
_QUERY_AXES = (3, 1, 1)
_BLOCK_AXES = (2, 2, 1, 1)


def _pass(block, c):
    """Each device's block to the next device of the axis."""
    return jax.lax.ppermute(block, AXIS, [(i, (i + 1) % c) for i in range(c)])


def _tied(arriving, done):
    """(arriving, done): the block in transit made available only with `done`, this step's
    attention, computed: otherwise, nothing else depending on the ring's transfers, XLA:TPU's scheduler runs
    all c - 1 of them back to back before the first block's attention (every block then held at
    once, as a gather would) and overlaps only the last with the attention. Tied, each transfer
    runs while one block's attention is computed (docs/PERFORMANCE.md)."""
    return jax.lax.optimization_barrier((arriving, done))


def _grouped(q, K):
    """q [B, T, H, D] -> [B, K, G, T, D], the reference's layout."""
    B, T, H, D = q.shape
    return q.reshape(B, T, K, H // K, D).transpose(0, 2, 3, 1, 4)


def _half(arrays, axes, which: int):
    """The first (0) or second (1) half of each array along its axis: a balanced device's chunk."""
    return tuple(jnp.split(a, 2, axis=ax)[which] for a, ax in zip(arrays, axes))


def _by_chunks(fn, size, queries, carry=None):
    """fn over `size` queries at a time: `queries` a tuple of (array, its query axis), the arrays
    padded to whole chunks and each chunk's slices handed to fn(carry, *slices) -> (carry, out),
    in a scan (recomputed in the backward: jax.checkpoint); returns (carry, outs [n, ...])."""
    T = queries[0][0].shape[queries[0][1]]
    size = size if 0 < size < T else T
    n = -(-T // size)

    def split(a, axis):
        a = jnp.pad(a, [(0, n * size - T if i == axis else 0) for i in range(a.ndim)])
        return jnp.moveaxis(a.reshape(*a.shape[:axis], n, size, *a.shape[axis + 1 :]), axis, 0)

    return jax.lax.scan(
        jax.checkpoint(lambda carry, xs: fn(carry, *xs)), carry, tuple(split(a, ax) for a, ax in queries)
    )


def _joined(outs, axis, T):
    """The scan's outputs [n, ..., size, ...] (query axis `axis` of a chunk) -> [..., T, ...]."""
    x = jnp.moveaxis(outs, 0, axis)
    return jax.lax.slice_in_dim(x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2 :]), 0, T, axis=axis)


def _fold(queries, state, block, window, chunk):
    """`state` (each query's running maximum, sum of exponentials and weighted sum of values) with
    the block's keys folded in: FlashAttention's online softmax, `chunk` queries at a time."""
    kb, vb, sb, pb = block

    def one(_, q, seg, pos, top, total, acc):
        scores = masked_scores(q, kb, attention_mask(seg, pos, sb, pb, window))
        new_top = jnp.maximum(top, jnp.max(scores, axis=-1))
        decay = jnp.exp(top - new_top)
        p = jnp.exp(scores - new_top[..., None])
        total = total * decay + jnp.sum(p, axis=-1)
        acc = acc * decay[..., None] + jnp.einsum("bkgts,bksd->bkgtd", p.astype(vb.dtype), vb).astype(jnp.float32)
        return None, (new_top, total, acc)

    _, outs = _by_chunks(one, chunk, tuple(zip(queries + state, _QUERY_AXES + (3, 3, 3))))
    return tuple(_joined(o, 3, queries[0].shape[3]) for o in outs)


def _grads(queries, block, window, chunk):
    """(d_q, d_k, d_v), float32, of the block's part of the attention: attention.softmax_grads,
    `chunk` queries at a time; queries: (q, segments, positions, top, log_sum, row, live, d_out)."""
    kb, vb, sb, pb = block

    def one(d_kv, q, seg, pos, top, log_sum, row, live, d_out):
        mask = attention_mask(seg, pos, sb, pb, window)
        d_q, d_k, d_v = softmax_grads(q, kb, vb, mask, top[..., None], log_sum[..., None], row[..., None], live, d_out)
        return (d_kv[0] + d_k.astype(jnp.float32), d_kv[1] + d_v.astype(jnp.float32)), d_q.astype(jnp.float32)

    zeros = (jnp.zeros(kb.shape, jnp.float32), jnp.zeros(vb.shape, jnp.float32))
    (d_k, d_v), d_qs = _by_chunks(one, chunk, tuple(zip(queries, _QUERY_AXES + (3,) * 5)), zeros)
    return _joined(d_qs, 3, queries[0].shape[3]), d_k, d_v


def _from_earlier(step: int, c: int):
    """Whether the block at ring `step` comes from an earlier device of the axis: j = i - step < i."""
    i = jax.lax.axis_index(AXIS)
    return (i - step) % c < i


def _placed(part, which: int, axis: int):
    """`part` as the first (0) or second (1) half of an array twice its size along `axis`, zeros in the other."""
    zeros = jnp.zeros_like(part)
    return jnp.concatenate([part, zeros] if which == 0 else [zeros, part], axis=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _ring(q, k, v, segments, positions, window, chunk, c, balanced):
    return _ring_fwd(q, k, v, segments, positions, window, chunk, c, balanced)[0]


def _ring_fwd(q, k, v, segments, positions, window, chunk, c, balanced):
    """The c blocks folded into each query's softmax as they come round, each only as far as the
    causal mask lets the queries see it: a column never attends a later one, so the block from
    device j = i - step (step > 0) is, in row order (a chunk a device), wholly seen where j < i and
    not at all where j > i; balanced (device i: chunks i and 2c-1-i), where j < i all queries see
    its first chunk alone, where j > i only the queries' second chunk sees it, whole. Half the
    block's work either way. Kept for the backward: the output and the softmax's top and log-sum."""
    B, T, H, D = q.shape
    qg = _grouped(q, k.shape[1])
    queries = (qg, segments, positions)
    state = (
        jnp.full(qg.shape[:-1], jnp.finfo(jnp.float32).min),
        jnp.zeros(qg.shape[:-1], jnp.float32),
        jnp.zeros(qg.shape, jnp.float32),
    )
    block = (k, v, segments, positions)
    for step in range(c):
        arriving = _pass(block, c) if step < c - 1 else None
        whole = functools.partial(_fold, queries, block=block, window=window, chunk=chunk)
        if step == 0:
            state = whole(state)
        elif not balanced:
            state = jax.lax.cond(_from_earlier(step, c), whole, lambda s: s, state)
        else:

            def earlier(s, b=block):
                return _fold(queries, s, _half(b, _BLOCK_AXES, 0), window, chunk)

            def later(s, b=block):
                first, second = _half(s, (3, 3, 3), 0), _half(s, (3, 3, 3), 1)
                second = _fold(_half(queries, _QUERY_AXES, 1), second, b, window, chunk)
                return tuple(jnp.concatenate(h, axis=3) for h in zip(first, second))

            state = jax.lax.cond(_from_earlier(step, c), earlier, later, state)
        if arriving is not None:
            arriving, state = _tied(arriving, state)
        block = arriving
    top, total, acc = state
    out = (acc / total[..., None]).astype(q.dtype)
    log_sum = jnp.log(total)
    result = out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)
    return result, (qg, k, v, segments, positions, out, top, log_sum)


def _ring_bwd(window, chunk, c, balanced, residuals, d_out):
    """attention.softmax_grads of each block as it comes round, of what the forward folded in, the
    block's key and value gradients passed on with it: after c passes they are back on the device
    that holds those keys."""
    qg, k, v, segments, positions, out, top, log_sum = residuals
    B, T, H, D = d_out.shape
    d_out = _grouped(d_out, k.shape[1])
    row = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    live = top > jnp.finfo(jnp.float32).min  # a query with no key at all (padding) has no gradient
    queries = (qg, segments, positions, top, log_sum, row, live, d_out)
    d_q = jnp.zeros(qg.shape, jnp.float32)
    keys, d_kv = (k, v, segments, positions), (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    for step in range(c):
        # The keys go on while this block's gradients are computed; the gradients follow them.
        arriving = _pass(keys, c) if step < c - 1 else None
        whole = functools.partial(_grads, queries, keys, window, chunk)
        if step == 0:
            grads = whole()
        elif not balanced:
            nothing = lambda: (jnp.zeros(qg.shape, jnp.float32), *(jnp.zeros_like(a) for a in d_kv))
            grads = jax.lax.cond(_from_earlier(step, c), whole, nothing)
        else:

            def earlier(b=keys):
                d_q, d_k, d_v = _grads(queries, _half(b, _BLOCK_AXES, 0), window, chunk)
                return d_q, _placed(d_k, 0, 2), _placed(d_v, 0, 2)

            def later(b=keys):
                d_q, d_k, d_v = _grads(_half(queries, _QUERY_AXES + (3,) * 5, 1), b, window, chunk)
                return _placed(d_q, 1, 3), d_k, d_v

            grads = jax.lax.cond(_from_earlier(step, c), earlier, later)
        d_q = d_q + grads[0]
        d_kv = _pass((d_kv[0] + grads[1], d_kv[1] + grads[2]), c)
        if arriving is not None:
            keys, d_q = _tied(arriving, d_q)
    d_k, d_v = d_kv
    d_q = d_q.astype(qg.dtype).transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)
    return d_q, d_k.astype(k.dtype), d_v.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


# ---------------------------------------------------------------- load balancing


def balance(cfg, x, c: int, inverse: bool = False):
    """x [B, T, ...] split along T over the context axis, its 2c chunks of columns in row order
    (device j: chunks 2j and 2j+1) -> device i holding chunks i and 2c-1-i; `inverse` back. Each
    device sends one even and one odd chunk and receives one of each: two ppermutes."""
    spec = sharding.logical_to_spec(("batch", "length") + (None,) * (x.ndim - 2), cfg.logical_axis_rules)
    move = _restore if inverse else _reorder
    return jax.shard_map(functools.partial(move, c=c), in_specs=spec, out_specs=spec, check_vma=False)(x)


def _halves(x):
    s = x.shape[1] // 2
    return x[:, :s], x[:, s:]


def _reorder(x, c):
    # Device j's chunk 2j + r (r = 0, 1) goes to device 2j + r when that is below c (its first
    # slot), else to device 2c-1-(2j+r) (its second).
    to = lambda k: k if k < c else 2 * c - 1 - k
    even, odd = (jax.lax.ppermute(h, AXIS, [(j, to(2 * j + r)) for j in range(c)]) for r, h in enumerate(_halves(x)))
    # Device i's first chunk, i, has i's parity; its second, 2c-1-i, the other.
    first_even = jax.lax.axis_index(AXIS) % 2 == 0
    return jnp.where(first_even, jnp.concatenate([even, odd], 1), jnp.concatenate([odd, even], 1))


def _restore(x, c):
    # Device i holds chunks i and 2c-1-i: the even one goes to device (its index) // 2 as that
    # device's first chunk, the odd one as its second.
    first, second = _halves(x)
    first_even = jax.lax.axis_index(AXIS) % 2 == 0
    even, odd = jnp.where(first_even, first, second), jnp.where(first_even, second, first)
    home = lambda i, r: (i if (i % 2 == r) else 2 * c - 1 - i) // 2
    even, odd = (jax.lax.ppermute(h, AXIS, [(i, home(i, r)) for i in range(c)]) for r, h in enumerate((even, odd)))
    return jnp.concatenate([even, odd], 1)


# ---------------------------------------------------------------- checks


def _devices(c) -> int | None:
    """The context devices the config asks for; None where a size fills the mesh (-1), known only on
    the devices (each device's share is then checked where it is traced: the model pads)."""
    ici, dcn = c["ici_context_parallelism"], c["dcn_context_parallelism"]
    return None if -1 in (ici, dcn) else ici * dcn


@check("ici_context_parallelism", "dcn_context_parallelism", "logical_axis_rules", "model_source", "moe_routing_replay")
def _split(c) -> str | None:
    """The `length` rule is what splits the sequence, and our decoder is what attends across it."""
    if _devices(c) == 1:
        return None
    length = dict((r[0], r[1]) for r in c["logical_axis_rules"] if isinstance(r, list) and len(r) == 2).get("length")
    if length != AXIS:
        return f"context parallelism splits the sequence by the `length` rule: logical_axis_rules needs [length, context], not [length, {length}]"
    if c["model_source"] != "unitrain":
        return (
            f"context parallelism is our decoder's attention: it needs model_source unitrain, not {c['model_source']}"
        )
    if c["moe_routing_replay"]:
        return "moe_routing_replay is not supported with context parallelism yet (its routes are read in the columns' order): set it false or the context sizes to 1"
    return None


@check(
    "ici_context_parallelism",
    "dcn_context_parallelism",
    "context_load_balance",
    "max_target_length",
    "attention_chunk_size",
    "logits_chunk_size",
    "mode",
)
def _divides(c) -> str | None:
    """Rows of max_target_length columns (the modes but grpo and ppo, whose rows are bucketed
    prompts and completions) split into whole chunks: c, or 2c with load balancing, and each
    device's share into whole attention and LM-head chunks where those are smaller."""
    n = _devices(c)
    if n in (None, 1) or c["mode"] in RL_MODES:
        return None
    T, parts = c["max_target_length"], 2 * n if c["context_load_balance"] else n
    if T % parts:
        times = " x 2 (context_load_balance: a chunk from each end of the row)" if c["context_load_balance"] else ""
        return f"max_target_length ({T}) must be a multiple of the {n} context devices{times}: {parts}"
    share = T // n
    for key in ("attention_chunk_size", "logits_chunk_size"):
        if 0 < c[key] < share and share % c[key]:
            return f"{key} ({c[key]}) must divide each context device's {share} of max_target_length's {T} positions"
    return None


CONFIG_CHECKS = (_split, _divides)
