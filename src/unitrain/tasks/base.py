"""The training-mode interface: what a mode gives the loop.

A mode is a Task subclass registered in tasks/__init__.py (or named in the config as
`mode: pkg.module:Class`). The loop knows nothing else of it:

    task = Mode(run)                         # run: the RunContext of run.build_run
    state = task.train_state(state)          # build_run's state, plus what else the mode trains
    state, metrics = task.step(state, step)  # one optimizer step (or several, for RL): data -> update
    task.data_iterator                       # get_state()/set_state(): checkpointed with the state
    task.evaluate(params, step) -> {name: value}   # every eval_interval steps ({} = nothing to report)
    task.samples_text(step) -> str           # extra logs (sampled text for TensorBoard), "" = none
    task.close()                             # the run ended (however): what the mode started goes

`loss(params, batch)` is the mode's loss in train_step's form (sum, (denominator, metrics)) and
`batch_shardings()` the shardings of its batch; step.make_train_step turns the two into the jitted,
donated update, and `run.programs` compiles it once per batch shape.
"""

from __future__ import annotations

import abc
from typing import Any

from unitrain.context import RunContext


class Task(abc.ABC):
    data_iterator: Any
    tokens_per_step: int | None = None  # positions trained per step, for tokens/s and MFU; None = not reported
    # True: the run builder builds the model as a scalar-head model (models/scalar_head.py: values per
    # position, no LM head) from load_parameters_path or the model keys, not as a causal LM
    scalar_head: bool = False

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

    def train_state(self, state: dict) -> dict:
        """The state the loop carries and checkpoints, from build_run's {params, opt_state, step}: a
        mode that trains another model besides the policy (PPO's critic) adds it under a key of its
        own, a {params, opt_state, step} of its own (checkpoint.py saves each such key as an item)."""
        return state

    def evaluate(self, params, step: int) -> dict:
        """Eval metrics of these parameters (after `step` steps); {} = this mode has nothing to evaluate."""
        return {}

    def samples_text(self, step: int) -> str:
        return ""

    def close(self) -> None:
        """Ends what the mode started outside this process (an inference server); called once the run ends."""
        return None
