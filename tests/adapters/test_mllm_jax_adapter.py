"""unitrain.adapters.mllm_jax: MLLM_JAX's Llama and Qwen2 behind the model interface, against
transformers' PyTorch forward and our decoder on the same random HF checkpoint.

MLLM_JAX (github.com/demon2036/MLLM-JAX, tested at commit 8b19c02) is no package: these tests run
where UNITRAIN_MLLM_JAX_PATH names a checkout of it (or it is on the Python path) and are skipped,
with the reason, elsewhere. The one-line refusals of a missing or incompatible checkout run always.
"""

import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from jax.sharding import PartitionSpec

from helpers import packed_batch
from unitrain import sharding
from unitrain.adapters import hf, mllm_jax
from unitrain.engines.base import SamplingParams
from unitrain.engines.colocated import ColocatedSampler
from unitrain.errors import ConfigError

PATH = os.environ.get("UNITRAIN_MLLM_JAX_PATH", "")
# MLLM_JAX's llama imports torch and einops, and JAX APIs that JAX deprecates (jax.experimental.shard_map).
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# MLLM_JAX applies unscaled RoPE (the adapter refuses llama3 scaling): llama's checkpoint here has
# none; qwen2's is tied (exported untied); qwen3's head_dim of 128 makes its attention pick its splash
# kernel on a call whose length is a multiple of 128 (PACKED, the cache test's prompt block), which
# the adapter steers around.
VARIANTS = {"llama": dict(rope_scaling="none"), "qwen2": dict(tie=True), "qwen3": dict(head_dim=128)}
TOL = 1e-4  # float32; compiled, RoPE's inverse frequencies fold to within a few ulp of torch's
SHARDED = {"data": 1, "fsdp": 4, "tensor": 2}
ONES = {"data": 1, "fsdp": 1, "tensor": 1}


def _library_or_why() -> str | None:
    try:
        mllm_jax.library(PATH)
    except ConfigError as e:
        return f"set UNITRAIN_MLLM_JAX_PATH to a checkout of MLLM_JAX: {e}"
    return None


WHY_NOT = _library_or_why()
needs_mllm_jax = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


PACKED = packed_batch(np.random.default_rng(0), length=256, seg_lengths=(100, 60))


def torch_logits(path, *sequences):
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return [ref.eval()(torch.tensor(np.asarray(s))[None]).logits[0].numpy() for s in sequences]


def forward(model, tokens, positions, segment_ids):
    graphdef, params = nnx.split(model)
    fn = jax.jit(lambda p, *batch: nnx.merge(graphdef, p)(*batch)[0])  # the trainer's pattern
    return np.asarray(fn(nnx.to_pure_dict(params), tokens, positions, segment_ids))


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return lambda name: tiny_checkpoint(name, **VARIANTS[name])


@pytest.fixture(scope="module")
def loaded(checkpoint):
    """loaded(name) -> (path, the adapter's model on one device, its compiled logits on PACKED), made once."""
    made = {}

    def get(name):
        if name not in made:
            model = mllm_jax.load(checkpoint(name), mllm_jax_path=PATH)
            made[name] = checkpoint(name), model, forward(model, *PACKED[:3])
        return made[name]

    return get


@needs_mllm_jax
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_logits_equal_transformers_and_our_decoder(loaded, name):
    path, model, logits = loaded(name)
    assert logits.shape == (2, 256, 512) and model.vocab_size == 512
    tokens, positions, segment_ids, long_seq, segs = PACKED
    refs = torch_logits(path, long_seq, *segs)
    np.testing.assert_allclose(logits[0], refs[0], atol=TOL, rtol=0)
    for ref, start in zip(refs[1:], np.cumsum([0, *map(len, segs)])):
        np.testing.assert_allclose(logits[1, start : start + len(ref)], ref, atol=TOL, rtol=0)
    ours = forward(hf.load(path), tokens, positions, segment_ids)
    real = segment_ids > 0
    np.testing.assert_allclose(logits[real], ours[real], atol=TOL, rtol=0)
    assert model.flops_per_token(256) == hf.load(path).flops_per_token(256)


@needs_mllm_jax
def test_mllm_jax_own_call_misses_the_packed_reference(loaded):
    """Why the adapter drives its layers itself: MLLM_JAX's own __call__ masks a many-token call causally
    by column, so the second packed sequence sees the first one and its logits miss the reference."""
    _, model, logits = loaded("llama")
    tokens, positions, segment_ids, _, segs = PACKED
    weights = nnx.to_pure_dict(nnx.state(model, nnx.Param))["params"]
    theirs, _ = model.lm.apply({"params": weights}, tokens, positions, None, np.ones_like(tokens))
    first, second = slice(0, len(segs[0])), slice(len(segs[0]), len(segs[0]) + len(segs[1]))
    np.testing.assert_allclose(np.asarray(theirs[1, first]), logits[1, first], atol=TOL, rtol=0)
    assert np.abs(np.asarray(theirs[1, second]) - logits[1, second]).max() > 100 * TOL


