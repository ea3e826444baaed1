"""The devices a run is laid out on, its meshes, logical axis rules, the shardings of state and batches,
and the moves of rows between host and global arrays.

`layout_for(cfg)` is what the config gives on the target devices (mesh shapes, batch sizes, updates
per step). Parameters and activations name their dimensions logically (`embed`, `mlp`, `heads`,
...); the `logical_axis_rules` table of the config (data, not code) maps each name to mesh axes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from unitrain.config import MESH_AXES, ROLLOUT_MESH_KEYS, TRAINER_MESH_KEYS, check
from unitrain.errors import ConfigError
from unitrain.registry import RL_MODES

Rules = tuple[tuple[str, Any], ...]

# The table configs/base.yml ships (a test keeps the two equal); used by library callers such as
# adapters.hf.load that run without a config.
DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("length", "context"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("kv", None),
    ("vocab", "tensor"),
    ("layers", None),
    ("expert", None),
    ("norm", None),
    ("activation_embed", None),
)


def rules_from_config(rules: list) -> Rules:
    """[[logical, mesh_axis | [mesh_axes] | null], ...] from yml -> hashable tuple."""
    return tuple((name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in rules)


def logical_to_spec(logical_axes: tuple, rules: Rules) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions carry these logical names (None = replicated).
    A mesh axis splits one dimension of an array: one that an earlier dimension took is skipped in
    a later one's entry (with `expert` on fsdp, an expert weight is split by expert, its `embed`
    whole), as flax's logical rules do."""
    table = dict(rules)
    spec, used = [], set()
    for name in logical_axes:
        if name is not None and name not in table:
            raise ConfigError(
                f"config key 'logical_axis_rules': logical axis '{name}' has no entry; add [{name}, <mesh axes or null>]"
            )
        entry = None if name is None else table[name]
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        free = tuple(a for a in axes if a not in used)
        used.update(free)
        spec.append(entry if free == axes else (free if len(free) > 1 else free[0] if free else None))
    return PartitionSpec(*spec)


_compile_target: list | None = None


def target_devices() -> list:
    """The devices the programs are built for: this job's (jax.devices()), or within `compile_for`
    a topology's that need not be attached (ahead-of-time compilation)."""
    return jax.devices() if _compile_target is None else _compile_target


def target_platform() -> str:
    """The platform of `target_devices()` ("cpu", "gpu", "tpu"): the models' kernel and layout choices
    follow it, so that a program compiled ahead of time for a TPU is the one a TPU would run."""
    return target_devices()[0].platform


def target_process_count() -> int:
    return len({d.process_index for d in target_devices()})


@contextlib.contextmanager
def compile_for(target: list):
    """Within: layouts, meshes and models are built for `target` (e.g. the devices of
    jax.experimental.topologies.get_topology_desc) instead of this job's devices."""
    global _compile_target
    previous, _compile_target = _compile_target, list(target)
    try:
        yield
    finally:
        _compile_target = previous


def sequence_shards() -> int:
    """The devices the sequence axis is split over in the current mesh: its `context` axis, which the
    `length` rule names where it is above 1 (a config check); 1 outside a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or "context" not in mesh.axis_names else mesh.shape["context"]


def create_mesh(ici_shape: dict, dcn_shape: dict, devices=None) -> Mesh:
    """Mesh with axes (data, fsdp, context, tensor), an axis the shapes leave out of size 1; dcn sizes
    span slices (TPU) or processes (GPU/CPU)."""
    devices = target_devices() if devices is None else devices
    ici = [ici_shape.get(a, 1) for a in MESH_AXES]
    dcn = [dcn_shape.get(a, 1) for a in MESH_AXES]
    if math.prod(dcn) > 1:
        # TPU slices are the granules across DCN; elsewhere (GPU, CPU) a process is.
        granule_is_process = devices[0].platform != "tpu"
        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=granule_is_process)
    else:
        grid = mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True)
    return Mesh(grid, MESH_AXES)


def split_devices(rollout_devices: int) -> tuple[list, list]:
    """(the trainer's devices, the rollout's): each process gives its last rollout_devices /
    process_count local devices to rollouts, so that both meshes span every process."""
    per_process = rollout_devices // target_process_count()
    by_process: dict = {}
    for d in target_devices():
        by_process.setdefault(d.process_index, []).append(d)
    local = [sorted(ds, key=lambda d: d.id) for _, ds in sorted(by_process.items())]
    cut = len(local[0]) - per_process
    return [d for ds in local for d in ds[:cut]], [d for ds in local for d in ds[cut:]]


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a config gives on its devices (layout_for): the meshes' shapes and the batch sizes."""

    mesh_shape: dict  # the trainer's ici size per mesh axis
    dcn_mesh_shape: dict  # the trainer's size per mesh axis across slices (TPU) or processes
    rollout_mesh_shape: dict  # each rollout mesh's (all 1 without rollout_devices)
    global_batch_size: int  # rows per micro-batch: per_device_batch_size * the trainer's devices / its context size
    rows_per_update: int  # global_batch_size * gradient_accumulation_steps
    updates_per_step: int  # GRPO: rollout rows / rows_per_update * num_iterations; else 1
    optimizer_steps: int  # steps * updates_per_step: the learning-rate schedule's horizon


