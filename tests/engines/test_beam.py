"""Beam search as a decoding strategy of the colocated sampler (engines/beam.py), against independent
references: exhaustive teacher-forced scoring of every valid sequence, greedy decoding, the trie."""

import jax
import numpy as np
import pytest
from flax import nnx

from helpers import BEAM_CFG as CFG
from helpers import BEAM_EOS as EOS
from helpers import BEAM_PROMPTS as PROMPTS
from helpers import BEAM_V as V
from helpers import beam_items as items
from helpers import beam_model as model
from helpers import check_wide_beam_is_exact_top_k
from unitrain import sharding
from unitrain.engines.base import SamplingParams
from unitrain.engines.beam import BeamParams
from unitrain.engines.colocated import ColocatedSampler
from unitrain.engines.trie import Trie
from unitrain.models import decoder as model_lib


def test_wide_beam_is_exact_top_k_of_all_valid_items_with_teacher_forced_scores():
    check_wide_beam_is_exact_top_k()  # helpers.py: test_decode_compaction.py runs it compacted too


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
