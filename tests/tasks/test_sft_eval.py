"""SFT like GRPO: chat-template rendering of prompt/completion data (the prompts GRPO sees), the loss on
every assistant turn of a chat against transformers' own assistant mask, and generation evals on SFT
eval files (greedy accuracy and pass@k with the run's reward, answers in TensorBoard) against answers
generated independently from the run's checkpoint."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from generate import main as generate_main
from helpers import REPO, make_cfg, read_events, write_jsonl
from make_tiny_model import BUILTIN_CORPUS, build_tokenizer
from unitrain import train
from unitrain.data.prompts import eval_prompts, make_prompt_iterator
from unitrain.data.sft import eval_prompt_records, make_sft_iterator
from unitrain.data.tokenizer import load_tokenizer
from unitrain.errors import ConfigError
from unitrain.evals import sft_reward_fn, warn_if_answers_cut

# ChatML as tools/make_tiny_model.py writes it, with the assistant turns marked for transformers'
# return_assistant_tokens_mask: the independent reference of the loss mask.
GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "How many clips?"},
    {"role": "assistant", "content": "48 in April."},
    {"role": "user", "content": "And in May?"},
    {"role": "assistant", "content": "Half as many: 24."},
    {"role": "user", "content": "Altogether?"},
    {"role": "assistant", "content": "#### 72"},
]


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat_tok")
    hf = build_tokenizer(512, BUILTIN_CORPUS)
    hf.chat_template = GENERATION_TEMPLATE
    hf.save_pretrained(path)
    return str(path)


def _row(cfg, tok) -> tuple[list[int], set[int]]:
    """The first example of the SFT pipeline (unpacked): its tokens and the indices of the tokens it trains on."""
    batch = next(make_sft_iterator(cfg, tok, 8))
    n = int((batch["inputs_segmentation"][0] > 0).sum())
    trained = {i + 1 for i in np.flatnonzero(batch["targets_segmentation"][0][:n] > 0)}  # position i predicts i + 1
    return batch["inputs"][0][:n].tolist(), trained


@pytest.mark.parametrize("loss_on", ["all_assistant", "last_assistant"])
def test_chat_loss_mask_is_the_assistant_turns(tmp_path, chat_tokenizer_dir, loss_on):
    tok = load_tokenizer(chat_tokenizer_dir)
    cfg = make_cfg(
        dataset_path=write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVO}] * 8),
        tokenizer_path=chat_tokenizer_dir,
        max_target_length=128,
        packing=False,
        chat_loss_on=loss_on,
    )
    ids, trained = _row(cfg, tok)
    reference = AutoTokenizer.from_pretrained(chat_tokenizer_dir).apply_chat_template(
        CONVO, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert ids == list(reference["input_ids"])
    spans = np.flatnonzero(reference["assistant_masks"])
    if loss_on == "last_assistant":  # the last contiguous run of assistant tokens
        spans = spans[np.flatnonzero(np.diff(spans) > 1)[-1] + 1 :]
    assert trained == set(spans.tolist())
    assert tok.decode([ids[i] for i in sorted(trained)], skip_special_tokens=False) == (
        "48 in April.<|im_end|>\nHalf as many: 24.<|im_end|>\n#### 72<|im_end|>\n"
        if loss_on == "all_assistant"
        else "#### 72<|im_end|>\n"
    )


def test_chat_template_renders_sft_prompts_as_grpo_does(tmp_path, chat_tokenizer_dir):
    """chat_template + system_prompt on prompt/completion data: the prompt is a user message with the
    generation prompt, token for token GRPO's prompt of the same text; the completion is the assistant turn."""
    tok = load_tokenizer(chat_tokenizer_dir)
    rows = [{"prompt": "How many clips?", "completion": "#### 72", "answer": "72"}] * 8
    keys = dict(
        dataset_path=write_jsonl(tmp_path / "d.jsonl", rows),
        tokenizer_path=chat_tokenizer_dir,
        chat_template=True,
        system_prompt="Be brief.",
        max_target_length=64,
        packing=False,
        per_device_batch_size=1,
    )
    ids, trained = _row(make_cfg(**keys), tok)
    grpo = next(make_prompt_iterator(make_cfg(mode="grpo", **keys), tok, 1))["prompts"][0]
    context = len(grpo.ids)
    assert ids[:context] == list(grpo.ids) and trained == set(range(context, len(ids)))
    assert tok.decode(ids[context:], skip_special_tokens=False) == "#### 72<|im_end|>\n"
    # The SFT eval prompt of the same record is that prompt too.
    sft_eval = make_cfg(eval_dataset_path=keys["dataset_path"], **keys)
    assert eval_prompts(sft_eval, tok, 1, eval_prompt_records(sft_eval, tok))[0] == grpo


