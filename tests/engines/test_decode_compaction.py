"""Decode compaction (rollout/programs.compacted, rollout_compaction): as rows end, the running rows
move into smaller row buckets. Against independent references: a toy loop that records the rows each
step ran with, the naive uncached sampling loop cut at each row's end, the uncompacted decode (the
same tokens; logprobs to float32 rounding, as XLA:CPU's matmuls round by the rows they run), beam
search's exhaustive scoring, and episodes through the driver (its per-row budgets)."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from helpers import ROLLOUT_PROMPTS as PROMPTS
from helpers import beam_reference as test_beam
from helpers import make_cfg, naive_sample, tiny_model
from unitrain.checks import load_checked
from unitrain.data.prompt_ids import Prompt
from unitrain.engines import buckets, programs
from unitrain.engines.base import SamplingParams
from unitrain.engines.beam import BeamParams
from unitrain.engines.colocated import ColocatedSampler
from unitrain.engines.factory import make_sampler
from unitrain.engines.trie import Trie
from unitrain.errors import ConfigError
from unitrain.rollout.driver import run_groups
from unitrain.rollout.workflow import Generate, Transcript, Workflow

PROMPTS8 = PROMPTS + [[7, 7, 8], [30, 31], [3, 9, 27, 81 % 64], [60]]
BUDGETS = (12, 1, 3, 2, 12, 5, 2, 9)  # long-tailed: most rows short, two run to the end
STOPS = (4, 13)


@struct.dataclass
class Toy:
    i: jax.Array
    cache: dict
    tokens: jax.Array  # [B, N]: the rows the step ran with, per token
    done: jax.Array
    rows: jax.Array


class ToyModel:
    def cache_axes(self):
        return {"k": ("batch", "length")}


def test_running_rows_move_into_smaller_buckets_as_rows_end():
    """Each step records how many rows it ran with; row r ends after its budget's steps."""
    budgets = jnp.asarray([1, 7, 2, 2, 3, 1, 5, 2])
    B, N, sizes = 8, 8, (8, 4, 2, 1)

    def step(s: Toy) -> Toy:
        tokens = jax.lax.dynamic_update_slice_in_dim(s.tokens, jnp.full((len(s.rows), 1), len(s.rows)), s.i, 1)
        return s.replace(i=s.i + 1, tokens=tokens, done=s.done | (s.i + 1 >= budgets[s.rows]))

    @jax.jit
    def run(cache):
        state = Toy(jnp.int32(0), cache, jnp.zeros((B, N), jnp.int32), jnp.zeros((B,), bool), jnp.arange(B))
        running = lambda s: ~s.done
        state = jax.lax.while_loop(lambda s: ~programs.first_bucket_done(s, sizes, 1, running), step, state)
        return programs.compacted(
            ToyModel(), state, step, buckets=sizes, group=1, running=running, stop=N,
            fields=("tokens", "done", "rows"), outputs=("tokens",), rules=None,
        )  # fmt: skip

    out = run({"k": jnp.arange(B * 3).reshape(B, 3)})
    # After step 0, 6 rows run (> 4): all 8 again; after step 1, rows 1, 4, 6 (and row 0, the first
    # ended row, filling the bucket of 4); after step 2, rows 1 and 6 in 2; after step 4, row 1 alone.
    assert out.tokens[1].tolist() == [8, 8, 4, 2, 2, 1, 1, 0]
    assert out.tokens[6].tolist() == [8, 8, 4, 2, 2, 0, 0, 0]
    assert out.tokens[4].tolist() == [8, 8, 4, 0, 0, 0, 0, 0]
    assert out.tokens[2].tolist() == out.tokens[5].tolist() == [8, 8, 0, 0, 0, 0, 0, 0]
    assert buckets.row_buckets(64) == [64, 32, 16, 8, 4, 2, 1] and buckets.row_buckets(18, 3) == [18, 9, 6, 3]