@needs_mllm_jax
def test_hidden_states_through_the_head_give_the_call_logits(loaded):
    _, model, logits = loaded("qwen2")
    graphdef, params = nnx.split(model)

    def head_of_hidden(p, *batch):
        m = nnx.merge(graphdef, p)
        return m.logits(m.hidden_states(*batch))

    np.testing.assert_allclose(jax.jit(head_of_hidden)(params, *PACKED[:3]), logits, atol=1e-5, rtol=0)


@needs_mllm_jax
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_cache_decode_matches_the_full_forward(loaded, name):
    """The sampler's pattern: a left-padded prompt block, then one token per row per call, teacher-forced
    with the packed batch's own sequences, gives the full forward's logits (qwen3: a block of 128)."""
    _, model, full = loaded(name)
    rows, P, N = ((0, 0, 40), (1, 0, 13), (1, 100, 5)), 128, 8
    B = len(rows)
    prompt = np.zeros((3, B, P), np.int32)  # tokens, positions, segments
    steps = np.zeros((2, B, N - 1), np.int32)
    for b, (row, start, n) in enumerate(rows):
        seq = PACKED[0][row, start : start + n + N]
        prompt[:, b, P - n :] = seq[:n], np.arange(n), np.ones(n)
        steps[:, b] = seq[n : n + N - 1], n + np.arange(N - 1)
    graphdef, params = nnx.split(model)

    def run(params, prompt, steps):
        m = nnx.merge(graphdef, params)
        logits, cache = m(*prompt, m.init_cache(B, P + N))

        def step(cache, token_and_position):
            token, position = token_and_position
            logits, cache = m(token[:, None], position[:, None], jnp.ones((B, 1), jnp.int32), cache)
            return cache, logits[:, 0]

        return logits[:, -1], jax.lax.scan(step, cache, (steps[0].T, steps[1].T))[1]

    last, step_logits = map(np.asarray, jax.jit(run)(params, prompt, steps))
    for b, (row, start, n) in enumerate(rows):
        np.testing.assert_allclose(last[b], full[row, start + n - 1], atol=TOL, rtol=0)
        np.testing.assert_allclose(step_logits[:, b], full[row, start + n : start + n + N - 1], atol=TOL, rtol=0)


@needs_mllm_jax
def test_greedy_samples_equal_our_decoders(loaded):
    """The colocated sampler (its prefill, growing cache phases, one-token steps) over the adapter and
    over our decoder on the same weights: the same greedy tokens."""
    path, model, _ = loaded("qwen2")
    prompts = [[5, 17, 3], [9, 2, 44, 61, 7, 30, 11, 8, 1], [12]]
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    ours, theirs = (
        ColocatedSampler(m, cache_phases=2).generate(prompts, greedy, jax.random.key(0)) for m in (hf.load(path), model)
    )
    np.testing.assert_array_equal(theirs.tokens, ours.tokens)
    np.testing.assert_allclose(theirs.logprobs, ours.logprobs, atol=TOL, rtol=0)
    assert len(set(ours.tokens.ravel())) > 6  # not one token repeated


@needs_mllm_jax
def test_sharded_placement_and_logits_equal_one_device(loaded):
    """fsdp=4 x tensor=2: kernels [embed, heads] on (fsdp, tensor), as MLLM_JAX's own partition rules
    with dp/fsdp/tp as data/fsdp/tensor; the same logits as one device."""
    path, _, reference = loaded("qwen2")
    mesh = sharding.create_mesh(SHARDED, ONES)
    model = mllm_jax.load(path, mesh=mesh, mllm_jax_path=PATH, max_replicated_param_mib=0.01)
    attn = model.params["model"]["layers_0"]["self_attn"]
    assert attn["q_proj"]["kernel"].get_value().sharding.spec == PartitionSpec("fsdp", "tensor")
    assert attn["o_proj"]["kernel"].get_value().sharding.spec == PartitionSpec("tensor", "fsdp")
    assert model.params["lm_head"]["kernel"].get_value().sharding.spec == PartitionSpec("fsdp", "tensor")
    with jax.set_mesh(mesh):
        np.testing.assert_allclose(forward(model, *PACKED[:3]), reference, atol=TOL, rtol=0)
    no_rules = tuple((name, None) for name, _ in sharding.DEFAULT_RULES)
    with pytest.raises(ConfigError, match="would be fully replicated"):
        mllm_jax.load(path, mesh=mesh, mllm_jax_path=PATH, rules=no_rules, max_replicated_param_mib=0.01)


