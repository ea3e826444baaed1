"""Rollouts: the sampler interface (base.py: Sampler, SamplingParams, Completions), the colocated
JAX sampler (colocated.py), and the one path from prompts to scored, filtered groups that GRPO and
the evaluations share (groups.py). This file holds the factory; the built-in names are in
unitrain.registry.
`sampler` picks the engine:

    colocated        the training parameters, sampled in-process (default)
    mesh             the same sampler on rollout_devices of its own, weights pushed after each update (mesh.py)
    pkg.module:fn    any fn(run) -> Sampler (another mesh, an external engine)
"""

from __future__ import annotations

from unitrain import plugins, registry


def make_sampler(run):
    """The configured sampler for this run."""
    return plugins.resolve(run.cfg.sampler, registry.SAMPLERS, "sampler", "a sampler factory (run) -> Sampler")(run)
