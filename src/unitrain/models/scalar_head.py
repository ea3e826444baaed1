"""Models with a scalar head: a backbone's final-normed hidden states through a `score` matrix
[E, num_labels] without bias, a value per position (HF's `*ForSequenceClassification`, whose
`score.weight` is this matrix transposed). The critic reads every position; a reward model pools the
last real token (`pool_last`, as transformers pools). The backbone is any model of models/base.py
that the model source builds without its LM head (`sources.build(cfg, mesh, output_head=False)`,
the same call for our decoder, Tunix's models and a plugin), so nothing unused is held, decayed or
sought in a classifier checkpoint.

`build_scalar_model` places one on the mesh from an HF classifier, a unitrain checkpoint of one, a
causal LM (HF or unitrain: its backbone, a fresh head, which is how a reward model or a critic
starts from a policy) or the config's model keys (random init); the source reads the backbone, this
module the head. `save_hf` writes the classifier that transformers reloads.
"""

from __future__ import annotations

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
from unitrain.models import sources

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
    """A scalar-head model of `num_labels` outputs on `mesh` over the backbone that cfg.model_source
    builds without its LM head (sources.build(..., output_head=False)) from `path`:

    path an HF *ForSequenceClassification folder   backbone and score from it (num_labels must match)
    path an HF causal LM folder                     its backbone, a fresh score (logged); refused
                                                    with `require_classifier` (a reward model to
                                                    score with must have been trained as one)
    path a unitrain checkpoint of a scalar-head     its parameters, read whole into the model the
      model (it holds a `score`)                    source builds at random (load_parameters_path "")
    path "" or anything else                        what the source builds from it as its
                                                    load_parameters_path (our decoder: random init,
                                                    a unitrain causal LM's backbone), a fresh score;
                                                    refused with `require_classifier`

    The architecture is the checkpoint's (config.json or the run's config.yml): the source gets the
    config with load_parameters_path = `path`, its architecture keys taken as the config loader takes
    them. The execution choices (dtype, remat, attention, sharding rules) are the config's."""
    rules = sharding.rules_from_config(cfg.logical_axis_rules)
    is_hf = bool(path) and os.path.isfile(os.path.join(path, "config.json"))
    classifier = is_hf and _hf_classifier(path, num_labels, require_classifier, cfg.trust_remote_code)
    restored = bool(path) and not is_hf and _holds_scalar_model(path, require_classifier)
    if path and not is_hf and require_classifier and not restored:
        raise CheckpointError(f"{path}: the checkpoint has no '{SCORE}' parameter; it is not a reward model")
    source_cfg = cfg if path == cfg.load_parameters_path else cfg.replace(load_parameters_path=path)
    if restored:
        source_cfg = source_cfg.replace(load_parameters_path="")
    backbone = sources.build(source_cfg, mesh, output_head=False)
    model = ScalarHeadModel(
        backbone,
        _hidden_size(backbone, source_cfg.emb_dim),
        num_labels,
        weight_dtype=cfg.weight_dtype,
        dtype=cfg.dtype,
        rngs=nnx.Rngs(params=cfg.seed + 1),  # not the backbone's draws
        pad_token_id=_pad_id(path, cfg) if is_hf else None,
    )
    model = _placed(model, mesh, rules)
    if classifier:
        return _with_hf_score(model, path, mesh, rules)
    if restored:
        return _with_unitrain_params(model, path)
    if path:
        log.info("%s: its backbone (model_source %s) under a freshly initialised score head", path, cfg.model_source)
    return model


def _holds_scalar_model(path: str, require_classifier: bool) -> bool:
    """Whether `path` is a unitrain checkpoint of a scalar-head model. A path that is no unitrain
    checkpoint is the model source's to read (or refuse), except where a reward model is required."""
    try:
        return SCORE in checkpoint.stored_params(path)
    except CheckpointError:
        if require_classifier:
            raise
        return False


def _hidden_size(backbone, default: int) -> int:
    """The width E of the backbone's hidden states: the size of its parameters' `embed` axis (the
    logical names of every model's param_axes, base.py), else `default` (the config's emb_dim)."""
    axes, _ = jax.tree_util.tree_flatten_with_path(backbone.param_axes(), is_leaf=lambda x: isinstance(x, tuple))
    params, _ = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(backbone, nnx.Param)))
    shapes = {jax.tree_util.keystr(k): np.shape(v) for k, v in params}
    sizes = set()
    for key, names in axes:
        shape = shapes.get(jax.tree_util.keystr(key), ())
        sizes |= {n for n, name in zip(shape, names) if name == "embed"}
    return sizes.pop() if len(sizes) == 1 else default


def _placed(model, mesh, rules):
    """`model` with every parameter in the sharding its logical axes give (the backbone's already
    are: only the new head moves)."""
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


def _with_unitrain_params(model: ScalarHeadModel, path: str) -> ScalarHeadModel:
    """`model` with all the parameters of the unitrain checkpoint of a scalar-head model at `path`."""
    graphdef, state = nnx.split(model)
    nnx.replace_by_pure_dict(state, checkpoint.load_params(path, nnx.to_pure_dict(state)))
    return nnx.merge(graphdef, state)