def layout_for(cfg) -> Layout:
    """The Layout of `cfg` on the target devices; a ConfigError where they cannot hold it."""
    ici, dcn, rollout = _mesh_shapes(cfg)
    _check_expert_split(cfg, {a: ici[a] * dcn[a] for a in MESH_AXES}, rollout)
    # The context axis' devices share their rows, each holding a part of every row's sequence.
    devices = math.prod(ici.values()) * math.prod(dcn.values())
    global_batch_size = cfg.per_device_batch_size * devices // (ici["context"] * dcn["context"])
    rows_per_update = global_batch_size * cfg.gradient_accumulation_steps
    updates_per_step = 1
    if cfg.mode in RL_MODES:
        rollout_rows = cfg.rollout_batch_size * cfg.n_samples_per_prompt
        if rollout_rows % rows_per_update:
            raise ConfigError(
                f"rollout_batch_size * n_samples_per_prompt ({rollout_rows}) must be a multiple of per_device_batch_size"
                f" * devices * gradient_accumulation_steps ({rows_per_update}), the rows of one update"
            )
        updates_per_step = rollout_rows // rows_per_update * cfg.num_iterations
    return Layout(
        mesh_shape=ici,
        dcn_mesh_shape=dcn,
        rollout_mesh_shape=rollout,
        global_batch_size=global_batch_size,
        rows_per_update=rows_per_update,
        updates_per_step=updates_per_step,
        optimizer_steps=cfg.steps * updates_per_step,
    )


def context_size(layout: Layout) -> int:
    """The devices every row's sequence is split over (ici and dcn context sizes)."""
    return layout.mesh_shape["context"] * layout.dcn_mesh_shape["context"]


def _check_expert_split(cfg, *meshes: dict) -> None:
    """Expert parallelism splits whole experts: their number must divide over the mesh axes that
    the `expert` rule names, on the trainer's mesh and the rollout mesh. A dense model has no
    expert axis, so a rules table written before MoE need not name it."""
    if not cfg.num_experts:
        return
    entry = logical_to_spec(("expert",), rules_from_config(cfg.logical_axis_rules))[0]
    axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
    for mesh in meshes:
        devices = math.prod(mesh[a] for a in axes)
        if cfg.num_experts % devices:
            raise ConfigError(
                f"num_experts ({cfg.num_experts}) must be a multiple of the {devices} devices of mesh axes "
                f"{', '.join(axes)}, over which logical_axis_rules' expert entry splits them"
            )


