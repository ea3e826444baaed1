"""`stages:` recipes: one command equals the stages run as separate commands; resume per stage;
every stage validated before the first runs."""

import json

import pytest

from helpers import REPO, sigterm_after_step
from unitrain import pipeline, train
from unitrain.checks import load_checked

BASE = str(REPO / "configs" / "base.yml")
COMMON = {
    "max_target_length": 32,
    "per_device_batch_size": 1,
    "eval_interval": 0,
    "peak_flops_per_device": 1e12,
    "log_period": 1,
    "warmup_steps": 1,
}
SFT = {"mode": "sft", "steps": 1}
# A reward that random completions sometimes earn, so the GRPO losses are not all zero.
GRPO = {
    "mode": "grpo",
    "steps": 4,
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 4,
    "rollout_max_response_len": 4,
    "checkpoint_period": 1,
    "async_checkpointing": False,
    "learning_rate": 1e-4,
    "reward": "format",
    "format_reward_pattern": "[0-9]",
}


def recipe(tmp_path, *stages) -> str:
    path = tmp_path / "recipe.yml"
    path.write_text(
        json.dumps(
            {
                "base_config": BASE,
                "base_output_directory": str(tmp_path / "runs"),
                "run_name": "pipe",
                **COMMON,
                "stages": list(stages),
            }
        )
    )  # JSON is YAML
    return str(path)


def as_args(values: dict) -> list[str]:
    return [f"{k}={v}" for k, v in values.items()]


def losses(path) -> dict:
    return {line["step"]: line["loss"] for line in map(json.loads, open(path)) if "loss" in line}


def test_a_pipeline_equals_its_stages_as_separate_commands_and_resumes_per_stage(tmp_path, monkeypatch):
    sep = tmp_path / "separate"
    args = [BASE, f"base_output_directory={sep}", *as_args(COMMON)]
    assert train.main([*args, "run_name=sft", *as_args(SFT), f"export_hf_path={sep / 'export'}"]) == 0
    assert train.main([*args, "run_name=grpo", *as_args(GRPO), f"load_parameters_path={sep / 'export'}"]) == 0

    path = recipe(tmp_path, {"name": "sft", **SFT}, {"name": "grpo", **GRPO})
    with sigterm_after_step(monkeypatch, 1):  # only the grpo stage reaches step 1
        assert train.main([path]) == train.EXIT_SIGTERM
    run = tmp_path / "runs" / "pipe"
    sft_record = (run / "sft" / "metrics.jsonl").read_text()
    assert (run / "sft" / "stage_done").exists() and not (run / "grpo" / "stage_done").exists()
    assert max(losses(run / "grpo" / "metrics.jsonl")) < 3

    assert train.main([path]) == 0  # skips sft, resumes grpo
    assert (run / "sft" / "metrics.jsonl").read_text() == sft_record
    assert losses(run / "sft" / "metrics.jsonl") == losses(sep / "sft" / "metrics.jsonl")
    ours, theirs = losses(run / "grpo" / "metrics.jsonl"), losses(sep / "grpo" / "metrics.jsonl")
    assert sorted(ours) == [0, 1, 2, 3]
    assert ours == pytest.approx(theirs, rel=1e-6) and any(ours.values())
    assert (run / "pipeline.yml").exists() and (run / "grpo" / "config.yml").exists()


def test_stage_configs(tmp_path):
    cfg = load_checked(
        [
            recipe(
                tmp_path,
                {"name": "sft", **SFT},
                {"name": "grpo", **GRPO, "load_parameters_path": "/x"},
                {"name": "eval", "action": "eval"},
            )
        ]
    )
    sft, grpo, evaluate = pipeline.stage_configs(cfg)
    assert (sft.run_dir, sft.mode, sft.steps, sft.load_parameters_path) == (f"{cfg.run_dir}/sft", "sft", 1, "")
    assert (grpo.mode, grpo.load_parameters_path, grpo.reward) == ("grpo", "/x", "format")  # its own path wins
    assert evaluate.load_parameters_path == grpo.checkpoint_dir and evaluate.action == "eval"
    assert {s.wandb_group for s in (sft, grpo, evaluate)} == {"pipe"} and grpo.wandb_run_name == "pipe/grpo"


