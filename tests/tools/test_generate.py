"""tools/generate.py against transformers' own greedy decoding on a tiny HF checkpoint."""

import json

import numpy as np
import pytest

from generate import main
from helpers import REPO

PROMPTS = ["Natalia sold clips to 48 of her friends", "How many"]


def _args(ckpt, *extra):
    # tiny.yml already has the llama fixture's dimensions; the rope settings are read from config.json.
    return [
        str(REPO / "configs" / "base.yml"),
        f"load_parameters_path={ckpt}",
        f"tokenizer_path={ckpt}",
        *extra,
        "--json",
        "--max-new-tokens",
        "8",
    ]


def _run(capsys, argv) -> list[dict]:
    assert main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def _until_eos(ids, eos):
    ids = [int(i) for i in ids]
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def _hf_greedy(ckpt, prompt_ids: list[int]) -> list[int]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(ckpt), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    x = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=8)
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
def test_greedy_matches_transformers(tiny_checkpoint, capsys, chat):
    from transformers import AutoTokenizer

    ckpt = tiny_checkpoint("llama")
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    argv = _args(ckpt, *[a for p in PROMPTS for a in ("--prompt", p)], *(["--chat"] if chat else []))
    rows = _run(capsys, argv)
    assert [(r["prompt"], r["sample"]) for r in rows] == [(p, 0) for p in PROMPTS]
    for row in rows:
        if chat:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": row["prompt"]}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        else:  # this tokenizer has no BOS
            ids = tok(row["prompt"], add_special_tokens=False)["input_ids"]
        expected = _until_eos(_hf_greedy(ckpt, list(ids)), tok.eos_token_id)
        assert row["tokens"] == expected
        assert row["completion"] == tok.decode(expected)
        assert np.isfinite(row["logprob_sum"]) and row["logprob_sum"] <= 0


def test_n_samples_per_prompt(tiny_checkpoint, capsys, tmp_path):
    ckpt = tiny_checkpoint("llama")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPTS[0]}\n\n{PROMPTS[1]}\n")
    rows = _run(capsys, _args(ckpt, "--prompt-file", str(prompts), "--n", "3", "--temperature", "1.0"))
    assert [(r["prompt"], r["sample"]) for r in rows] == [(p, s) for p in PROMPTS for s in range(3)]
    assert all(1 <= len(r["tokens"]) <= 8 for r in rows)
    assert len({tuple(r["tokens"]) for r in rows}) > 1  # sampled, not six copies of one row


def test_missing_prompt_file_is_one_line_and_exit_2(tmp_path, capsys):
    rc = main([str(REPO / "configs" / "base.yml"), "--prompt-file", str(tmp_path / "nope.txt")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("generate: ") and "nope.txt" in err and err.count("\n") == 1


def test_no_prompt_is_exit_2(capsys):
    assert main([str(REPO / "configs" / "base.yml")]) == 2
    assert capsys.readouterr().err.startswith("generate: no prompt")
