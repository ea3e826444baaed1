"""Every test runs on 8 simulated CPU devices so that each sharding path is exercised."""

import os

# The suite's programs are tiny: LLVM's optimisations of them cost more compile time than they save
# at run time (the suite 16 -> 11-12 minutes on 2 cores). Numerics are unchanged: no fast math either way.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0", "--xla_force_host_platform_device_count=8"]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session (subprocesses inherit it): the many runs of the
# same tiny programs compile once. Fresh per session, so nothing stale carries over.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="unitrain-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import contextlib
import json
import signal
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

# Each family with the variant that exercises its distinctive code path.
FAMILY_VARIANTS = {
    "llama": dict(rope_scaling="llama3"),
    "qwen2": dict(tie=True),
    "qwen3": dict(),
    "mistral": dict(sliding_window=64),
    # Every 6th layer global, the others sliding over 64 positions; linear RoPE scaling on the global ones.
    "gemma3": dict(tie=True, layers=6, sliding_window=64, rope_scaling="linear"),
}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(family, **variant) -> dir of a random tiny HF checkpoint made by
    tools/make_tiny_model.py, with `variant` (make_tiny_model's keywords) or else FAMILY_VARIANTS[family].

    A large init std makes attention sharp, so a wrong mask or RoPE changes logits visibly.
    """
    from make_tiny_model import make_tiny_model

    made = {}

    def get(family: str, **variant):
        key = (family, tuple(sorted(variant.items())))
        if key not in made:
            made[key] = make_tiny_model(
                tmp_path_factory.mktemp(f"hf_{family}"), family, init_std=0.25, **(variant or FAMILY_VARIANTS[family])
            )
        return made[key]

    return get


def cpu_env(devices: int) -> dict:
    """os.environ for a child process that sees `devices` CPU devices, with the suite's other XLA flags."""
    from launch.local import with_device_count

    return {**os.environ, "XLA_FLAGS": with_device_count(os.environ["XLA_FLAGS"], devices), "JAX_PLATFORMS": "cpu"}


def make_cfg(**overrides):
    """A Config from configs/base.yml with keyword overrides."""
    from unitrain.config import load_config

    return load_config([str(REPO / "configs" / "base.yml"), *(f"{k}={v}" for k, v in overrides.items())])


def small_model_config(**overrides):
    """The unit tests' small decoder (2 layers, width 32, 4 query and 2 key/value heads of 8, vocab
    64), with overrides: model tests compile in seconds at this size."""
    from unitrain import sharding
    from unitrain.models import decoder

    small = dict(
        vocab_size=64, emb_dim=32, mlp_dim=64, num_decoder_layers=2, num_query_heads=4, num_kv_heads=2, head_dim=8
    )
    return decoder.ModelConfig(**{**small, "platform": sharding.target_platform(), **overrides})


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