def test_a_stage_names_an_earlier_stages_checkpoints(tmp_path):
    """`stage:<name>` in a `*_path` key: the grpo stage starts from the sft stage, not the rm stage
    before it, and scores with the rm stage's model; other keys' values are left as written."""
    rm = {"mode": "rm", "steps": 1}
    grpo = {
        **GRPO,
        "reward": "format,rm",
        "load_parameters_path": "stage:sft",
        "reward_model_path": "stage:rm",
        "format_reward_pattern": "stage:rm",
        "reward_weights": [1.0, 0.5],  # a list, as the config's rule wants it (the recipe's values are frozen)
    }
    sft, rm_stage, grpo = pipeline.stage_configs(
        load_checked([recipe(tmp_path, {"name": "sft", **SFT}, {"name": "rm", **rm}, {"name": "grpo", **grpo})])
    )
    run = tmp_path / "runs" / "pipe"
    assert rm_stage.load_parameters_path == sft.checkpoint_dir == f"{run}/sft/checkpoints"  # the stage before
    assert grpo.load_parameters_path == sft.checkpoint_dir
    assert grpo.reward_model_path == rm_stage.checkpoint_dir == f"{run}/rm/checkpoints"
    assert grpo.format_reward_pattern == "stage:rm" and grpo.reward_weights == (1.0, 0.5)


@pytest.mark.parametrize("ref, before", [("grpo", "sft"), ("rm", "sft"), ("sft", "none")])
def test_a_reference_to_no_earlier_stage_is_one_line(tmp_path, capsys, ref, before):
    stages = [{"name": "sft", **SFT}, {"name": "grpo", **GRPO, "load_parameters_path": f"stage:{ref}"}]
    if before == "none":
        stages = [{"name": "sft", **SFT, "load_parameters_path": f"stage:{ref}"}]
    assert train.main([recipe(tmp_path, *stages)]) == 2
    name = stages[-1]["name"]
    assert capsys.readouterr().err.strip() == (
        f"unitrain: stages: stage '{name}' sets load_parameters_path: stage:{ref}, but no stage before it is "
        f"named '{ref}' (before it: {before})"
    )
    assert not (tmp_path / "runs").exists()


