"""Tests for unitrain.config: layering, typing, validation, derived values, freezing, round trip.

Temporary recipes say `base_config: <path>`; a relative path is relative to the directory of the yml
that names it. Model ymls are looked up beside the ROOT base.yml (<its dir>/models/), wherever the
recipe lives. conftest.py gives 8 simulated CPU devices.
"""

import dataclasses
import json
import os
import pickle
import re
import shutil

import pytest
import yaml

from helpers import REPO
from unitrain import pipeline, sharding
from unitrain.checks import _Declared, check_config, load_checked, owner_checks
from unitrain.config import MODEL_KEYS, Check, Config, write_config
from unitrain.errors import ConfigError

CONFIGS = REPO / "configs"
BASE = str(CONFIGS / "base.yml")
MODELS = sorted(p.stem for p in (CONFIGS / "models").glob("*.yml"))


def load(*overrides):
    return load_checked([BASE, *overrides])


def error(argv) -> str:
    with pytest.raises(ConfigError) as e:
        load_checked(argv)
    return str(e.value)


def recipe(tmp_path, text, name="recipe.yml"):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_base_defaults_and_derived_values():
    cfg = load()
    assert isinstance(cfg, Config) and cfg.emb_dim == 64 and cfg["num_query_heads"] == 4 and cfg.model_name == "demo"
    assert cfg.head_dim == 16  # tiny.yml sets it; base.yml's null would give 64 // 4 as well
    assert cfg.run_dir == "runs/default"


def test_derived_run_paths():
    cfg = load("base_output_directory=/tmp/out", "run_name=exp1")
    assert (cfg.run_dir, cfg.checkpoint_dir, cfg.tensorboard_dir, cfg.metrics_file) == (
        "/tmp/out/exp1",
        "/tmp/out/exp1/checkpoints",
        "/tmp/out/exp1/tensorboard",
        "/tmp/out/exp1/metrics.jsonl",
    )
    assert "unknown config key 'run_dir'" in error([BASE, "run_dir=/x"])  # derived: not an input


def test_head_dim_null_is_emb_dim_over_heads():
    assert load("head_dim=null", "emb_dim=128").head_dim == 32
    assert load("head_dim=8").head_dim == 8
    assert "not a multiple of num_query_heads" in error([BASE, "head_dim=null", "emb_dim=66"])


@pytest.mark.parametrize(
    "arg, key, expected",
    [
        ("scan_layers=false", "scan_layers", False),
        ("qkv_bias=true", "qkv_bias", True),
        ("num_decoder_layers=3", "num_decoder_layers", 3),
        ("rms_norm_eps=1e-5", "rms_norm_eps", 1e-5),  # YAML 1.1 reads 1e-5 as a string
        ("rms_norm_eps=2.5E-6", "rms_norm_eps", 2.5e-6),
        ("rope_theta=500000", "rope_theta", 500000.0),  # int accepted for a float key, stored as float
        ("run_name=123", "run_name", "123"),  # str keys keep the raw text
        ("run_name=true", "run_name", "true"),
        ("run_name=007", "run_name", "007"),
        (
            "logical_axis_rules=[[batch, data], [embed, null]]",
            "logical_axis_rules",
            (("batch", "data"), ("embed", None)),
        ),
        ("sliding_window=4096", "sliding_window", 4096),  # null default accepts any YAML value
        ("sliding_window=null", "sliding_window", None),
    ],
)
def test_override_typing(arg, key, expected):
    value = load(arg)[key]
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    "arg, message",
    [
        ("num_decoder_layers=1.5", "config key 'num_decoder_layers' expects an int, got '1.5' (from command line)"),
        ("num_decoder_layers=abc", "config key 'num_decoder_layers' expects an int, got 'abc' (from command line)"),
        ("num_decoder_layers=true", "expects an int, got 'true'"),
        ("scan_layers=1", "config key 'scan_layers' expects a bool (true or false), got '1' (from command line)"),
        ("rms_norm_eps=small", "config key 'rms_norm_eps' expects a number, got 'small'"),
        ("logical_axis_rules=batch", "config key 'logical_axis_rules' expects a list, got 'batch'"),
        ("logical_axis_rules=[[batch, data]", "expects a list, got '[[batch, data]'"),
        ("emb_dim=0", "config key 'emb_dim' expects a positive int, got '0' (from command line)"),
        ("rms_norm_eps=-1", "expects a positive number"),
        ("dtype=float64", "config key 'dtype' expects one of float32 | bfloat16 | float16, got 'float64'"),
        ("remat_policy=some", "expects one of none | full | save_dots | save_dots_no_batch"),
        ("model_family=gpt2", "expects one of llama | qwen2 | qwen3 | mistral"),
        ("rope_scaling_type=yarn", "expects one of none | linear | llama3"),
        ("sliding_window=-4", "config key 'sliding_window' expects a positive int or null, got '-4'"),
        ("run_name=", "config key 'run_name' expects a non-empty string"),
    ],
)
def test_bad_values(arg, message):
    assert message in error([BASE, arg])


