"""`reward: rm`: a reward model scores the rollouts. This file owns loading it once (on the trainer's
mesh under the same logical rules, or in pinned host memory between uses with
`reward_model_host_offload`), refusing before the load one whose parameters cannot fit, rendering
each (prompt, completion) as the reward model's own conversation with its own tokenizer (so its
vocabulary need not be the policy's), and scoring a round in length buckets: the texts sorted by
length, each bucket (engines/buckets.py's rule) right-padded and run `reward_model_batch_size` rows
at a time through one compiled forward pooled at the last real token (models/scalar_head.pool_last).
Memory is bounded by that batch and `reward_model_max_length`, whatever the round's size; a text
longer than the limit loses tokens from its prompt's start. The reward is a rewards.BatchReward:
weighted with the other rewards by RewardFn, its raw scores and time logged as rm/* metrics.
"""

from __future__ import annotations

import functools
import glob
import logging
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx

from unitrain import checkpoint, compile_cache, sharding
from unitrain import step as step_lib
from unitrain.adapters import hf
from unitrain.config import check
from unitrain.data.tokenizer import load_tokenizer
from unitrain.engines.buckets import batch_parallelism, bucket_batch_size, bucket_prompt_length
from unitrain.errors import ConfigError
from unitrain.models import sources
from unitrain.models.scalar_head import build_scalar_model, pool_last
from unitrain.rewards import BatchReward

log = logging.getLogger("unitrain")

NORMALIZE_EPS = 1e-6  # reward_model_normalize: (s - mean) / (std + eps)


def make_rm_reward(cfg) -> BatchReward:
    """registry.REWARDS["rm"]: the reward model's scores of a call's samples, standardised over the
    call with reward_model_normalize. The model is loaded once per config (the calculator
    environment's reward and the mode's share it)."""
    scorer = _scorer(cfg)

    def rm_reward(prompts: list, completions: list, labels: list) -> list:
        scores = scorer.score(prompts, completions)
        if cfg.reward_model_normalize:
            scores = (scores - scores.mean()) / (scores.std() + NORMALIZE_EPS)
        return scores.tolist()

    return BatchReward(rm_reward, scorer.metrics)


@functools.lru_cache(maxsize=1)
def _scorer(cfg) -> RewardModelScorer:
    mesh = sharding.trainer_mesh(cfg, sharding.layout_for(cfg))
    return RewardModelScorer(cfg, mesh, sharding.rules_from_config(cfg.logical_axis_rules))


def pooled_scores(graphdef, device, params, tokens, positions, segment_ids):
    """[rows] float32: each row's score at its last real token. `device`: the parameters' device
    shardings when they are kept in host memory (brought over here), else None."""
    if device is not None:
        params = jax.device_put(params, device)
    values = nnx.merge(graphdef, params)(tokens, positions, segment_ids)
    return pool_last(values, segment_ids)[:, 0]


def scoring_forward(graphdef, params, host_offload: bool):
    """The jitted pooled_scores over parameters placed as `params` (arrays or abstract shapes in
    device memory): the program the scorer runs and tools/bench.py's --mode rm_score compiles. With
    `host_offload` it takes them in host memory and brings them to the devices inside."""
    device = step_lib.device_shardings(params) if host_offload else None
    return jax.jit(functools.partial(pooled_scores, graphdef, device))