def _mesh_shapes(cfg) -> tuple[dict, dict, dict]:
    """The trainer's ici and dcn mesh shapes over the devices rollout_devices leaves it, and each
    rollout mesh's shape over its share of those (all 1 without rollout devices)."""
    n, r, processes, meshes = len(target_devices()), cfg.rollout_devices, target_process_count(), cfg.rollout_meshes
    if r and (r >= n or r % (processes * meshes)):
        raise ConfigError(
            f"rollout_devices ({r}) must be below the {n} devices and a multiple of the {processes} "
            f"processes times rollout_meshes ({meshes}): each process gives each rollout mesh the same number"
        )
    trainer = _fill({k: cfg[k] for k in TRAINER_MESH_KEYS}, n - r, "the ici_* and dcn_* parallelism sizes")
    rollout = _fill({k: cfg[k] for k in ROLLOUT_MESH_KEYS}, r // meshes or 1, "the rollout_*_parallelism sizes")
    ici, dcn = ({a: trainer[f"{net}_{a}_parallelism"] for a in MESH_AXES} for net in ("ici", "dcn"))
    return ici, dcn, {a: rollout.get(f"rollout_{a}_parallelism", 1) for a in MESH_AXES}


def _fill(sizes: dict, n: int, what: str) -> dict:
    """The sizes with the one -1 set so that they multiply to n devices."""
    fill = [k for k, v in sizes.items() if v == -1]
    others = math.prod(v for v in sizes.values() if v != -1)
    if fill and n % others:
        raise ConfigError(
            f"{fill[0]}=-1 cannot fill the mesh: the other sizes multiply to {others}, which does not divide the {n} devices"
        )
    if fill:
        return {**sizes, fill[0]: n // others}
    if others != n:
        raise ConfigError(
            f"{what} multiply to {others} but there are {n} devices for them; make the product {n} or set one size to -1"
        )
    return sizes


def trainer_mesh(cfg, layout: Layout) -> Mesh:
    """The trainer's mesh, over the devices rollout_devices leaves it."""
    return create_mesh(layout.mesh_shape, layout.dcn_mesh_shape, split_devices(cfg.rollout_devices)[0])


def rollout_meshes(cfg, layout: Layout) -> tuple[Mesh, ...]:
    """The `rollout_meshes` rollout meshes (axes as the trainer's, so the same logical rules apply),
    none without rollout_devices. Each takes the same share of every process's rollout devices,
    ordered process by process: `data` spans the processes."""
    if not cfg.rollout_devices:
        return ()
    shape = [layout.rollout_mesh_shape[a] for a in MESH_AXES]
    devices = np.array(split_devices(cfg.rollout_devices)[1]).reshape(target_process_count(), cfg.rollout_meshes, -1)
    return tuple(Mesh(devices[:, m].reshape(shape), MESH_AXES) for m in range(cfg.rollout_meshes))


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def logical_axes_of(var: nnx.Variable) -> tuple:
    return var.get_metadata().get("out_sharding") or (None,) * len(var.shape)


def state_shardings(state, mesh: Mesh, rules: Rules):
    """NamedSharding for every Variable of an NNX state (concrete or abstract), from its logical axes.

    Raises a clear error when a dimension does not divide evenly over the mesh axes it maps to.
    """

    def one(path, var):
        spec = logical_to_spec(logical_axes_of(var), rules)
        _check_divisible(jax.tree_util.keystr(path), var.shape, spec, mesh)
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_variable)


def logical_shardings(axes_tree, mesh: Mesh, rules: Rules):
    """NamedShardings for a pytree of logical-axis tuples (a model's param_axes()), shapes unchecked."""
    return jax.tree.map(
        lambda axes: NamedSharding(mesh, logical_to_spec(axes, rules)),
        axes_tree,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def _check_divisible(name: str, shape, spec: PartitionSpec, mesh: Mesh) -> None:
    for dim, (size, axes) in enumerate(zip(shape, spec)):
        if axes is None:
            continue
        axes = axes if isinstance(axes, tuple) else (axes,)
        parts = math.prod(mesh.shape[a] for a in axes)
        if size % parts:
            raise ValueError(
                f"parameter {name} dimension {dim} (size {size}) cannot be split over mesh axes {axes} "
                f"({parts} devices); change logical_axis_rules or the *_parallelism sizes"
            )


def param_axes(state) -> dict:
    """The logical axes of every Variable of an NNX state, as a pure dict (nnx.to_pure_dict's layout)."""
    return nnx.to_pure_dict(jax.tree.map(lambda var: var.replace(logical_axes_of(var)), state, is_leaf=_is_variable))


def check_not_replicated(abstract_state, mesh: Mesh, rules: Rules, limit_mib: float) -> None:
    """A large parameter copied whole onto every device is almost always a wrong axis rule: stop
    before anything is materialised."""
    if mesh.size == 1:
        return
    shardings = state_shardings(abstract_state, mesh, rules)
    for (path, var), (_, s) in zip(nnx.to_flat_state(abstract_state), nnx.to_flat_state(shardings)):
        mib = math.prod(var.shape) * np.dtype(var.dtype).itemsize / 2**20
        if s.get_value().is_fully_replicated and mib > limit_mib:
            name = ".".join(map(str, path))
            raise ConfigError(
                f"parameter {name} ({mib:.0f} MiB, logical axes {logical_axes_of(var)}) would be fully "
                f"replicated on all {mesh.size} devices; map one of its axes to a mesh axis in logical_axis_rules "
                f"or raise max_replicated_param_mib"
            )


def init_sharded(make_module: Callable[[], nnx.Module], mesh: Mesh, rules: Rules) -> nnx.Module:
    """Builds a module with every parameter created directly in its sharding (no full host copy)."""
    graphdef, abstract_state = nnx.split(nnx.eval_shape(make_module))
    shardings = state_shardings(abstract_state, mesh, rules)
    init = jax.jit(lambda: nnx.state(make_module()), out_shardings=shardings)
    return nnx.merge(graphdef, init())


def batch_sharding(mesh: Mesh, rules: Rules, logical_axes=("batch", "length")) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes, rules))