@pytest.mark.parametrize(
    "arg, hint",
    [
        ("env=calculater", "calculator"),
        ("mode=gpro", "grpo"),
        ("attention=splsh", "splash"),
        ("workflow=multi", "multi_turn"),
    ],
)
def test_a_misspelt_choice_gets_a_did_you_mean(arg, hint):
    assert error([BASE, arg]).endswith(f"(from command line); did you mean '{hint}'?")
    assert "did you mean" not in error([BASE, "remat_policy=some"])  # nothing close: no guess


def test_last_of_a_repeated_override_wins():
    assert load("emb_dim=32", "emb_dim=128").emb_dim == 128


def test_malformed_argument():
    assert error([BASE, "emb_dim"]) == "command-line argument 'emb_dim' is not of the form key=value"
    assert "not of the form key=value" in error([BASE, "=3"])


def test_unknown_key_on_command_line_suggests():
    assert (
        error([BASE, "num_kv_head=2"])
        == "unknown config key 'num_kv_head' (from command line); did you mean 'num_kv_heads'?"
    )
    assert error([BASE, "zzzz=1"]).startswith("unknown config key 'zzzz' (from command line)")


def test_unknown_key_in_yml_names_file_and_line(tmp_path):
    path = recipe(tmp_path, f"base_config: {BASE}\nrun_name: a\nemb_dimm: 32\n")
    assert re.fullmatch(
        r"unknown config key 'emb_dimm' \(from \S*recipe.yml line 3\); did you mean 'emb_dim'\?", error([path])
    )


def test_bad_type_in_yml(tmp_path):
    path = recipe(tmp_path, f"base_config: {BASE}\nnum_decoder_layers: 2.5\n")
    assert re.fullmatch(
        r"config key 'num_decoder_layers' expects an int, got '2.5' \(from \S*recipe.yml line 2\)", error([path])
    )


def test_yml_float_without_dot_is_a_float(tmp_path):
    tiny = (CONFIGS / "models" / "tiny.yml").read_text()
    assert load_checked(_tmp_root(tmp_path, tiny.replace("1.0e-5", "1e-6"))).rms_norm_eps == 1e-6


def test_bad_files(tmp_path):
    assert "cannot read config file" in error([str(tmp_path / "missing.yml")])
    assert "must be a mapping" in error([recipe(tmp_path, "- a\n- b\n")])
    assert re.search(r"recipe.yml line 3 is not valid YAML", error([recipe(tmp_path, "a: 1\nb: [1, 2\nc: 3\n")]))
    msg = error([recipe(tmp_path, f"base_config: {BASE}\nemb_dim: 32\nemb_dim: 64\n")])
    assert "line 3" in msg and "appears twice" in msg
    assert "no config file given" in error([])
    assert "a recipe must start with `base_config: base.yml`" in error([recipe(tmp_path, "emb_dim: 32\n")])


def test_base_config_chain_relative_and_absolute(tmp_path):
    # sub/leaf.yml -> mid.yml (relative to sub/) -> base.yml (relative to tmp_path)
    rel_base = os.path.relpath(BASE, tmp_path)
    recipe(tmp_path, f"base_config: {rel_base}\nrun_name: mid\nseed: 7\nnum_decoder_layers: 9\n", "mid.yml")
    leaf = recipe(tmp_path, "base_config: ../mid.yml\nrun_name: leaf\n", "sub/leaf.yml")
    cfg = load_checked([leaf])
    assert (cfg.run_name, cfg.seed) == ("leaf", 7)
    assert cfg.num_decoder_layers == 4  # a model dimension: the model yml is layered over the chain
    absolute = recipe(tmp_path, f"base_config: {BASE}\nseed: 3\n", "abs.yml")
    assert load_checked([absolute]).seed == 3


