"""The training-mode interface: what a mode gives the loop.

A mode is a Task subclass registered in tasks/__init__.py (or named in the config as
`mode: pkg.module:Class`). The loop knows nothing else of it:

    task = Mode(run)                         # run: the RunContext train.py built
    state, metrics = task.step(state, step)  # one optimizer step (or several, for RL): data -> update
    task.data_iterator                       # get_state()/set_state(): checkpointed with the state
    task.evaluate(params) -> {name: value}   # every eval_interval steps ({} = nothing to report)
    task.samples_text(step) -> str           # extra logs (sampled text for TensorBoard), "" = none

`loss(params, batch)` is the mode's loss in train_step's form (sum, (denominator, metrics)) and
`batch_shardings()` the shardings of its batch; step.make_train_step turns the two into the jitted,
donated update, and `run.programs` compiles it once per batch shape.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import optax
from jax.sharding import Mesh

from unitrain.step import CompileCache


@dataclasses.dataclass
class RunContext:
    """Everything built once for a run, handed to the mode."""

    cfg: Any  # the frozen Config
    mesh: Mesh
    rules: tuple  # logical axis rules
    tokenizer: Any  # unitrain.data.Tokenizer
    model: Any  # the Model (models/base.py) with its initial parameters placed
    graphdef: Any  # nnx graph of the model: nnx.merge(graphdef, params) is callable
    optimizer: optax.GradientTransformation
    state_shardings: dict  # shardings of {params, opt_state, step}
    programs: CompileCache  # the run's one ahead-of-time compile cache


class Task(abc.ABC):
    data_iterator: Any
    tokens_per_step: int | None = None  # positions trained per step, for tokens/s and MFU; None = not reported

    def __init__(self, run: RunContext):
        self.run, self.cfg = run, run.cfg

    @abc.abstractmethod
    def loss(self, params, batch) -> tuple[Any, tuple[Any, dict]]:
        """(loss sum, (denominator, {metric: (sum, count)})) of one micro-batch."""

    @abc.abstractmethod
    def batch_shardings(self) -> dict:
        """{batch key: NamedSharding} of the batch `loss` takes."""

    @abc.abstractmethod
    def step(self, state: dict, step: int) -> tuple[dict, dict]:
        """One training step: (state, step index) -> (new state, metrics as arrays or numbers)."""

    def evaluate(self, params) -> dict:
        return {}

    def samples_text(self, step: int) -> str:
        return ""
