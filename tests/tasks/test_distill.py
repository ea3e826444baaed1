"""Distillation (tasks/teacher.py). On-policy: teachers of any source score the student's sampled
tokens in the RL step's logprob pass, equal to transformers' forward of the same checkpoints; the
per-token reverse-KL advantage equals its NumPy formula; a GRPO run with a teacher, with and without
the outcome reward, logs distill/teacher_kl. Offline (mode=sft): the top-k soft-target loss equals
its NumPy formula, chunked or not, on a fixed padded batch and on three models' logits, each
teacher's KL logged beside their weighted one; an SFT run with a teacher logs distill/kl. The bad inputs are one line and exit 2."""

import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import (
    GRPO_FAST,
    REPO,
    SFT_FAST,
    grpo_config,
    grpo_rows,
    log_softmax,
    make_cfg,
    make_step,
    sft_config,
    small_model_config,
    torch_logits,
)
from unitrain import losses, modes, reward_model, run, sharding, train
from unitrain.data.tokenizer import load_tokenizer
from unitrain.errors import ConfigError
from unitrain.tasks.teacher import distill

# float32 on both sides (measured: at most 5e-6 on logprobs down to -12); the student's own
# logprobs of the same tokens are 2 to 6 away.
TOL = 1e-4


@pytest.fixture(scope="module")
def builtin_teachers(tiny_checkpoint, tmp_path_factory) -> list[str]:
    """A tiny HF Llama and a tiny HF Qwen3-MoE (512 embeddings, as the student's default model)
    with the student's built-in character tokenizer in place of their own."""
    out = []
    for family, variant in (("llama", dict(rope_scaling="llama3")), ("qwen3_moe", dict(experts=(4, 2, 32)))):
        path = tmp_path_factory.mktemp(f"teacher_{family}") / "hf"
        shutil.copytree(tiny_checkpoint(family, **variant), path)
        for old in [*path.glob("tokenizer*"), *path.glob("special_tokens_map.json")]:
            old.unlink()
        load_tokenizer("").save(str(path))
        out.append(str(path))
    return out


def trajectory_rows(rows: int, P: int, C: int) -> dict:
    """`rows` rows in the RL step's layout (groups of 4 sharing a prompt left-padded to end at column
    P, completions right-padded to C) with multi-turn loss masks: an environment's reply (mask 0)
    between two sampled turns."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(4, 100, rng.integers(2, P + 1)) for _ in range(rows // 4)]
    inputs, positions, segments = grpo_rows(rng, prompts, 4, P, C, 100)
    targets = inputs[:, P:].copy()
    mask = segments[:, P:].copy()
    mask[:, 3:5] = 0  # the environment's tokens
    return {
        "inputs": inputs,
        "inputs_position": positions,
        "inputs_segmentation": segments,
        "targets": targets,
        "loss_mask": mask,
    }


def torch_token_logprobs(path, row: dict, P: int) -> np.ndarray:
    """transformers' float32 logprobs of a row's completion tokens, the row's padding left out."""
    real = row["inputs_segmentation"] > 0
    tokens = row["inputs"][real]
    start = int(np.argmax(real))
    logp = log_softmax(torch_logits(path, tokens).astype(np.float64))
    completion = len(tokens) - (P - start)
    cols = np.arange(completion)
    return logp[P - start - 1 + cols, row["targets"][cols]]


def test_teachers_score_the_sampled_tokens_as_transformers_does(builtin_teachers, tmp_path):
    """A dense and an MoE teacher, both in the logprob pass (offloaded to the host), on right-padded
    multi-turn rows: each equals transformers' forward of its checkpoint; the student's old logprobs
    come from the same program."""
    cfg = grpo_config(
        tmp_path,
        f"teacher_path={','.join(builtin_teachers)}",
        "teacher_weights=[0.75, 0.25]",
        "distill_coef=1.0",
        "teacher_host_offload=true",
    )
    task, _, params, _ = make_step(cfg)
    assert [t.weight for t in task.teachers] == [0.75, 0.25]
    P, C = 8, 16
    batch = trajectory_rows(16, P, C)
    out = task.logprobs(params, batch)
    assert set(out) == {"old_logprobs", "teacher_logprobs_0", "teacher_logprobs_1"}
    for r in (0, 5, 15):
        row = {k: v[r] for k, v in batch.items()}
        length = int(row["inputs_segmentation"][P:].sum())
        for i, path in enumerate(builtin_teachers):
            expected = torch_token_logprobs(path, row, P)
            np.testing.assert_allclose(out[f"teacher_logprobs_{i}"][r, :length], expected, atol=TOL, rtol=0)
    # The step's term on these rows: the weighted KL on the sampled tokens alone (not the
    # environment's, not the padding), the row's outcome advantage beside it.
    outcome = np.linspace(-1, 1, 16).astype(np.float32)
    got, metrics = distill(task.teachers, cfg, outcome, {**batch, **out})
    teachers = [out["teacher_logprobs_0"], out["teacher_logprobs_1"]]
    want, kl = numpy_distill(
        outcome,
        out["old_logprobs"],
        teachers,
        [0.75, 0.25],
        batch["loss_mask"],
        1.0,
        1.0,
    )
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert metrics["distill/teacher_kl"] == pytest.approx(kl.sum() / batch["loss_mask"].sum(), rel=1e-5)
    # distill_kl_discount: each sampled token's term the discounted KL to its row's end, the
    # environment's tokens skipped; the KL metric stays the tokens' own
    discounted, same = distill(task.teachers, cfg.replace(distill_kl_discount=0.5), outcome, {**batch, **out})
    want = numpy_distill(outcome, out["old_logprobs"], teachers, [0.75, 0.25], batch["loss_mask"], 1.0, 1.0, 0.5)[0]
    np.testing.assert_allclose(discounted, want, atol=1e-5)
    assert same == metrics and not np.allclose(discounted, got, atol=1e-3)
    for i in (0, 1):  # each teacher's own reverse KL beside the weighted total
        own = np.where(batch["loss_mask"] > 0, out["old_logprobs"] - out[f"teacher_logprobs_{i}"], 0.0)
        assert metrics[f"distill/teacher_kl/{i}"] == pytest.approx(own.sum() / batch["loss_mask"].sum(), rel=1e-5)


