"""rl_packing: the first-fit-decreasing packer, and packed updates equal to unpacked ones (GRPO and
its loss variants, PPO with its critic, DPO): loss, every metric and the parameters after the update."""

import itertools

import jax
import numpy as np
import pytest

from helpers import FIXED_STEP_FAST as FAST
from helpers import REPO, assert_same_step, fixed_groups, one_step
from helpers import STEP_ATOL as ATOL
from helpers import STEP_RTOL as RTOL
from helpers import fixed_step_config as config
from unitrain import modes, run, sharding
from unitrain.data.rl_packing import RolloutPacking, first_fit_decreasing

# ------------------------------------------------------------------ the packer


def best_bins(lengths, capacity):
    """The fewest bins that hold the items, by trying every assignment (small N only)."""
    n = len(lengths)
    for bins in range(1, n + 1):
        for assign in itertools.product(range(bins), repeat=n):
            if all(sum(l for l, a in zip(lengths, assign) if a == b) <= capacity for b in range(bins)):
                return bins
    return n


@pytest.mark.parametrize("seed", range(12))
def test_first_fit_decreasing_places_every_sequence_once_within_the_budget(seed):
    rng = np.random.default_rng(seed)
    capacity = int(rng.integers(8, 24))
    lengths = rng.integers(1, capacity + 1, size=int(rng.integers(1, 8)))
    bins, starts, count = first_fit_decreasing(lengths, capacity)
    used = np.zeros((count, capacity), int)
    for b, s, n in zip(bins, starts, lengths):
        assert 0 <= b < count and s + n <= capacity  # inside its bin
        used[b, s : s + n] += 1
    assert used.max() <= 1 and used.sum() == lengths.sum()  # every token once, no overlap
    best = best_bins(list(lengths), capacity)
    assert best <= count <= 11 / 9 * best + 6 / 9  # FFD's bound (Dosa 2007)


def test_a_sequence_longer_than_the_row_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_decreasing([3, 9], 8)


# Every aggregation without and with both KL and rollout_is; token-mean also with each alone.
VARIANTS = [
    (agg, on, on)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
    for on in (False, True)
] + [("token-mean", True, False), ("token-mean", False, True)]


@pytest.mark.parametrize("agg,kl,is_", VARIANTS)
def test_a_packed_grpo_step_equals_the_unpacked_one(tmp_path, agg, kl, is_):
    overrides = [f"loss_agg_mode={agg}", "mode=grpo"]
    if kl:
        overrides += ["kl_coef=0.1"]
    if is_:  # a sequence-level weight in mask mode: per-sequence sums and rejections
        overrides += [
            "rollout_is=true",
            "rollout_is_level=geometric",
            "rollout_is_mode=mask",
            "rollout_is_threshold=4.0",
        ]
    packed = one_step(config(tmp_path / "p", *overrides, "rl_packing=true"))
    unpacked = one_step(config(tmp_path / "u", *overrides))
    assert_same_step(packed, unpacked)
    if is_:  # some sequences rejected, not all
        assert 0 < unpacked[0]["rollout_is_seq_masked_fraction"] < 1


def test_packing_fills_fewer_rows_than_the_round_has_sequences(tmp_path):
    """The fixed round's 16 sequences (most short) in 8 packed rows of the unpacked width, several
    sequences a row, and the completion fields come back to the unpacked layout unchanged."""
    cfg = config(tmp_path, "mode=grpo", "rl_packing=true")
    built, _ = run.build_run(cfg)
    task = modes.create(built)
    batch = task.to_rows(fixed_groups(cfg, built.tokenizer))
    step_rows = task.step_rows(batch)
    (chunk,) = step_rows.chunks
    rows = {k: step_rows.host(chunk, k) for k in ("inputs", "inputs_segmentation", "targets", "loss_mask")}
    plan, n = chunk.plan, chunk.sequences
    assert rows["inputs"].shape == (8, batch["inputs"].shape[1]) and n == 16
    assert rows["inputs_segmentation"].max() > 2  # rows hold several sequences
    assert rows["loss_mask"].sum() == batch["loss_mask"].sum()
    np.testing.assert_array_equal(
        plan.unpack(rows["targets"], n) * batch["loss_mask"], batch["targets"] * batch["loss_mask"]
    )
    # Each packed target is the token after its column in the same segment.
    seg, ids = rows["inputs_segmentation"], rows["inputs"]
    follows = (seg[:, :-1] == seg[:, 1:]) & (rows["loss_mask"][:, :-1] > 0)
    np.testing.assert_array_equal(rows["targets"][:, :-1][follows], ids[:, 1:][follows])
    assert not (rows["loss_mask"][:, :-1][seg[:, :-1] != seg[:, 1:]]).any()  # no loss across a segment's end


