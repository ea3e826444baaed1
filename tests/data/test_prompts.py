"""The GRPO prompt stream: sources (built-in task, GSM8K files), rendering (BOS, chat template),
order, shards, checkpoints, over-long prompts and the fixed eval prompts."""

import json
import re

import pytest

from helpers import REPO, make_cfg, write_jsonl
from unitrain.data.builtin import builtin_problem, problem_split
from unitrain.data.prompts import Prompt, eval_prompts, make_prompt_iterator
from unitrain.data.tokenizer import load_tokenizer
from unitrain.errors import ConfigError, DataError

GSM8K_TRAIN = REPO.parent / "shared/data/gsm8k/train.jsonl"
TOK = load_tokenizer("")  # built-in character tokenizer: <pad>=0, <bos>, <eos>


def qa_rows(n):
    return [{"prompt": f"q{i}:" + "x" * (i % 5), "answer": f"a{i}"} for i in range(n)]


def take(it, n):
    return [next(it) for _ in range(n)]


def texts(batches):
    return [p.text for b in batches for p in b["prompts"]]


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    """tokenizer dir made by tools/make_tiny_model.py's build_tokenizer (byte-level BPE, ChatML
    template); with_template=False saves the same tokenizer without a chat template."""
    from make_tiny_model import build_tokenizer

    made = {}

    def get(with_template: bool = True):
        if with_template not in made:
            hf = build_tokenizer(512, ["How many clips did Natalia sell? #### 72", "Be brief. 0123456789"])
            if not with_template:
                hf.chat_template = None
            made[with_template] = tmp_path_factory.mktemp("tok")
            hf.save_pretrained(made[with_template])
        return str(made[with_template])

    return get


@pytest.mark.skipif(not GSM8K_TRAIN.is_file(), reason="../shared/data/gsm8k is absent")
def test_gsm8k_prompts_decode_to_questions_with_gold_answers(hf_tokenizer_dir):
    tok = load_tokenizer(hf_tokenizer_dir())
    rows = [json.loads(line) for line in GSM8K_TRAIN.read_text().splitlines() if line.strip()]
    answers = {r["question"]: r["answer"] for r in rows}
    cfg = make_cfg(dataset_path=GSM8K_TRAIN, prompt_key="question", label_key="answer", max_prompt_length=4096)
    batches = take(make_prompt_iterator(cfg, tok, 8), 3)
    for b in batches:
        assert len(b["prompts"]) == 8 and b["num_dropped"] == 0
        for p in b["prompts"]:
            assert isinstance(p, Prompt) and all(isinstance(i, int) for i in p.ids)
            assert tok.decode(p.ids) == p.text and p.label == answers[p.text]
            assert re.search(r"\n#### -?[\d,.]+$", p.label)


def test_builtin_prompts_and_labels():
    cfg = make_cfg()
    for b in take(make_prompt_iterator(cfg, TOK, 16), 4):
        assert len(b["prompts"]) == 16 and b["num_dropped"] == 0
        for p in b["prompts"]:
            assert re.fullmatch(r"\d+[-+*]\d+=", p.text) and problem_split(p.text) == "train"
            assert p.label == str(eval(p.text[:-1]))
            assert list(p.ids) == [TOK.bos_id, *TOK.encode(p.text)]


