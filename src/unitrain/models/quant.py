"""Weight quantisation with qwix, in one place for its two users: QLoRA's frozen base (lora.py: int8
or nf4 in blocks of inputs) and the sampler's weight-only decode weights (`rollout_quantization`:
our decoder's `decode_weights`, int8 or fp8 with one scale per output channel).

A quantised weight is a qwix QArray (int8 codes, fp8 values or 4-bit codes, and their scales);
`matmul` and `einsum` take one where a weight may be one, by qwix's own ops: with activations in
floating point qwix dequantises the weight and multiplies in floating point (XLA fuses the two where
it can), so the quantised model's outputs are those of its dequantised weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import qwix

QTYPES = {"int8": "int8", "nf4": "nf4", "fp8": "float8_e4m3fn"}  # our names -> qwix's qtypes
FOUR_BIT = {"nf4": jnp.uint4}  # the code dtype qwix gives a 4-bit qtype


def quantise(w: jax.Array, in_axes: tuple[int, ...], qtype: str, block: int = 0) -> qwix.QArray:
    """`w` as a QArray of `qtype` (a key of QTYPES), symmetric, its scales in w's dtype. With `block`:
    one scale per block of `block` along the last input axis (the whole axis when `block` does not
    divide it) and per index of every other axis (QLoRA's blocks). Without: one scale per output
    channel, every input axis reduced (weight-only per-channel quantisation)."""
    if block:
        last_in = in_axes[-1]
        channelwise = [ax for ax in range(w.ndim) if ax != last_in]
        tiles = {last_in: block} if w.shape[last_in] % block == 0 else {}
    else:
        channelwise, tiles = [ax for ax in range(w.ndim) if ax not in in_axes], {}
    q = qwix.quantize(w, QTYPES[qtype], channelwise_axes=channelwise, tiled_axes=tiles, scale_dtype=w.dtype)
    # 4-bit codes are held one per byte: JAX's CPU runtime hands packed 4-bit arrays to compiled
    # programs in a layout they refuse.
    return q.replace(qvalue=q.qvalue.astype(jnp.uint8)) if qtype in FOUR_BIT else q


def dequantise(q: qwix.QArray) -> jax.Array:
    if q.qtype in FOUR_BIT:
        q = q.replace(qvalue=q.qvalue.astype(FOUR_BIT[q.qtype]))
    return qwix.dequantize(q)


def matmul(x: jax.Array, w) -> jax.Array:
    """x @ w for a weight that may be a QArray (qwix's dot)."""
    return qwix.dot(x, w) if isinstance(w, qwix.QArray) else x @ w


def einsum(spec: str, x: jax.Array, w) -> jax.Array:
    """jnp.einsum(spec, x, w) for a weight that may be a QArray (qwix's einsum)."""
    return qwix.einsum(spec, x, w) if isinstance(w, qwix.QArray) else jnp.einsum(spec, x, w)
