"""Models with a scalar head: a backbone's final-normed hidden states through a `score` matrix
[E, num_labels] without bias, a value per position (HF's `*ForSequenceClassification`, whose
`score.weight` is this matrix transposed). The critic reads every position; a reward model pools the
last real token (`pool_last`, as transformers pools). The backbone is any model of models/base.py
built without its LM head (our decoder with `output_head=False`, a Tunix model headless), so
nothing unused is held, decayed or sought in a classifier checkpoint.

`build_scalar_model` places one on the mesh from an HF classifier, a unitrain checkpoint of one, a
causal LM (HF or unitrain: its backbone, a fresh head, which is how a reward model or a critic
starts from a policy) or the config's model keys (random init); `save_hf` writes the classifier
that transformers reloads.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from unitrain import checkpoint, sharding
from unitrain.adapters import hf, hf_config
from unitrain.errors import CheckpointError, ConfigError
from unitrain.models import decoder, sources

log = logging.getLogger("unitrain")

SCORE = "score"  # the head's parameter: what trains whole under LoRA (lora.apply's train_whole)
SCORE_TENSOR = "score.weight"  # its HF name, [num_labels, E]


class ScalarHeadModel(nnx.Module):
    """backbone.hidden_states -> values [B, T, num_labels] float32. `pad_token_id` is what save_hf
    writes into config.json (transformers pools by it); an export writes the run tokenizer's."""

    def __init__(
        self,
        backbone,
        emb_dim: int,
        num_labels: int,
        *,
        weight_dtype: str,
        dtype: str,
        rngs: nnx.Rngs,
        pad_token_id: int | None = None,
    ):
        self.backbone = backbone
        self.num_labels, self.emb_dim, self.dtype, self.pad_token_id = num_labels, emb_dim, dtype, pad_token_id
        # HF initialises a classifier's score as any Linear: normal(0, initializer_range = 0.02).
        init = jax.nn.initializers.normal(0.02)(rngs.params(), (emb_dim, num_labels), weight_dtype)
        self.score = nnx.Param(init, out_sharding=("embed", None), eager_sharding=False)

    @property
    def vocab_size(self) -> int:
        return self.backbone.vocab_size

    def __call__(self, tokens, positions, segment_ids, cache=None):
        """Values [B, T, num_labels] float32 at every position. `cache` exists for wrappers that
        pass the call through (lora.LoraModel); a scalar-head model scores whole sequences."""
        if cache is not None:
            raise ValueError("a scalar-head model scores whole sequences: it takes no KV cache")
        hidden = self.backbone.hidden_states(tokens, positions, segment_ids)
        return jnp.einsum(
            "bte,ek->btk", hidden, self.score[...].astype(hidden.dtype), preferred_element_type=jnp.float32
        )

    def param_axes(self) -> dict:
        return {"backbone": self.backbone.param_axes(), SCORE: ("embed", None)}

    def decay_mask(self) -> dict:
        """The backbone's, and decay on the score matrix (as HF's Trainer: all but biases and norms)."""
        return {"backbone": self.backbone.decay_mask(), SCORE: True}

    def flops_per_token(self, seq_len: int) -> float:
        return self.backbone.flops_per_token(seq_len) + 6.0 * self.emb_dim * self.num_labels

    def save_hf(self, path: str) -> None:
        """An HF `<Family>ForSequenceClassification` folder: the backbone's tensors (its own save_hf),
        `score.weight` in a file of its own joined by the index, config.json naming the class with
        num_labels and pad_token_id. Every process calls it (gathering is a collective)."""
        self.backbone.save_hf(path)
        score = np.asarray(multihost_utils.process_allgather(self.score[...], tiled=True))
        if jax.process_index() == 0:
            hf.add_tensors(path, {SCORE_TENSOR: np.ascontiguousarray(score.T)}, "score.safetensors")
            hf_config.write_classifier_config(path, self.num_labels, self.pad_token_id)


def pool_last(values, mask):
    """values [B, T, k] at each row's last real token -> [B, k]: the rightmost column where `mask`
    (segment ids, or any [B, T] array nonzero on real tokens) is nonzero, for right- and left-padded
    rows alike, column 0 for a row with none. transformers' *ForSequenceClassification takes the
    rightmost token that is not pad_token_id the same way (argmax of index * not-pad)."""
    columns = jnp.arange(mask.shape[1], dtype=jnp.int32)
    last = jnp.argmax(columns * (mask > 0), axis=-1)
    return jnp.take_along_axis(values, last[:, None, None], axis=1)[:, 0]


