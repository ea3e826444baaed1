"""Beam search as a decoding strategy of the colocated sampler (rollout/beam.py), against independent
references: exhaustive teacher-forced scoring of every valid sequence, greedy decoding, the trie."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import small_model_config
from unitrain import sharding
from unitrain.models import decoder as model_lib
from unitrain.rollout.base import SamplingParams
from unitrain.rollout.beam import BeamParams
from unitrain.rollout.colocated import ColocatedSampler
from unitrain.rollout.trie import Trie

EOS, V = 1, 48
CFG = small_model_config(vocab_size=V)
PROMPTS = [[5, 6, 7], [8, 9], [2, 3, 4, 5, 6, 7, 40, 41, 42], [44]]


@functools.cache
def model():
    m = model_lib.create(CFG, 0)
    for _, var in nnx.to_flat_state(nnx.state(m, nnx.Param)):  # sharper than init: distinct scores
        var.set_value(var.get_value() * 4)
    return m


def items(seed, n=30, lows=(10, 20, 30), highs=(14, 24, 36)):
    rng = np.random.default_rng(seed)
    return sorted({tuple(int(t) for t in row) for row in rng.integers(lows, highs, size=(n, 3))})


def teacher_forced(prompt, seqs) -> np.ndarray:
    """Total logprob of each full sequence after `prompt`, from one plain forward per sequence batch."""
    T = len(prompt) + len(seqs[0])
    tokens = np.asarray([prompt + list(s) for s in seqs], np.int32)
    logits, _ = model()(tokens, np.broadcast_to(np.arange(T, dtype=np.int32), tokens.shape), np.ones_like(tokens))
    lp = np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1))
    steps = np.arange(len(prompt) - 1, T - 1)
    return lp[:, steps, :][np.arange(len(seqs))[:, None], np.arange(len(steps))[None], tokens[:, steps + 1]].sum(1)


def test_wide_beam_is_exact_top_k_of_all_valid_items_with_teacher_forced_scores():
    valid = items(0)
    trie = Trie.build([list(s) + [EOS] for s in valid])
    sampler = ColocatedSampler(model(), pad_id=0)
    ranked = sampler.beam_search(
        PROMPTS, BeamParams(trie.widest_level, trie.depth, trie, stop_token_ids=(EOS,)), jax.random.key(0)
    )
    assert ranked.tokens.shape == (len(PROMPTS), trie.widest_level, 4)
    for b, prompt in enumerate(PROMPTS):
        reference = teacher_forced(prompt, [list(s) + [EOS] for s in valid])
        order = np.argsort(-reference, kind="stable")
        k = 10
        assert [tuple(t[:3]) for t in ranked.tokens[b, :k]] == [valid[i] for i in order[:k]], b
        np.testing.assert_allclose(ranked.scores[b], reference[order[: trie.widest_level]], atol=1e-4)
        np.testing.assert_allclose(ranked.logprobs[b].sum(-1), ranked.scores[b], atol=1e-5)
        assert (ranked.lengths[b] == 4).all() and (ranked.tokens[b, :, 3] == EOS).all()


@pytest.mark.parametrize("sample", [False, True])
def test_every_constrained_sequence_is_valid_over_many_prompts(sample):
    trie = Trie.build([list(s) + [EOS] for s in items(1, n=60)])
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, V, size=int(rng.integers(1, 12))).tolist() for _ in range(40)]
    width = 6 if not sample else 5
    ranked = ColocatedSampler(model(), pad_id=0).beam_search(
        prompts, BeamParams(width, trie.depth, trie, sample=sample, stop_token_ids=(EOS,)), jax.random.key(3)
    )
    assert np.isfinite(ranked.scores).all()
    for row, lengths in zip(ranked.tokens, ranked.lengths):
        for tokens, n in zip(row, lengths):
            assert trie.contains(tokens[:n]), tokens[:n]
    assert (np.diff(ranked.scores, axis=1) <= 1e-6).all()  # best first
    if not sample:  # beams are distinct sequences
        assert all(len({tuple(t) for t in row}) == width for row in ranked.tokens)


def test_another_trie_of_the_same_buckets_does_not_recompile_and_unconstrained_width_1_is_greedy():
    sampler = ColocatedSampler(model(), pad_id=0)
    first, second = (Trie.build([list(s) + [EOS] for s in items(seed)]) for seed in (4, 5))
    assert first.tokens.shape == second.tokens.shape and not np.array_equal(first.tokens, second.tokens)
    for trie in (first, second, first):
        ranked = sampler.beam_search(PROMPTS, BeamParams(4, 4, trie, stop_token_ids=(EOS,)), jax.random.key(0))
        assert all(trie.contains(t[:n]) for row, ns in zip(ranked.tokens, ranked.lengths) for t, n in zip(row, ns))
    assert len(sampler.programs) == 2  # the search and the decode weights

    beam = sampler.beam_search(PROMPTS, BeamParams(1, 6), jax.random.key(0))
    greedy = sampler.generate(PROMPTS, SamplingParams(6, temperature=0.0), jax.random.key(0))
    np.testing.assert_array_equal(beam.tokens[:, 0], greedy.tokens)
    np.testing.assert_allclose(beam.logprobs[:, 0], greedy.logprobs, atol=1e-5)


def test_sharded_beam_search_equals_one_device():
    trie = Trie.build([list(s) + [EOS] for s in items(6)])
    beams = BeamParams(8, trie.depth, trie, stop_token_ids=(EOS,))
    one = ColocatedSampler(model(), pad_id=0).beam_search(PROMPTS, beams, jax.random.key(0))
    mesh = sharding.create_mesh({"data": 2, "fsdp": 2, "tensor": 2}, {"data": 1, "fsdp": 1, "tensor": 1})
    rules = sharding.rules_from_config(sharding.DEFAULT_RULES)
    placed = sharding.init_sharded(lambda: model_lib.create(CFG, 0), mesh, rules)
    graphdef, params = nnx.split(placed)
    scaled = jax.tree.map(lambda x: x * 4, nnx.to_pure_dict(params))
    sampler = ColocatedSampler(nnx.merge(graphdef, scaled), pad_id=0, mesh=mesh, rules=sharding.DEFAULT_RULES)
    many = sampler.beam_search(PROMPTS, beams, jax.random.key(0))
    np.testing.assert_array_equal(many.tokens, one.tokens)
    np.testing.assert_allclose(many.scores, one.scores, atol=1e-4)