# A key the config refuses, and a combination only the data format's checks (unitrain.checks) refuse.
@pytest.mark.parametrize(
    "mistake, named",
    [
        ({"eval_pass_kk": 2}, "eval_pass_kk"),
        ({"data_format": "minionerec", "beam_width": 2}, "beam_width (2) must be at least the largest rec_eval_k (10)"),
    ],
)
def test_a_mistake_in_the_last_stage_stops_before_the_first(tmp_path, capsys, mistake, named):
    path = recipe(
        tmp_path,
        {"name": "sft", **SFT},
        {"name": "grpo", **GRPO},
        {"name": "eval", "action": "eval", **mistake},
    )
    assert train.main([path]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "stage 'eval' (stage 3 of 3)" in err and named in err
    assert "replace()" not in err
    if "eval_pass_kk" in mistake:  # where the key was written: the recipe's stages
        assert f"unknown config key 'eval_pass_kk' (from the stages of {path} line " in err
    assert not (tmp_path / "runs" / "pipe").exists()


def test_a_finished_stage_whose_definition_changed_is_reported_before_anything_runs(tmp_path, capsys):
    assert train.main([recipe(tmp_path, {"name": "sft", **SFT})]) == 0
    assert train.main([recipe(tmp_path, {"name": "sft", **SFT, "learning_rate": 1e-3})]) == 2
    assert "stage 'sft' is finished but its definition changed (learning_rate" in capsys.readouterr().err
    assert train.main([recipe(tmp_path, {"name": "sft", **SFT}), "steps=3"]) == 2  # its steps too
    assert "stage 'sft' is finished but its definition changed (steps: 1 -> 3)" in capsys.readouterr().err


def test_the_command_line_wins_over_every_stages_values(tmp_path, caplog):
    """steps=, eval_num_samples= and any other key given on the command line replace the stages' own
    values (the README: the command line wins last), with one line per stage naming what it replaced."""
    caplog.set_level("INFO", logger="unitrain")
    path = recipe(
        tmp_path,
        {"name": "sft", **SFT, "eval_num_samples": 16},
        {"name": "grpo", **GRPO, "eval_num_samples": 32},
    )
    sft, grpo = pipeline.stage_configs(load_checked([path, "steps=7", "eval_num_samples=3", "learning_rate=0.5"]))
    assert (sft.steps, sft.eval_num_samples, sft.learning_rate) == (7, 3, 0.5)
    assert (grpo.steps, grpo.eval_num_samples, grpo.learning_rate) == (7, 3, 0.5)
    assert (grpo.mode, grpo.reward) == ("grpo", "format")  # the keys the command line leaves are the stage's
    said = [r.getMessage() for r in caplog.records if "the command line's" in r.getMessage()]
    assert said == [
        "stage sft: the command line's steps=7, eval_num_samples=3 over the stage's steps: 1, eval_num_samples: 16",
        "stage grpo: the command line's steps=7, learning_rate=0.5, eval_num_samples=3 over the stage's steps: 4, "
        "learning_rate: 0.0001, eval_num_samples: 32",
    ]


def test_a_stage_that_sets_model_name_is_refused_not_ignored(tmp_path, capsys):
    assert train.main([recipe(tmp_path, {"name": "sft", **SFT, "model_name": "demo"})]) == 2
    assert "stage 'sft' sets model_name, which picks a model yml for the whole recipe" in capsys.readouterr().err


def test_the_distill_demo_recipe_validates_every_stage():
    teacher, student, distill = pipeline.stage_configs(load_checked([str(REPO / "configs" / "distill_demo.yml")]))
    assert (teacher.num_decoder_layers, student.num_decoder_layers) == (4, 2)
    assert teacher.load_parameters_path == student.load_parameters_path == ""  # both from random weights
    assert distill.load_parameters_path == student.checkpoint_dir and distill.teacher_path == teacher.checkpoint_dir
    assert (distill.mode, distill.distill_coef, distill.distill_reward_weight) == ("grpo", 1.0, 0.0)


def test_a_stage_with_its_own_start_keeps_its_architecture_once_the_stage_before_has_a_checkpoint(tmp_path):
    """distill_demo's student beside its teacher: a stage naming its own load_parameters_path ("": random
    weights) does not take the previous stage's architecture, before or after that stage has run."""
    path = recipe(
        tmp_path, {"name": "big", **SFT, "num_decoder_layers": 3}, {"name": "small", **SFT, "load_parameters_path": ""}
    )
    before = [s.num_decoder_layers for s in pipeline.stage_configs(load_checked([path]))]
    assert train.main([path]) == 0
    after = [s.num_decoder_layers for s in pipeline.stage_configs(load_checked([path]))]
    assert before == after == [3, 4]  # the second: base.yml's model


def test_a_stage_that_fails_before_it_starts_leaves_no_run_directory(tmp_path, capsys):
    path = recipe(tmp_path, {"name": "sft", **SFT, "dataset_path": str(tmp_path / "absent.jsonl")})
    assert train.main([path]) == 2
    assert "absent.jsonl" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # no pipeline.yml, no empty stage directory


SFT_RM_GRPO = str(REPO / "configs" / "sft_rm_grpo.yml")


def test_the_sft_rm_grpo_recipe_validates_every_stage():
    sft, rm, grpo = pipeline.stage_configs(load_checked([SFT_RM_GRPO]))
    assert (sft.mode, rm.mode, grpo.mode) == ("sft", "rm", "grpo")
    assert rm.load_parameters_path == sft.checkpoint_dir  # the reward model starts from the SFT backbone
    assert grpo.load_parameters_path == sft.checkpoint_dir == "runs/sft_rm_grpo/sft/checkpoints"  # not rm's
    assert grpo.reward_model_path == rm.checkpoint_dir == "runs/sft_rm_grpo/rm/checkpoints"
    assert (grpo.reward, grpo.reward_weights) == ("exact_match,rm", (0.0, 1.0))


def test_the_sft_rm_grpo_recipe_runs_end_to_end_and_plots(tmp_path, capsys):
    """Two steps a stage: the grpo stage scores with the rm stage's model, trains on its score alone
    (reward_mean is the rm score, weight 1) and logs exact_match beside it at weight 0."""
    from plot_metrics import main as plot

    short = ["steps=2", "eval_interval=0", "rollout_batch_size=4", "n_samples_per_prompt=4", "per_device_batch_size=2"]
    argv = [SFT_RM_GRPO, f"base_output_directory={tmp_path}", "peak_flops_per_device=1e12", *short]
    assert train.main(argv) == 0
    run = tmp_path / "sft_rm_grpo"
    assert all((run / stage / "stage_done").read_text() == "2\n" for stage in ("sft", "rm", "grpo"))
    rm_steps = [line for line in map(json.loads, open(run / "rm" / "metrics.jsonl")) if "accuracy" in line]
    assert [line["step"] for line in rm_steps] == [0, 1]
    grpo_steps = [line for line in map(json.loads, open(run / "grpo" / "metrics.jsonl")) if "loss" in line]
    assert [line["step"] for line in grpo_steps] == [0, 1]
    for line in grpo_steps:
        assert 0 <= line["reward_exact_match_mean"] <= 1 and line["rm/score_std"] > 0
        assert line["reward_rm_mean"] == pytest.approx(line["rm/score_mean"], abs=1e-5)
        assert line["reward_mean"] == pytest.approx(0.0 * line["reward_exact_match_mean"] + line["reward_rm_mean"])
    capsys.readouterr()
    out = tmp_path / "curves.png"
    assert plot([str(run), "grpo/rm/score_mean", "grpo/reward_exact_match_mean", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
