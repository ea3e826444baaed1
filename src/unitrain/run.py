"""A run: everything built once from the config (mesh, tokenizer, model, optimizer, train state,
the compile cache) and handed to the mode. Used by the entry (train.py) and the tools alike.

    run, state = build_run(cfg)
    task = tasks.create(run)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from unitrain import data, lora, models, sharding, vocab
from unitrain import step as step_lib
from unitrain.errors import ConfigError
from unitrain.optimizer import make_optimizer


@dataclasses.dataclass
class RunContext:
    """Everything built once for a run, handed to the mode."""

    cfg: Any  # the frozen Config
    mesh: Mesh  # the trainer's
    rollout_mesh: Mesh | None  # rollout_devices' mesh (sampler: mesh), None = rollouts share the trainer's
    rules: tuple  # logical axis rules
    tokenizer: Any  # unitrain.data.Tokenizer
    model: Any  # the Model (models/base.py) with its initial parameters placed
    graphdef: Any  # nnx graph of the model: nnx.merge(graphdef, params) is callable
    init_params: dict  # the starting parameters; the first step donates them: copy what you keep
    optimizer: optax.GradientTransformation
    state_shardings: dict  # shardings of {params, opt_state, step}
    programs: step_lib.CompileCache  # the run's one ahead-of-time compile cache


def build_run(cfg) -> tuple[RunContext, dict]:
    """The mesh, tokenizer, model, optimizer and train state of a run; the state is {params,
    opt_state, step} with every array in its sharding."""
    mesh = sharding.mesh_from_config(cfg)
    rules = sharding.rules_from_config(cfg.logical_axis_rules)
    tokenizer = data.load_tokenizer(cfg.tokenizer_path, cfg.trust_remote_code)
    cfg = vocab.extend(cfg, tokenizer)  # extra_tokens: a wider vocabulary, grown by the model source
    vocab.save_tokenizer(cfg, tokenizer)
    model = models.build(cfg, mesh)
    if cfg.lora_rank:
        model = lora.apply(model, cfg, mesh)
    if tokenizer.vocab_size > model.vocab_size:
        raise ConfigError(f"tokenizer_path has {tokenizer.vocab_size} tokens but the model has {model.vocab_size}")
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    adapters_only = cfg.lora_rank > 0
    optimizer = make_optimizer(cfg, lora.trainable(model.decay_mask(), adapters_only))
    state = step_lib.init_state(params, optimizer, mesh, cfg.optimizer_host_offload, adapters_only)
    run = RunContext(
        cfg=cfg,
        mesh=mesh,
        rollout_mesh=sharding.rollout_mesh_from_config(cfg),
        rules=rules,
        tokenizer=tokenizer,
        model=model,
        graphdef=graphdef,
        init_params=params,
        optimizer=optimizer,
        state_shardings=jax.tree.map(lambda x: x.sharding, state),
        programs=step_lib.CompileCache(mesh),
    )
    return run, state
