"""The tests' shared builders: configs and their fast overrides, tiny models and the references
computed from them, data writers, and the context managers that steer a run. A plain module, not a
test: a test file imports it (`from helpers import ...`), and never another test file.

Light to import (conftest.py imports it before any test): the modules of jax, unitrain and torch
are imported inside the functions, and the model configs that need jax's devices (MOE_CFG,
ROLLOUT_CFG, BEAM_CFG) are made on first use."""

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE_YML = str(REPO / "configs" / "base.yml")
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
if str(REPO / "tools") not in sys.path:
    sys.path.insert(0, str(REPO / "tools"))  # make_tiny_model, launch


# ---------------------------------------------------------------- configs

# A run of the default (builtin-task) SFT model in seconds: the shapes most SFT tests compile, so the
# suite's persistent compilation cache serves them all after the first.
SFT_FAST = [
    "max_target_length=32",
    "per_device_batch_size=1",
    "eval_interval=0",
    "peak_flops_per_device=1e12",
    "log_period=1",
    "builtin_task_digits=2",
    "warmup_steps=2",
]
# The same for the RL modes (4 prompts of 4 samples, 6-token completions, 8 rows an update): prefix a
# mode, as GRPO_FAST does.
RL_FAST = [
    "per_device_batch_size=2",
    "rollout_batch_size=4",
    "n_samples_per_prompt=4",
    "rollout_max_response_len=6",
    "eval_interval=0",
    "log_period=1",
    "builtin_task_digits=1",
    "max_prompt_length=16",
    "learning_rate=1e-3",
    "warmup_steps=0",
    "peak_flops_per_device=1e12",  # not measured at start-up (tens of seconds on a loaded CPU)
]
GRPO_FAST = ["mode=grpo", *RL_FAST]
PPO_FAST = ["mode=ppo", *RL_FAST]
# A 4-expert Qwen3-MoE in place of the default model's dense MLP.
TINY_MOE = ["model_family=qwen3_moe", "qk_norm=true", "num_experts=4", "num_experts_per_tok=2", "moe_mlp_dim=32"]


# What the pair modes' runs through the entry share (mode=dpo, mode=rm: tests/tasks/test_{dpo,rm}.py).
PAIR_E2E = [
    "max_target_length=16",
    "per_device_batch_size=1",
    "learning_rate=1e-2",
    "peak_flops_per_device=1e12",
    "warmup_steps=2",
    "log_period=1",
    "eval_steps=2",
    "checkpoint_period=100",
]


def metrics_by_step(run_dir) -> dict:
    """{step: {metric: value}} of a run's metrics.jsonl; a resumed run's later lines win."""
    out = {}
    for line in open(Path(run_dir) / "metrics.jsonl"):
        row = json.loads(line)
        out.setdefault(row.pop("step"), {}).update(row)
    return out


def run_config(tmp_path, *overrides):
    """A Config from configs/base.yml writing under tmp_path, with `key=value` overrides."""
    from unitrain.checks import load_checked

    return load_checked([BASE_YML, f"base_output_directory={tmp_path}", *overrides])


def sft_config(tmp_path, *overrides):
    return run_config(tmp_path, *SFT_FAST, *overrides)


def grpo_config(tmp_path, *overrides):
    return run_config(tmp_path, *GRPO_FAST, *overrides)


def make_cfg(**overrides):
    """A Config from configs/base.yml with keyword overrides."""
    from unitrain.checks import load_checked

    return load_checked([BASE_YML, *(f"{k}={v}" for k, v in overrides.items())])


def cpu_env(devices: int) -> dict:
    """os.environ for a child process that sees `devices` CPU devices, with the suite's other XLA flags."""
    from launch.local import with_device_count

    return {**os.environ, "XLA_FLAGS": with_device_count(os.environ["XLA_FLAGS"], devices), "JAX_PLATFORMS": "cpu"}


