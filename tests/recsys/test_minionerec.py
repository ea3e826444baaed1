"""Generative recommendation: MiniOneRec CSVs as records, HR/NDCG against NumPy loops, the rank-aware
reward, and SFT -> GRPO (beam rollouts) on the shared slice with a tiny model that has the SID tokens."""

import json
import math
import shutil

import numpy as np
import pytest

from helpers import REPO, make_cfg
from unitrain import rewards, train
from unitrain.errors import DataError
from unitrain.recsys import data as recommendation
from unitrain.recsys.evaluate import hr_ndcg
from unitrain.recsys.rewards import sid_rank_reward

DATA = REPO.parent / "shared" / "data" / "minionerec"
VALID = DATA / "valid_Industrial_and_Scientific_5_2016-10-2018-11.csv"
TEST = DATA / "test_Industrial_and_Scientific_5_2016-10-2018-11.csv"
INFO = DATA / "info_Industrial_and_Scientific_5_2016-10-2018-11.txt"
INDEX = DATA / "index_Industrial_and_Scientific.index.json"
needs_data = pytest.mark.skipif(not VALID.exists(), reason="../shared/data/minionerec is not here")


def test_hr_ndcg_equal_a_numpy_loop():
    rng = np.random.default_rng(0)
    universe = [f"<a_{i}>" for i in range(30)]
    ranked = [list(rng.choice(universe, size=12, replace=False)) for _ in range(200)]
    targets = [str(rng.choice(universe)) for _ in range(200)]
    got = hr_ndcg(ranked, targets, [1, 3, 5, 10])
    for k in (1, 3, 5, 10):
        hits = [t in r[:k] for r, t in zip(ranked, targets)]
        gains = [1 / math.log2(r[:k].index(t) + 2) if t in r[:k] else 0.0 for r, t in zip(ranked, targets)]
        assert got[f"hr_at_{k}"] == pytest.approx(np.mean(hits))
        assert got[f"ndcg_at_{k}"] == pytest.approx(np.mean(gains))
    assert 0 < got["hr_at_10"] < 1 and got["ndcg_at_10"] < got["hr_at_10"]