# ---------------------------------------------------------------- building


def build_scalar_model(
    cfg, mesh, path: str, num_labels: int = 1, *, require_classifier: bool = False
) -> ScalarHeadModel:
    """A scalar-head model of `num_labels` outputs on `mesh`, its backbone from cfg.model_source:

    path an HF *ForSequenceClassification folder   backbone and score from it (num_labels must match)
    path an HF causal LM folder                     its backbone, a fresh score (logged); refused
                                                    with `require_classifier` (a reward model to
                                                    score with must have been trained as one)
    path a unitrain checkpoint                      a scalar-head model's parameters, or a causal
                                                    LM's backbone with a fresh score, as above
    path ""                                         random init from the config's model keys

    The architecture is the checkpoint's (config.json or the run's config.yml); where `path` is
    cfg.load_parameters_path the config loader has already made the config's keys equal it. The
    execution choices (dtype, remat, attention, sharding rules) are the config's."""
    rules = sharding.rules_from_config(cfg.logical_axis_rules)
    is_hf = bool(path) and os.path.isfile(os.path.join(path, "config.json"))
    classifier = is_hf and _hf_classifier(path, num_labels, require_classifier, cfg.trust_remote_code)
    if cfg.model_source == "tunix":
        return _tunix_scalar_model(cfg, mesh, path, num_labels, classifier, rules)
    if cfg.model_source != "unitrain":
        return _source_scalar_model(cfg, mesh, path, num_labels, classifier, rules)
    model_cfg = _backbone_config(cfg, path)
    if is_hf:
        unused = () if classifier else ("lm_head.weight",)  # a causal LM's head: not part of the backbone
        backbone = hf.load(path, mesh=mesh, model_cfg=model_cfg, other_tensors=(SCORE_TENSOR, *unused))
        model = _placed(_with_head(backbone, model_cfg, num_labels, cfg.seed, _pad_id(path, cfg)), mesh, rules)
        if classifier:
            return _with_hf_score(model, path, mesh, rules)
        log.info("%s is a causal LM: its backbone under a freshly initialised score head", path)
        return model
    model = sharding.init_sharded(
        lambda: _with_head(decoder.create(model_cfg, cfg.seed, hf.save), model_cfg, num_labels, cfg.seed), mesh, rules
    )
    return _with_unitrain_params(model, path, require_classifier, model_cfg, mesh, rules) if path else model


def _backbone_config(cfg, path: str) -> decoder.ModelConfig:
    """The decoder's ModelConfig without an output head: the config's keys, the architecture of
    `path` where it is not load_parameters_path (whose keys the config already took)."""
    model_cfg = decoder.ModelConfig.from_config(cfg, sharding.target_platform(), output_head=False)
    if path and path != cfg.load_parameters_path:
        from unitrain.config import checkpoint_architecture  # config imports no JAX; only this path needs it

        found = checkpoint_architecture(path, cfg)
        model_cfg = dataclasses.replace(model_cfg, **found[0]) if found else model_cfg
    return model_cfg


def _with_head(backbone, model_cfg, num_labels: int, seed: int, pad_token_id: int | None = None) -> ScalarHeadModel:
    return ScalarHeadModel(
        backbone,
        model_cfg.emb_dim,
        num_labels,
        weight_dtype=model_cfg.weight_dtype,
        dtype=model_cfg.dtype,
        rngs=nnx.Rngs(params=seed + 1),  # not the backbone's draws
        pad_token_id=pad_token_id,
    )


def _placed(model, mesh, rules):
    """`model` with every parameter in the sharding its logical axes give (the loaded backbone's
    already are: only the new head moves)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.device_put(state, sharding.state_shardings(state, mesh, rules)))


def _hf_classifier(path: str, num_labels: int, require_classifier: bool, trust_remote_code: bool) -> bool:
    """Whether the HF folder is a sequence classifier of `num_labels` labels (a ConfigError if it
    has another number, or is none where one is required)."""
    config = hf_config.read_hf_config(path, trust_remote_code)
    architectures = list(getattr(config, "architectures", None) or [])
    classifier = any(a.endswith("ForSequenceClassification") for a in architectures)
    if require_classifier and not classifier:
        raise ConfigError(
            f"{path}: config.json's architectures are {architectures or 'not given'}; a reward model must be "
            "a *ForSequenceClassification checkpoint (train one with mode=rm)"
        )
    if classifier and config.num_labels != num_labels:
        raise ConfigError(
            f"{path}: the classifier has num_labels={config.num_labels}; a scalar reward or value needs {num_labels}"
        )
    return classifier


def _pad_id(path: str, cfg) -> int | None:
    return getattr(hf_config.read_hf_config(path, cfg.trust_remote_code), "pad_token_id", None)


def _with_hf_score(model: ScalarHeadModel, path: str, mesh, rules) -> ScalarHeadModel:
    """`model` with the classifier's score.weight [num_labels, E] as its head [E, num_labels]."""
    target = sharding.logical_shardings({SCORE: ("embed", None)}, mesh, rules)[SCORE]
    score = hf.read_tensor(path, SCORE_TENSOR, (model.num_labels, model.emb_dim), model.score.dtype, target)
    model.score = nnx.Param(score, out_sharding=("embed", None), eager_sharding=False)
    return model