@needs_mllm_jax
def test_save_hf_reloads_in_transformers_untied(loaded, tmp_path):
    path, model, _ = loaded("qwen2")
    model.save_hf(str(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is False
    tokens = np.random.default_rng(2).integers(0, 512, 50)
    np.testing.assert_array_equal(torch_logits(tmp_path / "out", tokens)[0], torch_logits(path, tokens)[0])


def _curve(cfg, keys) -> np.ndarray:
    return np.asarray([[l[k] for k in keys] for l in map(json.loads, open(cfg.metrics_file)) if "loss" in l])


RL_REWARD = ["reward=format", "format_reward_pattern=[aeiou]", "rollout_temperature=2.0"]
# mode -> its overrides and the metrics compared; lora: SFT's adapters on MLLM_JAX's projection kernels
MODES = {
    "sft": ([], ()),
    "lora": (["lora_rank=4", r"lora_target=params/model/layers_\d+/(self_attn|mlp)/\w+_proj/kernel"], ()),
    "grpo": ([*RL_REWARD, "remat_policy=full"], ("reward_mean", "entropy")),
    "ppo": (RL_REWARD, ("reward_mean", "critic/value_loss", "critic/grad_norm")),
}


@needs_mllm_jax
@pytest.mark.parametrize("mode", list(MODES))
def test_trainer_with_model_source_mllm_jax_sharded_equals_one_device(checkpoint, tmp_path, mode):
    """model_source=mllm_jax through train.train: fsdp=8 gives one device's losses (grpo, ppo: its rollouts
    too; ppo: its critic, MLLM_JAX's model without its lm_head under a value head, trained beside it)."""
    from helpers import GRPO_FAST, PPO_FAST, SFT_FAST, only_first_device, run_config
    from unitrain import train

    path = str(checkpoint("qwen2"))
    overrides, extra = MODES[mode]
    fast = {"grpo": GRPO_FAST, "ppo": PPO_FAST}.get(mode, SFT_FAST)
    common = [*fast, *overrides, "model_source=mllm_jax", f"mllm_jax_path={PATH}", f"load_parameters_path={path}"]
    common += [f"tokenizer_path={path}", "steps=2", "learning_rate=1e-3", "warmup_steps=0"]
    with only_first_device():
        one = run_config(tmp_path, *common, "run_name=one")  # still 8 devices' rows per step
        assert train.train(one) == 0
    sharded = run_config(tmp_path, *common, "run_name=sharded", "ici_fsdp_parallelism=8")
    assert train.train(sharded) == 0
    keys = ("loss", "grad_norm", *extra)
    a, b = _curve(one, keys), _curve(sharded, keys)
    assert a.shape[0] == 2 and a[:, 1].max() > 0  # real updates
    np.testing.assert_allclose(b, a, rtol=2e-4, atol=1e-6)


@needs_mllm_jax
@pytest.mark.parametrize("mode", ["dpo", "rm"])
def test_pair_mode_steps_equal_our_decoders(checkpoint, tmp_path, mode):
    """mode=dpo (the reference: the starting weights) and mode=rm (MLLM_JAX's model without its lm_head
    under a fresh score head, the same draw as ours) on the built-in pairs: the losses and gradient norms
    of MLLM_JAX's Llama equal our decoder's on the same untied checkpoint, step after step."""
    from helpers import PAIR_E2E, run_config
    from unitrain import train

    path = str(checkpoint("llama"))
    common = [f"mode={mode}", *PAIR_E2E, f"load_parameters_path={path}", f"tokenizer_path={path}", "model_name="]
    common += ["steps=3", "eval_interval=0", "learning_rate=1e-3", "warmup_steps=0"]
    ours = run_config(tmp_path, *common, "run_name=ours")
    theirs = run_config(tmp_path, *common, "run_name=theirs", "model_source=mllm_jax", f"mllm_jax_path={PATH}")
    assert train.train(ours) == 0 and train.train(theirs) == 0
    keys = ("loss", "grad_norm", "rewards/accuracy" if mode == "dpo" else "accuracy")
    a, b = _curve(ours, keys), _curve(theirs, keys)
    assert a.shape[0] == 3 and np.ptp(a[:, 0]) > 1e-3  # the loss moves
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- refusals


@needs_mllm_jax
def test_unsupported_checkpoints_are_one_line_config_errors(tiny_checkpoint):
    with pytest.raises(ConfigError, match=r"field 'rope_parameters.rope_type' is 'llama3'; MLLM_JAX applies unscaled"):
        mllm_jax.load(tiny_checkpoint("llama"), mllm_jax_path=PATH)  # conftest's llama: llama3 RoPE scaling
    moe = tiny_checkpoint("qwen3_moe", experts=(4, 2, 32))
    with pytest.raises(ConfigError, match=r"model_type' is 'qwen3_moe'.*calls megablox's TPU kernel unconditionally"):
        mllm_jax.load(moe, mllm_jax_path=PATH)
    with pytest.raises(ConfigError, match="remat_policy 'save_dots' is not available with model_source mllm_jax"):
        mllm_jax.load(moe, mllm_jax_path=PATH, remat_policy="save_dots")


@pytest.fixture
def no_mllm_jax_imported(monkeypatch):
    """Whatever MLLM_JAX the process imported or has on its path is set aside, and whatever a test
    imports is dropped after."""
    for name in [n for n in sys.modules if n.split(".")[0] == "MLLM_JAX"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not (Path(p or ".") / "MLLM_JAX").is_dir()])
    yield
    for name in [n for n in sys.modules if n.split(".")[0] == "MLLM_JAX"]:
        del sys.modules[name]


def test_a_missing_or_incompatible_checkout_is_one_line_naming_path_and_commit(tmp_path, no_mllm_jax_imported):
    with pytest.raises(ConfigError, match=rf"mllm_jax_path '{tmp_path}' holds no MLLM_JAX/language folder.*8b19c02"):
        mllm_jax.library(str(tmp_path))
    package = tmp_path / "MLLM_JAX" / "language"
    for module in ("llama", "qwen2"):
        (package / module).mkdir(parents=True)
    for init in ("MLLM_JAX", "MLLM_JAX/language", "MLLM_JAX/language/llama", "MLLM_JAX/language/qwen2"):
        (tmp_path / init / "__init__.py").write_text("")
    (package / "llama" / "llama.py").write_text("class LlamaConfig: pass\n")  # an API the adapter does not know
    (package / "qwen2" / "configuration_qwen2.py").write_text("class Qwen2Config: pass\n")
    (package / "qwen2" / "modular_qwen2.py").write_text("class Qwen2ForCausalLM: pass\n")
    with pytest.raises(ConfigError, match=r"has no MLLM_JAX.language.llama.llama.LlamaJaxConfig; .*expects .*8b19c02"):
        mllm_jax.library(str(tmp_path))
    (package / "qwen2" / "modular_qwen2.py").write_text("import not_installed_dependency\n")
    for name in [n for n in sys.modules if n.split(".")[0] == "MLLM_JAX"]:
        del sys.modules[name]
    with pytest.raises(ConfigError, match=r"does not import from .*ModuleNotFoundError.*not_installed_dependency"):
        mllm_jax.library(str(tmp_path))
    # Every name the adapter needs, but no deprecated/ folder: its Qwen3 is one line.
    (package / "llama" / "llama.py").write_text(
        "LlamaConfig = LlamaJaxConfig = LlamaForCausalLM = LlamaAttention = 0\n"
    )
    (package / "qwen2" / "modular_qwen2.py").write_text("Qwen2ForCausalLM = 0\n")
    for name in [n for n in sys.modules if n.split(".")[0] == "MLLM_JAX"]:
        del sys.modules[name]
    lib = mllm_jax.library(str(tmp_path))
    with pytest.raises(
        ConfigError, match=rf"does not import at {tmp_path} .*No module named 'MLLM_JAX.language.qwen3'"
    ):
        mllm_jax.revived(lib, "MLLM_JAX.language.qwen3.modular_qwen3", "Qwen3ForCausalLM")


def test_train_main_exits_2_with_one_line(tmp_path, tiny_checkpoint, capsys, no_mllm_jax_imported):
    from helpers import BASE_YML, SFT_FAST
    from unitrain import train

    path = tiny_checkpoint("qwen2", **VARIANTS["qwen2"])
    capsys.readouterr()  # transformers' progress bars while the checkpoint was made
    common = [BASE_YML, *SFT_FAST, f"base_output_directory={tmp_path}", f"load_parameters_path={path}"]
    missing = tmp_path / "nowhere"
    assert train.main([*common, "model_source=mllm_jax", f"mllm_jax_path={missing}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"'{missing}' holds no MLLM_JAX/language folder" in err, err
    assert train.main([*common, f"mllm_jax_path={missing}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "mllm_jax_path is read by model_source mllm_jax only" in err, err
