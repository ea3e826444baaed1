"""The seams: a mode, a sampler and a data format from a module outside the package, named in the
config alone; a sampler that cannot rank refused at config time; the one plugin loader's errors."""

import json
import sys
import textwrap

import numpy as np
import pytest

from helpers import REPO, SFT_FAST
from unitrain import train
from unitrain.checks import load_checked
from unitrain.errors import ConfigError

TOY = textwrap.dedent('''
    """A toy mode and a toy sampler, written against unitrain's public interfaces only."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from unitrain import sharding
    from unitrain import step as step_lib
    from unitrain.data.formats import DataFormat
    from unitrain.engines.base import Completions
    from unitrain.tasks.base import Task

    TARGET = 7
    SEEN_VERSIONS = []


    class Counter:
        """A data iterator whose position is checkpointed."""

        def __init__(self):
            self.position = 0

        def __next__(self):
            self.position += 1
            return self.position

        def get_state(self):
            return {"position": self.position}

        def set_state(self, state):
            self.position = state["position"]


    class ConstantTask(Task):
        """Teaches the model to predict token TARGET after random tokens."""

        def __init__(self, run):
            super().__init__(run)
            self.data_iterator = Counter()
            settings = step_lib.StepConfig.from_config(self.cfg, run.learning_rate)
            self.update = step_lib.make_train_step(self.loss, settings, run.optimizer, run.state_shardings,
                                                   self.batch_shardings())

        def loss(self, params, batch):
            logits, _ = nnx.merge(self.run.graphdef, params)(batch["tokens"], batch["positions"], batch["segments"])
            logp = jax.nn.log_softmax(logits.astype(jnp.float32))[..., TARGET]
            count = jnp.asarray(logp.size, jnp.float32)
            return -logp.sum(), (count, {"p_target": (jnp.exp(logp).sum(), count)})

        def batch_shardings(self):
            return {k: sharding.batch_sharding(self.run.mesh, self.run.rules) for k in ("tokens", "positions", "segments")}

        def step(self, state, step):
            position = next(self.data_iterator)
            rows, T = self.run.layout.rows_per_update, self.cfg.max_target_length
            tokens = np.random.default_rng(position).integers(1, 50, (rows, T)).astype(np.int32)
            batch = {"tokens": tokens, "positions": np.tile(np.arange(T, dtype=np.int32), (rows, 1)),
                     "segments": np.ones((rows, T), np.int32)}
            batch = sharding.full_rows_to_global(batch, self.batch_shardings())
            state, metrics = self.run.programs("toy_step", self.update, state, batch)
            return state, {**metrics, "toy_position": position}


    class EchoLabelSampler:
        """Answers every prompt of the built-in task with the digits '42' and records policy versions."""

        def __init__(self, run):
            self.tokenizer, self.version = run.tokenizer, None

        def update_weights(self, params, version):
            self.version = version
            SEEN_VERSIONS.append(version)

        def generate(self, prompt_ids, sampling, key):
            ids = self.tokenizer.encode("42")[:sampling.max_new_tokens]
            n, N = len(prompt_ids), sampling.max_new_tokens
            tokens = np.zeros((n, N), np.int32)
            mask = np.zeros((n, N), np.int32)
            tokens[:, :len(ids)], mask[:, :len(ids)] = ids, 1
            return Completions(tokens, mask, np.zeros((n, N), np.float32), mask.sum(axis=1).astype(np.int32),
                               self.version)


    def make_sampler(run):
        return EchoLabelSampler(run)


    def always_42(prompt, completion, label):
        return float(completion == "42")


    class TabSeparated(DataFormat):
        """Records as prompt<TAB>answer lines: the answer is the completion (SFT) or the label (GRPO)."""

        def sft_records(self, cfg, tokenizer, path):
            return [{"prompt": p, "completion": a} for p, a in self.pairs(path)]

        def prompt_records(self, cfg, path):
            return [{"prompt": p, "label": a} for p, a in self.pairs(path)]

        @staticmethod
        def pairs(path):
            with open(path) as f:
                return [line.rstrip("\\n").split("\\t") for line in f if line.strip()]
''')

# The SFT fast run (helpers.SFT_FAST), its later keys in place of its own: shorter rows, a constant
# learning rate from the first step (the toy mode's loss falls within 6 steps), a checkpoint at step 3.
FAST = [
    *SFT_FAST,
    "max_target_length=16",
    "warmup_steps=0",
    "learning_rate=1e-2",
    "lr_schedule=constant",
    "checkpoint_period=3",
]