def bytes_per_device(state) -> dict:
    """Bytes of the state's arrays held by each device (shows that sharding really splits the state)."""
    totals: dict = {}
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
    return totals


def with_memory_kind(tree, kind: str):
    """The same arrays in the same shardings, moved to another memory (e.g. "pinned_host")."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(kind)), tree)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


# ---------------------------------------------------------------- rows between host and device


def local_rows_to_global(batch: dict, shardings) -> dict:
    """This process's rows -> global arrays (SFT data: each process reads its own rows)."""
    shardings = _per_key(batch, shardings)
    return {k: jax.make_array_from_process_local_data(shardings[k], v) for k, v in batch.items()}


def full_rows_to_global(batch: dict, shardings) -> dict:
    """Rows every process holds in full -> global arrays; each device takes its slice (rollouts:
    every process computes the same batch)."""
    shardings = _per_key(batch, shardings)
    return {k: jax.make_array_from_callback(v.shape, shardings[k], lambda idx, v=v: v[idx]) for k, v in batch.items()}


def abstract_rows(batch: dict, shardings) -> dict:
    """full_rows_to_global's arrays, abstract (shape, dtype, sharding): what a program compiled for
    devices that are not here takes (tools/bench.py --compile-only --topology)."""
    shardings = _per_key(batch, shardings)
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in batch.items()}


def _per_key(batch: dict, shardings) -> dict:
    return shardings if isinstance(shardings, dict) else {k: shardings for k in batch}


def to_host(x) -> np.ndarray:
    """A global array as one numpy array on every process (gathered when it spans processes)."""
    if not x.is_fully_addressable:
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)


@check("logical_axis_rules")
def _logical_axis_rules(c) -> str | None:
    seen = set()
    for rule in c["logical_axis_rules"]:
        name, mesh = rule if isinstance(rule, list) and len(rule) == 2 else (None, None)
        axes = [] if mesh is None else [mesh] if isinstance(mesh, str) else mesh
        if not isinstance(name, str) or not isinstance(axes, list) or not all(isinstance(a, str) for a in axes):
            return f"logical_axis_rules entry {rule} must be [logical_name, mesh_axis | [mesh_axes] | null]"
        if bad := [a for a in axes if a not in MESH_AXES]:
            return f"logical_axis_rules entry '{name}' uses mesh axis '{bad[0]}', which is not one of {', '.join(MESH_AXES)}"
        if len(set(axes)) < len(axes) or name in seen:
            return f"logical_axis_rules entry '{name}' repeats a mesh axis or a logical name"
        seen.add(name)
    return None


@check(*TRAINER_MESH_KEYS, *ROLLOUT_MESH_KEYS)
def _one_fill(c) -> str | None:
    for keys, which in ((TRAINER_MESH_KEYS, "ici_*/dcn_*"), (ROLLOUT_MESH_KEYS, "rollout_*")):
        fills = [k for k in keys if c[k] == -1]
        if len(fills) > 1:
            return f"only one {which}_parallelism may be -1 (fill), got {' and '.join(fills)}"
    return None


CONFIG_CHECKS = (_logical_axis_rules, _one_fill)
