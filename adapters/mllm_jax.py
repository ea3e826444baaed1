"""MLLM_JAX's causal LMs (github.com/demon2036/MLLM-JAX: flax linen) behind unitrain's model interface.

    model = unitrain.adapters.mllm_jax.load(hf_dir, mllm_jax_path="/src/MLLM-JAX", mesh=mesh)
    logits, cache = model(tokens, positions, segment_ids)                    # models/base.py

MLLM_JAX is no package and carries no licence: it is imported at run time from the user's checkout
(`mllm_jax_path`, else the Python path) and nothing of it is copied here. Tested at its commit
8b19c02 (January 2026), whose API the adapter relies on (`API` below):
  - MLLM_JAX.language.llama.llama: LlamaConfig, LlamaJaxConfig, LlamaForCausalLM, LlamaAttention
    (its init_cache); MLLM_JAX.language.qwen2: Qwen2Config, Qwen2ForCausalLM;
  - the setup attributes of a *ForCausalLM: model.embed_tokens, model.rotary_emb(x, positions),
    model.layers (each called as layer(inputs_embeds, input_ids, cache, attn_mask,
    position_embeddings) -> (cache, out)), model.norm and lm_head; the parameter tree of its init;
  - a layer's cache {k, v: [batch, kv_heads, length, head_dim], end_index: [batch]}, written at
    column end_index[0] by every row; the config attribute `jax_attention_backend`;
  - Qwen3: deprecated/MLLM_JAX/language/qwen3/modular_qwen3.py's Qwen3ForCausalLM (`revived`: it imports
    `..llama.llama`, the active tree's, so it is read as part of the MLLM_JAX package), configured by a
    LlamaConfig, with the layers' interface above.
Its Qwen3-MoE is refused (`_QWEN3_MOE`): no portable path to pick without editing it.

The forward calls its modules one by one (the loop of its *Model.__call__): that __call__ makes any
call of more than one token causal by column, blind to padding and to packed segments; here every
call gets the additive mask [B, 1, Tq, Tk] of segments and positions (library_model.attention_mask),
which its layers' dot-product attention adds as it is. Its splash and flash kernels (TPU) take a
causal mask only, so its layers get no mesh and the `dot` backend: its portable path everywhere
(Qwen3's attention has no backend switch: `splash_length`).
A layer's cache is MLLM_JAX's, each column's segment and position kept beside it (library_model.py).

Weights: the HF folder's safetensors read under MLLM_JAX's parameter names by unitrain's reader
(each device reads its slice; MLLM_JAX's own convert_torch_to_flax_llama takes a whole torch state
dict), placed by unitrain's logical axis rules. Under the default rules that is MLLM_JAX's
get_partition_rules_llama with its mesh axes dp/fsdp/tp as unitrain's data/fsdp/tensor (kernels
[embed, heads|mlp] on (fsdp, tensor), their transposes on (tensor, fsdp)), but the embedding table,
split as our decoder's (vocab on tensor). save_hf writes them back for transformers; MLLM_JAX's
models have an lm_head of their own, so a tied checkpoint is trained and exported untied.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import logging
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.experimental import multihost_utils
from safetensors.numpy import save_file

from unitrain import sharding
from unitrain.adapters import hf, library_model
from unitrain.adapters.hf_config import read_hf_config
from unitrain.config import check
from unitrain.errors import ConfigError

log = logging.getLogger("unitrain")

EXPECTED = "github.com/demon2036/MLLM-JAX at commit 8b19c02"
# What of MLLM_JAX the adapter calls, module -> names.
API = {
    "MLLM_JAX.language.llama.llama": ("LlamaConfig", "LlamaJaxConfig", "LlamaForCausalLM", "LlamaAttention"),
    "MLLM_JAX.language.qwen2.configuration_qwen2": ("Qwen2Config",),
    "MLLM_JAX.language.qwen2.modular_qwen2": ("Qwen2ForCausalLM",),
}
REMAT = ("none", "full")  # a layer recomputed in the backward pass whole, or not at all
_MASKED = -0.7 * float(np.finfo(np.float32).max)  # added to a masked score: its softmax weight is 0

# Logical axes of MLLM_JAX's parameters by (module, parameter): the attention projections are
# flat [embed, heads * head_dim], split by heads.
_AXES = {
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("q_proj", "kernel"): ("embed", "heads"),
    ("k_proj", "kernel"): ("embed", "kv_heads"),
    ("v_proj", "kernel"): ("embed", "kv_heads"),
    ("o_proj", "kernel"): ("heads", "embed"),
    ("gate_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"),
    ("q_proj", "bias"): ("heads",),
    ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "bias"): ("kv_heads",),
    ("gate_proj", "bias"): ("mlp",),
    ("up_proj", "bias"): ("mlp",),
}
_VECTORS = ("scale", "bias")  # norm scales and the biases into the residual stream: ("norm",), replicated


# ---------------------------------------------------------------- the library


def library(path: str = "") -> dict:
    """MLLM_JAX's modules of `API` by name, imported from the checkout at `path` (else the Python
    path); a checkout that is missing, fails to import or lacks a name is a one-line ConfigError."""
    where = f"mllm_jax_path '{path}'" if path else "the Python path (mllm_jax_path is empty)"
    if path:
        if not (Path(path) / "MLLM_JAX" / "language").is_dir():
            raise ConfigError(f"{where} holds no MLLM_JAX/language folder; model_source mllm_jax expects {EXPECTED}")
        if path not in sys.path:
            sys.path.append(path)  # last: the checkout's other top-level folders (tests/, plugins/) shadow nothing
    modules = _imported(API, f"from {where}")
    found = _root(modules)
    if path and found.resolve() != Path(path).resolve():
        raise ConfigError(
            f"{where}: MLLM_JAX imports from {found} instead (imported before, or earlier on the Python path)"
        )
    return modules


def revived(lib: dict, module: str, name: str):
    """A module of the checkout's deprecated/ folder (its Qwen3 at 8b19c02), imported as deprecated/README.md
    revives one, moved back into the active tree: deprecated/MLLM_JAX and its language/ join the search
    paths of the packages MLLM_JAX and MLLM_JAX.language, after their own folders (nothing moved or edited)."""
    old = _root(lib) / "deprecated" / "MLLM_JAX"
    for package, folder in (("MLLM_JAX", old), ("MLLM_JAX.language", old / "language")):
        search = importlib.import_module(package).__path__  # a package's __path__ is its submodules' search path
        if str(folder) not in search:
            search.append(str(folder))
    return _imported({module: (name,)}, f"at {_root(lib)}")[module]


def _root(modules: dict) -> Path:
    return Path(modules["MLLM_JAX.language.llama.llama"].__file__).parents[3]


def _imported(api: dict, where: str) -> dict:
    """The modules of `api` (module -> names it must have); one line when one fails to import or lacks a name."""
    try:
        modules = {name: importlib.import_module(name) for name in api}
    except Exception as e:  # noqa: BLE001 - whatever breaks the import of the user's checkout, said in one line
        raise ConfigError(
            f"MLLM_JAX does not import {where} ({type(e).__name__}: {e}); model_source mllm_jax expects {EXPECTED}"
        ) from None
    missing = [f"{m}.{n}" for m, names in api.items() for n in names if not hasattr(modules[m], n)]
    if missing:
        raise ConfigError(f"MLLM_JAX {where} has no {missing[0]}; model_source mllm_jax expects {EXPECTED}")
    return modules


@functools.cache
def _hashable(config_cls):
    """MLLM_JAX's LlamaJaxConfig is a mutable dataclass, hence unhashable, and so is a linen module
    holding it; unitrain keys its compiled programs by the model's graph, which holds the module."""
    value_hash = lambda self: hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
    return type(config_cls.__name__, (config_cls,), {"__hash__": value_hash})


