"""Vocabulary extension: new tokens (e.g. the SID tokens of a recommender) in the tokenizer, and the
embedding and untied LM head grown to match.

    cfg = vocab.extend(cfg, tokenizer)     # run.build_run: adds `extra_tokens`, raises cfg.vocab_size if needed
    model = sources.build(cfg, mesh)        # the HF and Tunix loaders grow a smaller checkpoint (grown())

The model's vocabulary becomes the tokenizer's length rounded up to `vocab_pad_multiple` (so it
shards evenly), never smaller than the checkpoint's. The checkpoint's rows are kept as they are, so
the old tokens' logits do not change; each new row (embedding row, LM-head column) is drawn from a
normal with the per-dimension mean and std of the existing rows, so new tokens start where the
model's own tokens live. The extended tokenizer is saved in <run_dir>/tokenizer and, through
export.py, with export_hf_path.
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
from flax import nnx

from unitrain.errors import ConfigError, DataError
from unitrain.recsys.trie import read_sid_index

log = logging.getLogger("unitrain")


def read_tokens(path: str) -> list[str]:
    """The tokens of `path`: every SID token of a MiniOneRec index (.json), or one token a line."""
    if path.endswith(".json"):
        tokens = {t for sid in read_sid_index(path).values() for t in _split_sid(sid)}
    else:
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().split("\n")
        except OSError as e:
            raise DataError(f"extra_tokens {path!r}: {e.strerror}") from None
        for lineno, line in enumerate(lines, start=1):
            if line != line.strip():
                raise DataError(f"{path}:{lineno}: a token line may not start or end with whitespace ({line!r})")
        tokens = {line for line in lines if line}
    if not tokens:
        raise DataError(f"extra_tokens {path!r} holds no tokens")
    return sorted(tokens)  # sorted: the same ids in every run that adds the same tokens


def _split_sid(sid: str) -> list[str]:
    return [t + ">" for t in sid.split(">") if t]


def extend(cfg, tokenizer):
    """Adds cfg.extra_tokens to `tokenizer` (in place) and returns cfg with the vocabulary size the
    model needs; cfg unchanged without extra_tokens."""
    if not cfg.extra_tokens:
        return cfg
    try:
        added = tokenizer.add_tokens(read_tokens(cfg.extra_tokens))
    except NotImplementedError as e:
        raise ConfigError(f"extra_tokens: {e}") from None
    multiple = cfg.vocab_pad_multiple
    size = -(-tokenizer.vocab_size // multiple) * multiple
    log.info(
        "extra_tokens: %d new tokens, tokenizer %d, model vocabulary %d",
        added,
        tokenizer.vocab_size,
        max(size, cfg.vocab_size),
    )
    return cfg.replace(vocab_size=size) if size > cfg.vocab_size else cfg


def save_tokenizer(cfg, tokenizer) -> None:
    """The extended tokenizer beside the run's checkpoints (process 0), as AutoTokenizer loads it."""
    if cfg.extra_tokens and jax.process_index() == 0:
        tokenizer.save(os.path.join(cfg.run_dir, "tokenizer"))


def grown(model, graphdef, targets: dict, seed: int = 0):
    """The wider model (`graphdef`) from `model`'s arrays: each array narrower than its target
    (targets: the pure dict of (abstract array, sharding) pairs, see wider()) grows along the one
    axis that differs; every array lands in its target sharding."""
    old = nnx.to_pure_dict(nnx.state(model))
    leaves, treedef = jax.tree.flatten(old)
    targets = treedef.flatten_up_to(targets)
    keys = list(jax.random.split(jax.random.key(seed), len(leaves)))

    def grow_all(leaves, keys):
        return [_grow(x, t.shape, k) for x, (t, _), k in zip(leaves, targets, keys)]

    out = jax.jit(grow_all, out_shardings=[s for _, s in targets])(leaves, keys)
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, out))


def _grow(x, shape, key):
    if x.shape == tuple(shape):
        return x
    axis = next(i for i, (a, b) in enumerate(zip(x.shape, shape)) if a != b)
    extra_shape = list(shape)
    extra_shape[axis] -= x.shape[axis]
    x32 = x.astype(jnp.float32)
    mean, std = x32.mean(axis=axis, keepdims=True), x32.std(axis=axis, keepdims=True)
    extra = mean + std * jax.random.normal(key, extra_shape, jnp.float32)
    return jnp.concatenate([x, extra.astype(x.dtype)], axis=axis)


def wider(abstract_model, mesh, rules) -> tuple:
    """(graphdef, targets) of an abstract (nnx.eval_shape) wider model whose parameters carry logical
    axis names: the arguments grown() takes after the model."""
    from unitrain import sharding

    graphdef, state = nnx.split(abstract_model)
    placed = nnx.to_pure_dict(sharding.state_shardings(state, mesh, rules))
    shapes = nnx.to_pure_dict(state)
    return graphdef, jax.tree.map(lambda s, p: (s, p), shapes, placed)
