"""The SFT data path: packing layout against a plain-Python reference, order, shards, checkpoints,
file formats, error messages and the three tokenizer sources."""

import json

import numpy as np
import pytest

from helpers import REPO, make_cfg, write_jsonl
from unitrain.data.builtin import builtin_problem, problem_split
from unitrain.data.sft import BATCH_FIELDS, make_sft_iterator
from unitrain.data.tokenizer import load_tokenizer
from unitrain.errors import ConfigError, DataError

SHARED_DATA = REPO.parent / "shared" / "data"
TOK = load_tokenizer("")  # built-in character tokenizer: <pad>=0, <bos>, <eos>


def qa_rows(n, long_every=0):
    """n prompt/completion records of varied lengths; every `long_every`-th has a long completion."""
    return [
        {
            "prompt": f"q{i}:" + "x" * (i % 5),
            "completion": "y" * (1 + i % 7 + (40 if long_every and i % long_every == 0 else 0)),
        }
        for i in range(n)
    ]


def segments(batch):
    """Yield (row, segment id, slice) for every packed example in a batch."""
    for r, seg in enumerate(batch["inputs_segmentation"]):
        for s in range(1, seg.max() + 1):
            idx = np.nonzero(seg == s)[0]
            yield r, s, slice(idx[0], idx[-1] + 1)


def reference(prompt, completion, tok=TOK):
    """Plain-Python construction of one example: (inputs, targets, loss mask)."""
    p = [tok.bos_id] + tok.encode(prompt)
    toks = p + tok.encode(completion) + [tok.eos_id]
    n = len(toks)
    targets = toks[1:] + [tok.pad_id]
    loss = [1 if len(p) <= i + 1 < n else 0 for i in range(n)]
    return toks, targets, loss


def take(it, n):
    return [next(it) for _ in range(n)]


def all_batches(it):
    return list(it)


@pytest.mark.parametrize("packing", [True, False])
def test_layout_matches_plain_python_reference(tmp_path, packing):
    rows = qa_rows(24)
    cfg = make_cfg(
        dataset_path=write_jsonl(tmp_path / "d.jsonl", rows),
        max_target_length=32,
        packing=packing,
        num_epochs=1,
        shuffle=False,
    )
    batches = all_batches(make_sft_iterator(cfg, TOK, global_batch_size=4))
    expected = {tuple(reference(r["prompt"], r["completion"])[0]): r for r in rows}
    seen = []
    for b in batches:
        assert set(b) == {*BATCH_FIELDS, "num_truncated"}
        assert all(b[k].shape == (4, 32) and b[k].dtype == np.int32 for k in BATCH_FIELDS)
        seg = b["inputs_segmentation"]
        for r, s, sl in segments(b):
            seen.append(tuple(b["inputs"][r, sl]))
            inputs, targets, loss = reference(**expected[tuple(b["inputs"][r, sl])])
            assert b["inputs_position"][r, sl].tolist() == list(range(len(inputs)))
            assert b["targets"][r, sl].tolist() == targets
            assert (b["targets_segmentation"][r, sl] == s * np.array(loss)).all()
            assert b["targets"][r, sl][np.array(loss) == 1][-1] == TOK.eos_id  # the EOS carries loss
        # Segments are numbered 1, 2, ... left to right, padding is 0 and carries no loss.
        for row in seg:
            used = row[row > 0]
            assert (np.diff(used) >= 0).all() and set(used) == set(range(1, used.max() + 1))
            assert not row[len(used) :].any()
        assert not b["targets_segmentation"][seg == 0].any()
        if not packing:
            assert seg.max() == 1
    # Every record at most once; only the last, partly filled batch of rows may be left out.
    assert len(set(seen)) == len(seen)
    assert len(seen) == 24 if not packing else len(seen) > 12


def test_same_seed_same_batches_and_epochs_reshuffle(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", qa_rows(16))
    first = lambda seed: take(
        make_sft_iterator(make_cfg(dataset_path=path, seed=seed, packing=False, max_target_length=32), TOK, 16), 2
    )
    a, b, c = first(0), first(0), first(1)
    assert all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, b))
    assert not np.array_equal(a[0]["inputs"], c[0]["inputs"])
    assert not np.array_equal(a[0]["inputs"], a[1]["inputs"])  # epoch 2 has another order
    assert sorted(map(tuple, a[0]["inputs"])) == sorted(map(tuple, a[1]["inputs"]))  # same records