# ---------------------------------------------------------------- config.json -> MLLM_JAX's model


def _require(ok: bool, where, field: str, value, why: str) -> None:
    if not ok:
        raise ConfigError(f"{where}: field '{field}' is {value!r}; {why}")


# config.json fields MLLM_JAX's models have no code for: (field, accepted value, why)
_FIELDS = (
    ("hidden_act", lambda v: v == "silu", "MLLM_JAX's MLP is SwiGLU (silu)"),
    ("use_sliding_window", lambda v: not v, "MLLM_JAX's attention has no sliding window"),
)


_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",  # None: as many as the query heads, in both
    "rms_norm_eps",
)


def _sizes(hf_cfg, where) -> dict:
    """The fields both families' configs take, RoPE checked to be the one MLLM_JAX applies."""
    for field, accepted, why in _FIELDS:
        _require(accepted(getattr(hf_cfg, field, None)), where, field, getattr(hf_cfg, field, None), why)
    rope = hf_cfg.rope_parameters or {}
    rope_type = rope.get("rope_type", "default")
    _require(rope_type == "default", where, "rope_parameters.rope_type", rope_type, "MLLM_JAX applies unscaled RoPE")
    sizes = {field: getattr(hf_cfg, field, None) for field in _SIZES}  # the same names in MLLM_JAX's configs
    return {**sizes, "rope_theta": float(rope.get("rope_theta", 10000.0))}


