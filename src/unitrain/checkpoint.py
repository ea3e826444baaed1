"""Orbax checkpoints of a run: parameters, optimizer state and step, and the data iterator position.

Saves are asynchronous and atomic (orbax finalises a step directory only when every item is
written), so a run killed mid-save resumes from the previous complete step. Parameters are their own
item, which lets `load_params` start another run from them without the optimizer state. Restoring
takes the target shardings from an abstract state, so a checkpoint written on one topology restores
on another.

The data iterator's position is one JSON item (`data/metadata`), the same for every process count:
each process's get_state() is gathered on every process and merged (unitrain.data.shards.merge_states:
the union of the SFT data shards, or the one state of an iterator that is the same everywhere, like
the GRPO prompt stream), and restoring hands the merged state to set_state(), which takes what it
needs. Any iterator whose get_state() is JSON-serialisable works.
"""

from __future__ import annotations

import json
import logging
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from unitrain.config import ConfigError
from unitrain.data.shards import merge_states

log = logging.getLogger("unitrain")


def abstract_like(tree):
    """ShapeDtypeStructs carrying each array's sharding: the restore target of `tree`."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Checkpointer:
    def __init__(self, directory: str, period: int, max_to_keep: int, async_save: bool):
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=period, max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(os.path.abspath(directory), options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def set_aside(self, steps) -> None:
        """Moves the step directories `steps` into <checkpoint dir>.set_aside/ (kept, never deleted),
        so that the latest step is an earlier one. Every process must call it."""
        from jax.experimental import multihost_utils

        directory = str(self.manager.directory)
        if jax.process_index() == 0:
            for step in steps:
                os.makedirs(directory + ".set_aside", exist_ok=True)
                target, n = os.path.join(directory + ".set_aside", str(step)), 1
                while os.path.exists(target):  # set aside before: keep both
                    target, n = os.path.join(directory + ".set_aside", f"{step}.{n}"), n + 1
                os.replace(os.path.join(directory, str(step)), target)
                log.warning("moved the checkpoint of step %d to %s.set_aside", step, directory)
        multihost_utils.sync_global_devices("unitrain set_aside")
        self.manager.reload()

    def save(self, step: int, state: dict, data_iterator, force: bool = False) -> bool:
        """Starts a save of `state` (after `step` steps) if the period says so or `force`; True if started.

        Every process must call it with the same step and force (the iterator states are gathered)."""
        if not force and not self.manager.should_save(step):
            return False
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(state["params"]),
            train=ocp.args.StandardSave({"opt_state": state["opt_state"], "step": state["step"]}),
            data=ocp.args.JsonSave(iterator_state(data_iterator)),
        )
        return self.manager.save(step, args=args, force=force)

    def restore(self, step: int, state: dict, data_iterator) -> dict:
        """The saved state in the shardings of `state` (arrays or ShapeDtypeStructs); moves the iterator."""
        target = abstract_like(state)
        args = ocp.args.Composite(
            params=ocp.args.StandardRestore(target["params"]),
            train=ocp.args.StandardRestore({"opt_state": target["opt_state"], "step": target["step"]}),
            data=ocp.args.JsonRestore(),
        )
        restored = self.manager.restore(step, args=args)
        data_iterator.set_state(restored.data)
        return {"params": restored.params, **restored.train}

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def iterator_state(data_iterator):
    """The iterator state of all processes, merged: the same JSON-ready value on every process."""
    return merge_states([json.loads(text) for text in _allgather_text(json.dumps(data_iterator.get_state()))])


def _allgather_text(text: str) -> list[str]:
    """Every process's `text`, in process order, on every process (a collective: all must call it)."""
    from jax.experimental import multihost_utils

    local = np.frombuffer(text.encode(), np.uint8)
    lengths = multihost_utils.process_allgather(np.asarray([local.size], np.int32)).reshape(-1)
    padded = np.zeros(max(int(lengths.max()), 1), np.uint8)
    padded[:local.size] = local
    gathered = multihost_utils.process_allgather(padded).reshape(len(lengths), -1)
    return [gathered[i, :n].tobytes().decode() for i, n in enumerate(lengths)]


def load_params(path: str, params):
    """Parameters only, from a unitrain checkpoint directory (its latest step) or one step directory,
    placed in the shardings of `params`."""
    path = os.path.abspath(path)
    if os.path.isdir(os.path.join(path, "params")):
        step_dir = path
    else:
        steps = ocp.utils.checkpoint_steps(path) if os.path.isdir(path) else []
        if not steps:
            raise ConfigError(f"load_parameters_path {path} is neither an HF checkpoint (config.json) nor an orbax "
                              "checkpoint directory with saved steps")
        step_dir = os.path.join(path, str(max(steps)))
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(os.path.join(step_dir, "params"), abstract_like(params))
