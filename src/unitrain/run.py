"""A run: everything built once from the config (its layout on the devices, mesh, tokenizer, model,
optimizer, train state, the compile cache) and handed to the mode. Used by the entry (train.py) and
the tools alike.

    run, state = build_run(cfg)
    task = modes.create(run)
"""

from __future__ import annotations

import jax
from flax import nnx

from unitrain import compile_cache, lora, modes, sharding, vocab
from unitrain import step as step_lib
from unitrain.context import RunContext
from unitrain.data.tokenizer import load_tokenizer
from unitrain.errors import ConfigError
from unitrain.models import qwen2_5_vl, scalar_head, sources
from unitrain.models.attention import attention_kernel
from unitrain.optimizer import learning_rate_schedule, make_optimizer


def device_layout(cfg) -> sharding.Layout:
    """The config on the target devices (this job's, or compile_for's): the attention kernel checked
    against their platform, then the meshes' shapes and the batch sizes. A config these devices
    cannot run is a ConfigError here, before anything is built."""
    layout = sharding.layout_for(cfg)
    try:
        attention_kernel(
            cfg.attention,
            sharding.target_platform(),
            cfg.dtype,
            sharding.context_size(layout),
            cfg.context_parallel_strategy,
        )
    except ValueError as e:
        raise ConfigError(f"invalid config: {e}") from None
    return layout


def build_model(cfg, mesh):
    """The mode's model on `mesh`: a scalar-head model where the mode's Task says it trains one
    (scalar_head), else the model source's causal LM; with lora_rank > 0 under LoRA's adapters."""
    if modes.task_class(cfg.mode).scalar_head:
        model = scalar_head.build_scalar_model(cfg, mesh, cfg.load_parameters_path)
    else:
        model = sources.build(cfg, mesh)
    return lora.apply(model, cfg, mesh, **_lora_parts(model)) if cfg.lora_rank else model


def _lora_parts(model) -> dict:
    """Where LoRA's adapters go on `model`: a scalar-head model's backbone, its score trained whole."""
    if isinstance(model, scalar_head.ScalarHeadModel):
        return {"root": ("backbone",), "train_whole": ((scalar_head.SCORE,),)}
    return {}


def build_run(cfg) -> tuple[RunContext, dict]:
    """The layout, mesh, tokenizer, model, optimizer and train state of a run; the state is {params,
    opt_state, step} with every array in its sharding."""
    layout = device_layout(cfg)
    mesh = sharding.trainer_mesh(cfg, layout)
    rules = sharding.rules_from_config(cfg.logical_axis_rules)
    tokenizer = load_tokenizer(cfg.tokenizer_path, cfg.trust_remote_code, cfg.chat_template_file)
    cfg = vocab.extend(cfg, tokenizer)  # extra_tokens: a wider vocabulary, grown by the model source
    vocab.save_tokenizer(cfg, tokenizer)
    model = build_model(cfg, mesh)
    if tokenizer.vocab_size > model.vocab_size:
        raise ConfigError(f"tokenizer_path has {tokenizer.vocab_size} tokens but the model has {model.vocab_size}")
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    adapters_only = cfg.lora_rank > 0
    learning_rate = learning_rate_schedule(cfg, layout.optimizer_steps)
    frozen = qwen2_5_vl.tower_mask(model.decay_mask()) if cfg.freeze_vision_tower else None
    optimizer = make_optimizer(cfg, lora.trainable(model.decay_mask(), adapters_only), learning_rate, frozen)
    state = step_lib.init_state(params, optimizer, mesh, cfg.optimizer_host_offload, adapters_only)
    run = RunContext(
        cfg=cfg,
        layout=layout,
        mesh=mesh,
        rollout_meshes=sharding.rollout_meshes(cfg, layout),
        rules=rules,
        tokenizer=tokenizer,
        model=model,
        graphdef=graphdef,
        init_params=params,
        optimizer=optimizer,
        learning_rate=learning_rate,
        state_shardings=jax.tree.map(lambda x: x.sharding, state),
        programs=compile_cache.CompileCache(mesh),
    )
    return run, state
