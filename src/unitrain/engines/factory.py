"""The sampler a run samples with: `sampler` picks the engine (registry.SAMPLERS), and the
config-time check that it can rank.

    colocated        the training parameters, sampled in-process (default)
    mesh             the same sampler on rollout_devices of its own, weights pushed after each update (mesh.py)
    vllm             a vLLM server (vllm.py)
    pkg.module:fn    any fn(run) -> Sampler (another mesh, an external engine)

Beside the engines, which do not import it: it imports every engine it names.
"""

from __future__ import annotations

import typing

from unitrain import plugins, registry
from unitrain.config import check
from unitrain.engines.base import RankingSampler


def _factory(cfg):
    return plugins.resolve(cfg["sampler"], registry.SAMPLERS, "sampler", "a sampler factory (run) -> Sampler")


def make_sampler(run):
    """The configured sampler for this run."""
    return _factory(run.cfg)(run)


def check_ranking(cfg, what: str) -> str | None:
    """None when the configured sampler can rank: its factory is a RankingSampler class or says it
    returns one; else why `what`, which ranks with beam search, cannot run. Nothing is built."""
    factory = _factory(cfg)
    try:
        made = factory if isinstance(factory, type) else typing.get_type_hints(factory).get("return")
    except Exception:  # an annotation that does not resolve declares nothing
        made = None
    if isinstance(made, type) and issubclass(made, RankingSampler):
        return None
    return (
        f"{what} ranks with beam search, but sampler {cfg['sampler']} is not declared a RankingSampler "
        "(beam_search, engines/base.py; its factory's return annotation); use sampler colocated or mesh"
    )


@check("sampler", "rollout_devices", "mode", "max_staleness", "max_concurrent_rollouts")
def _rollout_devices(c) -> str | None:
    """Devices set apart for rollouts serve a sampler that uses them; rollouts serve the RL modes."""
    if c["sampler"] == "mesh" and not c["rollout_devices"]:
        return "sampler mesh samples on devices of its own: set rollout_devices (and the rollout_*_parallelism sizes)"
    if c["sampler"] in ("colocated", "vllm") and c["rollout_devices"]:
        return f"rollout_devices={c['rollout_devices']} needs a sampler that runs on them: sampler: mesh (or a plugin)"
    if c["mode"] in ("sft", "dpo", "rm") and (
        c["rollout_devices"] or c["max_staleness"] or c["max_concurrent_rollouts"]
    ):
        return f"rollout_devices, max_staleness and max_concurrent_rollouts serve RL rollouts; mode={c['mode']} trains on no rollouts"
    return None


@check("rollout_meshes", "sampler", "rollout_devices")
def _rollout_meshes(c) -> str | None:
    """Several rollout meshes split rollout_devices evenly, which sampler mesh alone samples on."""
    n = c["rollout_meshes"]
    if n > 1 and c["sampler"] != "mesh":
        return f"rollout_meshes={n} splits rollout_devices into meshes of sampler mesh, not sampler {c['sampler']}"
    if c["rollout_devices"] % n:
        return f"rollout_devices ({c['rollout_devices']}) must divide into rollout_meshes={n} meshes of as many devices"
    return None


@check("rollout_quantization", "sampler", "mode", "model_source", "num_experts")
def _rollout_quantization(c) -> str | None:
    """The sampler's quantised weights: the JAX samplers quantise our dense decoder's decode weights
    (colocated.py); vLLM takes its own flags (vllm.py checks them); a plugin sampler is told nothing."""
    q, sampler = c["rollout_quantization"], c["sampler"]
    if q == "none":
        return None
    if c["mode"] in ("dpo", "rm"):
        return f"rollout_quantization={q} quantises the sampler's weights; mode={c['mode']} samples nothing"
    if sampler == "vllm":
        return None
    if sampler not in ("colocated", "mesh"):
        return f"rollout_quantization={q} serves samplers colocated, mesh and vllm, not the plugin {sampler}"
    if c["model_source"] != "unitrain" or c["num_experts"]:
        return (
            f"rollout_quantization={q} with sampler {sampler} quantises unitrain's dense decoder (model_source "
            f"unitrain, num_experts 0), not model_source {c['model_source']} with num_experts {c['num_experts']}"
        )
    return None


CONFIG_CHECKS = (_rollout_devices, _rollout_meshes, _rollout_quantization)
