"""Every mode's step over rows split on the `context` axis equals the unsplit step: SFT on packed
rows, DPO's pairs, a GRPO update with KL on rl_packing's rows (its old-policy and reference passes
included): every metric and the parameters after the update (helpers.assert_same_step)."""

import pytest

from helpers import assert_same_step, one_step
from helpers import fixed_step_config as config

# The LM head 2 positions of a device's share at a time, so that it runs in several chunks.
COMMON = ["logits_chunk_size=2"]
# Each mode with another axis size and strategy, load balancing on and off; the rows per update
# kept (per_device_batch_size counts the rows of the batch axes: times the context size).
CASES = {
    "sft": (
        ["mode=sft", "max_target_length=32", "per_device_batch_size=1"],
        ["ici_context_parallelism=2", "context_parallel_strategy=ring", "per_device_batch_size=2"],
    ),
    "dpo": (
        ["mode=dpo", "dataset_path=builtin", "max_target_length=24", "dpo_beta=0.5", "per_device_batch_size=1"],
        [
            "ici_context_parallelism=4",
            "context_parallel_strategy=all_gather",
            "context_load_balance=false",
            "per_device_batch_size=4",
        ],
    ),
    "grpo": (
        ["mode=grpo", "kl_coef=0.1", "rl_packing=true"],
        ["ici_context_parallelism=8", "context_parallel_strategy=ring", "per_device_batch_size=16"],
    ),
}


@pytest.mark.parametrize("mode", list(CASES))
def test_a_split_step_equals_the_unsplit_one(tmp_path, mode):
    unsplit, split = CASES[mode]
    want = one_step(config(tmp_path / "unsplit", *COMMON, *unsplit))
    got = one_step(config(tmp_path / "split", *COMMON, *unsplit, *split))
    assert got[3].run.mesh.shape["context"] > 1
    assert_same_step(got, want)