def test_base_config_cycle(tmp_path):
    recipe(tmp_path, "base_config: b.yml\n", "a.yml")
    recipe(tmp_path, "base_config: a.yml\n", "b.yml")
    assert "base_config forms a cycle: " in error([str(tmp_path / "a.yml")])


def test_model_layering_order(tmp_path):
    # base.yml < recipe < model yml < command line
    path = recipe(tmp_path, f"base_config: {BASE}\nmodel_name: qwen2.5-0.5b\nemb_dim: 999\nseed: 5\n")
    cfg = load_checked([path])
    assert (cfg.model_name, cfg.emb_dim, cfg.seed, cfg.qkv_bias) == ("qwen2.5-0.5b", 896, 5, True)
    cfg = load_checked([path, "emb_dim=1792"])
    assert (cfg.emb_dim, cfg.num_query_heads) == (1792, 14)
    cfg = load_checked([path, "model_name=tiny"])  # the command line picks the model yml
    assert (cfg.emb_dim, cfg.qkv_bias) == (64, False)


def test_missing_model_lists_available():
    msg = error([BASE, "model_name=llama9"])
    assert "model_name 'llama9' has no file" in msg and "available: " in msg and "qwen3-8b" in msg


def _tmp_root(tmp_path, model_text):
    """A copy of base.yml with its own models/ folder holding one model yml."""
    shutil.copy(BASE, tmp_path / "base.yml")
    recipe(tmp_path, model_text, "models/custom.yml")
    return [str(tmp_path / "base.yml"), "model_name=custom"]


def test_model_yml_rejects_non_model_key(tmp_path):
    tiny = (CONFIGS / "models" / "tiny.yml").read_text()
    msg = error(_tmp_root(tmp_path, tiny + "dtype: bfloat16\n"))
    assert "config key 'dtype' is not a model dimension" in msg and "custom.yml line" in msg
    assert "did you mean 'emb_dim'" in error(_tmp_root(tmp_path, tiny + "emb_dimm: 3\n"))


def test_model_yml_must_be_complete(tmp_path):
    tiny = yaml.safe_load((CONFIGS / "models" / "tiny.yml").read_text())
    del tiny["qk_norm"]
    assert "lacks 'qk_norm'" in error(_tmp_root(tmp_path, yaml.safe_dump(tiny)))


def test_model_keys_match_base_yml_model_section():
    text = (CONFIGS / "base.yml").read_text()
    section = re.search(r"^# -+ model\n(.*?)^# -+ ", text, re.S | re.M).group(1)
    keys = re.findall(r"^(\w+):", section, re.M)
    assert (
        tuple(
            k
            for k in keys
            if k
            not in (
                "model_source",
                "mllm_jax_path",
                "model_name",
                "dtype",
                "weight_dtype",
                "remat_policy",
                "scan_layers",
                "attention",
                "attention_chunk_size",
            )
        )
        == MODEL_KEYS
    )


@pytest.mark.parametrize("model", MODELS)
def test_every_model_yml_loads(model):
    cfg = load(f"model_name={model}")
    assert cfg.model_name == model and cfg.num_query_heads % cfg.num_kv_heads == 0
    assert set(yaml.safe_load((CONFIGS / "models" / f"{model}.yml").read_text())) == set(MODEL_KEYS)


