"""A recipe with `stages:` runs them in order, in one process, under one run directory.

    stages:
      - {name: sft, mode: sft, steps: 200}
      - {name: grpo, mode: grpo, steps: 60, learning_rate: 2.0e-5}
      - {name: eval, action: eval}
      - {name: export, action: export, export_hf_path: out/model}

Each stage is the recipe with the stage's keys on top, run as `<run_dir>/<name>/` (its own
config.yml, checkpoints, metrics), starting from the previous stage's final parameters
(`load_parameters_path` = that stage's checkpoints; the optimizer starts fresh unless the stage
sets `load_optimizer_state: true`) unless the stage names its own. A stage's path key (`*_path`) may
name an earlier stage's checkpoints as `stage:<name>`: `load_parameters_path: stage:sft` starts a
later stage from the SFT stage rather than the one before it, `reward_model_path: stage:rm` scores
with the reward model a mode=rm stage trained. Every stage's config is built, and so validated,
before the first one runs. A stage
that finished leaves `<run_dir>/<name>/stage_done`; re-running the command skips those and resumes
the stage in progress from its latest checkpoint. A key given on the command line wins over every
stage's own value of it (`steps=10` shortens every stage), as it wins over the recipe's.
"""

from __future__ import annotations

import logging
import os

import jax
from jax.experimental import multihost_utils

from unitrain import checks, run_dir
from unitrain.config import FROM_COMMAND_LINE, write_config
from unitrain.errors import ConfigError
from unitrain.run import device_layout

log = logging.getLogger("unitrain")

STAGE_REFERENCE = "stage:"  # a stage's `*_path` value "stage:<name>": that earlier stage's checkpoints


def stage_configs(cfg) -> list:
    """The config of every stage, in order, each checked on the devices (run.device_layout); a mistake
    in any is one line naming the stage."""
    stages, names = [], set()
    recipe = cfg.origin("stages").removeprefix("from ")  # "configs/x.yml line 3"
    for i, stage in enumerate(cfg.to_dict()["stages"]):  # thawed: a stage's list values are lists again
        where = f"stage {i + 1} of {len(cfg.stages)}"
        if not isinstance(stage, dict) or not isinstance(stage.get("name"), str) or not stage["name"].strip():
            raise ConfigError(f"stages: {where} must be a mapping with a non-empty 'name' and the keys it overrides")
        name = stage["name"]
        if name in names or "/" in name:
            raise ConfigError(f"stages: {where} is named '{name}', which is repeated or contains '/'")
        names.add(name)
        # One W&B group per pipeline, one W&B run per stage; TensorBoard shows <run_dir>'s stages together.
        changes = {
            "stages": [],
            "base_output_directory": cfg.run_dir,
            "run_name": name,
            "wandb_group": cfg.wandb_group or cfg.run_name,
            "wandb_run_name": f"{cfg.run_name}/{name}",
        }
        own = {k: v for k, v in stage.items() if k != "name"}
        if stages and "load_parameters_path" not in own:  # else the previous checkpoint's architecture would stick
            changes["load_parameters_path"] = stages[-1].checkpoint_dir
        if bad := sorted(set(own) & {"stages", "run_name", "base_output_directory"}):
            raise ConfigError(f"stages: stage '{name}' sets '{bad[0]}', which the pipeline decides")
        if "model_name" in own:  # a model yml is layered when the recipe loads, under every stage
            raise ConfigError(
                f"stages: stage '{name}' sets model_name, which picks a model yml for the whole recipe; "
                "set the model keys the stage changes instead (e.g. num_decoder_layers)"
            )
        own = _without_command_line_keys(cfg, name, _resolve_stage_references(name, own, stages))
        try:
            stage_cfg = cfg.replace(**changes).replace(f"from the stages of {recipe}", **own)
            checks.check_config(stage_cfg)
            device_layout(stage_cfg)
        except ConfigError as e:
            raise ConfigError(f"stage '{name}' ({where}): {e}") from None
        stages.append(stage_cfg)
    return stages


