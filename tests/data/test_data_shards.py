"""Virtual data shards: the global SFT batch and its checkpointed position do not depend on the
process count (unitrain.data.shards)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import REPO
from unitrain import checkpoint
from unitrain.checks import load_checked
from unitrain.data import sft
from unitrain.data.prompts import make_prompt_iterator
from unitrain.data.sft import make_sft_iterator
from unitrain.data.shards import local_shards, merge_states
from unitrain.data.tokenizer import load_tokenizer
from unitrain.errors import ConfigError

TOK = load_tokenizer("")
ROWS = 8  # global rows per step
FIELDS = ("inputs", "inputs_position", "inputs_segmentation", "targets", "targets_segmentation")


def make_cfg(**overrides):
    return load_checked([str(REPO / "configs/base.yml"), *(f"{k}={v}" for k, v in overrides.items())])


def qa_rows(n):
    """n distinct prompt/completion records of varied lengths; every 7th is over-long (truncated)."""
    return [
        {"prompt": f"q{i}:" + "x" * (i % 5), "completion": "y" * (1 + i % 7 + (40 if i % 7 == 0 else 0))}
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("shards") / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(64)))
    return str(path)


def cfg_for(source, jsonl, **overrides):
    path = jsonl if source == "jsonl" else "builtin"
    return make_cfg(dataset_path=path, max_target_length=32, **overrides)


def iterators(cfg, processes):
    return [make_sft_iterator(cfg, TOK, ROWS, "train", p, processes) for p in range(processes)]


def global_batch(its):
    """The global batch of one step: the processes' local batches side by side (count summed)."""
    local = [next(it) for it in its]
    out = {k: np.concatenate([b[k] for b in local]) for k in FIELDS}
    out["num_truncated"] = sum(int(b["num_truncated"]) for b in local)
    return out


def assert_same(a, b):
    assert set(a) == set(b)
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def json_round_trip(state):
    return json.loads(json.dumps(state))


@pytest.mark.parametrize("source", ["builtin", "jsonl"])
@pytest.mark.parametrize("shards", [1, 2, 4])
def test_global_batch_does_not_depend_on_process_count(jsonl, source, shards):
    cfg = cfg_for(source, jsonl, data_shards=shards)
    single = iterators(cfg, 1)
    expected = [global_batch(single) for _ in range(3)]
    assert all(b["inputs"].shape == (ROWS, 32) for b in expected)
    if source == "jsonl":
        assert sum(b["num_truncated"] for b in expected) > 0  # the count is exercised too
    for processes in (2, 4):
        its = iterators(cfg, processes)
        for want in expected:
            assert_same(global_batch(its), want)


def test_shard_rows_come_from_its_records(jsonl):
    """Shard s packs records[s::S] only, and its rows are the s-th block of the global batch."""
    records = qa_rows(64)
    cfg = cfg_for("jsonl", jsonl, data_shards=4, packing=False, num_epochs=1)
    prompt_of = {}
    for i, r in enumerate(records):
        ids = [TOK.bos_id] + TOK.encode(r["prompt"])
        prompt_of[tuple(ids)] = i
    for batch in iterators(cfg, 1)[0]:
        for row, (tokens, seg) in enumerate(zip(batch["inputs"], batch["targets_segmentation"])):
            first_loss = int(np.argmax(seg > 0))  # position predicting the first completion token
            index = prompt_of[tuple(tokens[: first_loss + 1])]
            assert index % 4 == row // (ROWS // 4)


@pytest.mark.parametrize("shards,processes", [(2, 2), (4, 2), (2, 4)])
def test_each_process_reads_only_its_shards(jsonl, monkeypatch, shards, processes):
    """Count the records each process tokenizes (its pipelines and its not-empty check)."""
    records = qa_rows(64)
    index = {r["prompt"]: i for i, r in enumerate(records)}
    seen = []
    real = sft._example_fn

    def spying(*args):
        to_example = real(*args)

        def wrapped(record):
            seen.append(index[record["prompt"]])
            return to_example(record)

        return wrapped

    monkeypatch.setattr(sft, "_example_fn", spying)
    cfg = cfg_for("jsonl", jsonl, data_shards=shards)
    for p in range(processes):
        seen.clear()
        it = make_sft_iterator(cfg, TOK, ROWS, "train", p, processes)
        for _ in range(20):  # past one epoch of every shard
            next(it)
        local, _, _ = local_shards(shards, p, processes)
        assert {i % shards for i in seen} == set(local)
        assert {i for i in range(64) if i % shards in local} == set(seen)


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_state_moves_between_process_counts(jsonl, shards):
    cfg = cfg_for("jsonl", jsonl, data_shards=shards)
    uninterrupted = iterators(cfg, 1)
    expected = [global_batch(uninterrupted) for _ in range(5)][2:]

    # Two processes run two steps; their merged state resumes one process...
    two = iterators(cfg, 2)
    for _ in range(2):
        global_batch(two)
    merged = merge_states([json_round_trip(it.get_state()) for it in two])
    assert sorted(merged["shards"], key=int) == [str(s) for s in range(shards)]
    one = iterators(cfg, 1)
    one[0].set_state(json_round_trip(merged))
    for want in expected:
        assert_same(global_batch(one), want)

    # ...and one process's state resumes two (or four) processes.
    one = iterators(cfg, 1)
    for _ in range(2):
        global_batch(one)
    state = json_round_trip(one[0].get_state())
    for processes in (2, 4):
        its = iterators(cfg, processes)
        for it in its:
            it.set_state(state)
        for want in expected:
            assert_same(global_batch(its), want)