def test_chat_data_and_system_prompt_need_what_they_use(tmp_path, chat_tokenizer_dir):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}] * 8)
    with pytest.raises(ConfigError, match="system_prompt is set but chat_template is false"):
        make_cfg(dataset_path=data, system_prompt="Be brief.")
    with pytest.raises(ConfigError, match="has no chat template, so it cannot render chat messages"):
        make_sft_iterator(make_cfg(dataset_path=data, chat_template=True), load_tokenizer(""), 8)
    with pytest.raises(ConfigError, match="chat_loss_on"):
        make_cfg(chat_loss_on="every")


def test_eval_labels_are_label_key_else_the_completion(tmp_path, chat_tokenizer_dir):
    rows = [
        {"prompt": "p1", "completion": " c1"},
        {"prompt": "p2", "completion": " c2", "answer": 7},
        {"messages": CONVO},
        {"messages": CONVO, "answer": "72"},
    ]
    cfg = make_cfg(
        dataset_path="builtin",
        eval_dataset_path=write_jsonl(tmp_path / "e.jsonl", rows),
        tokenizer_path=chat_tokenizer_dir,
    )
    records = eval_prompt_records(cfg, load_tokenizer(chat_tokenizer_dir))
    assert [r["label"] for r in records] == [" c1", "7", "#### 72", "72"]
    assert records[2]["prompt"] == CONVO[:-1] and records[0]["prompt"] == "p1"


# ---------------------------------------------------------------- generation evals of an SFT run

PROMPTS = ["Q: 2+2=", "Q: 3+4=", "Q: 5+1=", "Q: 6+2="]
COMPLETIONS = [" 4", " 7", " 6", " 8"]


def test_sft_generation_eval_matches_answers_generated_from_the_checkpoint(tmp_path, capsys):
    train_rows = [{"prompt": p, "completion": c} for p, c in zip(PROMPTS, COMPLETIONS)]
    eval_rows = [dict(r) for r in train_rows]
    eval_rows[1]["answer"] = 7  # label_key present: it is the label
    eval_rows[3]["answer"] = "9"  # a label the completion does not give: that prompt is never right
    cfg = make_cfg(
        model_name="tiny",  # memorises the four rows in 30 steps (the 4-layer default needs more)
        base_output_directory=tmp_path,
        dataset_path=write_jsonl(tmp_path / "t.jsonl", train_rows),
        eval_dataset_path=write_jsonl(tmp_path / "e.jsonl", eval_rows * 16),
        steps=30,
        learning_rate=1e-2,
        warmup_steps=2,
        max_target_length=32,
        per_device_batch_size=1,
        eval_interval=30,
        eval_steps=1,
        eval_num_samples=4,
        eval_n_samples=2,
        eval_pass_k=2,
        rollout_max_response_len=8,
        checkpoint_period=1000,
        log_period=100,
        peak_flops_per_device=1e12,
    )
    assert train.train(cfg) == 0
    evals = [json.loads(line) for line in open(cfg.metrics_file) if "eval_accuracy" in line]
    assert len(evals) == 1 and 0.0 <= evals[0]["eval_pass_at_2"] <= 0.75

    # Independently: greedy answers from the saved checkpoint, scored by exact match by hand.
    argv = [
        str(REPO / "configs" / "base.yml"),
        "model_name=tiny",
        f"load_parameters_path={cfg.checkpoint_dir}",
        *[a for p in PROMPTS for a in ("--prompt", p)],
        "--json",
        "--max-new-tokens",
        "8",
    ]
    capsys.readouterr()
    assert generate_main(argv) == 0
    tok = load_tokenizer("")
    answers = [tok.decode(json.loads(line)["tokens"]) for line in capsys.readouterr().out.splitlines()]
    labels = [" 4", "7", " 6", "9"]
    assert answers[:3] == COMPLETIONS[:3]  # learned, so the accuracy below is not a trivial 0
    assert evals[0]["eval_accuracy"] == np.mean([a.strip() == l.strip() for a, l in zip(answers, labels)]) == 0.75

    # The answers are in TensorBoard as the samples of that eval.
    texts = [
        v.tensor.string_val[0].decode()
        for e in read_events(Path(cfg.tensorboard_dir))
        for v in e.summary.value
        if v.tag.startswith("samples")
    ]
    assert len(texts) == 1
    assert f"**prompt** {PROMPTS[0]}\n\n**completion** {answers[0]}\n\n**label**  4\n\n**reward** 1.000" in texts[0]
    assert "**label** 9\n\n**reward** 0.000" in texts[0]


def test_an_eval_file_smaller_than_one_batch_is_one_line(tmp_path, capsys):
    rows = write_jsonl(tmp_path / "d.jsonl", [{"prompt": p, "completion": c} for p, c in zip(PROMPTS, COMPLETIONS)])
    argv = [
        str(REPO / "configs" / "base.yml"),
        f"base_output_directory={tmp_path}",
        f"dataset_path={rows}",
        f"eval_dataset_path={rows}",
        "per_device_batch_size=1",
        "max_target_length=32",
        "steps=1",
    ]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("unitrain: eval_dataset_path") and "does not fill one eval batch of 8 rows" in err
    assert err.count("\n") == 1