def test_a_lora_run_teaches_as_its_merged_export(builtin_teachers, tmp_path):
    """A LoRA run's checkpoint holds its adapters alone; as teacher_path it is rebuilt from the run's
    config.yml (its base, its lora_* keys) and merged: its logprobs of the sampled tokens are
    transformers' forward of the merged model the run exported."""
    export = tmp_path / "export"
    lora_run = sft_argv(
        tmp_path,
        "run_name=lora",
        f"load_parameters_path={builtin_teachers[0]}",
        "lora_rank=4",
        "lora_alpha=8.0",
        "lora_target=layers/(wq|wo|w_down)|lm_head",
        "learning_rate=1e-2",
        "warmup_steps=0",
        f"export_hf_path={export}",
    )
    assert train.main(lora_run) == 0
    cfg = grpo_config(tmp_path, f"teacher_path={tmp_path / 'lora'}", "distill_coef=1.0")
    task, _, params, _ = make_step(cfg)
    P, C = 8, 16
    batch = trajectory_rows(16, P, C)
    scored = task.logprobs(params, batch)["teacher_logprobs_0"]
    for r in (0, 5, 15):
        row = {k: v[r] for k, v in batch.items()}
        length = int(row["inputs_segmentation"][P:].sum())
        np.testing.assert_allclose(scored[r, :length], torch_token_logprobs(export, row, P), atol=TOL, rtol=0)
        # the adapters moved the model off its base
        assert np.abs(scored[r, :length] - torch_token_logprobs(builtin_teachers[0], row, P)).max() > 1e-3
    # what the memory check counts of it: its base's parameters, not the adapters' alone
    assert reward_model.parameter_count(str(tmp_path / "lora")) == reward_model.parameter_count(builtin_teachers[0])


def numpy_distill(advantages, old, teachers, weights, mask, coef, reward_weight, discount=0.0):
    """Reverse KL per sampled token, KL_t = sum_i w_i (log pi(x_t) - log pi_i(x_t)) (Thinking
    Machines, "On-Policy Distillation": the per-token reverse KL as the negative advantage); with a
    discount, tinker-cookbook's discounted future sum of it, over each row's sampled tokens alone."""
    kl = np.where(mask > 0, sum(w * (old - t) for w, t in zip(weights, teachers)), 0.0)
    term = kl.copy()
    for r in range(len(kl)):
        later = 0.0
        for t in reversed(np.flatnonzero(mask[r] > 0)):
            term[r, t] = later = kl[r, t] + discount * later
    outcome = advantages[:, None] if advantages.ndim == 1 else advantages
    return np.where(mask > 0, reward_weight * outcome - coef * term, 0.0), kl


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize(("reward_weight", "discount"), [(0.0, 0.0), (0.5, 0.0), (0.0, 0.9), (0.5, 1.0)])
def test_the_distillation_advantage_is_the_numpy_formula(per_token, reward_weight, discount):
    rng = np.random.default_rng(0)
    B, T = 6, 9
    mask = (np.arange(T) < rng.integers(1, T + 1, B)[:, None]).astype(np.int32)  # right padding
    mask[:, 2] = 0  # an environment token
    lp = lambda: (-2.0 + rng.normal(size=(B, T))).astype(np.float32)  # noqa: E731
    old, teachers, weights = lp(), [lp(), lp()], [0.7, 0.3]
    advantages = rng.normal(size=(B, T) if per_token else B).astype(np.float32)
    got, kl = losses.distill_advantages(advantages, old, teachers, weights, mask, 0.8, reward_weight, discount)
    want, want_kl = numpy_distill(advantages, old, teachers, weights, mask, 0.8, reward_weight, discount)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)
    np.testing.assert_allclose(np.asarray(kl), want_kl, atol=1e-6)


