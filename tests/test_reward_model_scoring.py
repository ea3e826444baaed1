"""`reward: rm` (reward_model.py): a tiny random HF classifier's scores through the reward equal
transformers' `.logits` of the same texts rendered the same way, weighted with a rule reward,
normalised, truncated, bucketed, offloaded; a reward model with another vocabulary than the
policy's in a GRPO run; the bad inputs as one line and exit 2."""

import json
import math
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers

from helpers import GRPO_FAST, REPO, copy_with_bos, make_cfg
from unitrain import modes, reward_model, rewards, run, train
from unitrain.errors import ConfigError

TOL = 1e-4  # float32 on both sides, as the classifier parity tests (test_scalar_head.py)
PROMPTS = ["What is 2+3?", "Name a color.", "Natalia sold 48 clips in April and half as many in May. How many?", "Hi"]
COMPLETIONS = ["5", "The quick brown fox", "She sold 48 + 24 = 72 clips. #### 72", ""]
LABELS = ["5", "red", "72", "hello"]
VARIANTS = {"llama": dict(rope_scaling="llama3"), "qwen2": dict(tie=True)}


@pytest.fixture(autouse=True)
def fresh_scorer():
    """Each test loads its own reward model (make_rm_reward keeps one per config)."""
    reward_model._scorer.cache_clear()
    yield
    reward_model._scorer.cache_clear()


def rm_path(tiny_checkpoint, family="qwen2"):
    return tiny_checkpoint(family, num_labels=1, **VARIANTS.get(family, {}))


def rm_cfg(path, **overrides):
    return make_cfg(reward="rm", reward_model_path=str(path), **overrides)


