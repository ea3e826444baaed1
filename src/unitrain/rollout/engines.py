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
from unitrain.rollout.base import RankingSampler


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
        "(beam_search, rollout/base.py; its factory's return annotation); use sampler colocated or mesh"
    )