@pytest.mark.parametrize(
    "model, dims",
    [
        (
            "qwen2.5-0.5b",
            dict(
                vocab_size=151936,
                emb_dim=896,
                mlp_dim=4864,
                num_decoder_layers=24,
                num_query_heads=14,
                num_kv_heads=2,
                head_dim=64,
                tie_word_embeddings=True,
                qkv_bias=True,
                rms_norm_eps=1e-6,
            ),
        ),
        (
            "qwen2.5-7b",
            dict(
                vocab_size=152064,
                emb_dim=3584,
                mlp_dim=18944,
                num_query_heads=28,
                num_kv_heads=4,
                tie_word_embeddings=False,
                qkv_bias=True,
            ),
        ),
        (
            "llama3.1-8b",
            dict(
                vocab_size=128256,
                emb_dim=4096,
                mlp_dim=14336,
                num_decoder_layers=32,
                num_kv_heads=8,
                rope_theta=500000.0,
                rope_scaling_type="llama3",
                rope_scaling_factor=8.0,
                rope_original_max_position=8192,
                tie_word_embeddings=False,
            ),
        ),
        (
            "llama3.2-1b",
            dict(emb_dim=2048, num_decoder_layers=16, head_dim=64, rope_scaling_factor=32.0, tie_word_embeddings=True),
        ),
        (
            "qwen3-0.6b",
            dict(
                emb_dim=1024, num_query_heads=16, head_dim=128, qk_norm=True, qkv_bias=False, tie_word_embeddings=True
            ),
        ),
        ("qwen3-8b", dict(emb_dim=4096, mlp_dim=12288, num_decoder_layers=36, qk_norm=True, tie_word_embeddings=False)),
        ("mistral-7b", dict(vocab_size=32768, rope_theta=1e6, sliding_window=None, model_family="mistral")),
    ],
)
def test_model_dims(model, dims):
    cfg = load(f"model_name={model}")
    assert {k: cfg[k] for k in dims} == dims


def test_cross_key_checks():
    assert "num_query_heads (3) must be a multiple of num_kv_heads (2)" in error([BASE, "num_query_heads=3"])
    assert "rope_high_freq_factor > rope_low_freq_factor" in error(
        [BASE, "rope_scaling_type=llama3", "rope_low_freq_factor=4.0"]
    )


def test_mesh_errors():
    assert "only one ici_*/dcn_*_parallelism may be -1" in error([BASE, "ici_data_parallelism=-1"])
    assert "only one ici_*/dcn_*_parallelism may be -1" in error([BASE, "dcn_data_parallelism=-1"])
    assert "expects -1 (fill the remaining devices) or a positive int" in error([BASE, "ici_data_parallelism=0"])


def test_rollout_device_errors():
    mesh = ["mode=grpo", "sampler=mesh"]
    assert "sampler mesh samples on devices of its own: set rollout_devices" in error([BASE, *mesh])
    assert "rollout_devices=4 needs a sampler that runs on them" in error([BASE, "mode=grpo", "rollout_devices=4"])
    assert "mode=sft trains on no rollouts" in error([BASE, "max_staleness=1"])
    assert "mode=dpo trains on no rollouts" in error([BASE, "mode=dpo", "sampler=mesh", "rollout_devices=4"])
    assert "only one rollout_*_parallelism may be -1" in error(
        [BASE, *mesh, "rollout_devices=4", "rollout_fsdp_parallelism=-1"]
    )
    assert "'rollout_devices' expects an int >= 0" in error([BASE, "rollout_devices=-1"])
    assert "rollout_meshes=2 splits rollout_devices into meshes of sampler mesh, not sampler colocated" in error(
        [BASE, "mode=grpo", "rollout_meshes=2"]
    )
    assert "rollout_devices (6) must divide into rollout_meshes=4 meshes" in error(
        [BASE, *mesh, "rollout_devices=6", "rollout_meshes=4"]
    )
    assert "'rollout_meshes' expects a positive int" in error([BASE, "rollout_meshes=0"])
    assert "'max_staleness' expects an int >= 0" in error([BASE, "max_staleness=-2"])


def test_the_stream_keys_need_groups_that_sample_across_steps():
    assert "max_concurrent_rollouts bounds the groups in flight" in error(
        [BASE, "mode=grpo", "max_concurrent_rollouts=4"]
    )
    assert "rollout_chunk_tokens lets a weight update interrupt" in error([BASE, "mode=grpo", "rollout_chunk_tokens=4"])
    assert "max_concurrent_rollouts serve RL rollouts; mode=sft" in error([BASE, "max_concurrent_rollouts=4"])
    cfg = load("mode=grpo", "max_staleness=1", "max_concurrent_rollouts=4", "rollout_chunk_tokens=4")
    assert (cfg.max_concurrent_rollouts, cfg.rollout_chunk_tokens) == (4, 4)