@pytest.fixture
def toy(tmp_path, monkeypatch):
    (tmp_path / "toy_plugins.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib
    import sys

    sys.modules.pop("toy_plugins", None)
    return importlib.import_module("toy_plugins")


def lines_of(path):
    return [json.loads(l) for l in open(path)]


def test_a_toy_mode_from_outside_the_package_trains_checkpoints_and_resumes(tmp_path, toy):
    argv = [
        str(REPO / "configs" / "base.yml"),
        f"base_output_directory={tmp_path}",
        *FAST,
        "mode=toy_plugins:ConstantTask",
    ]
    assert train.main([*argv, "steps=6", "run_name=straight"]) == 0
    straight = lines_of(tmp_path / "straight" / "metrics.jsonl")
    assert [l["toy_position"] for l in straight] == [1, 2, 3, 4, 5, 6]
    assert straight[-1]["p_target"] > straight[0]["p_target"] and straight[-1]["loss"] < straight[0]["loss"]
    # Stopped after 3 steps, then resumed to 6: the toy iterator's position came back from the checkpoint.
    assert train.main([*argv, "steps=3", "run_name=resumed"]) == 0
    assert train.main([*argv, "steps=6", "run_name=resumed"]) == 0
    resumed = lines_of(tmp_path / "resumed" / "metrics.jsonl")
    assert [l["toy_position"] for l in resumed] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([l["loss"] for l in resumed], [l["loss"] for l in straight], rtol=1e-5)


def test_a_toy_sampler_from_outside_the_package_feeds_grpo(tmp_path, toy):
    argv = [
        str(REPO / "configs" / "base.yml"),
        f"base_output_directory={tmp_path}",
        *FAST,
        "mode=grpo",
        "sampler=toy_plugins:make_sampler",
        "reward=toy_plugins:always_42",
        "rollout_batch_size=4",
        "n_samples_per_prompt=2",
        "rollout_max_response_len=4",
        "steps=2",
        "per_device_batch_size=1",
    ]
    assert train.main(argv) == 0
    steps = [l for l in lines_of(tmp_path / "default" / "metrics.jsonl") if "loss" in l]
    assert [l["reward_mean"] for l in steps] == [1.0, 1.0]  # every completion came from the toy sampler
    assert toy.SEEN_VERSIONS == [0, 1]  # the trainer pushed each step's policy version


def test_a_toy_data_format_from_outside_the_package_feeds_grpo(tmp_path, toy):
    prompts = tmp_path / "prompts.tsv"
    prompts.write_text("".join(f"{i}+{42 - i}=\t42\n" for i in range(16)))
    argv = [
        str(REPO / "configs" / "base.yml"),
        f"base_output_directory={tmp_path}",
        *FAST,
        "mode=grpo",
        "data_format=toy_plugins:TabSeparated",
        f"dataset_path={prompts}",
        "sampler=toy_plugins:make_sampler",
        "reward=exact_match",  # the toy sampler's "42" against the label the format read
        "rollout_batch_size=4",
        "n_samples_per_prompt=2",
        "rollout_max_response_len=4",
        "steps=2",
    ]
    assert train.main(argv) == 0
    steps = [l for l in lines_of(tmp_path / "default" / "metrics.jsonl") if "loss" in l]
    assert [l["reward_mean"] for l in steps] == [1.0, 1.0]


def test_a_sampler_that_cannot_rank_stops_a_run_that_ranks_before_it_starts(tmp_path, capsys, toy):
    argv = [
        str(REPO / "configs" / "base.yml"),
        f"base_output_directory={tmp_path}",
        *FAST,
        "mode=grpo",
        "sampler=toy_plugins:make_sampler",
        "rollout_decoding=beam",
        "rollout_batch_size=4",
        "n_samples_per_prompt=2",
        "steps=1",
    ]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and (
            "invalid config: rollout_decoding=beam ranks with beam search, but sampler toy_plugins:make_sampler "
            "is not declared a RankingSampler"
        )
        in err[0]
    ), err
    assert not (tmp_path / "default").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("mode=spt", "config key 'mode' expects one of sft | grpo | dpo | rm | ppo | online_dpo or pkg.module:symbol"),
        (
            "mode=no_such_module:Task",
            "config key 'mode' names 'no_such_module:Task' but module 'no_such_module' is not found",
        ),
        (
            "mode=grpo sampler=unitrain.rollout:NoSuch",
            "config key 'sampler' names 'unitrain.rollout:NoSuch' but module 'unitrain.rollout' has no attribute 'NoSuch'",
        ),
        (
            "model_source=unitrain.registry:MODEL_SOURCES",
            "config key 'model_source' names 'unitrain.registry:MODEL_SOURCES' but 'MODEL_SOURCES' is a dict",
        ),
        ("dynamic_sampling_filter=nonzero", "config key 'dynamic_sampling_filter' expects"),
        ("data_format=csv", "config key 'data_format' expects one of records | minionerec or pkg.module:symbol"),
        (
            "data_format=unitrain.recsys.format:NoSuch",
            "config key 'data_format' names 'unitrain.recsys.format:NoSuch' but module 'unitrain.recsys.format' has no attribute 'NoSuch'",
        ),
    ],
)
def test_plugin_mistakes_are_one_line_and_exit_2(tmp_path, capsys, override, message):
    argv = [
        str(REPO / "configs" / "base.yml"),
        f"base_output_directory={tmp_path}",
        *FAST,
        "steps=1",
        *override.split(),
    ]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_choice_lists_come_from_the_registries():
    from unitrain.registry import DATA_FORMATS, FILTERS, MODEL_SOURCES, MODES, SAMPLERS

    base = str(REPO / "configs" / "base.yml")
    # the keys a choice needs beside it (an engine's interpreter: CI makes no SGLang venv)
    needs = {
        "mesh": ["mode=grpo", "rollout_devices=4"],
        "vllm": ["head_dim=32"],
        "sglang": [f"sglang_python={sys.executable}"],
    }
    for key, table in (
        ("mode", MODES),
        ("model_source", MODEL_SOURCES),
        ("sampler", SAMPLERS),
        ("data_format", DATA_FORMATS),
    ):
        for name in table:
            assert load_checked([base, f"{key}={name}", "per_device_batch_size=1", *needs.get(name, [])])[key] == name
    assert load_checked([base, f"dynamic_sampling_filter={next(iter(FILTERS))}"])
    with pytest.raises(ConfigError, match="one of sft | grpo | dpo"):
        load_checked([base, "mode=rl"])
