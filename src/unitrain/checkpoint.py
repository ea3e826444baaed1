"""Orbax checkpoints of a run: parameters, optimizer state and step, and the data iterator position.

Saves are asynchronous and atomic (orbax finalises a step directory only when every item is
written), so a run killed mid-save resumes from the previous complete step. Parameters are their own
item, which lets `load_params` start another run from them without the optimizer state. Restoring
takes the target shardings from an abstract state, so a checkpoint written on one topology restores
on another.

A mode that trains a second model (PPO's critic) holds it in the state under a key of its own, a
{params, opt_state, step} of its own (tasks/base.py: Task.train_state); every such key is one more
item of the same name, saved and restored (its shapes checked) with the rest.

The data iterator's position is one JSON item (`data/metadata`), the same for every process count:
each process's get_state() is gathered on every process and merged (unitrain.data.shards.merge_states:
the union of the SFT data shards, or the one state of an iterator that is the same everywhere, like
the GRPO prompt stream), and restoring hands the merged state to set_state(), which takes what it
needs. Any iterator whose get_state() is JSON-serialisable works.

What goes wrong is said in one line (CheckpointError): a save that fails (read-only or full disk) names
the directory and the OS reason; a checkpoint whose parameter shapes differ from the model's names the
first such parameter before anything is read; a damaged step directory (unreadable metadata or data)
is moved aside and the next older one restored, or, with fallback off, the run stops saying how to
go on; a second run saving in the same directory (which would delete this one's unfinished saves)
stops with one line. max_to_keep never deletes the newest checkpoint known good (`keep`), which the loop marks once
a loss computed from its weights was finite.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re

import jax
import numpy as np
import orbax.checkpoint as ocp

from unitrain import lora
from unitrain.config import check
from unitrain.data.shards import merge_states
from unitrain.errors import CheckpointError, UserError

log = logging.getLogger("unitrain")


def abstract_like(tree):
    """ShapeDtypeStructs carrying each array's sharding: the restore target of `tree`."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class _KeepStep:
    """An orbax preservation policy: keeps the checkpoint of `step` whatever max_to_keep says."""

    step: int | None = None

    def should_preserve(self, checkpoints, *, context):
        return [c.step == self.step for c in checkpoints]


