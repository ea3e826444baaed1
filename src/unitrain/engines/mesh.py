"""`sampler: mesh`: the JAX sampler on devices of its own (`rollout_devices`), split into
`rollout_meshes` meshes, each laid out by the rollout_*_parallelism sizes and holding its own copy
of the weights, pushed from the trainer's mesh by every update_weights. While the trainer updates on
its devices, rollouts dispatched ahead (`max_staleness`, rollout/executor.py) sample on these.

The push copies every parameter into each rollout mesh's shardings (the same logical axis rules,
other meshes). In one process that is a device-to-device copy. Across processes JAX cannot copy
between disjoint device sets (outside TPU's runtime), so each parameter is gathered to every
process's host, one at a time, and each process places its own shards on every mesh.

A call's rows are spread over the meshes (`spread`: as many rows each, their token budgets
balanced) and every share is dispatched before any is waited on: JAX dispatches asynchronously, so
the meshes sample at once while the host places the next share. Each row draws the noise of its
index in the whole call, so the meshes sample the tokens one mesh of them all would. Beam search
spreads its prompts the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from unitrain import sharding
from unitrain.engines import beam
from unitrain.engines.base import Completions, SamplingParams
from unitrain.engines.colocated import ColocatedSampler, Pending
from unitrain.errors import ConfigError

log = logging.getLogger("unitrain")


class RolloutMeshSampler:
    """The colocated sampler's programs on each rollout mesh; `push_seconds` is the last push's time."""

    def __init__(self, model, *, pad_id: int, meshes, rules, **decode):
        self.samplers = [ColocatedSampler(model, pad_id=pad_id, mesh=mesh, rules=rules, **decode) for mesh in meshes]
        try:  # the rollout mesh may split a dimension the trainer's did not
            self.shardings = [
                nnx.to_pure_dict(sharding.state_shardings(nnx.state(model), s.mesh, s.rules)) for s in self.samplers
            ]
        except ValueError as e:
            raise ConfigError(f"the rollout mesh: {e}") from None
        for s in self.samplers:
            s.params = None  # the trainer's arrays are not on these meshes: the first push places them
        self.version, self.push_seconds = 0, 0.0
        self.mesh_tokens = np.zeros(len(meshes), np.int64)  # tokens each mesh sampled since metrics()

    def update_weights(self, params, version: int) -> None:
        """Copies the trainer's parameters to every rollout mesh, waiting for the copies (they are
        timed; the trainer's arrays may be donated right after)."""
        jax.block_until_ready(params)  # the update that made them is the trainer's time, not the push's
        start = time.perf_counter()
        pushed = jax.block_until_ready(push(params, self.shardings))
        self.push_seconds = time.perf_counter() - start
        for sampler, copy in zip(self.samplers, pushed):
            sampler.update_weights(copy, version)
        self.version = version

    def release(self) -> None:
        for s in self.samplers:
            s.release()

    def metrics(self) -> dict[str, float]:
        """With several meshes, the tokens the busiest and the idlest sampled since the last call."""
        tokens = self.mesh_tokens.copy()
        self.mesh_tokens[:] = 0  # in place: calls in flight add to it as they finish
        if len(tokens) == 1:
            return {}
        return {"rollout_mesh_tokens_max": float(tokens.max()), "rollout_mesh_tokens_min": float(tokens.min())}

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, key: jax.Array) -> Completions:
        return self.submit(prompt_ids, sampling, key).result()

    def submit(self, prompt_ids: list[list[int]], sampling: SamplingParams, key: jax.Array) -> Spread:
        """generate, dispatched on every mesh (its share of the rows); `.result()` waits for them all."""
        shares = spread([sampling.budget(r) for r in range(len(prompt_ids))], len(self.samplers))
        # Fewer rows than meshes leave some idle; the first mesh takes even an empty call (and refuses it).
        used = [m for m, rows in enumerate(shares) if len(rows) or m == 0]
        pending = []
        for m in used:
            rows = shares[m]
            budgets = tuple(sampling.row_budgets[r] for r in rows) if sampling.row_budgets else ()
            share = dataclasses.replace(sampling, row_budgets=budgets)
            pending.append(self.samplers[m].submit([prompt_ids[r] for r in rows], share, key, rows=rows))
        return Spread(pending, used, [shares[m] for m in used], self.mesh_tokens)

    def beam_search(self, prompt_ids: list[list[int]], beams: beam.BeamParams, key: jax.Array) -> beam.Ranked:
        """The colocated beam search of each mesh's share of the prompts (contiguous shares; a search
        returns its results, so the meshes search in turn). W-way sampling draws a row's noise by its
        index in its own search: meshes but the first fold their index into the key, so that no two
        shares draw alike (the first draws as one mesh would)."""
        shares = spread([1] * len(prompt_ids), len(self.samplers))
        parts = [
            s.beam_search([prompt_ids[r] for r in rows], beams, key if m == 0 else jax.random.fold_in(key, m))
            for m, (s, rows) in enumerate(zip(self.samplers, shares))
            if len(rows) or m == 0  # as in submit: the first mesh takes even an empty call (and refuses it)
        ]
        stacked = lambda name: np.concatenate([getattr(p, name) for p in parts])  # noqa: E731
        return beam.Ranked(*map(stacked, ("tokens", "logprobs", "lengths", "scores")), parts[0].version)


