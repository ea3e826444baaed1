"""Multi-host start: `jax.distributed.initialize` driven by the config, before anything counts devices.

    distributed_init: auto   # initialize when num_processes > 1 or a cluster environment is detected
    coordinator_address: ""  # host:port of process 0 (GPU/CPU clusters; TPU pods and SLURM fill it in)
    num_processes: 1
    process_id: 0

On CPU the cross-process collectives go through gloo, set before the backend starts.
"""

from __future__ import annotations

import logging
import os

import jax

from unitrain.config import check

log = logging.getLogger("unitrain")

# Environments in which jax.distributed.initialize() finds coordinator, count and id by itself.
_CLUSTER_ENV = {
    "TPU pod": lambda env: "," in env.get("TPU_WORKER_HOSTNAMES", "") or int(env.get("MEGASCALE_NUM_SLICES", "1")) > 1,
    "SLURM": lambda env: int(env.get("SLURM_NTASKS", "1")) > 1,
    "Open MPI": lambda env: int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1,
}


def detected_cluster(env=os.environ) -> str | None:
    return next((name for name, test in _CLUSTER_ENV.items() if test(env)), None)


def maybe_initialize(c) -> bool:
    """Initializes jax.distributed as the config says; True if it did. `c` maps config keys."""
    mode, cluster = c["distributed_init"], detected_cluster()
    if mode == "off" or (mode == "auto" and c["num_processes"] <= 1 and cluster is None):
        return False
    if jax.distributed.is_initialized():
        return True
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu") or not _has_accelerator_plugin():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    explicit = c["num_processes"] > 1
    jax.distributed.initialize(
        coordinator_address=c["coordinator_address"] or None,
        num_processes=c["num_processes"] if explicit else None,
        process_id=c["process_id"] if explicit else None,
    )
    log.info(
        "jax.distributed initialized (%s): process %d of %d",
        cluster or "explicit",
        jax.process_index(),
        jax.process_count(),
    )
    return True


def _has_accelerator_plugin() -> bool:
    """True when a GPU/TPU jax plugin is installed (then collectives are the accelerator's own)."""
    from importlib.metadata import distributions

    return any((d.metadata["Name"] or "").startswith(("jax-cuda", "jax_cuda", "libtpu")) for d in distributions())


@check("process_id", "num_processes")
def _process_id(c) -> str | None:
    if c["process_id"] < c["num_processes"]:
        return None
    return f"process_id ({c['process_id']}) must be below num_processes ({c['num_processes']})"


CONFIG_CHECKS = (_process_id,)