@pytest.mark.parametrize(
    "rules, message",
    [
        ("[[batch, model]]", "uses mesh axis 'model'"),
        ("[[batch, data], [batch, fsdp]]", "repeats a mesh axis or a logical name"),
        ("[[batch, [data, data]]]", "repeats a mesh axis"),
        ("[[batch]]", "must be [logical_name, mesh_axis | [mesh_axes] | null]"),
        ("[[batch, 3]]", "must be [logical_name"),
    ],
)
def test_logical_axis_rules_checked(rules, message):
    assert message in error([BASE, f"logical_axis_rules={rules}"])


def test_frozen():
    cfg = load("stages=[{name: a}]")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.emb_dim = 1
    with pytest.raises(TypeError):
        cfg["emb_dim"] = 1
    with pytest.raises(TypeError):
        cfg.stages[0]["name"] = "b"
    assert isinstance(cfg.logical_axis_rules, tuple)
    with pytest.raises(AttributeError, match="did you mean 'emb_dim'"):
        _ = cfg.emb_dimm


def test_to_dict_is_a_plain_copy():
    cfg = load("stages=[{name: a}]")
    d = cfg.to_dict()
    assert type(d["logical_axis_rules"]) is list and type(d["stages"][0]) is dict
    d["logical_axis_rules"].clear()
    assert cfg.logical_axis_rules and yaml.safe_load(yaml.safe_dump(cfg.to_dict())) == cfg.to_dict()


def test_replace_retypes_and_rederives_and_the_owners_recheck():
    cfg = load("head_dim=null")
    new = cfg.replace(emb_dim=128, run_name="r2", logical_axis_rules=cfg.logical_axis_rules)
    assert (new.emb_dim, new.head_dim, new.run_dir, cfg.emb_dim) == (128, 32, "runs/r2", 64)
    with pytest.raises(ConfigError, match="expects a positive int"):
        cfg.replace(emb_dim=0)
    with pytest.raises(ConfigError, match="did you mean 'emb_dim'"):
        cfg.replace(emb_dimm=3)
    with pytest.raises(ConfigError, match="only one ici_\\*/dcn_\\*_parallelism may be -1"):
        check_config(cfg.replace(ici_data_parallelism=-1))


def test_every_check_declares_keys_of_base_yml_and_reads_no_other():
    schema = yaml.safe_load(open(BASE))
    found = list(owner_checks())
    assert len(found) >= 20
    for check in found:
        assert set(check.keys) <= set(schema), (check.fn.__name__, set(check.keys) - set(schema))
    sneaky = Check(("mode",), lambda c: c["critic_path"])
    with pytest.raises(KeyError, match="reads 'critic_path', which it does not declare"):
        sneaky(_Declared(load().inputs(), sneaky))


def test_a_failed_check_names_where_the_user_set_its_keys(tmp_path):
    recipe = tmp_path / "recipe.yml"
    recipe.write_text(f"base_config: {BASE}\nmode: sft\n")
    message = error([str(recipe), "critic_path=/c"])
    assert message.endswith("(mode from " + str(recipe) + " line 2; critic_path from command line)"), message


def test_equality_hash_pickle():
    a, b = load("seed=1"), load("seed=1")
    assert a == b and hash(a) == hash(b) and a != load("seed=2")
    assert pickle.loads(pickle.dumps(a)) == a


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["model_name=qwen3-0.6b", "emb_dim=512", "run_name=007", "sliding_window=128", "ici_data_parallelism=2"],
        ["head_dim=null", "rms_norm_eps=1e-7"],
    ],
)
def test_write_config_round_trip(tmp_path, args):
    cfg = load(*args)
    path = tmp_path / "run" / "config.yml"
    write_config(cfg, path)
    again = load_checked([str(path)])
    assert again.to_dict() == cfg.to_dict() and again == cfg
    text = path.read_text()
    assert "\n# run_dir: " in text and "\nrun_dir" not in text  # derived values only as comments
    assert load_checked([str(path), "seed=9"]).seed == 9


