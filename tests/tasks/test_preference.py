"""mode=dpo's preference family beyond DPO's sigmoid loss (dpo_loss_type): each loss against NumPy of
its published formula, the reference-free losses running no reference, KTO's unpaired data and
reference point, and the user errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import REPO, make_cfg, pair_logps_of_model, write_jsonl
from unitrain import losses, sharding, train
from unitrain import step as step_lib
from unitrain.data.preference import LABEL, make_preference_iterator, read_kto_records
from unitrain.data.tokenizer import load_tokenizer
from unitrain.errors import ConfigError, DataError
from unitrain.run import build_run
from unitrain.tasks.dpo import KTO_POINT, DPOTask, completion_lengths, real_pairs

TOK = load_tokenizer("")


def log_sigmoid(x):
    with np.errstate(invalid="ignore"):
        return -np.logaddexp(0.0, -x)


def padded_pairs(seed=0, pairs=10, width=9):
    """Token log-probs of `pairs` chosen and rejected completions of different lengths, right-padded
    (padding holds garbage, which must count nowhere), the last two pairs all padding (an eval
    batch's filler). Returns (batch of the targets_segmentation fields, {name: token log-probs})."""
    rng = np.random.default_rng(seed)
    batch, tokens = {}, {}
    for side in ("chosen", "rejected"):
        lengths = rng.integers(1, width + 1, pairs)
        lengths[-2:] = 0
        mask = (np.arange(width)[None] < lengths[:, None]).astype(np.int32)
        batch[f"{side}_targets_segmentation"] = mask
        for model in ("policy", "ref"):
            tokens[f"{model}_{side}"] = np.where(mask > 0, -rng.gamma(1.0, 0.6, (pairs, width)), 123.0)
    return batch, tokens


def numpy_sequences(batch, tokens):
    """{name: (sum, mean) over each completion's real tokens}, float64 NumPy."""
    out = {}
    for name, lp in tokens.items():
        mask = batch[f"{name.split('_')[1]}_targets_segmentation"] > 0
        total = (lp * mask).sum(-1)
        out[name] = (total, total / np.maximum(mask.sum(-1), 1))
    return out


def numpy_paired(loss_type, seqs, beta, ls, gamma, alpha):
    """Each paired loss as its paper / TRL's docstring writes it: -> (loss [P], metrics {name: [P]})."""
    avg = loss_type in ("ipo", "simpo", "orpo")  # TRL averages over tokens for these
    pc, pr, rc, rr = (
        seqs[k][1 if avg else 0] if k in seqs else None
        for k in ("policy_chosen", "policy_rejected", "ref_chosen", "ref_rejected")
    )
    nll = -seqs["policy_chosen"][1]
    smoothed = lambda z: -(1 - ls) * log_sigmoid(z) - ls * log_sigmoid(-z)  # noqa: E731
    extra = {}
    if loss_type == "ipo":  # Azar et al. 2023; TRL DPOTrainer loss_type="ipo"
        loss, wc, wr = (((pc - rc) - (pr - rr)) - 1 / (2 * beta)) ** 2, beta * (pc - rc), beta * (pr - rr)
    elif loss_type == "simpo":  # Meng et al. 2024, eq. 6; TRL CPOTrainer loss_type="simpo"
        loss, wc, wr = smoothed(beta * pc - beta * pr - gamma), beta * pc, beta * pr
    elif loss_type == "cpo":  # Xu et al. 2024, eq. 3 + NLL; TRL CPOTrainer loss_type="sigmoid" with cpo_alpha
        loss, wc, wr = smoothed(beta * (pc - pr)) + alpha * nll, beta * pc, beta * pr
        extra = {"nll_loss": nll}
    else:  # ORPO, Hong et al. 2024, eqs. 4-7; TRL ORPOTrainer.odds_ratio_loss
        odds = lambda lp: np.exp(lp) / (1 - np.exp(lp))  # noqa: E731
        with np.errstate(divide="ignore", invalid="ignore"):  # the padding pairs (average 0), counted nowhere
            log_or = np.log(odds(pc) / odds(pr))
        loss, wc, wr = nll - beta * log_sigmoid(log_or), beta * pc, beta * pr
        extra = {"nll_loss": nll, "log_odds_ratio": log_sigmoid(log_or), "log_odds_chosen": log_or}
    metrics = {
        "rewards/chosen": wc,
        "rewards/rejected": wr,
        "rewards/accuracy": (wc > wr).astype(float),
        "rewards/margin": wc - wr,
        "logps/chosen": pc,
        "logps/rejected": pr,
        **extra,
    }
    return loss, metrics


def assert_sums(got_sum, got_metrics, want_loss, want_metrics, keep, counts=None):
    np.testing.assert_allclose(got_sum, want_loss[keep].sum(), rtol=2e-5)
    assert set(got_metrics) == set(want_metrics)
    for name, values in want_metrics.items():
        total, count = got_metrics[name]
        mask = keep if counts is None else counts[name]
        assert count == mask.sum(), name
        np.testing.assert_allclose(total, values[mask].sum(), rtol=2e-5, atol=1e-5, err_msg=name)


# ---------------------------------------------------------------- the losses against NumPy


@pytest.mark.parametrize("loss_type", ["ipo", "simpo", "cpo", "orpo"])
def test_paired_losses_equal_numpy_on_padded_pairs(loss_type):
    batch, tokens = padded_pairs()
    ls = 0.15 if loss_type in ("simpo", "cpo") else 0.0
    settings = losses.PreferenceConfig(loss_type, beta=0.7, label_smoothing=ls, simpo_gamma=0.4, cpo_alpha=0.6)
    weights = real_pairs(batch)
    sums = {k: losses.sequence_logprobs(v, batch[f"{k.split('_')[1]}_targets_segmentation"]) for k, v in tokens.items()}
    ref = None if loss_type in ("simpo", "cpo", "orpo") else (sums["ref_chosen"], sums["ref_rejected"])
    loss_sum, (pairs, metrics) = jax.jit(
        lambda pol, ref: losses.preference_loss(pol, ref, completion_lengths(batch), settings, weights=weights)
    )((sums["policy_chosen"], sums["policy_rejected"]), ref)
    want, want_metrics = numpy_paired(loss_type, numpy_sequences(batch, tokens), 0.7, ls, 0.4, 0.6)
    keep = np.asarray(weights) > 0
    assert pairs == 8 and keep.sum() == 8
    assert_sums(loss_sum, metrics, want, want_metrics, keep)


def test_orpo_log_odds_are_finite_for_certain_completions():
    """log(1 - e^x) near x = 0 (a completion the policy is sure of) and far below: finite values and
    gradients, equal to float64 NumPy."""
    x = np.array([-1e-7, -1e-3, -0.5, -0.7, -3.0, -40.0, 0.0])
    got, grad = jax.vmap(jax.value_and_grad(losses.log1mexp))(jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(got[:-1], np.log(-np.expm1(x[:-1])), rtol=1e-5, atol=1e-12)
    np.testing.assert_allclose(grad[:-1], np.exp(x[:-1]) / np.expm1(x[:-1]), rtol=1e-4, atol=1e-12)
    assert np.isfinite(got).all() and np.isfinite(grad).all()
    sure = (jnp.zeros(2), jnp.array([-2.0, -0.5]))  # chosen average log-prob exactly 0
    loss, g = jax.value_and_grad(
        lambda c: losses.preference_loss(
            (c, sure[1]), None, (jnp.ones(2), jnp.ones(2)), losses.PreferenceConfig("orpo")
        )[0]
    )(sure[0])
    assert np.isfinite(loss) and np.isfinite(g).all()


@pytest.mark.parametrize("kl_sign", [1.0, -1.0])
def test_kto_loss_equals_numpy_with_its_reference_point(kl_sign):
    """KTO (Ethayarajh et al. 2024, eq. 8; TRL KTOTrainer.kto_loss): z = max(0, mean over the batch
    of the mismatched pairs' log-ratio) detached, desirable w_d (1 - sigmoid(beta (r - z))),
    undesirable w_u (1 - sigmoid(beta (z - r))); summed log-probs; padding counts nowhere."""
    batch, tokens = padded_pairs(seed=1)
    tokens["ref_rejected"] = tokens["ref_rejected"] - kl_sign * 0.3  # z > 0, or clamped to 0
    label = np.array([1, 0, 0, 1, 1, 0, 1, 1, 0, 1], np.float32)
    settings = losses.PreferenceConfig("kto", beta=0.4, desirable_weight=1.3, undesirable_weight=0.8)
    weights = real_pairs(batch)
    sums = {k: losses.sequence_logprobs(v, batch[f"{k.split('_')[1]}_targets_segmentation"]) for k, v in tokens.items()}
    z = losses.kto_reference_point(sums["policy_rejected"], sums["ref_rejected"], weights)
    z_grad = jax.grad(lambda p: losses.kto_reference_point(p, sums["ref_rejected"], weights))(sums["policy_rejected"])
    loss_sum, (records, metrics) = losses.kto_loss(
        sums["policy_chosen"], sums["ref_chosen"], label, jnp.full(10, z), settings, weights=weights
    )

    seqs = numpy_sequences(batch, tokens)
    keep = np.asarray(weights) > 0
    kl = seqs["policy_rejected"][0] - seqs["ref_rejected"][0]
    want_z = max(0.0, kl[keep].mean())
    assert (want_z > 0) == (kl_sign > 0) and not np.asarray(z_grad).any()  # detached
    np.testing.assert_allclose(z, want_z, rtol=1e-5, atol=1e-7)
    r = seqs["policy_chosen"][0] - seqs["ref_chosen"][0]
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    want = np.where(label > 0, 1.3 * (1 - sig(0.4 * (r - want_z))), 0.8 * (1 - sig(0.4 * (want_z - r))))
    good, bad = keep & (label > 0), keep & (label == 0)
    want_metrics = {
        "rewards/chosen": 0.4 * r,
        "logps/chosen": seqs["policy_chosen"][0],
        "rewards/rejected": 0.4 * r,
        "logps/rejected": seqs["policy_chosen"][0],
        "kl": np.full(10, want_z),
    }
    counts = {"rewards/chosen": good, "logps/chosen": good, "rewards/rejected": bad, "logps/rejected": bad, "kl": keep}
    assert records == 8
    assert_sums(loss_sum, metrics, want, want_metrics, keep, counts)


# ---------------------------------------------------------------- the task


def calls_of(monkeypatch, run) -> list:
    """The names of the programs `run` runs from now on, in order."""
    names = []
    compiled = run.programs.compiled

    def spy(name, *args, **kwargs):
        names.append(name)
        return compiled(name, *args, **kwargs)

    monkeypatch.setattr(run.programs, "compiled", spy)
    return names


def test_reference_free_loss_copies_and_runs_no_reference_and_equals_numpy(monkeypatch):
    """orpo: no reference copy is made, a step runs the update alone (no separate forward), eval one
    forward of the policy; the step's loss and metrics equal NumPy of the model's logits."""
    cfg = make_cfg(mode="dpo", dpo_loss_type="orpo", dpo_beta=0.5, max_target_length=16, eval_interval=1, eval_steps=1)
    run, state = build_run(cfg)
    monkeypatch.setattr(step_lib, "frozen_copy", lambda *a: pytest.fail("a reference copy was made"))
    task = DPOTask(run)
    assert task.ref is None
    batch = next(make_preference_iterator(cfg, TOK, run.layout.rows_per_update))
    model = pair_logps_of_model(run, state["params"], batch)
    seqs = {f"policy_{side}": (s, s / n) for side, (s, n) in model.items()}
    want, want_metrics = numpy_paired("orpo", seqs, 0.5, 0.0, 0.0, 0.0)

    names = calls_of(monkeypatch, run)
    task.evaluate(state["params"], 0)
    assert names == ["dpo_eval_logps", "dpo_eval"]
    names.clear()
    _, metrics = task.step(state, 0)
    assert names == ["train_step"]
    metrics = jax.device_get(metrics)
    np.testing.assert_allclose(metrics["loss"], want.mean(), rtol=1e-5)
    for name, values in want_metrics.items():
        np.testing.assert_allclose(metrics[name], values.mean(), rtol=1e-5, atol=1e-5, err_msg=name)


def test_kto_task_loss_equals_numpy_from_the_models_logits():
    """kto on the built-in task's unpaired records: the task's z (over the global batch) and loss equal NumPy of the model's logits,
    with a reference moved away from the start so that z > 0."""
    cfg = make_cfg(
        mode="dpo", dpo_loss_type="kto", dpo_beta=0.5, kto_undesirable_weight=1.5, max_target_length=16, eval_interval=0
    )
    run, state = build_run(cfg)
    task = DPOTask(run)
    local = next(make_preference_iterator(cfg, TOK, run.layout.rows_per_update))
    local.pop("num_truncated")
    label = local[LABEL]
    assert set(label.tolist()) == {0.0, 1.0}
    batch = sharding.local_rows_to_global(local, task.batch_shardings())
    scored = jax.device_get(task.pair_logps_of_both("pair_logps", task.logps_fn, state["params"], batch))
    assert (scored[KTO_POINT] == 0).all()  # the policy is the reference: z = 0
    shift = np.random.default_rng(0).normal(-0.5, 0.3, label.shape).astype(np.float32)
    scored = {
        **scored,
        "ref_chosen_logps": scored["ref_chosen_logps"] + shift,
        "ref_rejected_logps": scored["ref_rejected_logps"] + shift,
    }
    scored[KTO_POINT] = jax.device_get(task.reference_point({**batch, **scored}))
    with jax.set_mesh(run.mesh):
        loss_sum, (records, metrics) = jax.jit(task.loss)(state["params"], {**batch, **scored})

    model = pair_logps_of_model(run, state["params"], local)
    z = max(0.0, (model["rejected"][0] - scored["ref_rejected_logps"]).mean())
    assert z > 0
    np.testing.assert_allclose(scored[KTO_POINT], z, rtol=1e-4)
    r = model["chosen"][0] - scored["ref_chosen_logps"]
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    want = np.where(label > 0, 1 - sig(0.5 * (r - z)), 1.5 * (1 - sig(0.5 * (z - r))))
    assert records == len(label)
    np.testing.assert_allclose(loss_sum, want.sum(), rtol=1e-4)
    np.testing.assert_allclose(metrics["rewards/chosen"][0], 0.5 * r[label > 0].sum(), rtol=1e-4)


E2E = [
    "mode=dpo",
    "max_target_length=16",
    "per_device_batch_size=1",
    "peak_flops_per_device=1e12",
    "log_period=1",
    "warmup_steps=2",
    "learning_rate=1e-2",
    "checkpoint_period=100",
    "eval_interval=0",
    "steps=10",
]


def sums_of_digits(n, kto=False):
    """n single-digit sums: pairs (chosen the right answer, rejected a wrong one), or for kto
    unpaired records alternating the right answer (desirable) and a wrong one."""
    rows = [(f"{j // 10}+{j % 10}=", j // 10 + j % 10) for j in range(n)]
    if kto:
        return [
            {"prompt": p, "completion": str(a if i % 2 else a + 10), "label": bool(i % 2)}
            for i, (p, a) in enumerate(rows)
        ]
    return [{"prompt": p, "chosen": str(a), "rejected": str(a + 10)} for p, a in rows]


@pytest.mark.parametrize(
    "loss_type, learned",
    [("orpo", "rewards/accuracy"), ("kto", None)],
)
def test_short_runs_learn_the_preference(tmp_path, loss_type, learned):
    """Through the entry, on single-digit sums: orpo comes to rank the right answer above the wrong
    one; kto's implicit reward of the desirable records climbs above the undesirable ones'."""
    data = write_jsonl(tmp_path / "d.jsonl", sums_of_digits(64, kto=loss_type == "kto"))
    args = [str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", *E2E, f"dataset_path={data}"]
    evals = [f"eval_dataset_path={data}", "eval_interval=10", "eval_steps=1"]
    assert train.main([*args, *evals, f"dpo_loss_type={loss_type}", "run_name=r"]) == 0
    rows = {}
    for line in open(tmp_path / "r" / "metrics.jsonl"):  # a step's eval metrics on a line of their own
        row = json.loads(line)
        rows.setdefault(row.pop("step"), {}).update(row)
    assert sorted(rows) == list(range(10))
    late = [rows[s] for s in (7, 8, 9)]
    if learned:
        assert np.mean([r[learned] for r in late]) > 0.8
    else:
        assert rows[0]["kl"] == 0.0 and rows[0]["rewards/chosen"] == 0.0
        assert np.mean([r["rewards/chosen"] - r["rewards/rejected"] for r in late]) > 0.0
    assert np.mean([r["loss"] for r in late]) < rows[0]["loss"]
    assert np.isfinite(rows[9]["eval_loss"]) and ("eval_kl" in rows[9]) == (loss_type == "kto")


# ---------------------------------------------------------------- user errors


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"dpo_loss_type": "orpo", "kl_coef": 0.1}, "dpo_loss_type=orpo has no reference model; kl_coef is grpo's"),
        ({"dpo_loss_type": "sigmoid", "kl_coef": 0.1}, "holds the policy to the reference by dpo_beta"),
        ({"dpo_loss_type": "simpo", "ref_params_host_offload": True}, "simpo has no reference model to offload"),
        ({"dpo_loss_type": "ipo", "dpo_label_smoothing": 0.1}, "dpo_loss_type=ipo has none"),
        ({"dpo_loss_type": "kto", "rl_packing": True}, "kto's unpaired records are not packed"),
        ({"mode": "rm", "dpo_loss_type": "orpo"}, "dpo_loss_type=orpo is a loss of mode=dpo; mode is rm"),
    ],
)
def test_keys_the_loss_has_not_are_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_cfg(**{"mode": "dpo", **overrides})


def test_kto_data_without_labels_and_orpo_with_kl_coef_exit_2_in_one_line(tmp_path, capsys):
    records = sums_of_digits(4, kto=True)
    del records[2]["label"]
    bad = write_jsonl(tmp_path / "k.jsonl", records)
    base = [str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", *E2E]
    for args, message in (
        ([f"dataset_path={bad}", "dpo_loss_type=kto"], f"{bad}:3: a KTO record needs the boolean field 'label'"),
        (["dpo_loss_type=orpo", "kl_coef=0.05"], "dpo_loss_type=orpo has no reference model"),
    ):
        assert train.main([*base, *args]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def message_record(row):
    return {"prompt_messages": row["q"], "chosen_message": row["c"][0]}


def test_kto_records_pair_each_prompt_with_the_previous_completion(tmp_path):
    rows = [{"q": f"{i}+1=", "c": str(i + 1), "ok": i % 3 != 0} for i in range(5)]
    cfg = make_cfg(
        mode="dpo",
        dpo_loss_type="kto",
        dataset_path=write_jsonl(tmp_path / "k.jsonl", rows),
        prompt_key="q",
        completion_key="c",
        kto_label_key="ok",
        max_target_length=12,
        shuffle=False,
    )
    batch = next(make_preference_iterator(cfg, TOK, 5))
    assert batch[LABEL].tolist() == [0.0, 1.0, 1.0, 0.0, 1.0] and batch[LABEL].dtype == np.float32
    for r in range(5):
        for side, completion in (("chosen", rows[r]["c"]), ("rejected", rows[r - 1]["c"])):  # row 0: the last's
            seg = batch[f"{side}_inputs_segmentation"][r]
            assert batch[f"{side}_inputs"][r][seg > 0].tolist() == [
                TOK.bos_id,
                *TOK.encode(rows[r]["q"] + completion),
                TOK.eos_id,
            ]
    with pytest.raises(DataError, match="k.jsonl:1: a KTO record needs the boolean field 'label'"):
        make_preference_iterator(cfg.replace(kto_label_key="label"), TOK, 2)
    messages = [
        {
            "q": [{"role": "user", "content": f"{i}+1="}],
            "c": [{"role": "assistant", "content": str(i + 1)}],
            "ok": i > 0,
        }
        for i in range(2)
    ]
    assert read_kto_records(write_jsonl(tmp_path / "c.jsonl", messages), "q", "c", "ok") == [
        {**message_record(messages[0]), "rejected_message": messages[1]["c"][0], LABEL: False},
        {**message_record(messages[1]), "rejected_message": messages[0]["c"][0], LABEL: True},
    ]
    mixed = [
        {"q": "1=", "c": "1", "ok": True},
        {"q": [{"role": "user", "content": "1="}], "c": [{"role": "assistant", "content": "1"}], "ok": False},
    ]
    with pytest.raises(DataError, match="all plain texts or all messages"):
        make_preference_iterator(cfg.replace(dataset_path=write_jsonl(tmp_path / "m.jsonl", mixed)), TOK, 2)