class Spread:
    """A call dispatched on the meshes: each share's Pending, its mesh and its rows in the call;
    `mesh_tokens` counts the tokens each mesh sampled."""

    def __init__(self, pending: list[Pending], meshes: list[int], shares: list[np.ndarray], mesh_tokens: np.ndarray):
        self.pending, self.meshes, self.shares, self.mesh_tokens = pending, meshes, shares, mesh_tokens

    def result(self) -> Completions:
        parts = [p.result() for p in self.pending]
        for m, part in zip(self.meshes, parts):
            self.mesh_tokens[m] += part.lengths.sum()
        return joined(parts, self.shares)


def joined(parts: list[Completions], shares: list[np.ndarray]) -> Completions:
    """The call's Completions from its shares' (row i of the call: its place in its share)."""
    order = np.argsort(np.concatenate(shares))

    def rows(name):
        arrays = [getattr(p, name) for p in parts]
        if arrays[0] is None:
            return None
        if name == "prompt_routes":  # each share's prompt block is its own: left-padded to the widest
            width = max(a.shape[1] for a in arrays)
            pad = lambda a: [(0, 0), (width - a.shape[1], 0)] + [(0, 0)] * (a.ndim - 2)  # noqa: E731
            arrays = [np.pad(a, pad(a), constant_values=-1) for a in arrays]
        return np.concatenate(arrays)[order]

    fields = ("tokens", "mask", "logprobs", "lengths")
    return Completions(*map(rows, fields), parts[0].version, rows("routes"), rows("prompt_routes"))


def spread(budgets: list[int], meshes: int) -> list[np.ndarray]:
    """The rows of a call each mesh samples, each in call order: as many rows each (the first meshes
    one more where they do not divide), in runs of the call's order (a group's copies of a prompt
    stay together, prefilled once) but for the rows swapped to balance the token budgets: while a row
    of the most loaded mesh swapped for a shorter one of the least loaded lowers the larger of their
    loads, the swap that evens them best (each lowers the loads' sum of squares: it ends)."""
    budgets = np.asarray(budgets, np.int64)
    sizes = [len(budgets) // meshes + (m < len(budgets) % meshes) for m in range(meshes)]
    bounds = np.cumsum([0, *sizes])
    shares = [np.arange(a, b) for a, b in zip(bounds, bounds[1:])]
    while meshes > 1:
        loads = [budgets[s].sum() for s in shares]
        hi, lo = int(np.argmax(loads)), int(np.argmin(loads))
        gap = loads[hi] - loads[lo]
        moved = budgets[shares[hi]][:, None] - budgets[shares[lo]][None, :]  # what a swap moves from hi to lo
        worth = np.where((moved > 0) & (moved < gap), np.abs(gap - 2 * moved), np.inf)
        if not len(shares[lo]) or not np.isfinite(worth.min()):
            break
        i, j = np.unravel_index(np.argmin(worth), worth.shape)
        shares[hi][i], shares[lo][j] = shares[lo][j], shares[hi][i]
    return [np.sort(s).astype(np.int32) for s in shares]


def push(params, targets: list) -> list:
    """The parameters in each of `targets` (shardings on other devices than theirs)."""
    if jax.process_count() == 1:
        return [jax.device_put(params, t) for t in targets]
    return through_hosts(params, targets)


def through_hosts(params, targets: list) -> list:
    """The parameters in each of `targets` by way of every process's host memory: the multi-process
    push, each parameter gathered once for all the targets."""
    leaves, treedef = jax.tree.flatten(params)
    per_target = [jax.tree.leaves(t) for t in targets]
    copies = [[] for _ in targets]
    for n, x in enumerate(leaves):
        whole = multihost_utils.process_allgather(x, tiled=True)
        for copy, shardings in zip(copies, per_target):
            copy.append(jax.make_array_from_callback(x.shape, shardings[n], lambda index: whole[index]))
    return [treedef.unflatten(c) for c in copies]


def from_run(run) -> RolloutMeshSampler:
    """The sampler factory of `sampler: mesh`."""
    meshes = run.rollout_meshes
    log.info(
        "rollouts on %d mesh(es) of their own, each %s over %d devices; the trainer's: %s over %d",
        len(meshes),
        dict(meshes[0].shape),
        meshes[0].size,
        dict(run.mesh.shape),
        run.mesh.size,
    )
    return RolloutMeshSampler(
        run.model,
        pad_id=run.tokenizer.pad_id,
        meshes=meshes,
        rules=run.rules,
        cache_phases=run.cfg.rollout_cache_phases,
        compaction=run.cfg.rollout_compaction,
        compaction_min_tokens=run.cfg.rollout_compaction_min_tokens,
        quantization=run.cfg.rollout_quantization,
    )