@pytest.mark.parametrize("mode,packing", [("grpo", True), ("ppo", True), ("ppo", False)])
def test_a_step_plans_its_rows_once_and_puts_their_inputs_on_the_devices_once(tmp_path, monkeypatch, mode, packing):
    """One step of 2 chunks of 8 rows, 2 iterations, with a KL term: the logprob pass (and PPO's
    value pass) and every update (PPO's critic's too) take the chunks packed once, and the fields
    they share go to the devices once a chunk; the updates send only their own."""
    plans, puts = [], []
    plan, to_global = RolloutPacking.plan.__func__, sharding.full_rows_to_global
    monkeypatch.setattr(RolloutPacking, "plan", classmethod(lambda cls, *a: plans.append(1) or plan(cls, *a)))
    monkeypatch.setattr(sharding, "full_rows_to_global", lambda b, s: puts.append(set(b)) or to_global(b, s))
    overrides = ["per_device_batch_size=1", "gradient_accumulation_steps=1", "num_iterations=2", "kl_coef=0.1"]
    metrics, *_ = one_step(config(tmp_path, f"mode={mode}", f"rl_packing={packing}", *overrides))
    assert np.isfinite(metrics["loss"]) and (mode == "grpo" or np.isfinite(metrics["critic/value_loss"]))
    assert len(plans) == (2 if packing else 0)
    shared = {"inputs", "inputs_position", "inputs_segmentation", "targets"}
    assert [keys >= shared for keys in puts].count(True) == 2  # the first pass's, once a chunk
    assert not any(keys & shared for keys in puts if "inputs" not in keys)  # the others: none of them
    assert len(puts) == 2 * (3 if mode == "ppo" else 2)  # a chunk's: the passes', the critic's, the policy's


def test_gspo_with_two_mini_batches_packed_equals_unpacked(tmp_path):
    """GSPO's sequence ratio per segment, with KL in the reward (the old and reference passes packed
    and brought back for the advantages), a sequence-level rollout_is, two mini-batches of two
    micro-batches and two iterations."""
    overrides = [
        "mode=grpo",
        "policy_loss=gspo",
        "loss_agg_mode=seq-mean-token-mean",
        "kl_coef=0.1",
        "use_kl_in_reward=true",
        "rollout_is=true",
        "rollout_is_level=sequence",
        "per_device_batch_size=1",
        "gradient_accumulation_steps=1",
        "num_iterations=2",
    ]
    assert_same_step(
        one_step(config(tmp_path / "p", *overrides, "rl_packing=true")), one_step(config(tmp_path / "u", *overrides))
    )


def test_ppo_packed_equals_unpacked_critic_included(tmp_path):
    """PPO: the critic's value pass and its value loss packed too; the critic after its update equals."""
    overrides = ["mode=ppo", "loss_agg_mode=seq-mean-token-mean", "value_clip=0.2"]
    packed = one_step(config(tmp_path / "p", *overrides, "rl_packing=true"))
    unpacked = one_step(config(tmp_path / "u", *overrides))
    assert_same_step(packed, unpacked)
    assert "critic/value_loss" in packed[0]
    np.testing.assert_allclose(
        *(
            np.concatenate([np.ravel(x) for x in jax.tree.leaves(jax.tree.map(np.asarray, s[1]["critic"]["params"]))])
            for s in (packed, unpacked)
        ),
        rtol=RTOL,
        atol=ATOL,
    )


@pytest.mark.parametrize("loss_type", ["sigmoid", "orpo"])  # orpo: no reference, per-token averages of packed slots
def test_dpo_packed_equals_unpacked(tmp_path, loss_type):
    overrides = [
        "mode=dpo",
        "dataset_path=builtin",
        "max_target_length=24",
        "dpo_beta=0.5",
        f"dpo_loss_type={loss_type}",
    ]
    packed = one_step(config(tmp_path / "p", *overrides, "rl_packing=true"))
    unpacked = one_step(config(tmp_path / "u", *overrides))
    assert packed[3].packing and not unpacked[3].packing
    assert_same_step(packed, unpacked)


@pytest.mark.parametrize(
    "overrides,named",
    [
        (["mode=sft", "rl_packing=true"], "rl_packing"),
        (["mode=rm", "rl_packing=true"], "rl_packing"),
        (["mode=grpo", "rl_packing_row_tokens=64"], "rl_packing_row_tokens"),
        (["mode=grpo", "rl_packing=true", "rl_packing_row_tokens=40"], "rl_packing_row_tokens (40)"),
        (["mode=dpo", "rl_packing=true", "max_target_length=32", "rl_packing_row_tokens=48"], "rl_packing_row_tokens"),
        (["mode=grpo", "rl_packing=true", "rl_packing_row_tokens=-1"], "rl_packing_row_tokens"),
    ],
)
def test_bad_packing_settings_stop_with_one_line(tmp_path, capsys, overrides, named):
    from unitrain import train

    assert train.main([str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", *FAST, *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_bench_times_a_long_tailed_round_packed_against_unpacked(capsys):
    import json

    import bench

    args = ["configs/base.yml", "mode=grpo", "per_device_batch_size=2", "--mode", "grpo_round", "--new-tokens", "32"]
    assert (
        bench.main([*args, "--prompt-len", "8", "--steps", "2", "--warmup", "0", "--against", "rl_packing=true"]) == 0
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["sequences"] == 16 and not result["rl_packing"] and result["against"]["rl_packing"]
    assert len(result["step_times"]) == len(result["against"]["step_times"]) == 2
    ratios = sorted(a / b for a, b in zip(result["step_times"], result["against"]["step_times"]))
    assert result["against"]["speedup_median"] == pytest.approx(sum(ratios) / 2)
    assert result["completion_tokens"] < result["completion_columns"]  # long-tailed: most columns are padding
    assert bench.main([*args, "--long-fraction", "2"]) == 2


def test_packed_row_counts_take_two_shapes_an_octave():
    from unitrain.engines.buckets import bucket_packed_rows

    shapes = sorted({2**k for k in range(8)} | {3 * 2 ** (k - 1) for k in range(1, 8)})
    for n in range(1, 100):
        assert bucket_packed_rows(n) == min(s for s in shapes if s >= n)
        assert bucket_packed_rows(n, 8) == -(-min(s for s in shapes if s >= n) // 8) * 8