class Checkpointer:
    """`adapters_only` (LoRA): the params item holds the adapters alone (lora.trainable); the frozen
    base is not saved again but comes from the model source (load_parameters_path) on a resume."""

    def __init__(self, directory: str, period: int, max_to_keep: int, async_save: bool, adapters_only: bool = False):
        self.adapters_only = adapters_only
        self._known_good = _KeepStep()
        keep = ocp.checkpoint_managers.AnyPreservationPolicy(
            [ocp.checkpoint_managers.LatestN(n=max_to_keep), self._known_good]
        )
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=period, preservation_policy=keep, enable_async_checkpointing=async_save, create=True
        )
        self.manager = ocp.CheckpointManager(os.path.abspath(directory), options=options)
        self._saving = None  # the step of the save in flight: a background failure surfaces later
        self._claim = None  # the locked directory's descriptor while this process saves there

    def claim(self) -> None:
        """Locks the directory for this run's saves (process 0; until close or exit). A second run there
        would delete this one's unfinished saves (orbax removes a <step>.orbax-checkpoint-tmp it
        finds before writing its own), so it stops with one line instead."""
        directory = str(self.manager.directory)
        if self._claim is not None or jax.process_index() != 0 or "://" in directory:
            return
        fd = os.open(directory, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CheckpointError(
                f"another process is saving checkpoints in {directory} (the same run started twice?), and two "
                "runs there delete each other's unfinished saves; let it end, or give this one another run_name"
            ) from None
        self._claim = fd

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
        self.claim()
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(lora.trainable(state["params"], self.adapters_only)),
            train=ocp.args.StandardSave({"opt_state": state["opt_state"], "step": state["step"]}),
            data=ocp.args.JsonSave(iterator_state(data_iterator)),
            **{name: ocp.args.StandardSave(state[name]) for name in other_models(state)},
        )
        with self._failures():  # also the previous save's, which orbax re-raises here
            started = self.manager.save(step, args=args, force=force)
        self._saving = step
        return started

    def keep(self, step: int) -> None:
        """Keeps the checkpoint of `step` (the newest known good) from max_to_keep's deletions."""
        self._known_good.step = step

    def restore(self, step: int, state: dict, data_iterator, fallback: bool = True) -> tuple[int, dict]:
        """(the step restored, the saved state in the shardings of `state`); moves the iterator.

        A damaged checkpoint is moved aside and, with `fallback`, the newest older one restored."""
        target = abstract_like({**state, "params": lora.trainable(state["params"], self.adapters_only)})
        for candidate in [s for s in reversed(self.all_steps()) if s <= step]:
            step_dir = os.path.join(self.manager.directory, str(candidate))
            try:
                check_shapes(os.path.join(step_dir, "params"), target["params"])
                for name in other_models(state):
                    check_shapes(os.path.join(step_dir, name), target[name])
                restored = self.manager.restore(
                    candidate,
                    args=ocp.args.Composite(
                        params=ocp.args.StandardRestore(target["params"]),
                        train=ocp.args.StandardRestore({"opt_state": target["opt_state"], "step": target["step"]}),
                        data=ocp.args.JsonRestore(),
                        **{name: ocp.args.StandardRestore(target[name]) for name in other_models(state)},
                    ),
                )
            except UserError:
                raise
            except Exception as e:  # whatever orbax and tensorstore raise on a file they cannot read
                if not fallback:
                    raise CheckpointError(
                        f"the checkpoint {step_dir} is damaged ({reason(e)}); move it away to resume "
                        "from the one before, or set checkpoint_fallback=true"
                    ) from None
                log.warning("the checkpoint %s is damaged (%s); trying the one before", step_dir, reason(e))
                self.set_aside([candidate])
                continue
            data_iterator.set_state(restored.data)
            params = lora.with_trainable(state["params"], restored.params, self.adapters_only)
            return candidate, {"params": params, **restored.train, **{k: restored[k] for k in other_models(state)}}
        raise CheckpointError(
            f"no intact checkpoint left in {self.manager.directory} up to step {step} (the damaged "
            f"ones are in {self.manager.directory}.set_aside); remove the directory to start over"
        )

    def wait(self) -> None:
        with self._failures():
            self.manager.wait_until_finished()

    def close(self) -> None:
        try:
            with self._failures():
                self.manager.close()
        finally:
            if self._claim is not None:
                os.close(self._claim)  # the lock goes with it
                self._claim = None

    @contextlib.contextmanager
    def _failures(self):
        """A failed save (read-only or full disk) as one line; the finalised checkpoints are untouched."""
        try:
            yield
        except Exception as e:
            self._saving, step = None, self._saving
            what = f"the checkpoint of step {step}" if step is not None else "a checkpoint"
            raise CheckpointError(
                f"saving {what} in {self.manager.directory} failed: {reason(e)}; the checkpoints "
                "saved before it are intact"
            ) from None


_POLICY_KEYS = ("params", "opt_state", "step")


def other_models(state: dict) -> list[str]:
    """The keys of the state beyond the policy's: other models the mode trains, an item each."""
    return sorted(k for k in state if k not in _POLICY_KEYS)


def reason(e: BaseException) -> str:
    """The cause of a storage error in one line: the OS reason where the chain of causes has one
    (tensorstore reports it as text with an os_error_code, orbax wraps it), else the first line."""
    chain = [e]
    while len(chain) < 20 and (cause := chain[-1].__cause__ or chain[-1].__context__) is not None:
        chain.append(cause)
    for err in chain:
        if isinstance(err, OSError) and err.strerror:
            return f"{err.strerror}: {err.filename}" if err.filename else err.strerror
        if code := re.search(r"os_error_code='?(\d+)", str(err)):
            return os.strerror(int(code.group(1)))
    return (str(e).splitlines() or [type(e).__name__])[0][:300]


