"""Data sources beyond jsonl: CSV, datasets' save_to_disk folders and .arrow files give exactly what the
same records written as jsonl give, in every mode; malformed and non-UTF-8 files are named by file:line."""

import csv

import datasets  # the reference writer of save_to_disk folders
import numpy as np
import pytest

from helpers import REPO, make_cfg, write_jsonl
from unitrain import train
from unitrain.data.preference import make_preference_iterator
from unitrain.data.prompts import make_prompt_iterator
from unitrain.data.sft import make_sft_iterator
from unitrain.data.tokenizer import load_tokenizer
from unitrain.errors import DataError

TOK = load_tokenizer("")
# Text that CSV must quote: commas, quotes, a line break inside a field, non-ASCII.
TRICKY = ['say "hi", then', "two\nlines", "héllo ü", "plain"]


def write_csv(path, rows):
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


def write_saved_dataset(path, rows):
    datasets.Dataset.from_list(rows).save_to_disk(str(path), num_shards=2)  # two arrow files, in order
    return str(path)


def every_format(tmp_path, rows):
    """The same rows as jsonl (the reference), CSV, a save_to_disk folder and its arrow files by glob."""
    folder = write_saved_dataset(tmp_path / "saved", rows)
    return {
        "jsonl": write_jsonl(tmp_path / "d.jsonl", rows),
        "csv": write_csv(tmp_path / "d.csv", rows),
        "saved": folder,
        "arrow": f"{folder}/*.arrow",
    }


def batches_equal(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_sft_batches_equal_the_jsonl_batches(tmp_path):
    rows = [{"prompt": f"{TRICKY[i % 4]} {i}?", "completion": f"a{i % 7}" * (1 + i % 3)} for i in range(20)]
    batches = {
        name: [next(it) for _ in range(3)]
        for name, path in every_format(tmp_path, rows).items()
        for it in [make_sft_iterator(make_cfg(dataset_path=path, max_target_length=48), TOK, 4)]
    }
    for name in ("csv", "saved", "arrow"):
        assert all(batches_equal(a, b) for a, b in zip(batches["jsonl"], batches[name])), name


def test_grpo_prompts_equal_the_jsonl_prompts(tmp_path):
    rows = [{"question": f"{TRICKY[i % 4]} {i}+{i}=", "answer": str(2 * i)} for i in range(12)]
    cfg = dict(prompt_key="question", label_key="answer", max_prompt_length=64, num_epochs=1)
    got = {
        name: [p for b in make_prompt_iterator(make_cfg(dataset_path=path, **cfg), TOK, 4) for p in b["prompts"]]
        for name, path in every_format(tmp_path, rows).items()
    }
    assert len(got["jsonl"]) == 12
    assert got["csv"] == got["saved"] == got["arrow"] == got["jsonl"]


def test_dpo_pairs_equal_the_jsonl_pairs(tmp_path):
    rows = [{"prompt": f"{TRICKY[i % 4]} {i}", "chosen": f" yes{i}", "rejected": f" no, {i}"} for i in range(8)]
    got = {
        name: next(make_preference_iterator(make_cfg(mode="dpo", dataset_path=path, max_target_length=32), TOK, 4))
        for name, path in every_format(tmp_path, rows).items()
    }
    for name in ("csv", "saved", "arrow"):
        assert batches_equal(got["jsonl"], got[name]), name


@pytest.mark.parametrize(
    "content, message",
    [
        ('prompt,completion\na,b\n"c"d,e\n', r"bad.csv:3: not valid CSV \(',' expected after '\"'\)"),
        ('prompt,completion\na,b\n"x\ny",z\nonly\n', "bad.csv:5: the row has 1 field\\(s\\), the header 2"),
        ("prompt,prompt\na,b\n", "bad.csv:1: the header names a column twice"),
        ('prompt,completion\na,b\n"never closed,z\n', "bad.csv:3: not valid CSV"),
    ],
)
def test_malformed_csv_names_file_and_line(tmp_path, content, message):
    (tmp_path / "bad.csv").write_text(content)
    with pytest.raises(DataError, match=message):
        make_sft_iterator(make_cfg(dataset_path=str(tmp_path / "bad.csv")), TOK, 2)


def test_folders_that_are_not_one_dataset(tmp_path):
    rows = [{"prompt": "a", "completion": "b"}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(
        DataError, match=f"is a datasets DatasetDict; name one of its splits' folders \\({tmp_path}/dd/train\\)"
    ):
        make_sft_iterator(make_cfg(dataset_path=str(tmp_path / "dd")), TOK, 2)
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="not one made by datasets' save_to_disk"):
        make_sft_iterator(make_cfg(dataset_path=str(tmp_path / "plain")), TOK, 2)
    # The split folder itself is a dataset.
    assert next(make_sft_iterator(make_cfg(dataset_path=str(tmp_path / "dd" / "train")), TOK, 2))


@pytest.mark.parametrize(
    "name, content",
    [
        ("latin1.jsonl", '{"prompt": "a", "completion": "b"}\n{"prompt": "caf\xe9", "completion": "b"}\n'),
        ("latin1.csv", "prompt,completion\ncaf\xe9,b\na,b\n"),
    ],
)
def test_non_utf8_file_is_one_line_and_exit_2(tmp_path, capsys, name, content):
    path = tmp_path / name
    path.write_bytes(content.encode("latin-1"))
    argv = [
        str(REPO / "configs" / "base.yml"),
        f"base_output_directory={tmp_path}",
        f"dataset_path={path}",
        "max_target_length=32",
        "per_device_batch_size=1",
        "eval_interval=0",
        "peak_flops_per_device=1e12",
    ]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"unitrain: {path}:2: not UTF-8 text (byte 0xe9); re-encode the file as UTF-8\n"