def _llama_config(lib, hf_cfg, where):
    config = lib["MLLM_JAX.language.llama.llama"].LlamaConfig(
        **_sizes(hf_cfg, where),
        head_dim=getattr(hf_cfg, "head_dim", None),
        attention_bias=bool(getattr(hf_cfg, "attention_bias", False)),
        mlp_bias=bool(getattr(hf_cfg, "mlp_bias", False)),
    )
    config.jax_attention_backend = "dot"
    return config


def _jax_config(lib, dtype):
    config_cls = _hashable(lib["MLLM_JAX.language.llama.llama"].LlamaJaxConfig)
    return config_cls(mesh=None, dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(dtype))


def _llama(lib, hf_cfg, where, dtype):
    """MLLM_JAX's Llama computes in the dtype its parameters come in (cast to `dtype` by the adapter)."""
    return lib["MLLM_JAX.language.llama.llama"].LlamaForCausalLM(_llama_config(lib, hf_cfg, where))


def _qwen2(lib, hf_cfg, where, dtype):
    config = lib["MLLM_JAX.language.qwen2.configuration_qwen2"].Qwen2Config(**_sizes(hf_cfg, where))
    config.head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    config.jax_attention_backend = "dot"
    return lib["MLLM_JAX.language.qwen2.modular_qwen2"].Qwen2ForCausalLM(config, _jax_config(lib, dtype))


def _qwen3(lib, hf_cfg, where, dtype):
    """Its Qwen3Config cannot be made (its __init__ passes tie_word_embeddings on to object.__init__);
    its Qwen3 modules read the same fields of a LlamaConfig."""
    qwen3 = revived(lib, "MLLM_JAX.language.qwen3.modular_qwen3", "Qwen3ForCausalLM")
    return qwen3.Qwen3ForCausalLM(_llama_config(lib, hf_cfg, where), _jax_config(lib, dtype))