def test_resolved_config_refuses_a_new_model(tmp_path):
    write_config(load(), tmp_path / "config.yml")
    assert "model_name cannot change" in error([str(tmp_path / "config.yml"), "model_name=qwen3-8b"])


def test_recipes_load():
    cfg = load_checked([str(CONFIGS / "gsm8k_grpo.yml")])
    assert cfg.mode == "grpo" and sharding.layout_for(cfg).updates_per_step >= 1
    sft, grpo = pipeline.stage_configs(load_checked([str(CONFIGS / "sft_then_grpo.yml")]))
    assert (sft.mode, grpo.mode, sharding.layout_for(grpo).updates_per_step) == ("sft", "grpo", 1)
    assert grpo.load_parameters_path == sft.checkpoint_dir == "runs/sft_then_grpo/sft/checkpoints"


def test_the_shapes_recipe_chains_a_vision_language_model_through_its_stages(tmp_path, tiny_checkpoint, monkeypatch):
    """configs/shapes_vl.yml as its comment runs it: every stage checked before the first runs, the GRPO
    stage from the SFT stage's checkpoints (its tower's shape found through that run), the blank stage
    on the blank pictures."""
    from make_shapes import make_shapes

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "tiny_vl").symlink_to(tiny_checkpoint("qwen2_5_vl"))
    make_shapes(tmp_path / "runs" / "shapes", train=4, eval_=4)
    # 16 rows a device: the suite's 8 devices take GRPO's 128 rows an update (the recipe runs on one CPU device).
    sft, grpo, blank = pipeline.stage_configs(
        load_checked([str(CONFIGS / "shapes_vl.yml"), "per_device_batch_size=16"])
    )
    assert (sft.mode, grpo.mode, blank.action) == ("sft", "grpo", "eval")
    assert sft.model_family == grpo.model_family == "qwen2_5_vl" and grpo.max_image_patches == 72
    assert grpo.load_parameters_path == sft.checkpoint_dir and blank.load_parameters_path == grpo.checkpoint_dir
    assert blank.eval_dataset_path == "runs/shapes/eval_blank.jsonl"


def test_model_name_empty_on_the_command_line_takes_the_checkpoints_architecture(tiny_checkpoint):
    """gsm8k_grpo.yml sets model_name: qwen2.5-0.5b; another checkpoint's message names the way on,
    `model_name=`, and that way loads the checkpoint's architecture (its config.json)."""
    ckpt = tiny_checkpoint("qwen2")
    hf = json.loads((ckpt / "config.json").read_text())
    grpo = str(CONFIGS / "gsm8k_grpo.yml")
    message = error([grpo, f"load_parameters_path={ckpt}"])
    assert "\n" not in message and "by model_name=qwen2.5-0.5b" in message
    assert "add `model_name=` (empty) to the command line to take the checkpoint's architecture" in message
    cfg = load_checked([grpo, f"load_parameters_path={ckpt}", "model_name="])
    assert (cfg.model_name, cfg.emb_dim, cfg.num_decoder_layers, cfg.mlp_dim) == (
        "",
        hf["hidden_size"],
        hf["num_hidden_layers"],
        hf["intermediate_size"],
    )
    # a key set by hand names its own ways: drop it, or give the checkpoint's value
    message = error([grpo, f"load_parameters_path={ckpt}", "model_name=", "emb_dim=999"])
    assert f"drop the key (or set emb_dim={hf['hidden_size']})" in message
    assert load_checked([grpo, f"load_parameters_path={ckpt}", "model_name=", f"emb_dim={hf['hidden_size']}"])
    # without a checkpoint, no model yml: the root base.yml's model keys
    assert load_checked([grpo, "model_name="]).emb_dim == yaml.safe_load(open(BASE))["emb_dim"]


def test_is_default_says_whether_a_layer_set_the_key(tmp_path):
    path = recipe(tmp_path, f"base_config: {BASE}\nseed: 5\n")
    cfg = load_checked([path, "learning_rate=0.1"])
    assert cfg.is_default("reward") and not cfg.is_default("seed") and not cfg.is_default("learning_rate")
    assert not cfg.replace(reward="math").is_default("reward") and pickle.loads(pickle.dumps(cfg)).is_default("reward")
