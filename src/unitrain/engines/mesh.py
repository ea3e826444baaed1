"""`sampler: mesh`: the JAX sampler on devices of its own (`rollout_devices`, laid out by the
rollout_*_parallelism sizes), with its own copy of the weights, pushed from the trainer's mesh by
every update_weights. While the trainer updates on its devices, rollouts dispatched ahead
(`max_staleness`, rollout/executor.py) sample on these.

The push copies every parameter into the rollout mesh's shardings (the same logical axis rules,
another mesh). In one process that is a device-to-device copy. Across processes JAX cannot copy
between disjoint device sets (outside TPU's runtime), so each parameter is gathered to every
process's host, one at a time, and each process places its own rollout shards.
"""

from __future__ import annotations

import logging
import time

import jax
from flax import nnx
from jax.experimental import multihost_utils

from unitrain import sharding
from unitrain.engines.colocated import ColocatedSampler
from unitrain.errors import ConfigError

log = logging.getLogger("unitrain")


class RolloutMeshSampler(ColocatedSampler):
    """The colocated sampler's programs on the rollout mesh; `push_seconds` is the last push's time."""

    def __init__(self, model, *, pad_id: int, mesh, rules, **decode):
        super().__init__(model, pad_id=pad_id, mesh=mesh, rules=rules, **decode)
        try:  # the rollout mesh may split a dimension the trainer's did not
            shardings = sharding.state_shardings(nnx.state(model), mesh, self.rules)
        except ValueError as e:
            raise ConfigError(f"the rollout mesh: {e}") from None
        self.shardings = nnx.to_pure_dict(shardings)
        self.params, self.push_seconds = None, 0.0

    def update_weights(self, params, version: int) -> None:
        """Copies the trainer's parameters to the rollout mesh, waiting for the copy (it is timed;
        the trainer's arrays may be donated right after)."""
        jax.block_until_ready(params)  # the update that made them is the trainer's time, not the push's
        start = time.perf_counter()
        pushed = jax.block_until_ready(push(params, self.shardings))
        self.push_seconds = time.perf_counter() - start
        super().update_weights(pushed, version)


def push(params, shardings):
    """The parameters in `shardings` (on other devices than theirs)."""
    if jax.process_count() == 1:
        return jax.device_put(params, shardings)
    return jax.tree.map(through_hosts, params, shardings)


def through_hosts(x, target):
    """x in `target` by way of every process's host memory: the multi-process push of one parameter."""
    whole = multihost_utils.process_allgather(x, tiled=True)
    return jax.make_array_from_callback(x.shape, target, lambda index: whole[index])


def from_run(run) -> RolloutMeshSampler:
    """The sampler factory of `sampler: mesh`."""
    mesh = run.rollout_mesh
    log.info(
        "rollouts on their own mesh %s over %d devices; the trainer's: %s over %d",
        dict(mesh.shape),
        mesh.size,
        dict(run.mesh.shape),
        run.mesh.size,
    )
    return RolloutMeshSampler(
        run.model,
        pad_id=run.tokenizer.pad_id,
        mesh=mesh,
        rules=run.rules,
        cache_phases=run.cfg.rollout_cache_phases,
        compaction=run.cfg.rollout_compaction,
        compaction_min_tokens=run.cfg.rollout_compaction_min_tokens,
        quantization=run.cfg.rollout_quantization,
    )