def _resolve_stage_references(name: str, own: dict, earlier: list) -> dict:
    """The stage's keys with each `*_path` value "stage:<name>" replaced by that earlier stage's
    checkpoint directory; a name that is not an earlier stage's is one line."""
    done = {stage.run_name: stage.checkpoint_dir for stage in earlier}
    resolved = dict(own)
    for key, value in own.items():
        if key.endswith("_path") and isinstance(value, str) and value.startswith(STAGE_REFERENCE):
            ref = value.removeprefix(STAGE_REFERENCE)
            if ref not in done:
                raise ConfigError(
                    f"stages: stage '{name}' sets {key}: {value}, but no stage before it is named '{ref}' "
                    f"(before it: {', '.join(done) or 'none'})"
                )
            resolved[key] = done[ref]
    return resolved


def _without_command_line_keys(cfg, name: str, own: dict) -> dict:
    """The stage's keys less those the command line sets: the command line wins last, over a stage's
    values too (steps=10 shortens every stage); a line says which stage values it replaced."""
    given = {k: v for k, v in cfg.to_dict().items() if cfg.origin(k) == FROM_COMMAND_LINE}
    if overridden := {k: v for k, v in own.items() if k in given and v != given[k]}:
        log.info(
            "stage %s: the command line's %s over the stage's %s",
            name,
            ", ".join(f"{k}={run_dir.show(given[k])}" for k in overridden),
            ", ".join(f"{k}: {run_dir.show(v)}" for k, v in overridden.items()),
        )
    return {k: v for k, v in own.items() if k not in given}


def run(cfg, train) -> int:
    """Runs the stages of `cfg` with `train(stage_cfg) -> exit status`; stops at the first failure."""
    stages = stage_configs(cfg)
    _check_finished_stages_unchanged(stages)
    for stage in stages:
        done = os.path.join(stage.run_dir, "stage_done")
        if os.path.exists(done):
            log.info("stage %s: finished before, skipped", stage.run_name)
            continue
        log.info("stage %s: %s %s in %s", stage.run_name, stage.action, stage.mode, stage.run_dir)
        status = None
        try:
            status = train(stage)
        finally:  # once a stage ran or started: a command that failed before leaves no file behind
            if jax.process_index() == 0 and (
                status is not None or os.path.exists(os.path.join(stage.run_dir, "config.yml"))
            ):
                write_config(cfg, os.path.join(cfg.run_dir, "pipeline.yml"))
        if status != 0:
            log.warning("stage %s stopped with status %d; re-run the command to resume it", stage.run_name, status)
            return status
        if jax.process_index() == 0:
            with open(done, "w") as f:
                f.write(f"{stage.steps}\n")
        multihost_utils.sync_global_devices(f"unitrain stage {stage.run_name}")
    return 0


def _finished_steps(done: str) -> str:
    with open(done) as f:
        return f.read().strip()


def _check_finished_stages_unchanged(stages) -> None:
    """A finished stage whose definition changed would leave the run's record wrong: stop first."""
    for stage in stages:
        previous = run_dir.previous_config(stage.run_dir)
        if previous is None:
            continue
        changes = run_dir.changed_keys(stage, previous)
        done = os.path.join(stage.run_dir, "stage_done")
        if os.path.exists(done) and (finished := _finished_steps(done)) != str(stage.steps):
            changes["steps"] = (finished, stage.steps)  # a run's steps may grow, a finished stage's not
        shown = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in changes.items())
        if changes and os.path.exists(done):
            raise ConfigError(
                f"stage '{stage.run_name}' is finished but its definition changed ({shown}); "
                f"use another run_name, or remove {stage.run_dir} to run it again"
            )
        if changes:
            log.warning(
                "stage %s changed since it started (%s); it resumes with the new definition", stage.run_name, shown
            )