def transformers_scores(path, prompts, completions, chat=True, max_length=None):
    """[N] the HF classifier's logits of each text, rendered as the reward renders it: the chat
    template's conversation (or the plain text and EOS, as TRL's RewardTrainer trains on it),
    tokenized by the HF tokenizer alone, unpadded."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for p, c in zip(prompts, completions):
        conv = [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
        text = tok.apply_chat_template(conv, tokenize=False) if chat else p + c
        ids = tok(text, add_special_tokens=not chat)["input_ids"] + ([] if chat else [tok.eos_token_id])
        with torch.no_grad():
            out.append(float(model(torch.tensor([ids])).logits[0, 0]))
    return np.asarray(out, np.float32)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_rm_scores_equal_transformers_logits_of_the_rendered_conversation(tiny_checkpoint, family):
    path = rm_path(tiny_checkpoint, family)
    reward_fn = rewards.make_reward_fn(rm_cfg(path, reward_model_batch_size=2))
    total, per_reward = reward_fn(PROMPTS, COMPLETIONS, LABELS)
    expected = transformers_scores(path, PROMPTS, COMPLETIONS)
    assert np.ptp(expected) > 1e-2  # distinct texts, distinct scores: a wrong position would show
    np.testing.assert_allclose(per_reward["rm"], expected, atol=TOL, rtol=0)
    np.testing.assert_array_equal(total, per_reward["rm"])
    metrics = reward_fn.metrics()
    assert metrics["rm/score_mean"] == pytest.approx(expected.mean(), abs=TOL)
    assert metrics["rm/score_std"] == pytest.approx(expected.std(), abs=TOL)
    assert metrics["rm/score_time"] > 0 and metrics["rm/truncated_fraction"] == 0
    assert reward_fn.metrics() == {}  # drained


def test_plain_text_rendering_without_the_chat_template(tiny_checkpoint):
    path = rm_path(tiny_checkpoint)
    reward_fn = rewards.make_reward_fn(rm_cfg(path, reward_model_chat_template=False))
    _, per_reward = reward_fn(PROMPTS, COMPLETIONS, LABELS)
    np.testing.assert_allclose(
        per_reward["rm"], transformers_scores(path, PROMPTS, COMPLETIONS, chat=False), atol=TOL, rtol=0
    )


@pytest.mark.parametrize("added", [False, True])
def test_plain_text_gets_a_bos_only_where_the_tokenizer_adds_one(tiny_checkpoint, tmp_path, added):
    path = copy_with_bos(rm_path(tiny_checkpoint), tmp_path / "rm", added)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert (tok("Hi")["input_ids"][0] == tok.bos_token_id) == added
    scorer = reward_model._scorer(rm_cfg(path, reward_model_chat_template=False))
    for p, c in zip(PROMPTS, COMPLETIONS):
        assert scorer.encode(p, c) == (tok(p + c)["input_ids"] + [tok.eos_token_id], False)
    want = transformers_scores(path, PROMPTS, COMPLETIONS, chat=False)
    np.testing.assert_allclose(scorer.score(PROMPTS, COMPLETIONS), want, atol=TOL, rtol=0)


def test_weighted_with_exact_match_is_the_numpy_sum(tiny_checkpoint):
    path = rm_path(tiny_checkpoint)
    cfg = make_cfg(reward="exact_match,rm", reward_weights="[1.0, 0.5]", reward_model_path=str(path))
    total, per_reward = rewards.make_reward_fn(cfg)(PROMPTS, COMPLETIONS, LABELS)
    exact = np.asarray([c.strip() == l.strip() for c, l in zip(COMPLETIONS, LABELS)], np.float32)
    assert exact.tolist() == [1, 0, 0, 0]
    expected = exact + 0.5 * transformers_scores(path, PROMPTS, COMPLETIONS)
    np.testing.assert_allclose(total, expected, atol=TOL, rtol=0)


def test_normalisation_standardises_the_round_and_logs_raw_scores(tiny_checkpoint):
    path = rm_path(tiny_checkpoint)
    reward_fn = rewards.make_reward_fn(rm_cfg(path, reward_model_normalize="true"))
    _, per_reward = reward_fn(PROMPTS, COMPLETIONS, LABELS)
    raw = transformers_scores(path, PROMPTS, COMPLETIONS).astype(np.float64)
    np.testing.assert_allclose(per_reward["rm"], (raw - raw.mean()) / (raw.std() + 1e-6), atol=1e-3, rtol=0)
    assert reward_fn.metrics()["rm/score_mean"] == pytest.approx(raw.mean(), abs=TOL)  # raw, not normalised


def test_bucketing_gives_the_scores_of_one_big_batch(tiny_checkpoint):
    path = rm_path(tiny_checkpoint)
    texts = [("x " * n, "y" * (n % 5)) for n in range(1, 40, 3)]  # 13 texts, lengths over several buckets
    prompts, completions = [t[0] for t in texts], [t[1] for t in texts]
    scorer = reward_model._scorer(rm_cfg(path, reward_model_batch_size=3))
    bucketed = scorer.score(prompts, completions)
    ids = [scorer.encode(p, c)[0] for p, c in zip(prompts, completions)]
    batches = reward_model.score_batches([len(i) for i in ids], scorer.max_length, 3, scorer.row_multiple)
    assert len({length for _, length, _ in batches}) >= 3 and all(rows == 8 for _, _, rows in batches)
    assert sorted(r for rows, _, _ in batches for r in rows) == list(range(len(ids)))
    assert all(len(ids[r]) <= length for rows, length, _ in batches for r in rows)
    # One forward of every text right-padded to the longest, 16 rows.
    T, N = max(map(len, ids)), 16
    tokens, positions, segments = (np.zeros((N, T), np.int32) for _ in range(3))
    for r, row in enumerate(ids):
        tokens[r, : len(row)], positions[r, : len(row)], segments[r, : len(row)] = row, np.arange(len(row)), 1
    segments[len(ids) :, 0] = 1
    big = np.asarray(scorer.forward(scorer.params, tokens, positions, segments))[: len(ids)]
    np.testing.assert_allclose(bucketed, big, atol=1e-5, rtol=0)
    np.testing.assert_allclose(bucketed, transformers_scores(path, prompts, completions), atol=TOL, rtol=0)


def test_score_batches_bound_rows_and_shapes():
    lengths = [3, 40, 17, 16, 5, 200, 33, 2, 15]
    batches = reward_model.score_batches(lengths, max_length=100, batch_size=3, multiple=2)
    expected = {16: [7, 0, 4, 8, 3], 32: [2], 64: [6, 1], 100: [5]}  # each bucket's texts, shortest first
    got: dict = {}
    for rows, length, padded in batches:
        assert len(rows) <= 3 and padded == (2 if len(rows) <= 2 else 4)  # power of two, multiple of 2, cap 4
        got.setdefault(length, []).extend(rows)
    assert got == expected


def test_texts_over_max_length_lose_their_prompts_start(tiny_checkpoint):
    path = rm_path(tiny_checkpoint)
    prompt, completion = "The quick brown fox jumps over the lazy dog. " * 6, "#### 72"
    scorer = reward_model._scorer(rm_cfg(path, reward_model_max_length=24))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    full = tok.apply_chat_template(
        [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}], tokenize=False
    )
    full_ids = tok(full, add_special_tokens=False)["input_ids"]
    head = len(tok("<|im_start|>user\n", add_special_tokens=False)["input_ids"])
    ids, cut = scorer.encode(prompt, completion)
    assert cut and len(full_ids) > 24 and len(ids) == 24
    assert ids[:head] == full_ids[:head] and ids[head:] == full_ids[len(full_ids) - (24 - head) :]
    score = scorer.score([prompt, "Hi"], [completion, "5"])
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = float(model(torch.tensor([ids])).logits[0, 0])
    assert score[0] == pytest.approx(expected, abs=TOL)
    assert scorer.metrics()["rm/truncated_fraction"] == 0.5


def test_host_offload_gives_the_same_scores(tiny_checkpoint):
    path = rm_path(tiny_checkpoint)
    on_device = reward_model._scorer(rm_cfg(path)).score(PROMPTS, COMPLETIONS)
    offloaded = reward_model._scorer(rm_cfg(path, reward_model_host_offload="true"))
    leaf = jax.tree.leaves(offloaded.params)[0]
    assert leaf.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(offloaded.score(PROMPTS, COMPLETIONS), on_device)


def test_a_unitrain_checkpoint_of_a_reward_model_with_its_runs_tokenizer(tiny_checkpoint, tmp_path):
    """A mode=rm run's step directory: the parameters from orbax, the architecture and the
    tokenizer from the run's config.yml (two levels up)."""
    import orbax.checkpoint as ocp
    import yaml
    from flax import nnx

    from unitrain.adapters import hf_config
    from unitrain.models.scalar_head import build_scalar_model

    path = rm_path(tiny_checkpoint)
    model = build_scalar_model(make_cfg(), run_mesh(), str(path), require_classifier=True)
    step_dir = tmp_path / "rm_run" / "checkpoints" / "3"
    with ocp.StandardCheckpointer() as saver:
        saver.save(step_dir / "params", nnx.to_pure_dict(nnx.state(model)))
    keys = {**hf_config.model_keys(path), "tokenizer_path": str(path)}
    (tmp_path / "rm_run" / "config.yml").write_text(yaml.safe_dump(keys))
    _, per_reward = rewards.make_reward_fn(rm_cfg(step_dir))(PROMPTS, COMPLETIONS, LABELS)
    np.testing.assert_allclose(per_reward["rm"], transformers_scores(path, PROMPTS, COMPLETIONS), atol=TOL, rtol=0)