def test_rank_reward_penalises_wrong_items_above_the_hit_most():
    completions = ["<a_1><b_1>", "<a_2><b_2>", "<a_3><b_3>", "<a_4><b_4>"]
    weights = [1 / math.log2(r + 2) for r in range(4)]
    values = sid_rank_reward([""] * 4, completions, ["<a_3><b_3>"] * 4)
    assert values == pytest.approx(
        [-weights[0] / sum(weights), -weights[1] / sum(weights), 0.0, -weights[3] / sum(weights)]
    )
    assert sid_rank_reward([""] * 4, completions, ["<a_9><b_9>"] * 4) == [0.0] * 4
    fn = rewards.make_reward_fn(make_cfg(reward="sid_hit,sid_rank", reward_weights=[1.0, 2.0], rollout_decoding="beam"))
    total, per = fn([""] * 8, completions * 2, ["<a_3><b_3>"] * 4 + ["<a_1><b_1>"] * 4, group_size=4)
    np.testing.assert_allclose(per["sid_hit"], [0, 0, 1, 0, 1, 0, 0, 0])
    np.testing.assert_allclose(total[:4], [2 * v + h for v, h in zip(values, [0, 0, 1, 0])], rtol=1e-6)
    assert per["sid_rank"][4] == 0 and per["sid_rank"][5] < per["sid_rank"][6] < 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["beam_width=5"], "beam_width (5) must be at least the largest rec_eval_k (10)"),
        (["rec_eval_k=[]"], "config key 'rec_eval_k' expects a non-empty list of positive ints, got '[]'"),
        (
            ["rec_task_weights=[1.0,-0.5,0.0]"],
            "config key 'rec_task_weights' expects a list of 3 finite numbers >= 0, not all 0 (next-SID, "
            "title->SID, SID->title), got '[1.0, -0.5, 0.0]'",
        ),
        (
            ["rec_task_weights=[1.0,0.5,0.0]"],
            "rec_task_weights gives the alignment tasks (title->SID, SID->title) a weight but rec_info_path is empty",
        ),
        (
            ["mode=grpo", "rec_task_weights=[1.0,0.0,0.5]", "rec_info_path=info.txt"],
            "mode=grpo cannot score SID->title records (rewards compare SIDs); set the third rec_task_weights entry to 0",
        ),
        (
            ["mode=grpo", "reward=sid_hit,sid_rank", "reward_weights=[1.0,1.0]"],
            "reward sid_rank scores a group by rank: it needs ranked rollouts (rollout_decoding=beam or sid_index_path)",
        ),
    ],
)
def test_the_format_checks_stop_the_run_with_one_line(tmp_path, capsys, overrides, message):
    base = [str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", "per_device_batch_size=1"]
    grpo = ["rollout_batch_size=4", "n_samples_per_prompt=2"]
    assert train.main([*base, *grpo, "data_format=minionerec", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"unitrain: invalid config: {message}"]
    assert not (tmp_path / "default").exists()


def test_records_grpo_refuses_a_sid_index_it_would_not_use(tmp_path, capsys):
    argv = [str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", "per_device_batch_size=1"]
    assert train.main([*argv, "mode=grpo", "rollout_batch_size=4", "sid_index_path=index.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sid_index_path constrains GRPO's rollouts to SIDs" in err[0], err


@needs_data
def test_csv_rows_become_records_mixed_by_weight_and_bad_rows_name_their_line(tmp_path):
    examples = recommendation.read_examples(str(VALID), with_titles=True)
    assert len(examples) == 4532 and all(1 <= len(e["history"]) <= 10 for e in examples)
    cfg = make_cfg(
        data_format="minionerec", rec_info_path=INFO, rec_task_weights=[1.0, 0.5, 0.25], rec_history_titles=True
    )
    records = recommendation.sft_records(cfg, str(VALID))
    assert len(records) == 4532 + 2266 + 1133
    first = records[0]
    assert first["prompt"].startswith("The user has interacted with items <a_") and '"' in first["prompt"]
    assert sum(r["prompt"].startswith("Which item has the title") for r in records) == 2266
    grpo = recommendation.prompt_records(cfg.replace(rec_task_weights=[1.0, 0.5, 0.0]), str(VALID))
    assert len(grpo) == 4532 + 2266 and all(r["label"].startswith("<a_") for r in grpo)

    lines = VALID.read_text().split("\n")
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join(lines[:3] + [lines[3].replace("['<a_", "[<a_", 1)] + lines[4:6]))
    with pytest.raises(DataError, match=r"bad.csv:4: column 'history_item_sid' is not a Python list literal"):
        recommendation.read_examples(str(bad), with_titles=False)
    info = tmp_path / "info.txt"
    info.write_text("<a_1><b_2>\tA title\t0\n<a_1><b_3>\tno item id\n")
    with pytest.raises(DataError, match=r"info.txt:2: expected sid<TAB>title<TAB>item_id"):
        recommendation.read_info(str(info))


@needs_data
def test_sft_then_beam_grpo_on_the_slice(tmp_path):
    from make_tiny_model import make_tiny_model

    tiny = make_tiny_model(tmp_path / "tiny", "llama", vocab_size=400, extra_tokens=str(INDEX), seed=0)
    valid, test = tmp_path / "valid.csv", tmp_path / "test.csv"
    valid.write_text("\n".join(VALID.read_text().split("\n")[:129]))
    test.write_text("\n".join(TEST.read_text().split("\n")[:33]))
    common = [
        f"tokenizer_path={tiny}",
        f"dataset_path={valid}",
        f"eval_dataset_path={test}",
        f"base_output_directory={tmp_path}",
        "eval_num_samples=20",
        "rec_eval_batch_size=8",
        "per_device_batch_size=2",
        "log_period=1",
        "checkpoint_period=100",
    ]
    sft = train.main(
        [
            str(REPO / "configs" / "minionerec_sft.yml"),
            *common,
            f"load_parameters_path={tiny}",
            "steps=3",
            "eval_interval=3",
            "warmup_steps=1",
        ]
    )
    assert sft == 0
    lines = [json.loads(l) for l in (tmp_path / "minionerec_sft" / "metrics.jsonl").read_text().splitlines()]
    evaluated = [l for l in lines if "eval_hr_at_10" in l]
    assert evaluated and all(f"eval_ndcg_at_{k}" in evaluated[-1] for k in (1, 3, 5, 10))
    index_sids = {"".join(v) for v in json.loads(INDEX.read_text()).values()}
    predictions = [json.loads(l) for l in (tmp_path / "minionerec_sft" / "predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 20 and all(len(p["predictions"]) == 20 for p in predictions)
    assert all(sid in index_sids for p in predictions for sid in p["predictions"])  # 100% valid under the constraint
    assert all(np.all(np.diff(p["logprobs"]) <= 1e-6) for p in predictions)

    grpo = train.main(
        [
            str(REPO / "configs" / "minionerec_grpo.yml"),
            *common,
            f"load_parameters_path={tmp_path / 'minionerec_sft' / 'checkpoints'}",
            "steps=2",
            "eval_interval=2",
            "rollout_batch_size=2",
            "over_sampling_batch_size=2",
            "n_samples_per_prompt=8",
            "dynamic_sampling_filter=",
            "max_sampling_rounds=1",
        ]
    )
    assert grpo == 0
    lines = [json.loads(l) for l in (tmp_path / "minionerec_grpo" / "metrics.jsonl").read_text().splitlines()]
    steps = [l for l in lines if "reward_sid_hit_mean" in l]
    assert len(steps) == 2 and all(l["response_length_mean"] == 4 for l in steps)  # 3 SID tokens + EOS
    assert "eval_hr_at_10" in lines[-1]
    shutil.rmtree(tmp_path / "tiny")


def test_generate_beam_is_constrained_to_the_sid_index(tmp_path, capsys):
    import generate
    from make_tiny_model import make_tiny_model

    index = tmp_path / "index.json"
    index.write_text(
        json.dumps(
            {
                "0": ["<a_1>", "<b_2>", "<c_3>"],
                "1": ["<a_1>", "<b_2>", "<c_4>"],
                "2": ["<a_5>", "<b_2>", "<c_3>"],
                "3": ["<a_1>", "<b_6>", "<c_3>"],
            }
        )
    )
    tiny = make_tiny_model(tmp_path / "tiny", "llama", extra_tokens=str(index))
    argv = [
        str(REPO / "configs" / "base.yml"),
        f"load_parameters_path={tiny}",
        f"tokenizer_path={tiny}",
        f"sid_index_path={index}",
        f"extra_tokens={index}",
        "--prompt",
        "hello",
        "--prompt",
        "x",
        "--beam",
        "4",
        "--json",
    ]
    assert generate.main(argv) == 0
    rows = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert len(rows) == 8
    sids = {"".join(v) + "<|im_end|>" for v in json.loads(index.read_text()).values()}
    for prompt in ("hello", "x"):
        beams = [r for r in rows if r["prompt"] == prompt]
        assert {r["completion"] for r in beams} == sids  # 4 beams, 4 items: every one, each once
        assert [r["sample"] for r in beams] == [0, 1, 2, 3]
        assert all(a["logprob_sum"] >= b["logprob_sum"] - 1e-6 for a, b in zip(beams, beams[1:]))
    assert generate.main(argv[:-3] + ["--beam", "-1"]) == 2