def sample(compaction, sampling):
    sampler = ColocatedSampler(tiny_model(), cache_phases=2, compaction=compaction)
    return sampler.generate(PROMPTS8, sampling, jax.random.key(7))


def assert_same(a, b):
    for k in ("tokens", "mask", "lengths"):
        np.testing.assert_array_equal(getattr(a, k), getattr(b, k))
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)  # rounding by row count, ~1e-5


@pytest.mark.parametrize(
    "kw", [dict(temperature=0.0), dict(temperature=0.7, top_k=12, top_p=0.9)], ids=["greedy", "top_k_top_p"]
)
def test_compacted_decode_equals_uncompacted(kw):
    sampling = SamplingParams(12, stop_token_ids=STOPS, row_budgets=BUDGETS, **kw)
    out = sample(1, sampling)
    assert_same(out, sample(0, sampling))
    assert (out.lengths <= BUDGETS).all() and len(set(out.lengths.tolist())) >= 4  # rows ended apart: compaction ran
    assert np.all((out.lengths == BUDGETS) | np.isin(out.tokens[np.arange(8), out.lengths - 1], STOPS))


def test_compacted_sampling_draws_the_naive_loops_tokens_cut_at_each_rows_end(caplog):
    """The naive loop samples every row to the end with the uncompacted batch's noise; a row of the
    compacted decode is that row up to its first stop token or its budget."""
    sampling = SamplingParams(12, temperature=1.0, stop_token_ids=STOPS, row_budgets=BUDGETS)
    with caplog.at_level(logging.DEBUG, logger="unitrain"):
        out = sample(1, sampling)
    assert "compiled generate (batch=8 prompt=16 new=12 cache phases=2 compacted into rows 4/2/1)" in caplog.text
    tokens, logprobs = naive_sample(tiny_model(), PROMPTS8, 12, 1.0, jax.random.key(7))
    stopped = 0
    for r, budget in enumerate(BUDGETS):
        ends = [j + 1 for j in range(12) if tokens[r, j] in STOPS]
        n = min([budget, *ends])
        stopped += n < budget
        assert out.lengths[r] == n, r
        np.testing.assert_array_equal(out.tokens[r, :n], tokens[r, :n])
        np.testing.assert_allclose(out.logprobs[r, :n], logprobs[r, :n], atol=1e-4)
        assert (out.mask[r, n:] == 0).all() and (out.logprobs[r, n:] == 0).all()
    assert 1 <= stopped < len(BUDGETS)  # rows ended by their stop tokens, and by their budgets


def test_row_budgets_are_checked():
    with pytest.raises(ValueError, match="row budgets must be in"):
        SamplingParams(4, row_budgets=(1, 5))
    with pytest.raises(ValueError, match="2 row budgets for 8 prompts"):
        sample(1, SamplingParams(4, row_budgets=(1, 2)))


def varied_trie():
    """Sequences of one to three items then EOS: a prompt's beams end at different steps."""
    rng = np.random.default_rng(9)
    seqs = {tuple(int(t) for t in rng.integers(10, 40, size=int(rng.integers(1, 4)))) for _ in range(40)}
    return Trie.build([list(s) + [test_beam.EOS] for s in seqs])


@pytest.mark.parametrize("sample_mode", [False, True])
def test_compacted_beam_search_equals_uncompacted(sample_mode):
    trie = varied_trie()
    rng = np.random.default_rng(4)
    prompts = [rng.integers(2, test_beam.V, size=int(rng.integers(1, 8))).tolist() for _ in range(8)]
    beams = BeamParams(3, trie.depth, trie, sample=sample_mode, stop_token_ids=(test_beam.EOS,))
    one, other = (
        ColocatedSampler(test_beam.model(), pad_id=0, compaction=c).beam_search(prompts, beams, jax.random.key(2))
        for c in (3, 0)
    )
    np.testing.assert_array_equal(one.tokens, other.tokens)
    np.testing.assert_array_equal(one.lengths, other.lengths)
    np.testing.assert_allclose(one.scores, other.scores, atol=1e-5)
    assert len(set(one.lengths.max(axis=1).tolist())) > 1  # prompts finished at different steps


