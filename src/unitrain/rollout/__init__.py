"""Rollouts: the sampler interface (base.py: Sampler, SamplingParams, Completions), the colocated
JAX sampler (colocated.py), and the one path from prompts to scored, filtered groups that GRPO and
the evaluations share (groups.py). This file holds only the registries (config validation reads
them without importing JAX) and the factory.
`sampler` picks the engine:

    colocated        the training parameters, sampled in-process (default)
    mesh             the same sampler on rollout_devices of its own, weights pushed after each update (mesh.py)
    pkg.module:fn    any fn(run) -> Sampler (another mesh, an external engine)
"""

from __future__ import annotations

# Short names of the built-in samplers and dynamic-sampling filters ("module:symbol", imported
# only when chosen).
SAMPLERS = {"colocated": "unitrain.rollout.colocated:from_run", "mesh": "unitrain.rollout.mesh:from_run"}
FILTERS = {"nonzero_std": "unitrain.rollout.groups:nonzero_std"}


def make_sampler(run):
    """The configured sampler for this run."""
    from unitrain import plugins

    return plugins.resolve(run.cfg.sampler, SAMPLERS, "sampler", "a sampler factory (run) -> Sampler")(run)
