"""tools/check_logits.py: unitrain vs transformers logits on one checkpoint, as a CLI."""

import dataclasses
import json

from check_logits import main
from unitrain.adapters import hf


def test_tiny_checkpoint_passes_and_json_parses(tiny_checkpoint, capsys):
    assert main([str(tiny_checkpoint("qwen2")), "--length", "300", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["tokens"] == 300 and out["dtype"] == "float32"
    assert out["max_abs_diff"] < 1e-4 and out["kl_max"] < 1e-6 and out["top1_agreement"] == 1.0


def test_bfloat16_fails_float32_tolerances(tiny_checkpoint, capsys):
    """bf16 forwards round differently from each other: strict float32 tolerances must reject them."""
    rc = main([str(tiny_checkpoint("qwen2")), "--length", "64", "--dtype", "bfloat16", "--atol", "1e-6"])
    assert rc == 1
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("FAIL: max abs logit diff")


def test_a_wrong_unitrain_model_is_caught_with_default_tolerances(tiny_checkpoint, monkeypatch, capsys):
    """Negative control: a real modelling error on unitrain's side only (a wrong norm eps) exits 1."""
    load = hf.load

    def wrong_load(*args, **kwargs):
        model = load(*args, **kwargs)
        model.cfg = dataclasses.replace(model.cfg, rms_norm_eps=0.5)
        return model

    monkeypatch.setattr(hf, "load", wrong_load)
    assert main([str(tiny_checkpoint("qwen2")), "--length", "64", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["ok"] and out["max_abs_diff"] > 1e-2 and "atol" in out["reason"]


def test_not_a_checkpoint_is_exit_2_with_one_line(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"check_logits: {tmp_path}: not an HF checkpoint directory (no config.json)\n"
    assert main([str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err == f"check_logits: {tmp_path / 'missing'}: no such directory\n"


def test_prompt_file_is_tokenized_and_repeated(tiny_checkpoint, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Natalia sold clips to 48 of her friends in April.")
    assert main([str(tiny_checkpoint("qwen2")), "--prompt-file", str(prompt), "--length", "64"]) == 0
    out = capsys.readouterr().out
    assert "64 tokens, prompt file" in out and out.strip().endswith("OK")
    assert main([str(tiny_checkpoint("qwen2")), "--prompt-file", str(tmp_path / "nope.txt")]) == 2
    assert capsys.readouterr().err.startswith("check_logits: --prompt-file ")