def test_process_shards_are_disjoint_and_cover(tmp_path):
    cfg = make_cfg(
        dataset_path=write_jsonl(tmp_path / "d.jsonl", qa_rows(20)), packing=False, num_epochs=1, max_target_length=32
    )
    shards = [
        {tuple(row) for b in make_sft_iterator(cfg, TOK, 2, "train", p, 2) for row in b["inputs"]} for p in (0, 1)
    ]
    assert len(shards[0]) == len(shards[1]) == 10 and not shards[0] & shards[1]
    everything = {tuple(np.pad(reference(**r)[0], (0, 32 - len(reference(**r)[0])))) for r in qa_rows(20)}
    assert shards[0] | shards[1] == everything


def test_state_restore_continues_exactly(tmp_path):
    cfg = make_cfg(dataset_path=write_jsonl(tmp_path / "d.jsonl", qa_rows(30)), max_target_length=24)
    it = make_sft_iterator(cfg, TOK, 4)
    take(it, 5)
    state = json.loads(json.dumps(it.get_state()))  # it must survive JSON, as grain's orbax handler writes it
    expected = take(it, 6)
    resumed = make_sft_iterator(cfg, TOK, 4)
    resumed.set_state(state)
    for a, b in zip(expected, take(resumed, 6)):
        assert all(np.array_equal(a[k], b[k]) for k in a)


def test_parquet_and_glob_of_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = qa_rows(8)
    pq.write_table(pa.Table.from_pylist(rows[:4]), tmp_path / "a.parquet")
    pq.write_table(pa.Table.from_pylist(rows[4:]), tmp_path / "b.parquet")
    cfg = make_cfg(dataset_path=str(tmp_path / "*.parquet"), packing=False, num_epochs=1, max_target_length=32)
    got = {tuple(row) for b in make_sft_iterator(cfg, TOK, 2) for row in b["inputs"]}
    assert len(got) == 8


def test_gsm8k_real_file():
    gsm8k = SHARED_DATA / "gsm8k" / "train.jsonl"
    if not gsm8k.exists():
        pytest.skip("../shared/data is not present")
    cfg = make_cfg(dataset_path=str(gsm8k), prompt_key="question", completion_key="answer", max_target_length=512)
    for b in take(make_sft_iterator(cfg, TOK, 8), 3):
        assert b["inputs"].shape == (8, 512) and b["targets_segmentation"].sum() > 0
        assert (b["inputs_segmentation"] > 0).mean() > 0.5  # packing fills most of each row


def test_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a", \n')
    with pytest.raises(DataError, match=f"{bad}:2: not valid JSON"):
        make_sft_iterator(make_cfg(dataset_path=str(bad)), TOK, 2)
    wrong_keys = write_jsonl(tmp_path / "keys.jsonl", [{"question": "a", "answer": "b"}])
    with pytest.raises(DataError, match=r"keys.jsonl:1: record has neither 'prompt'\+'completion' nor 'messages'"):
        make_sft_iterator(make_cfg(dataset_path=wrong_keys), TOK, 2)
    with pytest.raises(DataError, match="does not exist"):
        make_sft_iterator(make_cfg(dataset_path=str(tmp_path / "missing.jsonl")), TOK, 2)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="holds no records"):
        make_sft_iterator(make_cfg(dataset_path=str(tmp_path / "empty.jsonl")), TOK, 2)
    long_only = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "p", "completion": "c" * 50}] * 3)
    with pytest.raises(DataError, match="no example of .* fits in max_target_length=16"):
        make_sft_iterator(make_cfg(dataset_path=long_only, truncation="drop", max_target_length=16), TOK, 2)
    with pytest.raises(ConfigError, match="too short for the built-in task"):
        make_sft_iterator(make_cfg(max_target_length=8), TOK, 2)


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_over_long_examples_are_counted(tmp_path, policy):
    rows = qa_rows(40, long_every=4)  # 10 records of 50+ tokens, none at the end of the stream
    cfg = make_cfg(
        dataset_path=write_jsonl(tmp_path / "d.jsonl", rows),
        max_target_length=32,
        truncation=policy,
        num_epochs=1,
        packing=False,
        shuffle=False,
    )
    batches = all_batches(make_sft_iterator(cfg, TOK, 2))
    assert sum(int(b["num_truncated"]) for b in batches) == 10
    rows_seen = [row for b in batches for row in b["inputs_segmentation"]]
    assert len(rows_seen) == (40 if policy == "truncate" else 30)
    full = [b for b in batches if b["inputs_segmentation"][:, -1].any()]  # truncated rows fill T
    assert len(full) > 0 if policy == "truncate" else not full


