"""What a run directory keeps between invocations of the same run: the config history, the global
batch the data stream was cut into, and which saved step a resumed run starts from.

A command that fails validation or start-up never touches `config.yml`: `save_config` runs only
once the run is built and restored. A resumed run whose config changed keeps the earlier file as
`config.<n>.yml` and logs every changed key; a resume on another device count keeps the global batch.
A command that cannot resume the directory's checkpoints (another mode, data pipeline or model than
its config.yml records) stops before anything is built (check_resumable); one for a run that already
trained all its steps says so (finished_step); one that failed before its run started leaves no
empty directory behind (no_empty_dirs_left).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil

import yaml

from unitrain.config import write_config
from unitrain.errors import ConfigError

log = logging.getLogger("unitrain")

# Keys that may differ between invocations of one run without changing what is trained.
_RUN_CONTROL = (
    "steps",
    "action",
    "resume_step",
    "log_period",
    "eval_interval",
    "checkpoint_period",
    "max_to_keep",
    "async_checkpointing",
    "export_hf_path",
    "profiler",
    "profiler_start_step",
    "profiler_steps",
    "sample_log_period",
    "distributed_init",
    "coordinator_address",
    "num_processes",
    "process_id",
)


# Keys whose change makes another run: its checkpoints hold another state (another mode's data
# iterator and loss, another data pipeline's position, another model's parameters).
_RUN_IDENTITY = (
    "mode",
    "data_format",
    "dataset_path",
    "model_source",
    "model_family",
    "emb_dim",
    "mlp_dim",
    "num_decoder_layers",
    "num_query_heads",
    "num_kv_heads",
    "lora_rank",
)


def check_resumable(cfg, previous: dict, has_checkpoint: bool) -> None:
    """A command that cannot resume the run directory's checkpoints (another mode, data pipeline or
    model than its config.yml records) stops here, before anything is built, in one line."""
    differ = [k for k in _RUN_IDENTITY if k in previous and previous[k] != cfg[k]]
    if has_checkpoint and differ:
        key = differ[0]
        same_model = key in ("mode", "data_format", "dataset_path", "lora_rank")
        start_there = f" (with load_parameters_path={cfg.checkpoint_dir} to start from its weights)" * same_model
        raise ConfigError(
            f"{cfg.run_dir} holds a run with {key}={show(previous[key])} (its config.yml) and this command "
            f"sets {key}={show(cfg[key])}, so it cannot resume it: give it another run_name{start_there}"
        )


def previous_config(run_dir: str) -> dict | None:
    """The config.yml of an earlier invocation of this run, inputs and derived values, or None."""
    path = os.path.join(run_dir, "config.yml")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            text = f.read()
        inputs = yaml.safe_load(text)
        derived = yaml.safe_load("\n".join(line[2:] for line in text.split("# ---- derived", 1)[-1].splitlines()[1:]))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(
            f"{path} cannot be read ({e.__class__.__name__}: {str(e).splitlines()[0]}); "
            "move it away to start the run afresh"
        ) from None
    return {**(derived or {}), **(inputs or {})}


def keep_global_batch(cfg, global_batch_size: int, previous: dict, has_checkpoint: bool):
    """The config of a resumed run with the global batch of its earlier invocations (this command's
    is `global_batch_size`, its Layout's): on another device count the per-device batch follows, so
    the data stream and the loss curve continue."""
    before, now = previous.get("global_batch_size"), global_batch_size
    if not has_checkpoint or before is None or before == now:
        return cfg
    devices = now // cfg.per_device_batch_size
    if previous.get("per_device_batch_size") == cfg.per_device_batch_size and before % devices == 0:
        log.warning(
            "resuming on %d devices: per_device_batch_size %d -> %d keeps the global batch of %d rows",
            devices,
            cfg.per_device_batch_size,
            before // devices,
            before,
        )
        return cfg.replace(per_device_batch_size=before // devices)
    hint = (
        f"set per_device_batch_size={before // devices} to keep it"
        if before % devices == 0
        else f"which {devices} devices cannot split evenly; resume on a device count that divides it"
    )
    raise ConfigError(
        f"{cfg.run_dir} was trained with a global batch of {before} rows, this command gives {now} "
        f"({devices} devices x per_device_batch_size {cfg.per_device_batch_size}); {hint}"
    )


def changed_keys(cfg, previous: dict) -> dict:
    """{key: (before, now)} for the inputs that differ from the earlier invocation's."""
    now = cfg.to_dict()
    return {
        k: (previous.get(k), now[k])
        for k in cfg._inputs
        if k not in _RUN_CONTROL and k in previous and previous[k] != now[k]
    }


def save_config(cfg, layout, previous: dict | None) -> None:
    """Writes <run_dir>/config.yml with the run's Layout (keep_global_batch reads its global batch
    back); an earlier config.yml that differs is kept as config.<n>.yml first."""
    path = os.path.join(cfg.run_dir, "config.yml")
    if previous is not None and (changes := changed_keys(cfg, previous)):
        n = 1
        while os.path.exists(kept := os.path.join(cfg.run_dir, f"config.{n}.yml")):
            n += 1
        shutil.copyfile(path, kept)
        log.warning(
            "the config changed since the last invocation of this run (%s); the earlier one is kept as %s",
            ", ".join(f"{k}: {show(a)} -> {show(b)}" for k, (a, b) in changes.items()),
            kept,
        )
    write_config(cfg, path, dataclasses.asdict(layout))


def show(value) -> str:
    """A config value as the run's config.yml writes it (a list inline): for messages."""
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("...").strip()


def finished_step(cfg, checkpointer) -> int | None:
    """The saved step of a run that trained all its `steps` (a train command has nothing left to do),
    else None; with resume_step the run goes back to a chosen step instead."""
    latest = max(checkpointer.all_steps(), default=0)
    if cfg.action != "train" or cfg.resume_step is not None or not latest or latest < cfg.steps:
        return None
    return latest


@contextlib.contextmanager
def no_empty_dirs_left(run_dir: str):
    """Runs the command's body, then removes the directories it created on the way to `run_dir`
    (the run directory, its checkpoints/, a new base_output_directory) that are still empty: a
    command that failed before its run started leaves nothing behind. A directory holding any file
    stays, so no record of a run is ever removed."""
    created = None if "://" in run_dir else _first_missing(os.path.abspath(run_dir))
    try:
        yield
    finally:
        if created is not None and os.path.isdir(created):
            for path, _, _ in os.walk(created, topdown=False):
                with contextlib.suppress(OSError):  # not empty: it stays
                    os.rmdir(path)


def _first_missing(path: str) -> str | None:
    """The outermost directory of `path` that does not exist yet (`path` itself or a parent), or None."""
    missing = None
    while not os.path.exists(path):
        missing, path = path, os.path.dirname(path)
    return missing


def check_resume_step(cfg, saved) -> None:
    """A `resume_step` that is not one of the `saved` steps is a ConfigError: train() asks before
    building the run, so the mistake costs no start-up."""
    if cfg.resume_step is not None and cfg.resume_step not in saved:
        raise ConfigError(
            f"resume_step={cfg.resume_step} is not a saved step of {cfg.checkpoint_dir}; "
            f"saved: {', '.join(map(str, saved)) or 'none'}"
        )


def resume_step(cfg, checkpointer) -> int:
    """The saved step the run starts from: `resume_step` if set (later steps are moved aside so the
    next resume does not jump back to them), else the latest, else 0."""
    saved = checkpointer.all_steps()
    if cfg.resume_step is None:
        return max(saved, default=0)
    check_resume_step(cfg, saved)
    checkpointer.set_aside(s for s in saved if s > cfg.resume_step)
    return cfg.resume_step