# ---------------------------------------------------------------- GSM8K: the data's answer

GSM8K = REPO.parent / "shared" / "data" / "gsm8k"
GSM8K_KEYS = {"prompt_key": "question", "completion_key": "answer", "label_key": "answer"}
needs_gsm8k = pytest.mark.skipif(not GSM8K.exists(), reason="needs ../shared/data/gsm8k")


def gsm8k_cfg(**overrides):
    return make_cfg(
        dataset_path=GSM8K / "train.jsonl", eval_dataset_path=GSM8K / "test.jsonl", **GSM8K_KEYS, **overrides
    )


@needs_gsm8k
def test_gsm8k_labels_are_scored_on_their_final_answer_unless_reward_is_set():
    """A GSM8K label is a worked solution ending in '#### <number>': with reward left at its default,
    an answer is right when it states that number, however it works its way there."""
    cfg = gsm8k_cfg(eval_num_samples=8)
    records = eval_prompt_records(cfg, load_tokenizer(""))[:8]
    golds = [r["label"].rsplit("####", 1)[1].strip() for r in records]  # by hand: the text after '####'
    reward_fn = sft_reward_fn(cfg, records)
    labels = [r["label"] for r in records]
    right = [f"Some other working.\n#### {gold}" for gold in golds]
    wrong = [f"{records[0]['label'].rsplit('####', 1)[0]}#### {gold}1" for gold in golds]
    assert reward_fn.names == ("math",)
    assert reward_fn([""] * 8, right, labels)[0].tolist() == [1.0] * 8
    assert reward_fn([""] * 8, wrong, labels)[0].tolist() == [0.0] * 8
    # reward set by the user is theirs: exact match of the whole solution
    assert sft_reward_fn(gsm8k_cfg(eval_num_samples=8, reward="exact_match"), records).names == ("exact_match",)
    # labels without a '#### <answer>' line keep the default reward
    plain = [{**r, "label": gold} for r, gold in zip(records, golds)]
    assert sft_reward_fn(cfg, plain).names == ("exact_match",)


@needs_gsm8k
def test_answers_longer_than_the_eval_can_generate_are_one_warning(caplog):
    tokenizer = load_tokenizer("")
    rows = [json.loads(line) for line in open(GSM8K / "test.jsonl")][:6]
    lengths = [len(tokenizer.encode(row["answer"])) + 1 for row in rows]  # + EOS
    caplog.set_level("INFO", logger="unitrain")
    cfg = gsm8k_cfg(eval_num_samples=6, rollout_max_response_len=16)
    warn_if_answers_cut(cfg, tokenizer, eval_prompt_records(cfg, tokenizer))
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == (
        f"eval: 6 of 6 eval completions are longer than rollout_max_response_len=16 tokens (the longest "
        f"{max(lengths)}): answers like them are cut before they end and score 0; raise rollout_max_response_len"
    )
    caplog.clear()
    enough = gsm8k_cfg(eval_num_samples=6, rollout_max_response_len=max(lengths))
    warn_if_answers_cut(enough, tokenizer, eval_prompt_records(enough, tokenizer))
    assert not caplog.records


@needs_gsm8k
def test_sft_on_gsm8k_says_how_it_scores_and_that_16_tokens_cannot_hold_an_answer(tmp_path, tiny_checkpoint, capsys):
    ckpt = tiny_checkpoint("qwen2")
    argv = [
        str(REPO / "configs" / "base.yml"),
        f"base_output_directory={tmp_path}",
        f"load_parameters_path={ckpt}",
        f"tokenizer_path={ckpt}",
        f"dataset_path={GSM8K / 'train.jsonl'}",
        f"eval_dataset_path={GSM8K / 'test.jsonl'}",
        *(f"{k}={v}" for k, v in GSM8K_KEYS.items()),
        "steps=1",
        "max_target_length=256",
        "per_device_batch_size=1",
        "max_prompt_length=512",
        "eval_interval=1",
        "eval_steps=1",
        "eval_num_samples=2",
        "eval_n_samples=0",
        "peak_flops_per_device=1e12",
    ]
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    assert "answers are scored by the math reward on that answer" in out
    assert "eval: 2 of 2 eval completions are longer than rollout_max_response_len=16 tokens" in out
    (evaluated,) = [
        json.loads(line) for line in open(tmp_path / "default" / "metrics.jsonl") if "eval_accuracy" in line
    ]
    assert math.isfinite(evaluated["eval_loss"]) and f"eval loss {evaluated['eval_loss']:.4f}, accuracy " in out