class RewardModelScorer:
    """The reward model of `reward_model_path` on `mesh` with its tokenizer:
    `score(prompts, completions)` -> float32 [N] raw scores; `metrics()` what it measured since
    the last call."""

    def __init__(self, cfg, mesh, rules):
        self.max_length, self.batch_size = cfg.reward_model_max_length, cfg.reward_model_batch_size
        self.tokenizer = load_tokenizer(*_tokenizer_source(cfg), cfg.trust_remote_code)
        self.chat = cfg.reward_model_chat_template and self.tokenizer.has_chat_template
        if cfg.reward_model_chat_template and not self.chat:
            log.info(
                "reward model: its tokenizer has no chat template; it scores the prompt text + the completion + EOS"
            )
        check_fits(cfg, mesh, rules, cfg.reward_model_path, "reward_model_path", "reward_model_host_offload")
        model = build_scalar_model(cfg, mesh, cfg.reward_model_path, require_classifier=True)
        graphdef, params = nnx.split(model)
        params = nnx.to_pure_dict(params)
        offload = cfg.reward_model_host_offload
        self.forward = scoring_forward(graphdef, params, offload)
        self.params = sharding.with_memory_kind(params, "pinned_host") if offload else params
        self.programs = compile_cache.CompileCache(mesh)
        self.rows_sharding = sharding.batch_sharding(mesh, rules)
        self.row_multiple = batch_parallelism(mesh, rules)
        self.warned = False
        self._reset()
        log.info(
            "reward model %s: %s, %d rows x up to %d tokens per forward%s",
            cfg.reward_model_path,
            "its chat template" if self.chat else "prompt + completion text",
            self.batch_size,
            self.max_length,
            ", kept in host memory between rounds" if offload else "",
        )

    # -- rendering
    def _ids(self, text: str) -> list[int]:
        """The template owns a chat's special tokens; plain text gets a BOS where transformers'
        tokenizer(text) adds one."""
        return self.tokenizer.encode(text) if self.chat else [*self.tokenizer.text_bos, *self.tokenizer.encode(text)]

    def encode(self, prompt: str, completion: str) -> tuple[list[int], bool]:
        """The reward model's ids of one sample, at most max_length; whether they were cut."""
        if self.chat:
            turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            text = self.tokenizer.render_chat(turns, add_generation_prompt=False)
        else:
            text = prompt + completion
        # Plain text ends in EOS, as mode=rm's preference rows (and TRL's RewardTrainer's) end: the
        # score is read at the position the reward model was trained to score, not at the answer's last token.
        end = [] if self.chat or self.tokenizer.eos_id is None else [self.tokenizer.eos_id]
        ids = self._ids(text) + end
        if len(ids) <= self.max_length:
            return ids, False
        at = text.find(prompt) if prompt else -1
        prompt_start = len(self._ids(text[:at])) if at >= 0 else 0
        return cut_prompt(ids, prompt_start, self.max_length), True

    # -- scoring
    def score(self, prompts: list[str], completions: list[str]) -> np.ndarray:
        start = time.perf_counter()
        encoded = [self.encode(p, c) for p, c in zip(prompts, completions)]
        ids = [e[0] for e in encoded]
        truncated = sum(e[1] for e in encoded)
        if truncated and not self.warned:
            self.warned = True
            log.warning(
                "reward model: %d of %d texts are longer than reward_model_max_length=%d; they lose tokens from "
                "the start of their prompt (rm/truncated_fraction counts them)",
                truncated,
                len(ids),
                self.max_length,
            )
        scores = np.zeros(len(ids), np.float32)
        for rows, length, padded_rows in score_batches(
            [len(i) for i in ids], self.max_length, self.batch_size, self.row_multiple
        ):
            scores[rows] = self._forward([ids[r] for r in rows], length, padded_rows)
        self._record(scores, truncated, time.perf_counter() - start)
        return scores

    def _forward(self, ids: list[list[int]], length: int, padded_rows: int) -> np.ndarray:
        """One compiled forward over `ids` right-padded to [padded_rows, length]; the padding rows
        hold one token (a row of no token attends to nothing)."""
        tokens = np.full((padded_rows, length), self.tokenizer.pad_id, np.int32)
        positions = np.zeros((padded_rows, length), np.int32)
        segment_ids = np.zeros((padded_rows, length), np.int32)
        segment_ids[len(ids) :, 0] = 1
        for r, row in enumerate(ids):
            tokens[r, : len(row)] = row
            positions[r, : len(row)] = np.arange(len(row))
            segment_ids[r, : len(row)] = 1
        batch = sharding.full_rows_to_global(
            {"tokens": tokens, "positions": positions, "segment_ids": segment_ids}, self.rows_sharding
        )
        out = self.programs(
            f"reward model (rows {padded_rows} x {length})",
            self.forward,
            self.params,
            batch["tokens"],
            batch["positions"],
            batch["segment_ids"],
        )
        return sharding.to_host(out)[: len(ids)]

    # -- metrics
    def _reset(self) -> None:
        self._count, self._sum, self._sum_sq, self._seconds, self._truncated = 0, 0.0, 0.0, 0.0, 0

    def _record(self, scores: np.ndarray, truncated: int, seconds: float) -> None:
        raw = scores.astype(np.float64)
        self._count += len(raw)
        self._sum += float(raw.sum())
        self._sum_sq += float((raw**2).sum())
        self._seconds += seconds
        self._truncated += truncated

    def metrics(self) -> dict:
        """Raw scores' mean and std, seconds spent scoring (tokenizing included), completions per
        second and the fraction cut at reward_model_max_length, since the last call; {} if none."""
        if not self._count:
            return {}
        n, mean = self._count, self._sum / self._count
        out = {
            "rm/score_mean": mean,
            "rm/score_std": math.sqrt(max(self._sum_sq / n - mean**2, 0.0)),
            "rm/score_time": self._seconds,
            "rm/completions_per_sec": n / max(self._seconds, 1e-9),
            "rm/truncated_fraction": self._truncated / n,
        }
        self._reset()
        return out


