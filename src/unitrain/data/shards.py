"""Virtual data shards: a global batch that does not depend on the number of processes.

The record stream is split into S = `data_shards` independent pipelines. Shard s reads records[s::S],
shuffles and packs them with its own seed and yields R/S rows per step (R = global rows per step).
The global batch of a step is the concatenation [shard 0 rows, shard 1 rows, ...], whatever the
process count P; process p's local batch is its contiguous part of it:

  S >= P (P divides S): process p runs shards [p*S/P, (p+1)*S/P) and concatenates their rows;
  S <  P (S divides P): the P/S processes of group s = p // (P/S) all run shard s and each keeps its
                        row slice number p % (P/S) of the shard's R/S rows.

So 1 process x 8 devices and 2 processes x 4 devices see the same global batches, and the position
of every shard can be saved by any process count and restored by any other (`merge_states`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from unitrain.errors import ConfigError, DataError


def local_shards(num_shards: int, process_index: int, process_count: int) -> tuple[range, int, int]:
    """(the shards process `process_index` runs, its part index, the number of parts of a shard's rows)."""
    s, p, n = num_shards, process_index, process_count
    if s >= n and s % n == 0:
        k = s // n
        return range(p * k, (p + 1) * k), 0, 1
    if s < n and n % s == 0:
        group = n // s
        return range(p // group, p // group + 1), p % group, group
    raise ConfigError(f"data_shards={s} must be a multiple or a divisor of the process count {n}")


def shard_seed(seed: int, shard: int) -> int:
    """The shuffle/packing seed of one shard: `seed` itself for shard 0, a hash of (seed, shard) otherwise."""
    if shard == 0:
        return int(seed)
    return int(np.random.SeedSequence([int(seed), int(shard)]).generate_state(1)[0])


class ShardedIterator(grain.DatasetIterator):
    """This process's part of the global batches drawn from its data shards.

    Each shard iterator yields dicts of numpy arrays: arrays with a leading row axis (the batch
    fields) are concatenated over the shards (or sliced to this process's part), 0-d arrays are
    per-batch counts (num_truncated). A count is summed over this process's shards; when several
    processes share one shard (S < P) only the first process of the group reports the shard's count
    (the others report 0), so a sum over processes counts every example once.

    get_state() -> {"data_shards": S, "shards": {s: state of shard s}} for the shards run here;
    set_state() accepts such a dict holding at least those shards (e.g. every shard, merged over the
    processes that saved it by `merge_states`), with int or (after JSON) str keys. The stream ends
    when any local shard ends (a finite num_epochs).
    """

    def __init__(self, shards: Mapping[int, grain.DatasetIterator], num_shards: int, part: int = 0, parts: int = 1):
        super().__init__(list(shards.values()))
        self._shards = dict(shards)
        self._num_shards, self._part, self._parts = num_shards, part, parts

    def __next__(self) -> dict:
        batches = [next(it) for it in self._shards.values()]
        out = {}
        for key in batches[0]:
            values = [np.asarray(b[key]) for b in batches]
            if values[0].ndim == 0:  # a count
                total = sum(v for v in values) if self._part == 0 else np.zeros_like(values[0])
                out[key] = np.asarray(total, values[0].dtype)
                continue
            rows = values[0] if len(values) == 1 else np.concatenate(values, axis=0)
            if self._parts > 1:
                if len(rows) % self._parts:
                    raise ValueError(f"{len(rows)} rows of a data shard do not split into {self._parts} parts")
                n = len(rows) // self._parts
                rows = rows[self._part * n : (self._part + 1) * n]
            out[key] = rows
        return out

    def get_state(self) -> dict[str, Any]:
        return {"data_shards": self._num_shards, "shards": {s: it.get_state() for s, it in self._shards.items()}}

    def set_state(self, state: Mapping[str, Any]) -> None:
        saved = state.get("data_shards") if isinstance(state, Mapping) else None
        if saved is None or "shards" not in state:
            raise ValueError(
                f"not a sharded data iterator state: {sorted(state) if isinstance(state, Mapping) else state!r}"
            )
        if int(saved) != self._num_shards:
            raise ConfigError(
                f"the checkpoint's data position was saved with data_shards={saved}, this run has "
                f"data_shards={self._num_shards}; resume with data_shards={saved}"
            )
        states = {int(s): v for s, v in state["shards"].items()}
        missing = sorted(set(self._shards) - set(states))
        if missing:
            raise ValueError(f"the data iterator state lacks data shards {missing} (it holds {sorted(states)})")
        for s, it in self._shards.items():
            it.set_state(states[s])

    def __str__(self) -> str:
        return f"ShardedIterator(shards={list(self._shards)} of {self._num_shards}, part={self._part}/{self._parts})"


def merge_states(states: Sequence[Any]) -> Any:
    """One state for every process from each process's get_state() (as decoded from JSON).

    Equal states (an iterator that is the same on every process, like the GRPO prompt stream) give
    that state; sharded states give the union of their shards. Two processes that ran the same shard
    (S < P) must agree on its state, and anything else that differs is an error: a checkpoint must
    restore exactly.
    """
    first = states[0]
    if all(s == first for s in states[1:]):
        return first
    if not all(isinstance(s, Mapping) and "shards" in s for s in states):
        raise ValueError(
            "the data iterator's state differs between processes and is not sharded; it cannot be saved as one state"
        )
    rest = {k: v for k, v in first.items() if k != "shards"}
    shards: dict[str, Any] = {}
    for state in states:
        if {k: v for k, v in state.items() if k != "shards"} != rest:
            raise ValueError("the processes' data iterators disagree on their configuration (data_shards)")
        for s, value in state["shards"].items():
            s = str(s)
            if s in shards and shards[s] != value:
                raise ValueError(f"two processes running data shard {s} disagree on its position")
            shards[s] = value
    return {**rest, "shards": dict(sorted(shards.items(), key=lambda kv: int(kv[0])))}


def sharded_iterator(
    num_shards: int, global_batch_size: int, process_index: int, process_count: int, make_shard
) -> ShardedIterator:
    """This process's rows of each global batch, drawn from `num_shards` virtual shards;
    make_shard(rows_per_shard, shard) -> a dataset of batches of that shard."""
    if global_batch_size % process_count:
        raise ConfigError(f"the global batch size {global_batch_size} does not divide among {process_count} processes")
    if global_batch_size % num_shards:
        raise ConfigError(f"data_shards={num_shards} does not divide the global batch of {global_batch_size} rows")
    local, part, parts = local_shards(num_shards, process_index, process_count)
    rows = global_batch_size // num_shards
    return ShardedIterator({s: iter(make_shard(rows, s)) for s in local}, num_shards, part, parts)


def shard_records(records, path: str, shard: int, num_shards: int):
    """(records of this shard, where: its name for error messages). Every shard keeps an equal,
    disjoint share (the few left over are skipped), so all shards see as many examples per epoch."""
    usable = len(records) - len(records) % num_shards
    records_of_shard = records[:usable][shard::num_shards]
    where = repr(path) if num_shards == 1 else f"{path!r} (data shard {shard} of data_shards={num_shards})"
    if len(records_of_shard) == 0:
        raise DataError(f"dataset {path!r} has {len(records)} records, too few for data_shards={num_shards}")
    return records_of_shard, where