def test_merge_rejects_disagreement_and_mismatched_shards(jsonl):
    cfg = cfg_for("jsonl", jsonl, data_shards=1)
    a, b = iterators(cfg, 1)[0], iterators(cfg, 1)[0]
    next(a)
    with pytest.raises(ValueError, match="disagree"):
        merge_states([json_round_trip(a.get_state()), json_round_trip(b.get_state())])
    other = make_sft_iterator(cfg_for("jsonl", jsonl, data_shards=2), TOK, ROWS)
    with pytest.raises(ConfigError, match="data_shards=1"):
        other.set_state(json_round_trip(a.get_state()))
    with pytest.raises(ValueError, match="lacks data shards"):
        other.set_state({"data_shards": 2, "shards": {"0": a.get_state()["shards"][0]}})


def test_invalid_shard_counts_name_data_shards(jsonl):
    with pytest.raises(ConfigError, match="data_shards=3 must be a multiple or a divisor of the process count 2"):
        make_sft_iterator(cfg_for("jsonl", jsonl, data_shards=3), TOK, 6, "train", 0, 2)
    with pytest.raises(ConfigError, match="data_shards=16 does not divide the global batch of 8 rows"):
        make_sft_iterator(cfg_for("jsonl", jsonl, data_shards=16), TOK, 8)
    with pytest.raises(ConfigError, match="data_shards"):
        make_cfg(data_shards=0)


def test_eval_split_is_sharded_too():
    cfg = make_cfg(max_target_length=32, data_shards=2)
    evals = lambda processes: [make_sft_iterator(cfg, TOK, ROWS, "eval", p, processes) for p in range(processes)]
    assert_same(global_batch(evals(4)), global_batch(evals(1)))


def tiny_state():
    return {"params": {"w": jnp.arange(8.0)}, "opt_state": {"m": jnp.zeros(8)}, "step": jnp.asarray(3, jnp.int32)}


def test_checkpointer_saves_one_json_item_and_restores(tmp_path, jsonl):
    cfg = cfg_for("jsonl", jsonl, data_shards=2)
    it = make_sft_iterator(cfg, TOK, ROWS)
    for _ in range(3):
        next(it)
    ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"), period=1, max_to_keep=2, async_save=False)
    assert ckpt.save(3, tiny_state(), it, force=True)
    ckpt.wait()
    expected = [next(it) for _ in range(3)]
    saved = json.loads((tmp_path / "ckpt" / "3" / "data" / "metadata").read_text())
    assert saved["data_shards"] == 2 and sorted(saved["shards"]) == ["0", "1"]

    fresh = make_sft_iterator(cfg, TOK, ROWS)
    step, restored = ckpt.restore(3, tiny_state(), fresh)
    assert step == int(restored["step"]) == 3 and np.array_equal(restored["params"]["w"], np.arange(8.0))
    for want in expected:
        assert_same(next(fresh), want)
    # The same checkpoint resumes two processes (each takes its shard).
    halves = [make_sft_iterator(cfg, TOK, ROWS, "train", p, 2) for p in range(2)]
    for half in halves:
        half.set_state(saved)
    for want in expected:
        assert_same(global_batch(halves), {**{k: want[k] for k in FIELDS}, "num_truncated": int(want["num_truncated"])})
    ckpt.close()


def test_checkpointer_skips_off_period_steps_and_takes_the_prompt_iterator(tmp_path):
    cfg = make_cfg(max_prompt_length=32)  # the built-in task's prompts
    it = make_prompt_iterator(cfg, TOK, 4)
    next(it)
    ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"), period=2, max_to_keep=2, async_save=True)
    assert ckpt.save(2, tiny_state(), it)
    ckpt.wait()
    expected = next(it)
    assert not ckpt.save(3, tiny_state(), it)  # off period: nothing gathered, nothing saved
    assert ckpt.latest_step() == 2
    fresh = make_prompt_iterator(cfg, TOK, 4)
    ckpt.restore(2, tiny_state(), fresh)
    assert next(fresh) == expected
    ckpt.close()