FAMILIES = {"llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3}
# Why not its Qwen3-MoE: no portable path to pick without editing MLLM_JAX (`megablox=True` is a local of gmm()).
_QWEN3_MOE = (
    "its Qwen3-MoE calls megablox's TPU kernel unconditionally (gmm() in deprecated/MLLM_JAX/language/qwen3_moe/"
    "modular_qwen3.py, whose ragged_dot path is unreachable), which imports aqt and runs in bfloat16 over "
    "MLLM_JAX's own dp/tp mesh"
)


def _read_hf_config(path: Path, trust_remote_code: bool):
    hf_cfg = read_hf_config(path, trust_remote_code)
    why = f"model_source mllm_jax runs MLLM_JAX's {', '.join(FAMILIES)}"
    if hf_cfg.model_type == "qwen3_moe":
        why += f"; {_QWEN3_MOE} (use model_source unitrain or tunix)"
    _require(hf_cfg.model_type in FAMILIES, path / "config.json", "model_type", hf_cfg.model_type, why)
    return hf_cfg


# ---------------------------------------------------------------- parameters <-> HF tensors


def _logical_axes(path: tuple) -> tuple:
    module, name = path[-2], path[-1]
    if (module, name) in _AXES:
        return _AXES[module, name]
    if name in _VECTORS:
        return ("norm",)
    raise ConfigError(f"MLLM_JAX's parameter {'/'.join(path)} is not one model_source mllm_jax knows ({EXPECTED})")


def _hf_tensor(path: tuple, tied: bool) -> tuple[str, tuple]:
    """(HF tensor name, perm) of an MLLM_JAX parameter: linen's kernels are the HF weights' transposes."""
    if path == ("lm_head", "kernel") and tied:
        return "model.embed_tokens.weight", (1, 0)
    module = ".".join(path[:-1]).replace("layers_", "layers.")
    name, leaf = path[-1], "bias" if path[-1] == "bias" else "weight"
    return f"{module}.{leaf}", (1, 0) if name == "kernel" else tuple(range(2 if name == "embedding" else 1))


# ---------------------------------------------------------------- the model


@dataclasses.dataclass(frozen=True)
class Dims:
    """The sizes of the cache and of the attention FLOPs."""

    vocab: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int


class MllmJaxModel(library_model.LibraryModel):
    """An MLLM_JAX causal LM with unitrain's model interface (models/base.py): the linen module
    (static) and its parameters as NNX Params with their logical axes."""

    def __init__(
        self, lm, layer_cache, params: dict, dims: Dims, dtype: str, remat: bool, hf_config: str, splash_length=0
    ):
        self.lm = lm
        # Its Qwen3's attention runs a splash kernel (TPU only, causal by column: blind to padding and packing)
        # on every call whose length is a multiple of 128, when head_dim is one too (Qwen3Attention.__call__).
        self.splash_length = splash_length
        self.layer_cache = layer_cache  # MLLM_JAX's LlamaAttention.init_cache
        self.params = nnx.data(params)
        self.dims, self.vocab_size = dims, dims.vocab
        self.dtype, self.remat = dtype, remat
        self.hf_config = hf_config  # config.json as save_hf writes it

    def __call__(self, tokens, positions, segment_ids, cache: library_model.Cache | None = None):
        hidden, new_cache = self._forward(tokens, positions, segment_ids, cache)
        return self.logits(hidden), new_cache

    def hidden_states(self, tokens, positions, segment_ids, cache: library_model.Cache | None = None):
        hidden, new_cache = self._forward(tokens, positions, segment_ids, cache)
        return hidden if cache is None else (hidden, new_cache)

    def logits(self, hidden):
        return self._apply(lambda m, x: m.lm_head(x), {"lm_head": self._weights()["lm_head"]}, hidden)

    def _weights(self) -> dict:
        """The parameters as a pure dict in the compute dtype (MLLM_JAX's Llama computes in theirs)."""
        return jax.tree.map(lambda p: p.astype(self.dtype), nnx.to_pure_dict(nnx.state(self, nnx.Param))["params"])

    def _apply(self, method, params: dict, *args):
        return self.lm.apply({"params": params}, *args, method=method)

    def _forward(self, tokens, positions, segment_ids, cache):
        """The final-normed hidden states and the updated cache (None without one), never by way of a
        splash kernel (see `splash_length`): such a call is made one masked column longer, or with a
        cache (whose columns are counted) as two calls, all but the last token, then that one."""
        n = tokens.shape[1]
        if not self.splash_length or n % self.splash_length:
            return self._layers(tokens, positions, segment_ids, cache)
        if cache is None:
            pad = functools.partial(jnp.pad, pad_width=((0, 0), (0, 1)))
            return self._layers(pad(tokens), pad(positions), pad(segment_ids), None)[0][:, :n], None
        first, cache = self._layers(tokens[:, :-1], positions[:, :-1], segment_ids[:, :-1], cache)
        last, cache = self._layers(tokens[:, -1:], positions[:, -1:], segment_ids[:, -1:], cache)
        return jnp.concatenate([first, last], axis=1), cache

    def _layers(self, tokens, positions, segment_ids, cache):
        weights = self._weights()
        if cache is None:
            mask = library_model.attention_mask(segment_ids, positions, segment_ids, positions)
        else:  # MLLM_JAX writes this call's keys and values at column end_index; so do we
            cache, mask = library_model.written(cache, cache.layers["layer_0"]["end_index"][0], segment_ids, positions)
        bias = jnp.where(mask, 0.0, _MASKED)[:, None]  # [B, 1, Tq, Tk], added to the scores
        model = weights["model"]
        x = self._apply(
            lambda m, t: m.model.embed_tokens(t), {"model": {"embed_tokens": model["embed_tokens"]}}, tokens
        )
        rope = self._apply(lambda m, x, p: m.model.rotary_emb(x, p), {}, x, positions)
        layers = {}
        for i in range(self.dims.layers):
            layer = functools.partial(self._layer, i)
            if self.remat and cache is None:
                layer = jax.checkpoint(layer)
            layer_cache = None if cache is None else cache.layers[f"layer_{i}"]
            layers[f"layer_{i}"], x = layer(model[f"layers_{i}"], x, tokens, layer_cache, bias, rope)
        x = self._apply(lambda m, x: m.model.norm(x), {"model": {"norm": model["norm"]}}, x)
        return x.astype(self.dtype), None if cache is None else cache.replace(layers=layers)

    def _layer(self, i, params, x, tokens, layer_cache, bias, rope):
        def call(m, x):
            return m.model.layers[i](
                inputs_embeds=x, input_ids=tokens, cache=layer_cache, attn_mask=bias, position_embeddings=rope
            )

        return self._apply(call, {"model": {f"layers_{i}": params}}, x)

    def init_cache(self, batch_size: int, max_length: int) -> library_model.Cache:
        d = self.dims
        layer = self.layer_cache(max_length, d.kv_heads, d.head_dim, batch_size, jnp.dtype(self.dtype))
        return library_model.empty(layer, d.layers, batch_size, max_length)

    def cache_axes(self) -> library_model.Cache:
        return library_model.axes(("batch", "kv_heads", "length", "kv"), self.dims.layers)

    def flops_per_token(self, seq_len: int) -> float:
        """As metrics.train_flops_per_token counts them: 6 * matmul parameters (every kernel: the
        projections, the MLP, the lm_head) per token plus 12*L*H*D*T of attention."""
        kernels = sum(v.size for p, v in nnx.to_flat_state(nnx.state(self, nnx.Param)) if p[-1] == "kernel")
        d = self.dims
        return float(6 * kernels + 12 * d.layers * d.heads * d.head_dim * seq_len)

    def save_hf(self, path: str) -> None:
        """Writes every parameter as its HF tensor (one model.safetensors, untied) and config.json;
        every process calls it."""
        tensors = {}
        for p, v in nnx.to_flat_state(nnx.state(self, nnx.Param)):
            name, perm = _hf_tensor(tuple(map(str, p[1:])), tied=False)
            full = np.asarray(multihost_utils.process_allgather(v.get_value(), tiled=True))
            tensors[name] = np.ascontiguousarray(full.transpose(np.argsort(perm)))
        if jax.process_index() != 0:
            return
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(self.hf_config)


# ---------------------------------------------------------------- load


def load(
    path: str | Path,
    dtype: str = "float32",
    mesh=None,
    *,
    mllm_jax_path: str = "",
    rules=sharding.DEFAULT_RULES,
    trust_remote_code: bool = False,
    max_replicated_param_mib: float | None = None,
    weight_dtype: str | None = None,
    remat_policy: str = "none",
    output_head: bool = True,
) -> MllmJaxModel:
    """An HF checkpoint dir as an MLLM_JAX model whose parameters are placed in their shardings.

    `dtype` is the compute dtype, `weight_dtype` (default: dtype) the parameters'. Dimensions that
    do not divide their mesh axes, and (with max_replicated_param_mib) a large parameter left fully
    replicated on several devices, are ConfigErrors before anything is read. Without `output_head`
    the lm_head is neither read nor held (the backbone of a scalar head: its hidden_states only).
    """
    path = Path(path)
    if remat_policy not in REMAT:
        raise ConfigError(
            f"remat_policy '{remat_policy}' is not available with model_source mllm_jax: its layers are "
            f"rematerialised whole or not at all ({', '.join(REMAT)})"
        )
    lib = library(mllm_jax_path)
    hf_cfg = _read_hf_config(path, trust_remote_code)
    lm = FAMILIES[hf_cfg.model_type](lib, hf_cfg, path / "config.json", dtype)
    tokens = jnp.zeros((1, 2), jnp.int32)
    shapes = jax.eval_shape(lambda: lm.init(jax.random.key(0), tokens, tokens, None, tokens)["params"])
    if not output_head:
        shapes = {k: v for k, v in shapes.items() if k != "lm_head"}
    weight_dtype = weight_dtype or dtype
    abstract = {
        p: nnx.Param(jax.ShapeDtypeStruct(s.shape, weight_dtype), out_sharding=_logical_axes(p), eager_sharding=False)
        for p, s in traverse_util.flatten_dict(shapes).items()
    }
    mesh = mesh or hf.single_device_mesh()
    try:
        placement = sharding.state_shardings(abstract, mesh, rules)
    except ValueError as e:  # an indivisible dimension, a logical name the rules lack
        raise ConfigError(f"{path}: {e}") from None
    if max_replicated_param_mib is not None:
        sharding.check_not_replicated(
            nnx.State(traverse_util.unflatten_dict(abstract)), mesh, rules, max_replicated_param_mib
        )
    tied = bool(hf_cfg.tie_word_embeddings)
    params = {}
    for p, var in abstract.items():
        name, perm = _hf_tensor(p, tied)
        hf_shape = tuple(var.shape[i] for i in np.argsort(perm))
        params[p] = var.replace(hf.read_tensor(path, name, hf_shape, weight_dtype, placement[p].get_value(), perm))
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = False
    heads = hf_cfg.num_attention_heads
    dims = Dims(
        vocab=hf_cfg.vocab_size,
        layers=hf_cfg.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(hf_cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // heads,
    )
    log.info(
        "model_source mllm_jax: %s with MLLM_JAX's dot-product attention (its TPU kernels take no segment mask)",
        hf_cfg.model_type,
    )
    return MllmJaxModel(
        lm,
        lib["MLLM_JAX.language.llama.llama"].LlamaAttention.init_cache,
        traverse_util.unflatten_dict(params),
        dims,
        dtype,
        remat_policy == "full",
        json.dumps(config, indent=2),
        splash_length=128 if hf_cfg.model_type == "qwen3" and dims.head_dim % 128 == 0 else 0,
    )


def source(cfg, mesh, output_head: bool = True) -> MllmJaxModel:
    """`model_source: mllm_jax`: the HF checkpoint at load_parameters_path through MLLM_JAX's models,
    imported from mllm_jax_path (else the Python path); without its lm_head under a scalar head."""
    path = cfg.load_parameters_path
    if not path or not (Path(path) / "config.json").is_file():
        raise ConfigError(
            f"model_source mllm_jax loads an HF checkpoint directory (config.json + safetensors); "
            f"load_parameters_path is '{path}'" + ("" if path else " (it initialises no model at random)")
        )
    if cfg.extra_tokens:
        raise ConfigError(
            "extra_tokens is not available with model_source mllm_jax (its vocabulary is the checkpoint's)"
        )
    return load(
        path,
        cfg.dtype,
        mesh,
        mllm_jax_path=cfg.mllm_jax_path,
        rules=sharding.rules_from_config(cfg.logical_axis_rules),
        trust_remote_code=cfg.trust_remote_code,
        max_replicated_param_mib=cfg.max_replicated_param_mib,
        weight_dtype=cfg.weight_dtype,
        remat_policy=cfg.remat_policy,
        output_head=output_head,
    )


@check("model_source", "mllm_jax_path")
def _mllm_jax_path(c) -> str | None:
    if not c["mllm_jax_path"] or c["model_source"] == "mllm_jax":
        return None
    return f"mllm_jax_path is read by model_source mllm_jax only; model_source is {c['model_source']}"


CONFIG_CHECKS = (_mllm_jax_path,)
