"""LoRA and QLoRA over any model of the model interface (models/base.py): `lora_rank > 0` wraps the
built model in a LoraModel whose parameters are

    {"base": the model's own parameters, frozen (targeted weights optionally quantised),
     "lora": {<path of a targeted weight>: {"a": [*layers, *in, rank], "b": [*layers, rank, *out]}}}

and whose call runs the model with every targeted weight W replaced by W + (alpha / rank) * A @ B.
Only "lora" is trained (`trainable`), held in the optimizer and checkpointed; the base with the
adapters off (`adapters_off`) is the reference policy of GRPO and DPO, so it costs no second copy.

Why weights and not qwix's interception: qwix.apply_lora_to_model adds the low-rank path where a Flax
module calls jnp.einsum / lax.dot_general on one of its *own* nnx.Param attributes. Our decoder keeps
each weight stacked over the layers in one module and applies it inside lax.scan from a plain
function, so qwix attaches adapters to lm_head only. Acting on the weights needs nothing of a model
but its parameters and their logical axes, so it serves every model source; dropout on the adapter
input cannot be expressed this way, hence no lora_dropout. qwix does the quantisation of the frozen
base (QLoRA: models/quant.py, int8 or nf4 in blocks of QUANT_BLOCK inputs).

Which axes are inputs: the model dimension `embed` is the input of a weight that starts with it
(wq, w_gate, lm_head) and the output of one that ends with it (wo, w_down); a leading `layers` axis
is shared by A, B and W.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx

from unitrain import sharding
from unitrain.config import check
from unitrain.errors import ConfigError
from unitrain.models import quant
from unitrain.models.base import SharedPrefixModel

QUANT_BLOCK = 64  # inputs per quantisation scale, as QLoRA's NF4 blocks
QUANTISED = ("int8", "nf4")


ADAPTERS = "lora"  # the key of the trained part of a LoraModel's parameters


@dataclasses.dataclass(frozen=True)
class Target:
    """A weight that gets an adapter: where it is, how its axes split into (layers, in, out), and
    the dtype the merged weight takes (the model's own)."""

    path: tuple[str, ...]
    lead: int  # leading `layers` axes
    n_in: int  # input axes after them
    dtype: str
    axes: tuple  # logical axis names of the weight

    @property
    def in_axes(self) -> tuple[int, ...]:
        return tuple(range(self.lead, self.lead + self.n_in))


# ---------------------------------------------------------------- the trained part of the parameters


def trainable(params: dict, adapters_only: bool) -> dict:
    """What the optimizer updates and a checkpoint saves: the adapters with LoRA, else everything."""
    return params[ADAPTERS] if adapters_only else params


def with_trainable(params: dict, new: dict, adapters_only: bool) -> dict:
    """`params` with its trainable part replaced by `new` (the frozen base shared, not copied)."""
    return {**params, ADAPTERS: new} if adapters_only else new


def adapters_off(params: dict) -> dict:
    """The parameters of the base model alone: the same base arrays, B = 0 (the reference policy)."""
    lora = jax.tree_util.tree_map_with_path(lambda k, x: jnp.zeros_like(x) if k[-1].key == "b" else x, params[ADAPTERS])
    return {**params, ADAPTERS: lora}


# ---------------------------------------------------------------- building


def apply(model, cfg, mesh, root: tuple[str, ...] = (), train_whole: tuple[tuple[str, ...], ...] = ()):
    """The built model wrapped with adapters on the weights matching cfg.lora_target below `root`
    (a scalar head's backbone), and the parameters at `train_whole` (a scalar head's score) trained
    whole beside them, every array placed in the sharding its logical axes give (param_axes) over
    `mesh`. Built inside one jit with the model's arrays donated: the base is never held twice, and
    quantised arrays get the layout compiled programs expect."""
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    targets = tuple(
        dataclasses.replace(t, path=root + t.path)
        for t in find_targets(_get(model.param_axes(), root), _get(params, root), cfg.lora_target)
    )
    base_graphdef, base_state = nnx.split(model)

    rules = sharding.rules_from_config(cfg.logical_axis_rules)

    # The capability is the base's, decided once here: a LoRA model shares prefixes where its base does.
    cls = SharedPrefixLoraModel if isinstance(model, SharedPrefixModel) else LoraModel

    def build(state):
        return cls(
            nnx.merge(base_graphdef, state),
            targets,
            cfg.lora_rank,
            cfg.lora_alpha,
            cfg.lora_base_dtype,
            cfg.seed,
            rules,
            train_whole,
        )

    graphdef, abstract = nnx.split(nnx.eval_shape(build, base_state))
    axes = nnx.merge(graphdef, abstract).param_axes()
    shardings = sharding.logical_shardings(axes, mesh, rules)
    params = jax.jit(
        lambda state: nnx.to_pure_dict(nnx.state(build(state))), out_shardings=shardings, donate_argnums=0
    )(base_state)
    nnx.replace_by_pure_dict(abstract, params)
    return nnx.merge(graphdef, abstract)


def find_targets(axes: dict, params: dict, pattern: str) -> tuple[Target, ...]:
    """The parameters whose '/'-joined path fully matches `pattern`; a ConfigError when none does or
    one has no `embed` axis at either end."""
    found = []
    for key, names in jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda x: isinstance(x, tuple))[0]:
        path = tuple(k.key for k in key)
        if not re.fullmatch(pattern, "/".join(path)):
            continue
        lead = 1 if names and names[0] == "layers" else 0
        inner = names[lead:]
        if len(inner) < 2 or "embed" not in (inner[0], inner[-1]):
            raise ConfigError(
                f"lora_target matches {'/'.join(path)} (axes {names}), which is not a projection with "
                "the embed axis first or last; narrow lora_target"
            )
        n_in = 1 if inner[0] == "embed" else len(inner) - 1
        found.append(Target(path, lead, n_in, str(_get(params, path).dtype), tuple(names)))
    if not found:
        raise ConfigError(f"lora_target '{pattern}' matches no parameter of the model")
    return tuple(found)


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree: dict, path, value) -> dict:
    """A copy of the nested dict `tree` with `value` at `path` (the rest shared)."""
    if not path:
        return value
    return {**tree, path[0]: _set(tree.get(path[0], {}), path[1:], value)}


