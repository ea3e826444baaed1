"""RunContext: everything built once for a run (run.build_run), handed to the mode. A leaf beside
run.py, so that the modes it builds import it without importing the builder."""

from __future__ import annotations

import dataclasses
from typing import Any

import optax
from jax.sharding import Mesh

from unitrain import compile_cache, sharding, step


@dataclasses.dataclass
class RunContext:
    """Everything built once for a run, handed to the mode."""

    cfg: Any  # the frozen Config
    layout: sharding.Layout  # the config on the devices: mesh shapes, batch sizes, updates per step
    mesh: Mesh  # the trainer's
    rollout_meshes: tuple[Mesh, ...]  # rollout_devices' meshes (sampler: mesh); none: rollouts share the trainer's
    rules: tuple  # logical axis rules
    tokenizer: Any  # unitrain.data.tokenizer.Tokenizer
    model: Any  # the Model (models/base.py) with its initial parameters placed
    graphdef: Any  # nnx graph of the model: nnx.merge(graphdef, params) is callable
    init_params: dict  # the starting parameters; the first step donates them: copy what you keep
    optimizer: optax.GradientTransformation
    learning_rate: optax.Schedule  # the optimizer's, by optimizer step
    state_shardings: dict  # shardings of {params, opt_state, step}
    programs: compile_cache.CompileCache  # the run's one ahead-of-time compile cache

    def make_update(self, loss_fn, batch_shardings, frozen_shardings=()):
        """The jitted, donated train step of `loss_fn` over this run's state (step.make_train_step)."""
        settings = step.StepConfig.from_config(self.cfg, self.learning_rate)
        return step.make_train_step(
            loss_fn, settings, self.optimizer, self.state_shardings, batch_shardings, frozen_shardings
        )