def test_an_environments_final_answer_is_scored_by_the_same_loaded_model(tiny_checkpoint):
    """env: calculator scores each episode's final answer with the configured reward, one at a time."""
    from unitrain.envs import calculator

    path = rm_path(tiny_checkpoint)
    cfg = make_cfg(
        mode="grpo",
        per_device_batch_size=2,
        workflow="multi_turn",
        env="calculator",
        reward="rm",
        reward_model_path=str(path),
    )
    rewards.make_reward_fn(cfg)  # the mode's
    score = calculator._final_answer_score(cfg)  # the environment's
    assert reward_model._scorer.cache_info().misses == 1  # loaded once
    got = [score(p, c, l) for p, c, l in zip(PROMPTS, COMPLETIONS, LABELS)]
    np.testing.assert_allclose(got, transformers_scores(path, PROMPTS, COMPLETIONS), atol=TOL, rtol=0)


# ---------------------------------------------------------------- in a GRPO run

GRPO = GRPO_FAST


def test_another_vocabulary_than_the_policys_scores_the_decoded_rollouts(tiny_checkpoint, tmp_path):
    path = rm_path(tiny_checkpoint)  # byte-level BPE, 512 tokens; the policy: the built-in characters
    cfg = make_cfg(
        **dict(a.split("=") for a in GRPO),
        base_output_directory=str(tmp_path),
        reward="rm",
        reward_model_path=str(path),
    )
    built, state = run.build_run(cfg)
    assert built.tokenizer.vocab_size != reward_model._scorer(cfg).tokenizer.vocab_size
    task = modes.create(built)
    groups, _ = task.rollouts.prepare_batch(0, lambda version: task.sampler.update_weights(state["params"], version))
    prompts = [g.prompt.text for g in groups for _ in g.trajectories]
    completions = [t.text for g in groups for t in g.trajectories]
    got = np.concatenate([g.per_reward["rm"] for g in groups])
    np.testing.assert_allclose(got, transformers_scores(path, prompts, completions), atol=TOL, rtol=0)