def delta(a: jax.Array, b: jax.Array, shape, target: Target) -> jax.Array:
    """A @ B over the flattened input and output axes, shaped like the weight."""
    lead = shape[: target.lead]
    return jnp.matmul(a.reshape(*lead, -1, a.shape[-1]), b.reshape(*lead, b.shape[target.lead], -1)).reshape(shape)


def quantise(w: jax.Array, target: Target, qtype: str):
    """The weight as a qwix QArray: one scale per layer, output channel and leading input axis, per
    block of QUANT_BLOCK along the last input axis (the whole axis when it is not a multiple)."""
    return quant.quantise(w, target.in_axes, qtype, block=QUANT_BLOCK)


# ---------------------------------------------------------------- the model


def without_adapters(params: dict) -> dict:
    """A LoraModel's parameters with every B zero: the model is then its base exactly."""
    adapters = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if path[-1].key == "b" else x, params[ADAPTERS]
    )
    return {**params, ADAPTERS: adapters}


class LoraModel(nnx.Module):
    """A model with low-rank adapters on its `targets`; the model interface of models/base.py."""

    def __init__(
        self,
        base,
        targets: tuple[Target, ...],
        rank: int,
        alpha: float,
        base_dtype: str,
        seed: int,
        rules: tuple = (),
        train_whole: tuple[tuple[str, ...], ...] = (),
    ):
        self.targets, self.rank, self.alpha, self.rules = targets, rank, alpha, rules
        # Trained whole with the adapters (PEFT's modules_to_save): the trained copy lives among the
        # adapters and replaces the base's in merged(); meant for small heads (the base keeps its copy).
        self.train_whole = train_whole
        graphdef, state = nnx.split(base)
        params, adapters = nnx.to_pure_dict(state), {}
        for t, key in zip(targets, jax.random.split(jax.random.key(seed), len(targets))):
            w = _get(params, t.path)
            lead, ins, outs = w.shape[: t.lead], w.shape[t.lead : t.lead + t.n_in], w.shape[t.lead + t.n_in :]
            # qwix's LoraRule defaults: A he-uniform over its inputs (each layer its own draw), B zero,
            # so training starts from the base model exactly. Adapters are float32 whatever the base.
            init = jax.nn.initializers.he_uniform(batch_axis=tuple(range(t.lead)))
            a = init(key, (*lead, math.prod(ins), rank), jnp.float32).reshape(*lead, *ins, rank)
            b = jnp.zeros((*lead, rank, *outs), jnp.float32)
            adapters = _set(adapters, t.path, {"a": nnx.LoRAParam(a), "b": nnx.LoRAParam(b)})
            if base_dtype in QUANTISED:
                params = _set(params, t.path, quantise(w, t, base_dtype))
            elif base_dtype:
                params = _set(params, t.path, w.astype(base_dtype))
        for path in train_whole:
            adapters = _set(adapters, path, nnx.LoRAParam(jnp.copy(_get(params, path))))
        nnx.replace_by_pure_dict(state, params)
        self.base = nnx.merge(graphdef, state)
        self.lora = nnx.data(adapters)

    def merged(self):
        """The base model with every targeted weight W + scale * A @ B, summed in float32 (a
        bfloat16 or quantised base must not round the small update away) and then given the
        model's own dtype, the one it had without LoRA."""
        graphdef, state = nnx.split(self.base)
        params = nnx.to_pure_dict(state)
        for t in self.targets:
            w = _get(params, t.path)
            w = quant.dequantise(w) if isinstance(w, qwix.QArray) else w
            adapter = _get(self.lora, t.path)
            update = delta(adapter["a"][...], adapter["b"][...], w.shape, t)
            merged = (w.astype(jnp.float32) + self.alpha / self.rank * update).astype(t.dtype)
            params = _set(params, t.path, self._constrain(merged, t.axes))
        for path in self.train_whole:
            params = _set(params, path, _get(self.lora, path)[...])
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)

    def _constrain(self, x, axes):
        """The merged weight in the sharding of the weight it replaces: XLA would otherwise be free to
        gather a dequantised weight whole on every device."""
        if jax.sharding.get_abstract_mesh().empty or not self.rules:
            return x
        return jax.lax.with_sharding_constraint(x, sharding.logical_to_spec(axes, self.rules))

    def __call__(self, tokens, positions, segment_ids, cache=None):
        return self.merged()(tokens, positions, segment_ids, cache)

    def hidden_states(self, tokens, positions, segment_ids, cache=None):
        return self.merged().hidden_states(tokens, positions, segment_ids, cache)

    def logits(self, hidden):
        # Every targeted weight is merged, but XLA drops the merges the output head does not use.
        return self.merged().logits(hidden)

    def decode_weights(self, quantization: str = "none"):
        """The merged model's: the sampler makes them once per weight version, not per token."""
        return self.merged().decode_weights(quantization)

    def for_decoding(self, weights):
        return self.merged().for_decoding(weights)

    # -- the rest of the model interface
    @property
    def vocab_size(self) -> int:
        return self.base.vocab_size

    def init_cache(self, batch_size: int, max_length: int):
        return self.base.init_cache(batch_size, max_length)

    def cache_axes(self):
        return self.base.cache_axes()

    def flops_per_token(self, seq_len: int) -> float:
        return self.base.flops_per_token(seq_len)

    def param_axes(self) -> dict:
        """The base's axes (a quantised weight's scale keeps an axis only where it is not blocked)
        and the adapters': A keeps the weight's layer and input axes, B its layer and output axes."""
        base_axes, params = self.base.param_axes(), nnx.to_pure_dict(nnx.state(self.base))
        lora_axes = {}
        for t in self.targets:
            names, w = _get(base_axes, t.path), _get(params, t.path)
            a_axes = names[: t.lead + t.n_in] + (None,)
            b_axes = names[: t.lead] + (None,) + names[t.lead + t.n_in :]
            lora_axes = _set(lora_axes, t.path, {"a": a_axes, "b": b_axes})
            if isinstance(w, qwix.QArray):
                scale = tuple(n if s == q else None for n, s, q in zip(names, w.scale.shape, w.qvalue.shape))
                base_axes = _set(base_axes, t.path, w.replace(qvalue=names, scale=scale))
        for path in self.train_whole:
            lora_axes = _set(lora_axes, path, _get(base_axes, path))
        return {"base": base_axes, ADAPTERS: lora_axes}

    def decay_mask(self) -> dict:
        """Weight decay on the adapters only: the base is frozen."""
        params = nnx.to_pure_dict(nnx.state(self))
        return {
            "base": jax.tree.map(lambda _: False, params["base"]),
            ADAPTERS: jax.tree.map(lambda _: True, params[ADAPTERS]),
        }

    def save_hf(self, path: str) -> None:
        """The merged model (base + scaled adapters): transformers loads it as a plain model."""
        self.merged().save_hf(path)

    def save_peft(self, path: str, hf_names: dict) -> None:
        """The adapters alone in PEFT's format (adapter_config.json + adapter_model.safetensors) for
        the HF base; `hf_names` maps a weight's '.'-joined path to its HF tensor name ({i} = layer).
        PEFT's lora_A is [rank, in] and lora_B [out, rank], its scaling lora_alpha / r, the same
        product as ours: every process calls it (gathering is a collective), process 0 writes."""
        from jax.experimental import multihost_utils
        from safetensors.numpy import save_file

        tensors, modules = {}, set()
        for t in self.targets:
            adapter = _get(self.lora, t.path)
            a, b = (np.asarray(multihost_utils.process_allgather(adapter[k][...], tiled=True)) for k in ("a", "b"))
            name = hf_names[".".join(t.path)].removesuffix(".weight")
            layers = range(a.shape[0]) if t.lead else [None]
            for i in layers:
                a_i, b_i = (a, b) if i is None else (a[i], b[i])
                prefix = "base_model.model." + name.format(i=i)
                tensors[prefix + ".lora_A.weight"] = np.ascontiguousarray(a_i.reshape(-1, a_i.shape[-1]).T)
                tensors[prefix + ".lora_B.weight"] = np.ascontiguousarray(b_i.reshape(b_i.shape[0], -1).T)
            modules.add(name.rsplit(".", 1)[-1])
        if jax.process_index() != 0:
            return
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": sorted(modules),
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": False,
            "inference_mode": True,
            "base_model_name_or_path": None,
        }
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(config, f, indent=2)


class SharedPrefixLoraModel(LoraModel):
    """LoRA over a model that shares prefixes (models/base.SharedPrefixModel): its merged model's."""

    def hidden_states_shared_prefix(self, *args, **kwargs):
        return self.merged().hidden_states_shared_prefix(*args, **kwargs)


@check("lora_rank", "lora_base_dtype", "lora_export_adapters")
def _needs_adapters(c) -> str | None:
    if c["lora_rank"] or not (c["lora_base_dtype"] or c["lora_export_adapters"]):
        return None
    return "lora_base_dtype and lora_export_adapters need lora_rank > 0"


@check("lora_export_adapters", "export_hf_path", "model_source")
def _adapter_export(c) -> str | None:
    if not c["lora_export_adapters"] or (c["export_hf_path"] and c["model_source"] == "unitrain"):
        return None
    return "lora_export_adapters writes into export_hf_path with the unitrain decoder's HF names: set export_hf_path and model_source=unitrain"


CONFIG_CHECKS = (_needs_adapters, _adapter_export)