def run_argv(tmp_path, *overrides) -> list[str]:
    return [str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", *GRPO_FAST, "steps=2", *overrides]


def test_a_grpo_run_distils_from_a_teacher_with_and_without_the_outcome_reward(builtin_teachers, tmp_path):
    """Two runs from the same seed, so their first rollouts are the same. One update a step at ratio
    1: the token-mean loss is the mean of -advantage_t, which without the outcome reward is the
    logged mean reverse KL (distill_coef 1); with it, the rewards change the gradient."""
    runs = {}
    for name, weight, offload in (("pure", 0.0, "true"), ("with_reward", 1.0, "false")):
        argv = run_argv(
            tmp_path,
            f"run_name={name}",
            f"teacher_path={builtin_teachers[0]}",
            f"teacher_host_offload={offload}",
            "distill_coef=1.0",
            f"distill_reward_weight={weight}",
            "reward=format",
            "format_reward_pattern=[a-z]",  # about half the untrained model's answers: rewards that vary
        )
        assert train.main(argv) == 0
        runs[name] = [json.loads(l) for l in open(tmp_path / name / "metrics.jsonl") if '"loss"' in l]
        assert len(runs[name]) == 2
    for line in runs["pure"] + runs["with_reward"]:
        # The random teacher and student disagree: the sampled tokens' reverse KL is far from 0.
        assert math.isfinite(line["distill/teacher_kl"]) and line["distill/teacher_kl"] > 0.5
    for line in runs["pure"]:
        assert line["loss"] == pytest.approx(line["distill/teacher_kl"], rel=1e-4)
    pure, with_reward = runs["pure"][0], runs["with_reward"][0]
    assert pure["distill/teacher_kl"] == with_reward["distill/teacher_kl"] and with_reward["reward_std"] > 0
    assert abs(pure["grad_norm"] - with_reward["grad_norm"]) > 1e-3 * pure["grad_norm"]
    # Two teachers, the second a unitrain run (the student 2 steps on, with the built-in tokenizer its
    # config.yml records): the first step's rollouts are the same, so its KL is half the HF
    # teacher's plus half that to the run's, which is close to the student it started from (measured:
    # 1.262 against 0.5 * 2.390).
    argv = run_argv(
        tmp_path,
        "run_name=two",
        "steps=1",
        f"teacher_path={builtin_teachers[0]},{tmp_path / 'pure'}",
        "teacher_weights=[0.5, 0.5]",
        "distill_coef=1.0",
        "reward=format",
        "format_reward_pattern=[a-z]",
    )
    assert train.main(argv) == 0
    (two,) = [json.loads(l) for l in open(tmp_path / "two" / "metrics.jsonl") if '"loss"' in l]
    assert two["distill/teacher_kl"] == pytest.approx(0.5 * pure["distill/teacher_kl"], abs=0.1)
    assert two["distill/teacher_kl"] != pytest.approx(0.5 * pure["distill/teacher_kl"], abs=1e-4)
    # Each teacher's own KL beside the total: the first's is the one-teacher run's, the weights mix them.
    assert two["distill/teacher_kl/0"] == pytest.approx(pure["distill/teacher_kl"], rel=1e-5)
    kl = 0.5 * two["distill/teacher_kl/0"] + 0.5 * two["distill/teacher_kl/1"]
    assert two["distill/teacher_kl"] == pytest.approx(kl, rel=1e-5) and "distill/teacher_kl/0" not in pure


@pytest.mark.parametrize("mode", ["grpo", "ppo"])
def test_a_multi_turn_workflow_distils_on_its_sampled_turns(builtin_teachers, tmp_path, capsys, mode):
    """plugin_verifier's episodes (an answer, the feedback, another answer): the teacher scores the
    trajectory's rows as any others; the loss, all distillation, is the logged KL of the sampled
    tokens, and the step learns though no reward spreads (the untrained model never answers right).
    PPO's GAE advantages give way to the KL term as GRPO's do."""
    argv = run_argv(
        tmp_path,
        f"mode={mode}",
        "steps=1",
        "workflow=plugin_verifier:Verifier",
        "max_turns=2",
        f"teacher_path={builtin_teachers[0]}",
        "distill_coef=1.0",
        "distill_reward_weight=0.0",
    )
    assert train.main(argv) == 0
    (line,) = [json.loads(l) for l in open(tmp_path / "default" / "metrics.jsonl") if '"loss"' in l]
    assert line["response_length_mean"] > 6  # two answers and the feedback between them
    assert math.isfinite(line["distill/teacher_kl"]) and line["distill/teacher_kl"] > 0.5
    assert line["loss"] == pytest.approx(line["distill/teacher_kl"], rel=1e-4)
    assert line["zero_std_group_fraction"] == 1.0 and "trained on nothing" not in capsys.readouterr().out


# ---------------------------------------------------------------- offline distillation (mode=sft)


def numpy_soft_targets(teacher, T, k) -> np.ndarray:
    """Top-k KD's target distribution over the whole vocabulary, float64 [..., V]: the teacher's
    k likeliest tokens of softmax(logits / T), renormalised over them, 0 elsewhere."""
    logp = log_softmax(np.asarray(teacher, np.float64) / T)
    top = np.argsort(-logp, axis=-1)[..., :k]
    p = np.zeros_like(logp)
    np.put_along_axis(p, top, np.take_along_axis(np.exp(logp), top, -1), -1)
    return p / p.sum(-1, keepdims=True)


def numpy_soft_target_loss(student, teachers, weights, targets, mask, coef, T, k):
    """Hinton et al. 2015's loss with top-k soft targets p_i (numpy_soft_targets), from full
    softmaxes in float64, against the student's q = softmax(logits / T) over its whole vocabulary;
    per label token (1 - coef) * CE(label) + coef * T^2 * sum_i w_i KL(p_i || q). Returns (loss sum,
    weighted KL sum, [each teacher's KL sum]) over mask, and the loss's gradient in the student's
    logits, by hand: per label token (1 - coef) * (softmax(logits) - onehot(label)) + coef * T * sum_i w_i (q - p_i)."""
    student = np.asarray(student, np.float64)
    logq = log_softmax(student / T)
    each, pull = [], 0.0
    for w, teacher in zip(weights, teachers):
        p = numpy_soft_targets(teacher, T, k)
        each.append((p * (np.log(np.where(p > 0, p, 1.0)) - logq)).sum(-1)[mask > 0].sum())
        pull = pull + w * (np.exp(logq) - p)
    kl = sum(w * e for w, e in zip(weights, each))
    logits = log_softmax(student)
    ce = -np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    onehot = np.eye(student.shape[-1])[targets]
    grad = ((1 - coef) * (np.exp(logits) - onehot) + coef * T * pull) * mask[..., None]
    return (1 - coef) * ce[mask > 0].sum() + coef * T**2 * kl, kl, each, grad


def test_the_soft_target_loss_is_the_numpy_formula():
    """Two teachers on a right-padded batch; the head the identity, so the logits are the hidden
    states. The loss, its KL and its gradient are NumPy's, all at once and in chunks of 3
    positions of 10 (the last one padded)."""
    rng = np.random.default_rng(1)
    B, T, V, k = 3, 10, 40, 5
    mask = (np.arange(T) < np.array([10, 6, 1])[:, None]).astype(np.float32)
    student, *teachers = (rng.normal(size=(B, T, V)).astype(np.float32) * 3 for _ in range(3))
    targets = rng.integers(0, V, (B, T))
    want, want_kl, want_each, want_grad = numpy_soft_target_loss(
        student, teachers, [0.7, 0.3], targets, mask, 0.4, 2.0, k
    )

    def loss(student, chunk):
        soft = [losses.teacher_targets(lambda h: h, t, chunk, k, 2.0, V) for t in teachers]
        stats, kl = losses.distill_token_stats(lambda h: h, student, targets, soft, chunk, 2.0)
        total, count, _, kl_sum, each = losses.distill_cross_entropy(stats, kl, [0.7, 0.3], mask, 0.4, 2.0)
        return total, (count, kl_sum, each)

    for chunk in (0, 3):
        (got, (count, kl_sum, each)), grad = jax.value_and_grad(loss, has_aux=True)(student, chunk)
        assert float(count) == 17
        np.testing.assert_allclose([float(got), float(kl_sum), *each], [want, want_kl, *want_each], rtol=1e-5)
        np.testing.assert_allclose(grad, want_grad, atol=1e-5)


def numpy_kl(p, q):
    return (p * np.log(np.where(p > 0, p / np.where(q > 0, q, 1.0), 1.0))).sum(-1)


def numpy_gkd(student, teacher, T, k, beta):
    """GKD's generalised JSD per position over the teacher's top-k (TRL GKDTrainer.generalized_jsd_loss's
    docstring and convention: beta 0 the forward KL(teacher || student), beta 1 the reverse
    KL(student || teacher), between them beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q),
    p the teacher's top-k soft targets and q the student's softmax(logits / T) renormalised over the
    same k tokens, in float64."""
    p = numpy_soft_targets(teacher, T, k)
    q = np.where(p > 0, np.exp(log_softmax(np.asarray(student, np.float64) / T)), 0.0)
    q = q / q.sum(-1, keepdims=True)
    if beta == 0:
        return numpy_kl(p, q)
    if beta == 1:
        return numpy_kl(q, p)
    m = beta * p + (1 - beta) * q
    return beta * numpy_kl(p, m) + (1 - beta) * numpy_kl(q, m)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_gkd_divergence_is_the_numpy_formula(beta):
    """Over a teacher's top 6 tokens at T 1.5, all positions of 2 x 5, in chunks of 2: at beta 0
    and 1 the two KLs, at 0.5 the mixture's JSD; no two of the three agree."""
    rng = np.random.default_rng(2)
    student, teacher = (rng.normal(size=(2, 5, 30)).astype(np.float32) * 3 for _ in range(2))
    soft = losses.teacher_targets(lambda h: h, teacher, 2, 6, 1.5, 30)
    got = losses.chunked(lambda h, s: losses.soft_target_divergence(h, s, 1.5, beta), 2, student, soft)
    np.testing.assert_allclose(got, numpy_gkd(student, teacher, 1.5, 6, beta), rtol=1e-5, atol=1e-6)
    others = [numpy_gkd(student, teacher, 1.5, 6, b) for b in (0.0, 0.5, 1.0) if b != beta]
    assert all(np.abs(np.asarray(got) - other).max() > 1e-2 for other in others)


def test_the_compiled_distillation_gradient_holds_no_full_logits():
    """A student and a wider teacher of vocabulary 16384, 16 rows of 128: one model's full float32
    logits are 128 MiB, and the unchunked gradient of the loss needs more than two of them; with
    chunks of 16 positions (16 MiB of each model's logits) the whole step needs less than one."""
    from unitrain.models import decoder

    def abstract(emb_dim):
        cfg = small_model_config(vocab_size=16384, emb_dim=emb_dim, num_decoder_layers=1)
        return nnx.split(nnx.eval_shape(lambda: decoder.create(cfg)))

    (student, params), (teacher, teacher_params) = abstract(32), abstract(48)
    B, T = 16, 128
    ints = jax.ShapeDtypeStruct((B, T), jnp.int32)
    full_logits = B * T * 16384 * 4

    def temp_bytes(chunk):
        def loss(p, q, tokens):
            rows = (tokens, jnp.broadcast_to(jnp.arange(T), (B, T)), jnp.ones_like(tokens))
            t = nnx.merge(teacher, q)
            soft = [losses.teacher_targets(t.logits, t.hidden_states(*rows), chunk, 64, 2.0, 16384)]
            m = nnx.merge(student, p)
            stats, kl = losses.distill_token_stats(m.logits, m.hidden_states(*rows), tokens, soft, chunk, 2.0)
            return losses.distill_cross_entropy(stats, kl, [1.0], jnp.ones((B, T)), 0.5, 2.0)[0]

        compiled = jax.jit(jax.grad(loss)).lower(params, teacher_params, ints).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp_bytes(0) > 2 * full_logits  # measured: 4.1 of them
    assert temp_bytes(16) < full_logits  # measured: 0.6 (the step's temporaries grow with the chunk)


def sft_task(cfg):
    """(the run, its state, the SFT task, its first batch on the host)."""
    built, state = run.build_run(cfg)
    task = modes.create(built)
    batch = next(task.data_iterator)
    batch.pop("num_truncated")
    return built, state, task, batch


def test_the_sft_distillation_loss_is_the_numpy_formula_of_the_models(builtin_teachers, tmp_path):
    """mode=sft's loss with two teachers (an HF Llama and an HF Qwen3-MoE of 512 embeddings, weighed
    0.75 and 0.25) on a packed batch of the built-in task, through the update's chunked path (8
    positions of 32) and all at once: both are NumPy's formula on the three models' full logits, its
    weighted KL logged as distill/kl and each teacher's own as distill/kl/<i>; so is GKD's (gkd_beta
    0.5) in the KL's place; the CE alone without the teachers' parameters."""
    cfg = sft_config(
        tmp_path,
        f"teacher_path={','.join(builtin_teachers)}",
        "teacher_weights=[0.75, 0.25]",
        "distill_coef=0.6",
        "distill_temperature=1.5",
        "distill_top_k=7",
        "logits_chunk_size=8",
    )
    built, state, task, batch = sft_task(cfg)
    params, teachers, weights = state["params"], task.teachers, [0.75, 0.25]
    rows = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    forward = jax.jit(lambda graphdef, p: nnx.merge(graphdef, p)(*rows)[0], static_argnums=0)
    student = forward(built.graphdef, params)
    teacher_logits = [forward(t.graphdef, t.params) for t in teachers]
    teacher_params = [t.params for t in teachers]
    mask = batch["targets_segmentation"] > 0
    want, want_kl, want_each, _ = numpy_soft_target_loss(
        student, teacher_logits, weights, batch["targets"], mask, 0.6, 1.5, 7
    )
    assert abs(want_each[0] - want_each[1]) > 1e-3 * want_kl  # 10 times the tolerance: each is its own
    for chunk in (8, 0):
        task.cfg = cfg.replace(logits_chunk_size=chunk)  # read as the loss is traced: one trace each
        got, (count, metrics) = jax.jit(lambda *args: task.loss(*args))(params, batch, *teacher_params)
        assert float(count) == mask.sum()
        logged = [float(metrics[k][0]) for k in ("distill/kl", "distill/kl/0", "distill/kl/1")]
        np.testing.assert_allclose([float(got), *logged], [want, want_kl, *want_each], rtol=1e-4)
    ce, (_, metrics) = jax.jit(task.loss)(params, batch)
    assert float(ce) == pytest.approx(float(metrics["nll"][0])) and float(ce) != pytest.approx(want, rel=1e-3)
    task.cfg = cfg.replace(gkd_beta=0.5)
    got, (_, metrics) = jax.jit(lambda *args: task.loss(*args))(params, batch, *teacher_params)
    jsd = [numpy_gkd(student, t, 1.5, 7, 0.5)[mask].sum() for t in teacher_logits]
    assert "distill/kl" not in metrics
    logged = [float(metrics[k][0]) for k in ("distill/jsd", "distill/jsd/0", "distill/jsd/1")]
    np.testing.assert_allclose(logged, [0.75 * jsd[0] + 0.25 * jsd[1], *jsd], rtol=1e-4)
    np.testing.assert_allclose(float(got), 0.4 * float(ce) + 0.6 * 1.5**2 * logged[0], rtol=1e-4)


def sft_argv(tmp_path, *overrides) -> list[str]:
    return [str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", *SFT_FAST, "steps=2", *overrides]


def test_an_sft_run_distils_from_a_teacher(builtin_teachers, tmp_path):
    """Two steps of SFT on the built-in task with an MoE teacher kept in host memory, two
    micro-batches an update: the logged loss is the labels' NLL and the teacher's KL mixed by
    distill_coef, T^2 on the KL (no z-loss)."""
    argv = sft_argv(
        tmp_path,
        f"teacher_path={builtin_teachers[1]}",
        "teacher_host_offload=true",
        "gradient_accumulation_steps=2",
        "distill_coef=0.25",
        "distill_temperature=2.0",
        "distill_top_k=16",
    )
    assert train.main(argv) == 0
    lines = [json.loads(l) for l in open(tmp_path / "default" / "metrics.jsonl") if '"loss"' in l]
    assert len(lines) == 2
    for line in lines:
        assert math.isfinite(line["distill/kl"]) and line["distill/kl"] > 0.05
        assert line["loss"] == pytest.approx(0.75 * line["nll"] + 0.25 * 4.0 * line["distill/kl"], rel=1e-4)
        assert not any(k.startswith("moe/") for k in line)  # the teacher's routers are not the student's


def test_an_sft_distillation_mistake_is_one_line(builtin_teachers, tmp_path, capsys):
    capsys.readouterr()
    assert train.main(sft_argv(tmp_path, f"teacher_path={builtin_teachers[0]}", "distill_coef=1.5")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "set distill_coef <= 1" in err


# ---------------------------------------------------------------- GKD's mix of completions (tasks/gkd.py)


def segments_of(rows: dict, tokenizer) -> list[tuple[str, list[int], list[int]]]:
    """(prompt text, token ids, trained target columns within them) of every example of SFT rows,
    the built-in task's prompt being the text up to its '='."""
    out = []
    for r in range(len(rows["inputs"])):
        for s in np.unique(rows["inputs_segmentation"][r][rows["inputs_segmentation"][r] > 0]):
            cols = np.flatnonzero(rows["inputs_segmentation"][r] == s)
            ids = rows["inputs"][r, cols].tolist()
            text = tokenizer.decode(ids)
            out.append((text[: text.index("=") + 1], ids, np.flatnonzero(rows["targets_segmentation"][r, cols] > 0)))
    return out


def test_an_on_policy_step_trains_on_the_student_samples_by_numpy_gkd(builtin_teachers, tmp_path):
    """distill_lmbda 1 (TRL GKDTrainer's lmbda, Agarwal et al. 2024): the step's rows are the
    dataset batch's prompts, each followed by the student's sample of it (the sampler called here with
    the step's key), trained on the sampled tokens alone, those that do not fit counted out; the loss is GKD's generalised JSD at beta
    0.5 on them, NumPy's formula (numpy_gkd) on the two models' logits of each example alone."""
    cfg = sft_config(
        tmp_path,
        f"teacher_path={builtin_teachers[0]}",
        "distill_coef=1.0",
        "distill_lmbda=1.0",
        "gkd_beta=0.5",
        "distill_top_k=7",
        "logits_chunk_size=8",
        "rollout_max_response_len=6",
    )
    built, state, task, batch = sft_task(cfg)
    params, (teacher,), tokenizer = state["params"], task.teachers, built.tokenizer
    assert task.mix.source(0) == "student"
    rows, metrics = task.mix.rows(batch, params, 0, "student")
    examples, asked = segments_of(rows, tokenizer), segments_of(batch, tokenizer)
    # The untrained student's samples run to the 6 tokens, longer than the data's answers: the rows
    # hold fewer of them, and the rest are counted out.
    dropped = metrics["distill/samples_dropped"]
    assert dropped > 0 and len(examples) + dropped == len(asked) and len(examples) > 8
    # The student's samples of the batch's prompts, as the sampler gives them for the step's key:
    # each kept example is one of them, its sampled tokens the ones trained on.
    encode = lambda text: [tokenizer.bos_id] * (tokenizer.bos_id is not None) + tokenizer.encode(text)  # noqa: E731
    prompts = [encode(a[0]) for a in asked]
    task.sampler.update_weights(params, 0)
    done = task.sampler.generate(prompts, task.mix.sampling, jax.random.fold_in(jax.random.key(cfg.seed), 0))
    samples = [prompts[j] + done.tokens[j, : done.lengths[j]].tolist() for j in range(len(asked))]
    width = cfg.max_target_length
    padded = {k: np.zeros((len(examples), width), np.int32) for k in ("inputs", "positions", "segments")}
    for i, (text, ids, trained) in enumerate(examples):
        samples.remove(ids)  # one of the samples, not two examples for one
        np.testing.assert_array_equal(trained, np.arange(len(encode(text)) - 1, len(ids) - 1))
        padded["inputs"][i, : len(ids)], padded["positions"][i, : len(ids)] = ids, np.arange(len(ids))
        padded["segments"][i, : len(ids)] = 1
    forward = jax.jit(lambda graphdef, p: nnx.merge(graphdef, p)(*padded.values())[0], static_argnums=0)
    student, teacher_logits = forward(built.graphdef, params), forward(teacher.graphdef, teacher.params)
    jsd = numpy_gkd(student, teacher_logits, 1.0, 7, 0.5)
    want = sum(jsd[i, e[2]].sum() for i, e in enumerate(examples))
    on_device = sharding.full_rows_to_global(rows, task.batch_shardings())
    got, (count, out) = jax.jit(lambda *args: task.loss(*args))(params, on_device, teacher.params)
    assert float(count) == sum(len(e[2]) for e in examples)
    np.testing.assert_allclose([float(got), float(out["distill/jsd"][0])], [want, want], rtol=1e-4)


def test_a_seq_kd_step_trains_on_the_teacher_greedy_answers_as_transformers_gives_them(builtin_teachers, tmp_path):
    """distill_seq_kd (TRL GKDTrainer's seq_kd) at a temperature near 0: every step's completions are
    the teacher's greedy continuations of the batch's prompts, those of transformers' forward of its
    checkpoint token by token. With distill_coef 0 (sequence-level KD alone) the update takes no
    teacher and its loss is NumPy's cross-entropy of those answers; distill_lmbda's coin still gives
    the student's samples where it falls."""
    cfg = sft_config(
        tmp_path,
        f"teacher_path={builtin_teachers[0]}",
        "distill_coef=0",
        "distill_seq_kd=true",
        "rollout_temperature=1e-4",
        "rollout_max_response_len=3",
    )
    built, state, task, batch = sft_task(cfg)
    assert [task.mix.source(s) for s in range(3)] == ["teacher"] * 3
    rows, _ = task.mix.rows(batch, state["params"], 0, "teacher")
    for r in (0, 5):
        columns = np.flatnonzero(rows["inputs_segmentation"][r] == 1)
        ids = rows["inputs"][r, columns].tolist()
        trained = np.flatnonzero(rows["targets_segmentation"][r, columns] > 0)
        prompt_end = int(trained[0]) + 1
        greedy = ids[:prompt_end]
        while len(greedy) < len(ids):
            greedy.append(int(np.argmax(torch_logits(builtin_teachers[0], greedy)[-1])))
        assert ids == greedy and 1 <= len(ids) - prompt_end <= 3
    assert task.scorers == []
    inputs = (rows["inputs"], rows["inputs_position"], rows["inputs_segmentation"])
    logits = nnx.merge(built.graphdef, state["params"])(*inputs)[0]
    logp = np.take_along_axis(log_softmax(np.asarray(logits, np.float64)), rows["targets"][..., None], -1)[..., 0]
    trained = rows["targets_segmentation"] > 0
    got, (count, _) = jax.jit(task.loss)(state["params"], sharding.full_rows_to_global(rows, task.batch_shardings()))
    assert float(count) == trained.sum()
    np.testing.assert_allclose(float(got), -logp[trained].sum(), rtol=1e-5)
    task.cfg = task.mix.cfg = cfg.replace(distill_lmbda=1.0, distill_coef=1.0)
    assert task.mix.source(0) == "student"


def test_the_eval_logs_each_teacher_accuracy_and_the_student_gap_to_it(builtin_teachers, tmp_path):
    """Two teachers evaluated once by the student's evaluator (a reward about half of untrained
    answers pass, so accuracies differ from 0 and 1): the first's is the eval_accuracy a run whose
    student is that teacher, not trained (learning_rate 0), logs; the gap is teacher minus student
    at each evaluation."""
    evals = ["reward=format", "format_reward_pattern=[a-z]", "eval_num_samples=16", "eval_n_samples=0"]
    argv = sft_argv(
        tmp_path,
        "run_name=gap",
        f"teacher_path={','.join(builtin_teachers)}",
        "distill_coef=0.5",
        "eval_interval=1",
        *evals,
    )
    assert train.main(argv) == 0
    lines = [json.loads(l) for l in open(tmp_path / "gap" / "metrics.jsonl") if "eval_accuracy" in l]
    assert len(lines) == 2
    teachers = [lines[0][f"eval_teacher_accuracy/{i}"] for i in (0, 1)]
    for line in lines:
        for i in (0, 1):
            assert line[f"eval_teacher_accuracy/{i}"] == teachers[i]
            assert line[f"eval_teacher_accuracy_gap/{i}"] == pytest.approx(teachers[i] - line["eval_accuracy"])
    for line in [json.loads(l) for l in open(tmp_path / "gap" / "metrics.jsonl") if '"loss"' in l]:
        # The update's KL to each teacher logged beside their mean (teacher_weights' default: 1/2 each).
        kl = 0.5 * line["distill/kl/0"] + 0.5 * line["distill/kl/1"]
        assert line["distill/kl"] == pytest.approx(kl, rel=1e-5) and line["distill/kl/0"] != line["distill/kl/1"]
    argv = sft_argv(tmp_path, "run_name=as_teacher", f"load_parameters_path={builtin_teachers[0]}", "steps=1", *evals)
    assert train.main([*argv, "learning_rate=0", "eval_interval=1"]) == 0
    (line,) = [json.loads(l) for l in open(tmp_path / "as_teacher" / "metrics.jsonl") if "eval_acc" in l]
    assert line["eval_accuracy"] == teachers[0] and 0 < teachers[0] < 1 and teachers[1] != teachers[0]


def jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_an_on_policy_run_never_reads_the_dataset_completions(builtin_teachers, tmp_path):
    """distill_lmbda 1 on two datasets of the same prompts whose completions differ (same lengths,
    so the packer lays them out alike): the runs are the same to the last digit; offline (lmbda 0)
    they differ."""
    sums = [(a, b) for a in range(10) for b in range(10)]
    data = {
        name: jsonl(tmp_path / f"{name}.jsonl", [{"prompt": f"{a}+{b}=", "completion": answer(a, b)} for a, b in sums])
        for name, answer in (("right", lambda a, b: f"{a + b:02d}"), ("wrong", lambda a, b: "99"))
    }
    logged = {}
    for lmbda in (1.0, 0.0):
        for name, path in data.items():
            argv = sft_argv(
                tmp_path,
                f"run_name={name}_{lmbda}",
                f"dataset_path={path}",
                f"teacher_path={builtin_teachers[0]}",
                "distill_coef=1.0",
                f"distill_lmbda={lmbda}",
            )
            assert train.main(argv) == 0
            lines = [json.loads(l) for l in open(tmp_path / f"{name}_{lmbda}" / "metrics.jsonl") if '"loss"' in l]
            logged[name, lmbda] = [(l["loss"], l["grad_norm"], l.get("distill/on_policy")) for l in lines]
    assert logged["right", 1.0] == logged["wrong", 1.0] and {l[2] for l in logged["right", 1.0]} == {1.0}
    assert logged["right", 0.0] != logged["wrong", 0.0]


def test_the_dataset_steps_of_a_mix_are_the_offline_run(builtin_teachers, tmp_path):
    """distill_lmbda 0.5 with seed 0 draws the dataset for steps 0 and 1 and the student's samples at
    step 2: until then its lines are the offline run's (lmbda 0) exactly, step 2's is not."""
    logged = {}
    for lmbda in (0.0, 0.5):
        argv = sft_argv(
            tmp_path,
            f"run_name=mix_{lmbda}",
            "steps=3",
            f"teacher_path={builtin_teachers[0]}",
            "distill_coef=1.0",
            f"distill_lmbda={lmbda}",
        )
        assert train.main(argv) == 0
        logged[lmbda] = [json.loads(l) for l in open(tmp_path / f"mix_{lmbda}" / "metrics.jsonl") if '"loss"' in l]
    assert [l["distill/on_policy"] for l in logged[0.5]] == [0.0, 0.0, 1.0]
    assert [l["distill/samples_dropped"] == 0 for l in logged[0.5]] == [True, True, False]  # long samples
    assert all("distill/on_policy" not in l for l in logged[0.0])
    for offline, mixed in zip(logged[0.0][:2], logged[0.5][:2]):
        assert (offline["loss"], offline["grad_norm"]) == (mixed["loss"], mixed["grad_norm"])
    assert logged[0.0][2]["loss"] != logged[0.5][2]["loss"]


# ---------------------------------------------------------------- bad input


def main_error(tmp_path, capsys, *overrides) -> str:
    capsys.readouterr()
    assert train.main(run_argv(tmp_path, "distill_coef=1.0", *overrides)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_a_teacher_of_another_vocabulary_is_one_line(tiny_checkpoint, tmp_path, capsys):
    other = tiny_checkpoint("llama")  # byte-level BPE; the student: the built-in characters
    err = main_error(tmp_path, capsys, f"teacher_path={other}")
    assert "the teacher's tokenizer (380 tokens) is not the student's (100 tokens" in err


def test_a_teacher_path_that_does_not_exist_is_one_line(tmp_path, capsys):
    err = main_error(tmp_path, capsys, f"teacher_path={tmp_path / 'no_teacher'}")
    assert f"teacher_path='{tmp_path / 'no_teacher'}' does not exist" in err


def test_a_teacher_larger_than_memory_is_one_line_unless_offloaded(builtin_teachers, tmp_path, capsys, monkeypatch):
    def small_devices(devices, host_offload):
        return (10**12, "the host") if host_offload else (1000, "a fake device limit")

    monkeypatch.setattr(reward_model, "available_bytes", small_devices)
    err = main_error(tmp_path, capsys, f"teacher_path={builtin_teachers[0]}")
    assert f"teacher_path='{builtin_teachers[0]}': the model's" in err
    assert "more than a fake device limit" in err and "set teacher_host_offload=true" in err


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"mode": "grpo", "distill_coef": "1.0"}, "weigh a teacher's KL and the reward: set teacher_path"),
        ({"mode": "grpo", "distill_reward_weight": "0"}, "weigh a teacher's KL and the reward: set teacher_path"),
        ({"mode": "grpo", "teacher_path": "/t"}, "teacher_path is set but distill_coef is 0"),
        (
            {"mode": "dpo", "teacher_path": "/t", "distill_coef": "1"},
            "a teacher distils in mode sft (offline) or grpo and ppo (on-policy), not mode dpo",
        ),
        ({"mode": "sft", "teacher_path": "/t", "distill_coef": "1.5"}, "set distill_coef <= 1"),
        (
            {"mode": "sft", "teacher_path": "/t", "distill_coef": "1", "distill_reward_weight": "0"},
            "mode=sft's labels weigh 1 - distill_coef",
        ),
        ({"mode": "sft", "distill_temperature": "2"}, "shape a teacher's soft targets in mode=sft"),
        ({"mode": "grpo", "teacher_path": "/t", "distill_coef": "1", "distill_top_k": "8"}, "at rollout_temperature"),
        ({"distill_top_k": "0"}, "distill_top_k"),
        ({"distill_temperature": "0"}, "distill_temperature"),
        ({"mode": "sft", "teacher_path": "/t", "distill_coef": "1", "gkd_beta": "1.5"}, "gkd_beta"),
        ({"mode": "grpo", "teacher_path": "/t", "distill_coef": "1", "gkd_beta": "0.5"}, "at rollout_temperature"),
        (
            {"mode": "grpo", "teacher_path": "/a,/b", "distill_coef": "1", "teacher_weights": "[1.0]"},
            "teacher_weights has 1 weights but teacher_path names 2 teachers",
        ),
        ({"teacher_weights": "[-1.0]"}, "teacher_weights"),
        (
            {"mode": "grpo", "teacher_path": "/t", "distill_coef": "1", "distill_lmbda": "0.5"},
            "mode=sft with teacher_path",
        ),
        ({"mode": "sft", "distill_seq_kd": "true"}, "choose the completions of offline distillation"),
        (
            {"mode": "sft", "teacher_path": "/a,/b", "distill_coef": "1", "distill_seq_kd": "true"},
            "distill_seq_kd samples one teacher's completions",
        ),
        ({"mode": "sft", "teacher_path": "/t", "distill_coef": "0.5", "distill_lmbda": "0.5"}, "set distill_coef=1"),
        (
            {"mode": "sft", "teacher_path": "/t", "distill_coef": "1", "distill_lmbda": "1", "env": "guess_number"},
            "an env's episodes distil on-policy in mode=grpo",
        ),
        ({"distill_lmbda": "1.5"}, "distill_lmbda"),
        ({"mode": "grpo", "distill_kl_discount": "0.9"}, "distill_kl_discount discounts on-policy distillation"),
        (
            {"mode": "sft", "teacher_path": "/t", "distill_coef": "1", "distill_kl_discount": "0.9"},
            "it needs teacher_path in mode grpo or ppo",
        ),
        ({"distill_kl_discount": "1.5"}, "distill_kl_discount"),
    ],
)
def test_distillation_config_mistakes_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_cfg(**overrides)