def test_wide_compacted_beam_is_exhaustive_scorings_top_k(monkeypatch):
    """test_beam's exhaustive reference, the searches compacting their finished prompts' rows."""
    original = ColocatedSampler.__init__
    monkeypatch.setattr(
        ColocatedSampler, "__init__", lambda self, *a, **kw: original(self, *a, **{**kw, "compaction": 1})
    )
    test_beam.test_wide_beam_is_exact_top_k_of_all_valid_items_with_teacher_forced_scores()


class AskingWorkflow(Workflow):
    """Three turns of the prompt's own budgets; the sampled ids recorded."""

    def __init__(self, budgets):
        self.budgets = budgets

    def episode(self, record):
        transcript = Transcript(record.ids)
        for budget in self.budgets[record.ids[0] % len(self.budgets)]:
            turn = yield Generate(transcript.context(), budget)
            transcript.add_sampled(turn)
            transcript.add_context([2, 3])
        return transcript.trajectory(0.0, "max_turns")


def test_episodes_submit_live_rows_with_their_budgets_and_sample_as_without_compaction():
    records = [Prompt(tuple(ids), str(ids), "") for ids in ([0, 5, 6], [1, 7], [2, 8, 9, 10], [3, 11])]
    wf = AskingWorkflow([[9, 2, 9], [1], [3, 9], [9, 9, 9]])
    seen = []

    class Recording(ColocatedSampler):
        def submit(self, prompt_ids, sampling, key):
            seen.append(sampling.row_budgets)
            return super().submit(prompt_ids, sampling, key)

    sampling = SamplingParams(9, temperature=1.0, stop_token_ids=STOPS)
    runs = [
        [
            g.trajectories[0]
            for g in run_groups(
                Recording(tiny_model(), compaction=c), wf, records, 1, sampling, jax.random.key(1), None
            )
        ]
        for c in (1, 0)
    ]
    assert seen[:3] == [(9, 1, 3, 9), (2, 9, 9), (9, 9)]  # the live episodes only, each with its request's budget
    for a, b in zip(*runs):
        sampled = a.loss_mask == 1
        assert a.ids.tolist() == b.ids.tolist() and a.turn_index.tolist() == b.turn_index.tolist()
        np.testing.assert_allclose(a.logprobs[sampled], b.logprobs[sampled], atol=1e-5)
    for t, r in zip(runs[0], records):  # no turn longer than its budget
        assert all((t.turn_index == i).sum() <= budget for i, budget in enumerate(wf.budgets[r.ids[0]]))


def test_rollout_compaction_reaches_the_sampler_and_is_checked():
    from unitrain.run import build_run

    run, _ = build_run(make_cfg(model_name="tiny", rollout_compaction=4))
    sampler = make_sampler(run)
    # Powers of two down to 4 rows, each a multiple of the devices the rows split over.
    assert sampler.row_buckets(64, 64) == tuple(b for b in (64, 32, 16, 8, 4) if b % sampler.parallelism == 0)
    assert sampler.row_buckets(64, 63) == (64,)  # a decode shorter than rollout_compaction_min_tokens=64
    one_device = ColocatedSampler(tiny_model(), compaction=4)
    assert one_device.row_buckets(4, 8) == (4,) and one_device.row_buckets(8, 8, group=2) == (8, 4, 2)  # beams: >= 4
    assert ColocatedSampler(tiny_model()).row_buckets(64, 64) == (64,)  # 0: off
    assert load_checked([str(make_cfg.__globals__["REPO"] / "configs" / "base.yml")]).rollout_compaction == 8
    with pytest.raises(ConfigError, match="rollout_compaction' expects an int >= 0"):
        make_cfg(rollout_compaction=-1)
    assert dataclasses.replace(SamplingParams(4), row_budgets=(2, 4)).budget(0) == 2