def cut_prompt(ids: list[int], prompt_start: int, max_length: int) -> list[int]:
    """`ids` cut to max_length by dropping tokens from `prompt_start` (the prompt's first token) on:
    what comes before the prompt (the template's header) and the end (the completion, and the last
    token the score is read at) are kept; past the prompt the cut goes on into what follows it."""
    keep = min(prompt_start, max_length - 1)
    return ids[:keep] + ids[keep + len(ids) - max_length :]


def score_batches(lengths: list[int], max_length: int, batch_size: int, multiple: int) -> list[tuple]:
    """The forwards of a round: (row indices, bucket length, padded rows) each. Texts sorted by
    length fall into buckets of bucket_prompt_length (capped at max_length), each split into
    `batch_size` rows at most; a forward's rows are a power of two, a multiple of `multiple` (the
    devices the batch splits over), and no more than batch_size rounded up to that multiple."""
    cap = -(-batch_size // multiple) * multiple
    buckets: dict[int, list[int]] = {}
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        buckets.setdefault(min(bucket_prompt_length(lengths[i]), max_length), []).append(i)
    return [
        (rows[s : s + batch_size], length, min(bucket_batch_size(len(rows[s : s + batch_size]), multiple), cap))
        for length, rows in buckets.items()
        for s in range(0, len(rows), batch_size)
    ]


# ---------------------------------------------------------------- where it comes from, whether it fits


def _tokenizer_source(cfg) -> tuple[str, str]:
    """(tokenizer path, chat template file) of the reward model: reward_model_tokenizer_path, else
    its checkpoint's (recorded_tokenizer)."""
    path, own = cfg.reward_model_path, cfg.reward_model_tokenizer_path
    if not os.path.isdir(path):
        raise ConfigError(
            f"reward_model_path={path!r} is not a directory (an HF classifier folder or a unitrain checkpoint)"
        )
    if own:
        if not os.path.exists(own):
            raise ConfigError(f"reward_model_tokenizer_path={own!r} does not exist")
        return own, ""
    if found := recorded_tokenizer(path):
        return found
    raise ConfigError(
        f"reward_model_path={path!r} holds neither an HF tokenizer nor a unitrain run's config.yml; "
        "set reward_model_tokenizer_path"
    )


def recorded_tokenizer(path: str) -> tuple[str, str] | None:
    """(tokenizer path, chat template file) of the checkpoint at `path`: the HF folder's own, else
    the tokenizer the unitrain run that saved it recorded; None where it holds neither."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path, ""
    for run_config in (os.path.join(path, *[os.pardir] * up, "config.yml") for up in range(3)):
        if os.path.isfile(run_config):
            with open(run_config, encoding="utf-8") as f:
                recorded = yaml.safe_load(f) or {}
            return recorded.get("tokenizer_path", ""), recorded.get("chat_template_file", "")
    return None


def parameter_count(path: str) -> int:
    """Parameters of the checkpoint at `path`, read from its safetensors headers (an HF folder) or
    its orbax metadata (a unitrain checkpoint): nothing is loaded. A LoRA run's checkpoint has its
    base's (the adapters are merged into it)."""
    if lora_run := sources.lora_run_config(path):
        return parameter_count(lora_run["load_parameters_path"])
    if os.path.isfile(os.path.join(path, "config.json")):
        count = 0
        for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            with hf.open_safetensors(file) as f:
                count += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
        return count
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(checkpoint.stored_params(path)))