def _with_unitrain_params(
    model: ScalarHeadModel, path: str, require_classifier: bool, model_cfg, mesh, rules
) -> ScalarHeadModel:
    """The parameters of the unitrain checkpoint at `path`: a scalar-head model's all, or a causal
    LM's backbone under the fresh head (the LM read as it was saved, its output head then dropped)."""
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    if SCORE in checkpoint.stored_params(path):
        params = checkpoint.load_params(path, params)
    elif require_classifier:
        raise CheckpointError(f"{path}: the checkpoint has no '{SCORE}' parameter; it is not a reward model")
    else:
        causal = nnx.state(nnx.eval_shape(lambda: decoder.create(dataclasses.replace(model_cfg, output_head=True))))
        like = jax.tree.map(
            lambda var, s: jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=s),
            nnx.to_pure_dict(causal),
            nnx.to_pure_dict(sharding.state_shardings(causal, mesh, rules)),
        )
        lm = checkpoint.load_params(path, like)
        params = {**params, "backbone": {k: v for k, v in lm.items() if k in params["backbone"]}}
        log.info("%s holds a causal LM: its backbone under a freshly initialised score head", path)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def _source_scalar_model(cfg, mesh, path: str, num_labels: int, classifier: bool, rules) -> ScalarHeadModel:
    """A fresh head over the headless model that a plugin model source builds from `path`
    (its fn(cfg, mesh, output_head=False); models.build)."""

    if classifier:
        raise ConfigError(
            f"{path} is an HF classifier, whose score head model_source unitrain or tunix reads; "
            f"model_source {cfg.model_source} builds its scalar models with a fresh head"
        )
    backbone = sources.build(cfg.replace(load_parameters_path=path), mesh, output_head=False)
    log.info("model_source %s: its headless model under a freshly initialised score head", cfg.model_source)
    model = ScalarHeadModel(
        backbone,
        cfg.emb_dim,
        num_labels,
        weight_dtype=cfg.weight_dtype,
        dtype=cfg.dtype,
        rngs=nnx.Rngs(params=cfg.seed + 1),
    )
    return _placed(model, mesh, rules)


def _tunix_scalar_model(cfg, mesh, path: str, num_labels: int, classifier: bool, rules) -> ScalarHeadModel:
    """The head over a headless Tunix model of the HF folder at `path`."""
    from unitrain.adapters import tunix

    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"model_source tunix loads an HF checkpoint directory; the scalar model's path is '{path}'")
    if classifier and not hf_config.read_hf_config(path, cfg.trust_remote_code).tie_word_embeddings:
        raise ConfigError(
            f"{path}: an untied classifier has no lm_head.weight, which Tunix's loader requires; use model_source unitrain"
        )
    backbone = tunix.load(
        path,
        cfg.dtype,
        mesh,
        rules=rules,
        trust_remote_code=cfg.trust_remote_code,
        max_replicated_param_mib=cfg.max_replicated_param_mib,
        weight_dtype=cfg.weight_dtype,
        remat_policy=cfg.remat_policy,
        output_head=False,
    )
    model = ScalarHeadModel(
        backbone,
        backbone.dims.emb,
        num_labels,
        weight_dtype=backbone.weight_dtype,
        dtype=backbone.dtype,
        rngs=nnx.Rngs(params=cfg.seed + 1),
        pad_token_id=_pad_id(path, cfg),
    )
    model = _placed(model, mesh, rules)
    if classifier:
        return _with_hf_score(model, path, mesh, rules)
    log.info("%s is a causal LM: its backbone under a freshly initialised score head", path)
    return model