def test_order_is_deterministic_and_reshuffled_each_epoch(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", qa_rows(12))
    cfg = make_cfg(dataset_path=path, num_epochs=2)
    a = list(make_prompt_iterator(cfg, TOK, 12))
    b = list(make_prompt_iterator(cfg, TOK, 12))
    assert len(a) == 2 and a == b  # Prompt is a frozen dataclass: equality is by value
    assert texts(a[:1]) != texts(a[1:]) and sorted(texts(a[:1])) == sorted(texts(a[1:]))
    other = list(make_prompt_iterator(make_cfg(dataset_path=path, num_epochs=2, seed=1), TOK, 12))
    assert texts(other) != texts(a)
    unshuffled = list(make_prompt_iterator(make_cfg(dataset_path=path, num_epochs=1, shuffle=False), TOK, 4))
    assert texts(unshuffled) == [r["prompt"] for r in qa_rows(12)]
    builtin = make_cfg()
    assert take(make_prompt_iterator(builtin, TOK, 8), 3) == take(make_prompt_iterator(builtin, TOK, 8), 3)


def test_process_shards_are_disjoint_and_cover(tmp_path):
    cfg = make_cfg(dataset_path=write_jsonl(tmp_path / "d.jsonl", qa_rows(20)), num_epochs=1)
    shards = [texts(make_prompt_iterator(cfg, TOK, 4, "train", p, 2)) for p in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == 10 and not set(shards[0]) & set(shards[1])
    assert set(shards[0]) | set(shards[1]) == {r["prompt"] for r in qa_rows(20)}
    first = [next(make_prompt_iterator(make_cfg(), TOK, 8, "train", p, 2))["prompts"] for p in (0, 1)]
    assert len(first[0]) == len(first[1]) == 4 and not {p.text for p in first[0]} & {p.text for p in first[1]}
    with pytest.raises(ConfigError, match="divide among 2 processes"):
        make_prompt_iterator(cfg, TOK, 3, "train", 0, 2)


def test_state_restore_continues_exactly(tmp_path):
    cfg = make_cfg(dataset_path=write_jsonl(tmp_path / "d.jsonl", qa_rows(30)))
    it = make_prompt_iterator(cfg, TOK, 4)
    take(it, 9)  # crosses the first epoch boundary (30 records, 4 per batch)
    state = json.loads(json.dumps(it.get_state()))  # it must survive JSON, as grain's orbax handler writes it
    expected = take(it, 6)
    resumed = make_prompt_iterator(cfg, TOK, 4)
    resumed.set_state(state)
    assert take(resumed, 6) == expected


def test_chat_template_renders_system_and_user_turns(tmp_path, hf_tokenizer_dir):
    tok = load_tokenizer(hf_tokenizer_dir())
    cfg = make_cfg(
        dataset_path=write_jsonl(tmp_path / "d.jsonl", qa_rows(6)),
        chat_template=True,
        system_prompt="Be brief.",
        shuffle=False,
        num_epochs=1,
    )
    prompts = [p for b in make_prompt_iterator(cfg, tok, 2) for p in b["prompts"]]
    assert [p.text for p in prompts] == [r["prompt"] for r in qa_rows(6)]  # the raw text, for the reward
    for p in prompts:
        rendered = (
            f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{p.text}<|im_end|>\n<|im_start|>assistant\n"
        )
        assert list(p.ids) == tok.encode(rendered)
        assert tok.decode(p.ids, skip_special_tokens=False) == rendered
    no_system = eval_prompts(cfg.replace(system_prompt="", eval_dataset_path=cfg.dataset_path), tok, 1)[0]
    assert (
        tok.decode(no_system.ids, skip_special_tokens=False)
        == "<|im_start|>user\nq0:<|im_end|>\n<|im_start|>assistant\n"
    )


def test_missing_chat_template_and_stray_system_prompt_are_config_errors(tmp_path, hf_tokenizer_dir):
    path = write_jsonl(tmp_path / "d.jsonl", qa_rows(4))
    plain = load_tokenizer(hf_tokenizer_dir(with_template=False))
    with pytest.raises(ConfigError, match=re.escape(f"tokenizer_path={plain.path!r} has no chat template")):
        make_prompt_iterator(make_cfg(dataset_path=path, chat_template=True), plain, 2)
    with pytest.raises(ConfigError, match="system_prompt is set but chat_template is false"):
        make_prompt_iterator(make_cfg(dataset_path=path, system_prompt="Be brief."), TOK, 2)


def test_overlong_prompts_are_dropped_and_counted(tmp_path):
    rows = [{"prompt": "x" * (12 if i % 3 == 1 else 5), "answer": str(i)} for i in range(12)]  # 4 too long
    cfg = make_cfg(
        dataset_path=write_jsonl(tmp_path / "d.jsonl", rows), max_prompt_length=10, shuffle=False, num_epochs=1
    )
    batches = list(make_prompt_iterator(cfg, TOK, 2))
    assert [p.label for b in batches for p in b["prompts"]] == [str(i) for i in range(12) if i % 3 != 1]
    assert all(len(p.ids) <= 10 for b in batches for p in b["prompts"])
    assert [b["num_dropped"] for b in batches] == [1, 1, 1, 1]
    with pytest.raises(DataError, match="no prompt of .* fits in max_prompt_length=5; the shortest has 6 tokens"):
        make_prompt_iterator(cfg.replace(max_prompt_length=5), TOK, 2)
    with pytest.raises(DataError, match="fits in max_prompt_length=3"):
        make_prompt_iterator(make_cfg(max_prompt_length=3), TOK, 2)  # the built-in task too


def test_eval_prompts_fixed_order_and_disjoint_from_train(tmp_path):
    cfg = make_cfg()
    first = eval_prompts(cfg, TOK, 64)
    assert first == eval_prompts(cfg, TOK, 64) and len(first) == 64
    assert [(p.text, p.label) for p in first] == [
        builtin_problem(i, "eval", cfg.builtin_task_digits, cfg.builtin_task_ops) for i in range(64)
    ]
    assert all(problem_split(p.text) == "eval" and list(p.ids) == [TOK.bos_id, *TOK.encode(p.text)] for p in first)
    train = set(texts(take(make_prompt_iterator(cfg, TOK, 64), 8)))
    assert not train & {p.text for p in first}

    train_path = write_jsonl(tmp_path / "t.jsonl", qa_rows(4))
    eval_rows = [{"prompt": "y" * (20 if i == 1 else 3) + str(i), "answer": i} for i in range(6)]  # numeric labels
    files = make_cfg(
        dataset_path=train_path, eval_dataset_path=write_jsonl(tmp_path / "e.jsonl", eval_rows), max_prompt_length=10
    )
    assert [p.label for p in eval_prompts(files, TOK, 4)] == ["0", "2", "3", "4"]  # file order, over-long skipped
    assert len(eval_prompts(files, TOK, 100)) == 5  # fewer when the file holds fewer
    in_order = texts(make_prompt_iterator(files, TOK, 1, "eval"))  # the eval split: one pass, in order
    assert in_order == [r["prompt"] for r in eval_rows if len(r["prompt"]) < 10]
    with pytest.raises(ConfigError, match="eval_dataset_path"):
        eval_prompts(make_cfg(dataset_path=train_path), TOK, 4)


def test_bad_records_name_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "label": "2"}])
    with pytest.raises(DataError, match=r"d.jsonl:2: record lacks 'prompt' or 'answer'.*set prompt_key and label_key"):
        make_prompt_iterator(make_cfg(dataset_path=path), TOK, 1)
    path = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "a", "answer": ["1"]}])
    with pytest.raises(DataError, match="e.jsonl:1: field 'answer' must be a string or a number"):
        make_prompt_iterator(make_cfg(dataset_path=path), TOK, 1)
    with pytest.raises(ConfigError, match="synthetic has no prompts"):
        make_prompt_iterator(make_cfg(dataset_path="synthetic"), TOK, 1)