def test_a_grpo_run_with_rm_and_a_rule_reward_logs_the_scores(tiny_checkpoint, tmp_path):
    path = rm_path(tiny_checkpoint)
    argv = [
        str(REPO / "configs" / "base.yml"),
        f"base_output_directory={tmp_path}",
        *GRPO,
        "steps=2",
        "reward=exact_match,rm",
        "reward_weights=[1.0, 0.5]",
        f"reward_model_path={path}",
        "reward_model_batch_size=8",
    ]
    assert train.main(argv) == 0
    steps = [json.loads(l) for l in open(tmp_path / "default" / "metrics.jsonl") if '"loss"' in l]
    assert len(steps) == 2
    for line in steps:
        assert math.isfinite(line["rm/score_mean"]) and line["rm/score_std"] > 0
        assert line["rm/score_mean"] == pytest.approx(line["reward_rm_mean"], abs=1e-5)
        assert 0 < line["rm/score_time"] < line["time_rollout"] and line["rm/completions_per_sec"] > 0
        expected = line["reward_exact_match_mean"] + 0.5 * line["reward_rm_mean"]
        assert line["reward_mean"] == pytest.approx(expected, abs=1e-5)


# ---------------------------------------------------------------- bad input


def main_error(tmp_path, capsys, *overrides) -> str:
    argv = [str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", *GRPO, "steps=1", *overrides]
    capsys.readouterr()  # what making the checkpoints printed
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_a_causal_lm_as_reward_model_is_one_line(tiny_checkpoint, tmp_path, capsys):
    lm = tiny_checkpoint("qwen2", **VARIANTS["qwen2"])
    err = main_error(tmp_path, capsys, "reward=rm", f"reward_model_path={lm}")
    assert "must be a *ForSequenceClassification checkpoint" in err


def test_a_classifier_without_score_weight_is_one_line(tiny_checkpoint, tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(rm_path(tiny_checkpoint), broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["score.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    err = main_error(tmp_path, capsys, "reward=rm", f"reward_model_path={broken}")
    assert "no tensor 'score.weight'" in err


def test_a_reward_model_larger_than_memory_is_one_line_unless_offloaded(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    path = rm_path(tiny_checkpoint)
    seen = []

    def small_devices(devices, host_offload):
        seen.append((len(devices), host_offload))
        return (10**12, "the host") if host_offload else (1000, "a fake device limit")

    monkeypatch.setattr(reward_model, "available_bytes", small_devices)
    err = main_error(tmp_path, capsys, "reward=rm", f"reward_model_path={path}")
    count = reward_model.parameter_count(str(path))
    per_device = count * 4 / 8  # float32, [embed, mlp] split over the 8 devices' fsdp axis
    assert f"{count / 1e6:.1f}M parameters need {per_device / 2**30:.2f} GiB per device" in err
    assert "more than a fake device limit" in err and "reward_model_host_offload=true" in err
    assert seen == [(8, False)]
    fitting = rm_cfg(path, reward_model_host_offload="true")
    reward_model.check_fits(fitting, run_mesh(), rules(), path, "reward_model_path", "reward_model_host_offload")


def test_parameter_count_reads_the_headers(tiny_checkpoint):
    path = rm_path(tiny_checkpoint)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path)
    assert reward_model.parameter_count(str(path)) == sum(p.numel() for p in model.state_dict().values())


def run_mesh():
    from unitrain import sharding

    return sharding.create_mesh({"data": 1, "fsdp": 8, "tensor": 1}, {"data": 1, "fsdp": 1, "tensor": 1})


def rules():
    from unitrain import sharding

    return sharding.rules_from_config(make_cfg().logical_axis_rules)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"reward": "math,rm"}, "reward names rm but reward_model_path is empty"),
        ({"reward_model_batch_size": "0"}, "reward_model_batch_size"),
        ({"reward_model_max_length": "1"}, "reward_model_max_length"),
    ],
)
def test_config_mistakes_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_cfg(**overrides)


def test_a_missing_reward_model_is_one_line_when_the_run_starts(tmp_path, capsys):
    """Not when the config loads: a pipeline's reward-model stage writes it before the RL stage runs."""
    cfg = make_cfg(reward="rm", reward_model_path=str(tmp_path / "rm"))
    with pytest.raises(ConfigError, match=f"reward_model_path='{tmp_path / 'rm'}' is not a directory"):
        rewards.make_reward_fn(cfg)
    err = main_error(
        tmp_path, capsys, "reward=rm", f"reward_model_path={tmp_path}", "reward_model_tokenizer_path=/no/tok"
    )
    assert "reward_model_tokenizer_path='/no/tok' does not exist" in err


def test_normalising_single_answers_of_an_environment_is_refused(tiny_checkpoint):
    path = rm_path(tiny_checkpoint)
    with pytest.raises(ConfigError, match="reward_model_normalize standardises the scores of a round"):
        make_cfg(
            mode="grpo",
            workflow="multi_turn",
            env="calculator",
            reward="rm",
            reward_model_path=str(path),
            reward_model_normalize="true",
        )
