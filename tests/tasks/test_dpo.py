"""mode=dpo: the loss against NumPy, exact accumulation, the preference data pipeline, and runs
through the entry (learning, exact resume, user errors)."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import PAIR_E2E, REPO, make_cfg, metrics_by_step, numpy_sequence_logps, pair_logps_of_model, write_jsonl
from unitrain import losses, sharding, train
from unitrain import step as step_lib
from unitrain.data.preference import PAIR_FIELDS, eval_pair_batches, make_preference_iterator
from unitrain.data.tokenizer import load_tokenizer
from unitrain.errors import ConfigError, DataError
from unitrain.run import build_run
from unitrain.tasks.dpo import DPOTask, real_pairs

TOK = load_tokenizer("")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def numpy_dpo(pi_c, pi_r, ref_c, ref_r, beta, ls):
    z = beta * ((pi_c - ref_c) - (pi_r - ref_r))
    loss = -(1 - ls) * log_sigmoid(z) - ls * log_sigmoid(-z)
    rc, rr = beta * (pi_c - ref_c), beta * (pi_r - ref_r)
    return loss, {
        "rewards/chosen": rc,
        "rewards/rejected": rr,
        "rewards/accuracy": (rc > rr).astype(float),
        "rewards/margin": rc - rr,
        "logps/chosen": pi_c,
        "logps/rejected": pi_r,
    }


def arithmetic_pairs(n, held_out=False):
    """n single-digit sums, chosen the right answer, rejected a wrong one; every fifth (a, b) is held
    out for eval, so the two sets share no problem."""
    problems = [(j // 10, j % 10) for j in range(100) if (j % 5 == 0) == held_out]
    return [
        {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 10 * (1 + i % 3))}
        for i, (a, b) in enumerate(problems[:n])
    ]


# ---------------------------------------------------------------- (a) the loss


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_dpo_loss_and_metrics_equal_numpy(label_smoothing):
    rng = np.random.default_rng(0)
    pi_c, pi_r, ref_c, ref_r = (rng.normal(-20, 5, 12) for _ in range(4))
    pi_c[3], ref_c[3], pi_r[3], ref_r[3] = -5.0, -5.0, -7.0, -7.0  # a tie: rewards equal, not accurate
    weights = np.ones(12)
    weights[[5, 9]] = 0  # padding pairs count nowhere
    settings = losses.PreferenceConfig(beta=0.3, label_smoothing=label_smoothing)
    lengths = (np.full(12, 5), np.full(12, 7))  # the sigmoid loss reads sums: lengths change nothing
    loss_sum, (pairs, metrics) = jax.jit(
        lambda pc, pr, rc, rr: losses.preference_loss((pc, pr), (rc, rr), lengths, settings, weights=weights)
    )(pi_c, pi_r, ref_c, ref_r)
    loss, want = numpy_dpo(pi_c, pi_r, ref_c, ref_r, 0.3, label_smoothing)
    keep = weights > 0
    assert pairs == 10
    np.testing.assert_allclose(loss_sum, loss[keep].sum(), rtol=1e-5)
    assert set(metrics) == set(want)
    for name, values in want.items():
        total, count = metrics[name]
        assert count == 10
        np.testing.assert_allclose(total, values[keep].sum(), rtol=1e-5, atol=1e-5, err_msg=name)
    assert want["rewards/accuracy"][3] == 0.0
    # at z = 0 the loss is log 2 whatever the smoothing; without weights every pair counts
    ones = (jnp.ones(4), jnp.ones(4))
    zero = losses.preference_loss(ones, ones, ones, dataclasses.replace(settings, beta=0.1))
    np.testing.assert_allclose(zero[0], 4 * np.log(2), rtol=1e-6)
    assert zero[1][0] == 4


def test_sequence_logprobs_equal_numpy_log_softmax_gather():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, (3, 7, 11)).astype(np.float32)
    targets = rng.integers(0, 11, (3, 7))
    weights = (rng.random((3, 7)) > 0.4).astype(np.int32)
    logits_bad = logits.copy()
    logits_bad[weights == 0] = np.nan  # masked positions contribute exactly 0
    got = losses.sequence_logprobs(losses.logit_stats(logits_bad, targets).logprobs, weights)
    np.testing.assert_allclose(got, numpy_sequence_logps(logits, targets, weights), rtol=1e-5)
    tok = losses.logit_stats(jnp.asarray(logits, jnp.bfloat16), targets).logprobs
    assert tok.dtype == jnp.float32 and tok.shape == (3, 7)


def test_task_loss_equals_numpy_and_accumulation_is_exact(tmp_path):
    """(a) the task's loss and metrics on a real batch against NumPy from the model's logits; (b) one
    step over 16 pairs in one micro-batch equals two micro-batches of 8: reference, loss, metrics and
    the update."""
    path = write_jsonl(tmp_path / "p.jsonl", arithmetic_pairs(32))
    # adam_eps >> |gradient|: the first AdamW update is ~ learning_rate * gradient, so comparing
    # parameters compares the accumulated gradients (not their signs)
    big = make_cfg(
        dataset_path=path,
        max_target_length=16,
        eval_interval=0,
        warmup_steps=0,
        learning_rate=1.0,
        adam_eps=1.0,
        dpo_beta=0.5,
        dpo_label_smoothing=0.1,
        per_device_batch_size=2,
    )
    small = big.replace(per_device_batch_size=1, gradient_accumulation_steps=2)
    run, state = build_run(big)
    tasks = [DPOTask(run), DPOTask(dataclasses.replace(run, cfg=small))]
    batch = next(make_preference_iterator(big, TOK, 16))
    batch.pop("num_truncated")
    global_batch = sharding.local_rows_to_global(batch, tasks[0].rows2d)
    refs = [
        jax.device_get(t.pair_logps_of_both(f"pair_logps{i}", t.logps_fn, state["params"], global_batch))
        for i, t in enumerate(tasks)
    ]
    for k in refs[0]:  # the micro-batched reference gives every pair its own log-probs back in place
        np.testing.assert_allclose(refs[0][k], refs[1][k], rtol=1e-6)
    noise = np.random.default_rng(3).normal(0, 2, 16).astype(np.float32)  # so that the loss is not log 2
    batch = {
        **batch,
        **refs[0],
        "ref_chosen_logps": refs[0]["ref_chosen_logps"] + noise,
    }

    pi = {name: sums for name, (sums, _) in pair_logps_of_model(run, state["params"], batch).items()}
    for name in ("chosen", "rejected"):
        np.testing.assert_allclose(refs[0][f"ref_{name}_logps"], pi[name], rtol=1e-5)  # the reference is the start
    loss, want = numpy_dpo(
        pi["chosen"], pi["rejected"], batch["ref_chosen_logps"], batch["ref_rejected_logps"], 0.5, 0.1
    )

    results = []
    for cfg, task, s in zip((big, small), tasks, (jax.tree.map(jnp.copy, state), state)):
        with jax.set_mesh(run.mesh):
            settings = step_lib.StepConfig.from_config(cfg, run.learning_rate)
            new, m = jax.jit(lambda s, b: step_lib.train_step(task.loss, settings, run.optimizer, s, b))(s, batch)
        results.append((jax.device_get(new["params"]), jax.device_get(m)))
    (a, ma), (b, mb) = results
    assert ma["loss_denominator"] == mb["loss_denominator"] == 16
    np.testing.assert_allclose(ma["loss"], loss.mean(), rtol=1e-5)
    for name, values in want.items():
        np.testing.assert_allclose(ma[name], values.mean(), rtol=1e-5, atol=1e-5, err_msg=name)
    for name in ("loss", "grad_norm", *want):
        np.testing.assert_allclose(ma[name], mb[name], rtol=1e-5, atol=1e-6, err_msg=name)
    start = jax.device_get(tasks[0].ref.frozen)
    for x, y, p in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(start)):
        np.testing.assert_allclose(x - p, y - p, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(
    "overrides",
    [
        {"ref_params_host_offload": "true"},
        # an unrolled stack and bfloat16: the update's forward fuses with its backward and rounds
        # differently from a forward alone
        {"scan_layers": "false", "dtype": "bfloat16", "gradient_accumulation_steps": 2},
        {"lora_rank": 4},  # the reference is the base with the adapters off (B = 0 at the start)
    ],
)
def test_identical_weights_tie_exactly_at_step_0(overrides):
    """Policy = reference (step 0): every reward is exactly 0.0 and, as TRL counts ties
    (chosen_rewards > rejected_rewards), no pair is accurate: in the step and in eval."""
    cfg = make_cfg(mode="dpo", max_target_length=32, eval_interval=1, eval_steps=1, **overrides)
    run, state = build_run(cfg)
    task = DPOTask(run)
    evaluated = task.evaluate(state["params"], 0)
    _, metrics = task.step(state, 0)
    for prefix, m in (("", jax.device_get(metrics)), ("eval_", evaluated)):
        for name in ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy"):
            assert m[prefix + name] == 0.0, (prefix + name, m[prefix + name])
        assert m[prefix + "loss"] == pytest.approx(np.log(2), rel=1e-6)  # -log sigmoid(0)


# ---------------------------------------------------------------- (c) data


def side(batch, name, row):
    """The ids of one row of a side: (input ids of the sequence, the target ids that carry loss)."""
    seg, tseg = batch[f"{name}_inputs_segmentation"][row], batch[f"{name}_targets_segmentation"][row]
    return batch[f"{name}_inputs"][row][seg > 0].tolist(), batch[f"{name}_targets"][row][tseg > 0].tolist()


def test_standard_pairs_layout_and_prompt_gets_no_loss(tmp_path):
    rows = [{"q": f"{i}+1=", "good": str(i + 1), "bad": f"{i}{i}"} for i in range(8)]
    cfg = make_cfg(
        dataset_path=write_jsonl(tmp_path / "p.jsonl", rows),
        prompt_key="q",
        chosen_key="good",
        rejected_key="bad",
        max_target_length=12,
        shuffle=False,
    )
    batch = next(make_preference_iterator(cfg, TOK, 4))
    assert set(batch) == {*PAIR_FIELDS, "num_truncated"} and int(batch["num_truncated"]) == 0
    assert all(batch[k].shape == (4, 12) and batch[k].dtype == np.int32 for k in PAIR_FIELDS)
    for r in range(4):
        for name, text in (("chosen", rows[r]["good"]), ("rejected", rows[r]["bad"])):
            ids, learned = side(batch, name, r)
            prompt = [TOK.bos_id] + TOK.encode(rows[r]["q"])
            assert ids == prompt + TOK.encode(text) + [TOK.eos_id]
            assert learned == TOK.encode(text) + [TOK.eos_id]  # the prompt carries no loss
            n = len(ids)
            assert batch[f"{name}_inputs_position"][r][:n].tolist() == list(range(n))
            assert (batch[f"{name}_inputs_segmentation"][r][n:] == 0).all()
            assert batch[f"{name}_targets"][r][: n - 1].tolist() == ids[1:]
    assert real_pairs(batch).tolist() == [1.0] * 4


def save_chat_tokenizer(path):
    from unitrain.data.tokenizer import _builtin_hf_tokenizer

    hf = _builtin_hf_tokenizer()
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(path)
    return load_tokenizer(str(path))


def test_conversational_pairs_explicit_and_implicit_prompt(tmp_path):
    tok = save_chat_tokenizer(tmp_path / "tok")
    user = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    explicit = {
        "prompt": user,
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
    }
    implicit = {
        "chosen": [*user, {"role": "assistant", "content": "4"}],
        "rejected": [*user, {"role": "assistant", "content": "5"}],
    }
    cfg = make_cfg(
        dataset_path=write_jsonl(tmp_path / "c.jsonl", [explicit, implicit]),
        tokenizer_path=str(tmp_path / "tok"),
        max_target_length=48,
        shuffle=False,
    )
    batch = next(make_preference_iterator(cfg, tok, 2))
    prompt = tok.encode("<|system|>be brief<eos><|user|>2+2?<eos><|assistant|>")
    for r in range(2):
        for name, answer in (("chosen", "4"), ("rejected", "5")):
            ids, learned = side(batch, name, r)
            assert ids == prompt + tok.encode(f"{answer}<eos>")  # the template's tokens only, no extra BOS/EOS
            assert learned == tok.encode(f"{answer}<eos>")
    with pytest.raises(ConfigError, match="has no chat template"):
        make_preference_iterator(cfg.replace(tokenizer_path=""), TOK, 2)


def test_truncation_is_counted(tmp_path):
    rows = [
        {"prompt": "1+1=", "chosen": "2", "rejected": "3"},
        {"prompt": "2+2=", "chosen": "4" * 20, "rejected": "5"},  # the chosen side is cut
        {"prompt": "p" * 30, "chosen": "1", "rejected": "2"},  # the prompt fills the row: dropped
        {"prompt": "3+3=", "chosen": "6", "rejected": "7" * 20},  # the rejected side is cut
        {"prompt": "4+4=", "chosen": "8", "rejected": "9"},
    ]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    cfg = make_cfg(dataset_path=path, max_target_length=10, shuffle=False, num_epochs=1)
    batch = next(make_preference_iterator(cfg, TOK, 4))
    assert int(batch["num_truncated"]) == 3
    ids, learned = side(batch, "chosen", 1)
    assert len(ids) == 10 and learned == TOK.encode("4" * 5)  # cut on the right, no EOS left
    assert side(batch, "chosen", 2)[1] == TOK.encode("6") + [TOK.eos_id]  # row 2 is the 4th record
    dropped = next(make_preference_iterator(cfg.replace(truncation="drop"), TOK, 2))
    assert int(dropped["num_truncated"]) == 3 and side(dropped, "chosen", 1)[1] == TOK.encode("8") + [TOK.eos_id]


def test_iterator_state_round_trip_and_any_process_count(tmp_path):
    cfg = make_cfg(
        dataset_path=write_jsonl(tmp_path / "p.jsonl", arithmetic_pairs(20)),
        max_target_length=12,
        data_shards=2,
        num_epochs=3,
    )
    it = make_preference_iterator(cfg, TOK, 4)
    for _ in range(4):  # crosses an epoch boundary (10 pairs per shard, 2 per batch)
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    want = [next(it) for _ in range(5)]
    resumed = make_preference_iterator(cfg, TOK, 4)
    resumed.set_state(state)
    halves = [make_preference_iterator(cfg, TOK, 4, p, 2) for p in range(2)]
    for h in halves:
        h.set_state(state)
    for batch in want:
        got = next(resumed)
        parts = [next(h) for h in halves]
        for k in PAIR_FIELDS:
            np.testing.assert_array_equal(got[k], batch[k])
            np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), batch[k])


def test_builtin_pairs_and_eval_batches_pad_with_empty_rows(tmp_path):
    cfg = make_cfg(max_target_length=16)
    batch = next(make_preference_iterator(cfg, TOK, 8))
    for r in range(8):
        (ids, chosen), (_, rejected) = side(batch, "chosen", r), side(batch, "rejected", r)
        prompt = TOK.decode(ids[: len(ids) - len(chosen)])  # "12*3="
        assert eval(prompt[:-1]) == int(TOK.decode(chosen)) != int(TOK.decode(rejected))
    evals = eval_pair_batches(
        cfg.replace(eval_dataset_path=write_jsonl(tmp_path / "e.jsonl", arithmetic_pairs(5))), TOK, 4, max_batches=3
    )
    assert len(evals) == 2 and real_pairs(evals[1]).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert len(eval_pair_batches(cfg, TOK, 4, max_batches=3)) == 3  # the built-in eval stream


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"prompt": "1+1=", "chosen": "2"}], r"p.jsonl:1: record lacks 'chosen' or 'rejected'"),
        ([{"prompt": "1+1=", "chosen": "2", "rejected": 3}], "p.jsonl:1: fields 'chosen' and 'rejected' must both be"),
        ([{"chosen": "2", "rejected": "3"}], "p.jsonl:1: field 'prompt' must be a string"),
        (
            [{"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]}],
            "must hold exactly one assistant message",
        ),
        ([], "holds no records"),
        (
            [{"prompt": "x" * 40, "chosen": "2", "rejected": "3"}],
            "no preference pair of .* fits in max_target_length=12",
        ),
    ],
)
def test_bad_preference_data_is_one_clear_error(tmp_path, rows, message):
    cfg = make_cfg(dataset_path=write_jsonl(tmp_path / "p.jsonl", rows), max_target_length=12)
    with pytest.raises(DataError, match=message):
        make_preference_iterator(cfg, TOK, 2)


# ---------------------------------------------------------------- (d) end to end through the entry

E2E = [
    "mode=dpo",
    "dpo_beta=0.5",
    *PAIR_E2E,
]


def entry_args(tmp_path, *overrides):
    return [str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", *E2E, *overrides]


def test_dpo_run_raises_reward_accuracy_and_resumes_exactly(tmp_path, capsys):
    """A short run on single-digit sums (chosen the right answer) learns to prefer the right answers;
    a run resumed from its step-6 checkpoint (as after a stop there) repeats steps 6..11 exactly."""
    args = entry_args(
        tmp_path,
        f"dataset_path={write_jsonl(tmp_path / 'train.jsonl', arithmetic_pairs(64))}",
        f"eval_dataset_path={write_jsonl(tmp_path / 'eval.jsonl', arithmetic_pairs(12, held_out=True))}",
        "steps=12",
        "eval_interval=12",
        "checkpoint_period=6",
        "run_name=dpo",
    )
    assert train.main(args) == 0
    straight = metrics_by_step(tmp_path / "dpo")
    assert sorted(straight) == list(range(12))
    np.testing.assert_allclose(straight[0]["loss"], np.log(2), rtol=1e-5)  # the policy starts as the reference
    assert np.mean([straight[s]["rewards/accuracy"] for s in (9, 10, 11)]) > 0.8
    # eval: 12 pairs in batches of 8 (the second one half padding) that the model never trained on
    assert straight[11]["eval_rewards/accuracy"] > 0.8 and straight[11]["eval_loss"] < np.log(2)
    assert straight[11]["num_truncated"] == 0 and straight[11]["tokens_per_sec"] > 0

    shutil.rmtree(tmp_path / "dpo" / "checkpoints" / "12")  # as if the run had stopped after step 6's save
    # the reference in host memory between uses changes where it lives, not a number
    capsys.readouterr()
    assert train.main([*args, "eval_interval=0", "ref_params_host_offload=true"]) == 0
    assert f"resumed from {tmp_path / 'dpo' / 'checkpoints'} at step 6" in capsys.readouterr().out
    resumed = metrics_by_step(tmp_path / "dpo")
    assert sorted(resumed) == list(range(12))
    for step in range(6, 12):
        for name in ("loss", "rewards/accuracy", "rewards/margin", "logps/chosen", "logps/rejected", "grad_norm"):
            assert resumed[step][name] == pytest.approx(straight[step][name], rel=1e-5, abs=1e-6), (step, name)


def test_missing_rejected_key_is_one_line_and_exit_2(tmp_path, capsys):
    bad = write_jsonl(
        tmp_path / "pairs.jsonl",
        [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}, {"prompt": "1+2=", "chosen": "3", "loser": "4"}],
    )
    assert train.main(entry_args(tmp_path, f"dataset_path={bad}", "eval_interval=0")) == 2
    err = capsys.readouterr().err.strip()
    assert f"{bad}:2: record lacks 'chosen' or 'rejected'" in err and "rejected_key" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