def run_cli(*args, devices=8, **kwargs) -> subprocess.Popen:
    """`python -m unitrain.train configs/base.yml *args` in a child process on `devices` CPU devices."""
    return subprocess.Popen(
        [sys.executable, "-m", "unitrain.train", BASE_YML, *args],
        env=cpu_env(devices),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


# ---------------------------------------------------------------- a run's outputs


def copy_with_bos(path, out, added: bool) -> str:
    """A copy of the HF checkpoint at `path` whose tokenizer defines a BOS token that transformers'
    tokenizer(text) adds (`added`, Llama style) or does not add (GPT-2 and NeoX style)."""
    import shutil

    import transformers

    shutil.copytree(path, out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    tok.bos_token, tok.add_bos_token = "<|endoftext|>", added
    tok.save_pretrained(out)
    return str(out)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def losses_of(cfg) -> dict:
    """{step: loss} of a run's metrics.jsonl."""
    lines = [json.loads(l) for l in open(cfg.metrics_file)]
    return {l["step"]: l["loss"] for l in lines if "loss" in l}


def read_events(tb_dir: Path) -> list:
    """Every Event in the tfevents files under tb_dir, read by hand: TFRecord framing is
    uint64 length, uint32 crc, payload, uint32 crc (tensorboardX ships the proto but no reader)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    events = []
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (length,) = struct.unpack("<Q", data[i : i + 8])
            events.append(Event.FromString(data[i + 12 : i + 12 + length]))
            i += 12 + length + 4
    return events


# ---------------------------------------------------------------- steering a run


@contextlib.contextmanager
def sigterm_after_step(monkeypatch, step: int):
    """Delivers a real SIGTERM to this process right after the metrics of `step` are written."""
    from unitrain import metrics

    original = metrics.MetricsWriter.write

    def write_then_sigterm(self, at, scalars):
        original(self, at, scalars)
        if at == step:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(metrics.MetricsWriter, "write", write_then_sigterm)
    try:
        yield
    finally:
        monkeypatch.setattr(metrics.MetricsWriter, "write", original)


@contextlib.contextmanager
def only_first_device():
    """Makes trainer_mesh build a 1-device mesh inside an 8-device process: the reference run (its
    Layout still counts the 8 devices: the same rows per update)."""
    import jax

    from unitrain import sharding

    original = sharding.trainer_mesh
    ones = dict(data=1, fsdp=1, tensor=1)
    sharding.trainer_mesh = lambda cfg, layout: sharding.create_mesh(ones, ones, jax.devices()[:1])
    try:
        yield
    finally:
        sharding.trainer_mesh = original


# ---------------------------------------------------------------- GRPO's pieces


def make_step(cfg):
    """cfg's run built and its task made, the sampler holding the initial weights."""
    from unitrain import modes, run

    built, state = run.build_run(cfg)
    task = modes.create(built)
    task.sampler.update_weights(state["params"], 0)
    return task, built.graphdef, state["params"], built.mesh


def first_groups(task, params):
    """The groups of step 0, sampled with `params`."""
    return task.rollouts.prepare_batch(0, lambda version: task.sampler.update_weights(params, version))


def grpo_rows(rng, prompts, n, P, C, vocab):
    """n rows per prompt as GRPO lays them out: the prompt left-padded to end at column P, then a
    completion of random length right-padded to C columns."""
    import numpy as np

    rows = len(prompts) * n
    tokens, positions, segments = (np.zeros((rows, P + C), np.int32) for _ in range(3))
    for r in range(rows):
        prompt = prompts[r // n]
        completion = rng.integers(1, vocab, rng.integers(1, C + 1))
        start, end = P - len(prompt), P + len(completion)
        tokens[r, start:end] = np.concatenate([prompt, completion])
        positions[r, start:end] = np.arange(end - start)
        segments[r, start:end] = 1
    return tokens, positions, segments


def fixed_grpo_batch() -> dict:
    """A rollout batch of 2 groups of 4 rows (8-token prompts, 16 completion columns) with
    random advantages and logprobs: the input of one GRPO update."""
    import numpy as np

    rng = np.random.default_rng(0)
    rows, prompt, length = 8, 8, 16
    tokens = rng.integers(3, 100, (rows, prompt + length)).astype(np.int32)
    tokens[:, :prompt] = np.repeat(tokens[::4, :prompt], 4, axis=0)  # a group's 4 rows share its prompt
    mask = np.zeros((rows, length), np.int32)
    for r in range(rows):
        mask[r, : rng.integers(3, 16)] = 1
    logprobs = lambda: (-3.0 + 0.3 * rng.normal(size=(rows, length))).astype(np.float32)  # noqa: E731
    return {
        "inputs": tokens,
        "inputs_position": np.tile(np.arange(prompt + length, dtype=np.int32), (rows, 1)),
        "inputs_segmentation": np.ones((rows, prompt + length), np.int32),
        "targets": tokens[:, prompt:],
        "loss_mask": mask,
        "advantages": rng.normal(size=rows).astype(np.float32),
        "old_logprobs": logprobs(),
        "ref_logprobs": logprobs(),
        "sampler_logprobs": logprobs(),
    }


def grpo_update(cfg, batch_np):
    """One GRPO optimizer update of `cfg`'s mesh on a fixed rollout batch; returns loss and params."""
    import jax

    from unitrain import modes, run

    built, state = run.build_run(cfg)
    task = modes.create(built)
    shardings = task.batch_shardings()
    batch = {k: jax.device_put(v, shardings[k]) for k, v in batch_np.items()}
    state, m = built.programs("grpo_update", task.update_fn, state, batch)
    return float(m["loss"]), jax.device_get(state["params"])


# ---------------------------------------------------------------- one step on fixed rows

# float32 on CPU: the same step computed another way (packed rows, a split sequence) sums in other
# orders; relative 1e-4 (of the largest parameter change, for the update) bounds that.
STEP_RTOL, STEP_ATOL = 1e-4, 1e-5

# The RL modes' fast run (RL_FAST), its later keys in place of its own: longer completions, so that
# rows differ in length and pack, and a constant step from the first.
FIXED_STEP_FAST = [
    *RL_FAST,
    "rollout_max_response_len=32",
    "rollout_temperature=1.0",
    "lr_schedule=constant",
    # adam_eps >> |gradient|: the first update is about learning_rate * gradient, so it shows any
    # difference in the gradient instead of Adam's sign.
    "adam_eps=1.0",
    "learning_rate=1.0",
]


def fixed_step_config(tmp_path, *overrides):
    from unitrain.checks import load_checked

    return load_checked([BASE_YML, f"base_output_directory={tmp_path}", *FIXED_STEP_FAST, *overrides])


def fixed_groups(cfg, tokenizer):
    """A fixed long-tailed round (tools/bench.py's): most completions short, a few at the maximum,
    prompts of 2 to 12 ids, random rewards, and sampler logprobs within 1.5 of the untrained
    model's (about -log vocab), so that rollout_is keeps some sequences and rejects others."""
    import dataclasses

    import numpy as np

    from bench import long_tailed_groups

    groups = long_tailed_groups(
        cfg.rollout_batch_size,
        cfg.n_samples_per_prompt,
        (2, 12),
        cfg.rollout_max_response_len,
        tokenizer.vocab_size,
        0.2,
    )
    rng = np.random.default_rng(1)
    out = []
    for g in groups:
        draws = rng.uniform(-1.5, 1.5, (len(g.trajectories), cfg.rollout_max_response_len))
        rows = tuple(
            dataclasses.replace(t, logprobs=(draws[i, : len(t.ids)] - np.log(cfg.vocab_size)).astype(np.float32))
            for i, t in enumerate(g.trajectories)
        )
        out.append(dataclasses.replace(g, trajectories=rows))
    return out


def one_step(cfg):
    """(metrics, the state after one step, the params before, the task) of one step (RL modes: on
    the fixed round; the others on their data's first batch)."""
    import jax
    import numpy as np

    from unitrain import modes, run
    from unitrain.registry import RL_MODES

    built, state = run.build_run(cfg)
    task = modes.create(built)
    if cfg.mode in RL_MODES:
        groups = fixed_groups(cfg, built.tokenizer)
        task.rollouts.prepare_batch = lambda step, push: (groups, {})
    before = jax.tree.map(np.asarray, state["params"])
    state = task.train_state(state)
    state, metrics = task.step(state, 0)
    return metrics, state, before, task


def assert_same_step(got, want):
    """Two one_step results alike: every metric but the timings, and the update."""
    import pytest

    (m_g, s_g, before, _), (m_w, s_w, _, _) = got, want
    timed = {k for k in m_w if k.startswith("time_") or k.endswith("_per_sec")}
    assert set(m_g) == set(m_w)
    for k in sorted(set(m_w) - timed):
        assert float(m_g[k]) == pytest.approx(float(m_w[k]), rel=STEP_RTOL, abs=STEP_ATOL), k
    assert_same_change(s_g["params"], s_w["params"], before)


def assert_same_change(got, want, before):
    """The parameters `got` and `want` moved alike from `before`."""
    import jax
    import numpy as np

    for a, b, p in zip(*(jax.tree.leaves(jax.tree.map(np.asarray, t)) for t in (got, want, before))):
        change = b - p
        assert np.abs(change).max() > 0  # the update moved every parameter
        np.testing.assert_allclose(
            a - p, change, atol=10 * STEP_RTOL * np.abs(change).max(), rtol=STEP_RTOL
        )  # float32 rounding of tiny changes


# ---------------------------------------------------------------- a scripted environment


class ScriptEnv:
    """Feedback "ok" to every turn; reward 1 and done on "done"; raises on "boom" (and on reset of
    the prompt "bad"); a tool call is answered by its error count. test_episodes.py's
    multi-turn episodes and test_vllm.py's name it in configs, `env: helpers:ScriptEnv`."""

    tools = []

    def __init__(self, cfg=None):
        self.steps = 0

    def reset(self, record):
        if record["prompt"] == "bad":
            raise RuntimeError("no such record")
        return [{"role": "user", "content": record["prompt"]}]

    def step(self, turn):
        from unitrain.envs.base import StepResult

        self.steps += 1
        if "boom" in turn.content:
            raise RuntimeError("boom")
        if turn.tool_calls or turn.tool_call_errors:
            return StepResult([{"role": "tool", "content": f"errors={len(turn.tool_call_errors)}"}])
        if "tuple" in turn.content:
            return [], 0.0, False
        if "done" in turn.content:
            return StepResult([], reward=1.0, done=True)
        return StepResult([{"role": "user", "content": "ok"}], reward=0.25)


_game_starts = 0


def make_logged_game(cfg):
    """The guessing game (env guess_number), logging every record it starts to $RECORD_LOG (the
    records a step trains on, in order) and killing its process at the $KILL_AT-th start:
    test_episodes_grpo.py's runs name it, `env: helpers:make_logged_game`."""
    from unitrain.envs.guess import GuessNumber

    class LoggedGame(GuessNumber):
        def reset(self, record):
            global _game_starts
            _game_starts += 1
            with open(os.environ["RECORD_LOG"], "a") as f:
                f.write(record["prompt"] + "\n")
            if _game_starts == int(os.environ.get("KILL_AT", 0)):
                os.kill(os.getpid(), signal.SIGKILL)
            return super().reset(record)

    return LoggedGame(cfg.guess_number_low, cfg.guess_number_high)


# ---------------------------------------------------------------- tiny models


# Gemma 3 text's keys over a small decoder (small_model_config, the base.yml model): a local layer over
# 6 positions, then a global one, each kind with its own RoPE; the scores and logits scaled as Gemma's.
GEMMA3_ARCH = dict(
    model_family="gemma3_text",
    qk_norm=True,
    qkv_bias=False,
    sliding_window=6,
    sliding_window_pattern=2,
    rope_theta=1e6,
    rope_local_base_freq=1e4,
    query_pre_attn_scalar=12,
    final_logit_softcapping=5.0,
    tie_word_embeddings=True,
)


def small_model_config(**overrides):
    """The unit tests' small decoder (2 layers, width 32, 4 query and 2 key/value heads of 8, vocab
    64), with overrides: model tests compile in seconds at this size."""
    from unitrain import sharding
    from unitrain.models import decoder

    small = dict(
        vocab_size=64, emb_dim=32, mlp_dim=64, num_decoder_layers=2, num_query_heads=4, num_kv_heads=2, head_dim=8
    )
    return decoder.ModelConfig(**{**small, "platform": sharding.target_platform(), **overrides})


def scaled(model, factor=5.0):
    """Random weights scaled up so that next-token distributions are far from uniform (and, for an
    MoE, the router far from ties)."""
    from flax import nnx

    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        var.set_value(var.get_value() * factor)
    return model


def sharp_moe(cfg, seed=0):
    """An MoE decoder of `cfg`, its random weights scaled by 10."""
    from unitrain.models import decoder

    return scaled(decoder.create(cfg, seed), 10.0)


# The configs that need jax's devices, made on first use (module __getattr__): ROLLOUT_CFG is the
# sampler tests' model, BEAM_CFG beam search's (vocab BEAM_V), MOE_CFG the 8-expert Qwen3-MoE.
BEAM_EOS, BEAM_V = 1, 48
_LAZY_CONFIGS = {
    "ROLLOUT_CFG": dict(),
    "BEAM_CFG": dict(vocab_size=BEAM_V),
    "MOE_CFG": dict(
        vocab_size=128, model_family="qwen3_moe", qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_mlp_dim=16
    ),
}


@functools.cache
def _config(name):
    return small_model_config(**_LAZY_CONFIGS[name])


def __getattr__(name):
    if name in _LAZY_CONFIGS:
        return _config(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------- the sampler's references

FORWARD_LEN = 32  # the reference forward right-pads every sequence to this length: one compile
ROLLOUT_PROMPTS = [
    [5, 17, 3],
    [9, 2, 44, 61, 7, 30, 11, 8, 1],
    [12],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52],
]


@functools.cache
def tiny_model():
    """ROLLOUT_CFG's model, its weights scaled by 5."""
    from unitrain.models import decoder

    return scaled(decoder.create(_config("ROLLOUT_CFG"), 0))


@functools.cache
def _forward_fn():
    from flax import nnx

    return nnx.jit(lambda model, tokens, positions, segments: model(tokens, positions, segments)[0])


def full_logits(model, seq):
    """[len(seq), V] float32 logits of the plain full forward (no cache), right-padded to FORWARD_LEN."""
    import numpy as np

    n = len(seq)
    assert n <= FORWARD_LEN
    tokens = np.zeros((1, FORWARD_LEN), np.int32)
    tokens[0, :n] = seq
    positions = np.arange(FORWARD_LEN, dtype=np.int32)[None]
    segments = (np.arange(FORWARD_LEN) < n).astype(np.int32)[None]
    return np.asarray(_forward_fn()(model, tokens, positions, segments)[0, :n], np.float32)


def log_softmax(x):
    import numpy as np

    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def numpy_sequence_logps(logits, targets, weights):
    """Summed log-probs of the weighted target tokens of each row, in float64 NumPy: [B, T, V], [B, T],
    [B, T] -> [B]."""
    import numpy as np

    logp = log_softmax(np.asarray(logits, np.float64))
    return (np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0] * weights).sum(-1)


def pair_logps_of_model(run, params, batch) -> dict:
    """{side: (summed completion log-probs [P], completion lengths [P])} of a preference batch's
    chosen and rejected rows under `params`, from the model's plain forward's logits in NumPy."""
    import jax
    from flax import nnx

    forward = jax.jit(lambda p, *rows: nnx.merge(run.graphdef, p)(*rows)[0])
    out = {}
    for side in ("chosen", "rejected"):
        logits = forward(params, *(batch[f"{side}_{k}"] for k in ("inputs", "inputs_position", "inputs_segmentation")))
        weights = batch[f"{side}_targets_segmentation"] > 0
        out[side] = (numpy_sequence_logps(logits, batch[f"{side}_targets"], weights), weights.sum(-1))
    return out


def naive_sample(model, prompts, n, temperature, key):
    """The sampler's draws (of a ROLLOUT_CFG model) recomputed the slow way, as the sampler did before
    its KV-cache work: at step i each row's next-token logits come from the full forward (no cache) of its prompt and
    tokens so far, and the bucket of rows draws one categorical with fold_in(key, i)."""
    import jax
    import numpy as np

    from unitrain.engines import buckets

    B = buckets.bucket_batch_size(len(prompts))
    seqs = [list(p) for p in prompts]
    tokens, logprobs = np.zeros((len(prompts), n), np.int32), np.zeros((len(prompts), n), np.float32)
    for i in range(n):
        logits = np.zeros((B, _config("ROLLOUT_CFG").vocab_size), np.float32)
        for b, seq in enumerate(seqs):
            logits[b] = full_logits(model, seq)[-1] / temperature
        drawn = np.asarray(jax.random.categorical(jax.random.fold_in(key, i), logits, axis=-1))
        for b, seq in enumerate(seqs):
            tokens[b, i], logprobs[b, i] = drawn[b], log_softmax(logits[b])[drawn[b]]
            seq.append(int(drawn[b]))
    return tokens, logprobs


# ---------------------------------------------------------------- beam search's references

BEAM_PROMPTS = [[5, 6, 7], [8, 9], [2, 3, 4, 5, 6, 7, 40, 41, 42], [44]]


@functools.cache
def beam_model():
    """BEAM_CFG's model, its weights scaled by 4 (sharper than init: distinct scores)."""
    from unitrain.models import decoder

    return scaled(decoder.create(_config("BEAM_CFG"), 0), 4)


def beam_items(seed, n=30, lows=(10, 20, 30), highs=(14, 24, 36)):
    """Distinct 3-token items drawn with `seed`, sorted."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return sorted({tuple(int(t) for t in row) for row in rng.integers(lows, highs, size=(n, 3))})


def teacher_forced(prompt, seqs):
    """Total logprob of each full sequence after `prompt`, from one plain forward per sequence batch."""
    import jax
    import numpy as np

    T = len(prompt) + len(seqs[0])
    tokens = np.asarray([prompt + list(s) for s in seqs], np.int32)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), tokens.shape)
    logits, _ = beam_model()(tokens, positions, np.ones_like(tokens))
    lp = np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1))
    steps = np.arange(len(prompt) - 1, T - 1)
    return lp[:, steps, :][np.arange(len(seqs))[:, None], np.arange(len(steps))[None], tokens[:, steps + 1]].sum(1)


def check_wide_beam_is_exact_top_k():
    """A beam as wide as the trie's widest level over BEAM_PROMPTS: its top 10 are the 10 best of
    every valid item by teacher-forced score, its scores theirs, each beam's logprobs sum to its score."""
    import jax
    import numpy as np

    from unitrain.engines.beam import BeamParams
    from unitrain.engines.colocated import ColocatedSampler
    from unitrain.engines.trie import Trie

    valid = beam_items(0)
    trie = Trie.build([list(s) + [BEAM_EOS] for s in valid])
    sampler = ColocatedSampler(beam_model(), pad_id=0)
    ranked = sampler.beam_search(
        BEAM_PROMPTS, BeamParams(trie.widest_level, trie.depth, trie, stop_token_ids=(BEAM_EOS,)), jax.random.key(0)
    )
    assert ranked.tokens.shape == (len(BEAM_PROMPTS), trie.widest_level, 4)
    for b, prompt in enumerate(BEAM_PROMPTS):
        reference = teacher_forced(prompt, [list(s) + [BEAM_EOS] for s in valid])
        order = np.argsort(-reference, kind="stable")
        k = 10
        assert [tuple(t[:3]) for t in ranked.tokens[b, :k]] == [valid[i] for i in order[:k]], b
        np.testing.assert_allclose(ranked.scores[b], reference[order[: trie.widest_level]], atol=1e-4)
        np.testing.assert_allclose(ranked.logprobs[b].sum(-1), ranked.scores[b], atol=1e-5)
        assert (ranked.lengths[b] == 4).all() and (ranked.tokens[b, :, 3] == BEAM_EOS).all()


class beam_reference:  # noqa: N801
    """The names test_decode_compaction.py reads from its `test_beam` (it imports this as
    `test_beam` until it is rewritten to import the helpers by name)."""

    EOS, V = BEAM_EOS, BEAM_V
    model = staticmethod(beam_model)
    test_wide_beam_is_exact_top_k_of_all_valid_items_with_teacher_forced_scores = staticmethod(
        check_wide_beam_is_exact_top_k
    )


# ---------------------------------------------------------------- transformers' references


def hf_model(path):
    """transformers' float32 causal LM of the checkpoint at `path`, in eval mode."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model, prompt, n):
    """`n` tokens after `prompt` by greedy decoding with transformers' `model` (a full forward each)."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def torch_logits(path, tokens):
    """transformers' float32 logits of `tokens` (one row) from the checkpoint at `path`."""
    import numpy as np
    import torch
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return ref.eval()(torch.tensor(np.asarray(tokens))[None]).logits[0].numpy()


def packed_batch(rng, length=640, seg_lengths=(300, 200)):
    """Row 0: one long sequence. Row 1: two packed sequences then right padding."""
    import numpy as np

    long_seq = rng.integers(0, 512, length)
    segs = [rng.integers(0, 512, n) for n in seg_lengths]
    tokens = np.zeros((2, length), np.int32)
    positions = np.zeros((2, length), np.int32)
    segment_ids = np.zeros((2, length), np.int32)
    tokens[0], positions[0], segment_ids[0] = long_seq, np.arange(length), 1
    start = 0
    for i, s in enumerate(segs):
        tokens[1, start : start + len(s)] = s
        positions[1, start : start + len(s)] = np.arange(len(s))
        segment_ids[1, start : start + len(s)] = i + 1
        start += len(s)
    return tokens, positions, segment_ids, long_seq, segs


def drawn(width, height, colour):
    """A white image of `width` x `height` pixels with a rectangle of `colour` and a black ellipse."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), "white")
    pen = ImageDraw.Draw(image)
    pen.rectangle([width // 4, height // 4, width // 2, height // 2], fill=colour)
    pen.ellipse([width // 2, height // 3, width - 2, height - 2], fill="black")
    return image