def check_shapes(item_dir: str, params) -> None:
    """The parameter shapes stored in `item_dir` against those of `params`, before anything is read:
    a different model is a CheckpointError naming the first parameter that differs."""
    with ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.metadata(item_dir).item_metadata
    stored = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_flatten_with_path(stored)[0]}
    if not stored:  # orbax only warns: a step directory whose metadata is gone is damaged
        raise FileNotFoundError(errno.ENOENT, "no parameter metadata", item_dir)
    # what a lora_rank > 0 run saves: {<targeted weight>: {a, b}}, its base left out
    adapters_alone = all(name.endswith(("['a']", "['b']")) for name in stored)
    for key, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = jax.tree_util.keystr(key)
        if name not in stored and adapters_alone:
            raise CheckpointError(
                f"the checkpoint {os.path.dirname(item_dir)} holds a LoRA run's adapters alone, not a model "
                "(a lora_rank > 0 run saves only what it trains): load the merged model its export_hf_path wrote"
            )
        if stored.get(name) != tuple(leaf.shape):
            found = f"shape {list(stored[name])}" if name in stored else "no such parameter"
            raise CheckpointError(
                f"the checkpoint {os.path.dirname(item_dir)} has {found} for parameter {name}, the "
                f"model {list(leaf.shape)}: the model config differs from the one that wrote it"
            )


def iterator_state(data_iterator):
    """The iterator state of all processes, merged: the same JSON-ready value on every process."""
    return merge_states([json.loads(text) for text in _allgather_text(json.dumps(data_iterator.get_state()))])


def _allgather_text(text: str) -> list[str]:
    """Every process's `text`, in process order, on every process (a collective: all must call it)."""
    from jax.experimental import multihost_utils

    local = np.frombuffer(text.encode(), np.uint8)
    lengths = multihost_utils.process_allgather(np.asarray([local.size], np.int32)).reshape(-1)
    padded = np.zeros(max(int(lengths.max()), 1), np.uint8)
    padded[: local.size] = local
    gathered = multihost_utils.process_allgather(padded).reshape(len(lengths), -1)
    return [gathered[i, :n].tobytes().decode() for i, n in enumerate(lengths)]


def load_params(path: str, params):
    """Parameters only, from a unitrain run directory or its checkpoint directory (the latest step) or
    one step directory, placed in the shardings of `params`."""
    return _read(os.path.join(_step_dir(path), "params"), params, check=check_shapes)


def stored_params(path: str) -> dict:
    """The parameter tree (shapes and dtypes, no data) of the checkpoint at `path` (as in load_params)."""
    item_dir = os.path.join(_step_dir(path), "params")
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            return dict(checkpointer.metadata(item_dir).item_metadata or {})
    except Exception as e:
        raise CheckpointError(f"load_parameters_path: cannot read {item_dir} ({reason(e)})") from None


def load_opt_state(path: str, state: dict):
    """The optimizer state saved at `path` (as in load_params), in the shardings of state["opt_state"]:
    a run that continues another's training (load_optimizer_state) rather than starting it afresh."""
    return _read(os.path.join(_step_dir(path), "train"), {"opt_state": state["opt_state"], "step": state["step"]})[
        "opt_state"
    ]


def _step_dir(path: str) -> str:
    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"load_parameters_path {path} does not exist")
    if os.path.isdir(os.path.join(path, "checkpoints")):  # a run directory
        path = os.path.join(path, "checkpoints")
    if os.path.isdir(os.path.join(path, "params")):
        return path
    steps = ocp.utils.checkpoint_steps(path) if os.path.isdir(path) else []
    if not steps:
        raise CheckpointError(
            f"load_parameters_path {path} is neither an HF checkpoint (config.json) nor an orbax "
            "checkpoint directory with saved steps"
        )
    return os.path.join(path, str(max(steps)))


def _read(item_dir: str, like, check=None):
    try:
        if check is not None:
            check(item_dir, like)
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(item_dir, abstract_like(like))
    except UserError:
        raise
    except Exception as e:  # whatever orbax and tensorstore raise on a file they cannot read or that differs
        raise CheckpointError(f"load_parameters_path: cannot read {item_dir} ({reason(e)})") from None


@check("load_optimizer_state", "load_parameters_path")
def _optimizer_state(c) -> str | None:
    path = c["load_parameters_path"]
    if not c["load_optimizer_state"] or path and not os.path.isfile(os.path.join(path, "config.json")):
        return None
    return "load_optimizer_state needs load_parameters_path on a unitrain checkpoint (an HF checkpoint has no optimizer state)"


CONFIG_CHECKS = (_optimizer_state,)