def weight_shards(mesh, rules) -> int:
    """How many devices a weight matrix [embed, mlp] is split over under the rules: what one
    device holds of the parameters is about 1 / this of them (norms and biases are small)."""
    spec = sharding.logical_to_spec(("embed", "mlp"), rules)
    axes = [a for part in spec if part is not None for a in (part if isinstance(part, tuple) else (part,))]
    return math.prod(mesh.shape[a] for a in axes)


def available_bytes(devices: list, host_offload: bool) -> tuple[int, str]:
    """(bytes one device may give the reward model, what that is). A device that reports its
    memory (GPU, TPU): its free bytes (bytes_limit - bytes_in_use, the least over `devices`). CPU
    devices, which report none, and an offloaded model, which lives in host memory: the host's
    available memory (/proc/meminfo MemAvailable) shared equally by this process's devices."""
    stats = [] if host_offload else [d.memory_stats() for d in devices]
    if stats and all(s and "bytes_limit" in s for s in stats):
        free = min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
        return free, f"the free memory of a {devices[0].platform} device"
    host = _host_available_bytes()
    where = "the offloaded model's" if host_offload else f"{devices[0].platform} devices'"
    return host // len(devices), (
        f"its share of the host's available memory ({host / 2**30:.1f} GiB MemAvailable over {len(devices)} devices; "
        f"{where} memory is the host's)"
    )


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(cfg, mesh, rules, path: str, key: str, offload_key: str) -> None:
    """A ConfigError before the load when one device's share of the parameters of the model at `path`
    (config key `key`: a reward model, a teacher) in weight_dtype exceeds what available_bytes says
    it has: with cfg[offload_key] off, the device's free memory (the policy and its optimizer state
    already placed); on, the host's."""
    offload = cfg[offload_key]
    count = parameter_count(path)
    per_device = count * jnp.dtype(cfg.weight_dtype).itemsize / weight_shards(mesh, rules)
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    have, what = available_bytes(local, offload)
    if per_device > have:
        hint = "" if offload else f"set {offload_key}=true, "
        raise ConfigError(
            f"{key}={path!r}: the model's {count / 1e6:.1f}M parameters need "
            f"{per_device / 2**30:.2f} GiB per device in {cfg.weight_dtype}, more than {what}: "
            f"{have / 2**30:.2f} GiB; {hint}shard it over more devices (fsdp/tensor) or use a smaller model"
        )


@check("reward", "reward_model_path", "reward_model_normalize", "workflow")
def _reward_scoring(c) -> str | None:
    """reward rm needs a reward model; its normalisation needs whole rounds to score. (Whether the
    path exists is the loader's check: a pipeline's earlier stage may be what writes it.)"""
    if "rm" not in [e.strip() for e in c["reward"].split(",")]:
        return None
    if not c["reward_model_path"]:
        return "reward names rm but reward_model_path is empty: set it to an HF *ForSequenceClassification folder or a mode=rm checkpoint"
    if c["reward_model_normalize"] and c["workflow"] != "single_turn":
        return (
            f"reward_model_normalize standardises the scores of a round, but workflow {c['workflow']} has its "
            "environment score each final answer alone; set reward_model_normalize=false"
        )
    return None


CONFIG_CHECKS = (_reward_scoring,)