def test_builtin_task_splits():
    train = {builtin_problem(i, "train", 2, "+-*")[0] for i in range(300)}
    evals = {builtin_problem(i, "eval", 2, "+-*")[0] for i in range(300)}
    assert not train & evals and {problem_split(p) for p in evals} == {"eval"}
    for prompt, answer in (builtin_problem(i, "eval", 3, "+-*") for i in range(50)):
        assert str(eval(prompt[:-1])) == answer  # noqa: S307 - arithmetic on generated digits only
    b = next(make_sft_iterator(make_cfg(max_target_length=32), TOK, 4, split="eval"))
    text = TOK.decode(b["inputs"][0], skip_special_tokens=True)
    assert "=" in text


def test_builtin_task_ops_draw_only_those_operators():
    for ops in ("+", "-*", "+-"):
        problems = [builtin_problem(i, "train", 2, ops) for i in range(200)]
        used = {next(c for c in prompt[1:] if c in "+-*") for prompt, _ in problems}
        assert used == set(ops)
        assert all(str(eval(prompt[:-1])) == answer for prompt, answer in problems)  # noqa: S307
    b = next(make_sft_iterator(make_cfg(max_target_length=32, builtin_task_ops="+"), TOK, 8))
    texts = [TOK.decode(row, skip_special_tokens=True) for row in b["inputs"]]
    assert all("+" in t and "*" not in t for t in texts if "=" in t)


@pytest.mark.parametrize("value", ["", "+/", "++", "x"])
def test_builtin_task_ops_refuses_other_operators(value):
    with pytest.raises(ConfigError, match="builtin_task_ops"):
        make_cfg(builtin_task_ops=value)


def test_synthetic_rows_are_full():
    b = next(make_sft_iterator(make_cfg(dataset_path="synthetic", max_target_length=16), TOK, 4))
    assert (b["inputs_segmentation"] == 1).all() and b["targets_segmentation"][:, :-1].all()
    assert b["inputs"].max() < TOK.vocab_size


def test_sentencepiece_tokenizer(tmp_path):
    import sentencepiece as spm

    lines = [f"the number {i} plus {i + 1} is {2 * i + 1}" for i in range(200)]
    (tmp_path / "corpus.txt").write_text("\n".join(lines))
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "corpus.txt"),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=60,
        model_type="bpe",
        minloglevel=2,
    )
    tok = load_tokenizer(str(tmp_path / "sp.model"))
    assert tok.decode(tok.encode("the number 7 is 15")) == "the number 7 is 15"
    assert tok.bos_id is not None and tok.eos_id is not None and tok.vocab_size == 60
    rows = [{"prompt": f"the number {i}", "completion": f" is {i}"} for i in range(8)]
    cfg = make_cfg(dataset_path=write_jsonl(tmp_path / "d.jsonl", rows), tokenizer_path=str(tmp_path / "sp.model"))
    b = next(make_sft_iterator(cfg, tok, 2))
    assert b["inputs"][0, 0] == tok.bos_id and (b["targets"][b["targets_segmentation"] > 0] == tok.eos_id).any()


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_hf_tokenizer(path, chat_template):
    from unitrain.data.tokenizer import _builtin_hf_tokenizer

    hf = _builtin_hf_tokenizer()
    hf.chat_template = chat_template
    hf.save_pretrained(path)
    return str(path)


def test_hf_tokenizer_dir_with_chat_template(tmp_path):
    tok = load_tokenizer(save_hf_tokenizer(tmp_path / "tok", CHAT_TEMPLATE))
    convo = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    prompt, completion = tok.apply_chat_template(convo)
    assert prompt.endswith("<|user|>3+3?<eos><|assistant|>") and completion == "6<eos>"
    cfg = make_cfg(
        dataset_path=write_jsonl(tmp_path / "chat.jsonl", [{"messages": convo}] * 4),
        tokenizer_path=str(tmp_path / "tok"),
        max_target_length=96,
        packing=False,
        chat_loss_on="last_assistant",
    )
    b = next(make_sft_iterator(cfg, tok, 2))
    learned = b["targets"][0][b["targets_segmentation"][0] > 0]
    assert learned.tolist() == tok.encode("6<eos>")  # only the last assistant turn, its end marker included


def test_messages_without_chat_template_is_a_config_error(tmp_path):
    tok = load_tokenizer(save_hf_tokenizer(tmp_path / "tok", None))
    chat = write_jsonl(
        tmp_path / "chat.jsonl",
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}],
    )
    with pytest.raises(ConfigError, match="tokenizer_path=.* has no chat template"):
        make_sft_iterator(make_cfg(dataset_path=chat, tokenizer_path=str(tmp_path / "tok")), tok, 2)
    with pytest.raises(ConfigError, match="tokenizer_path='nowhere'"):
        load_tokenizer("nowhere")
