"""extra_tokens: new tokens in the tokenizer, the embedding and untied LM head grown to match (HF
checkpoints through our decoder and through Tunix), old-token logits unchanged, the tokenizer saved
with the run and the export, and transformers reloads the export with the new tokens."""

import json

import numpy as np
import pytest
import torch
import transformers

from helpers import make_cfg
from unitrain import export, vocab
from unitrain.errors import ConfigError, DataError
from unitrain.run import build_run

NEW = ["<a_0>", "<a_1>", "<b_0>", "<b_7>", "<c_3>"]
TEXT = "hello <a_1><b_7><c_3> world"


def tokens_file(tmp_path, tokens=NEW):
    path = tmp_path / "tokens.txt"
    path.write_text("\n".join(tokens) + "\n")
    return str(path)


def torch_logits(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def our_logits(run, state, ids):
    from flax import nnx

    model = nnx.merge(run.graphdef, state["params"])
    n = len(ids)
    logits, _ = model(np.asarray([ids], np.int32), np.arange(n, dtype=np.int32)[None], np.ones((1, n), np.int32))
    return np.asarray(logits[0], np.float32)


@pytest.mark.parametrize("source", ["unitrain", "tunix"])
def test_grown_model_keeps_old_logits_and_the_export_reloads(tmp_path, tiny_checkpoint, source):
    # A tokenizer that fills the checkpoint's 264 rows, so new tokens need new rows; Tunix's Llama
    # applies RoPE with theta 1e6 whatever its config says: give it that theta.
    ckpt = tiny_checkpoint("llama", vocab_size=264, rope_theta=1e6)
    old_tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    old_ids = old_tok.encode("hello world, the quick brown fox")
    cfg = make_cfg(
        load_parameters_path=ckpt,
        tokenizer_path=ckpt,
        model_source=source,
        extra_tokens=tokens_file(tmp_path),
        vocab_pad_multiple=64,
        base_output_directory=tmp_path,
        run_name="r",
        export_hf_path=tmp_path / "out",
    )
    run, state = build_run(cfg)
    old_vocab = json.load(open(f"{ckpt}/config.json"))["vocab_size"]
    assert run.tokenizer.vocab_size == len(old_tok) + len(NEW)
    expected = max(old_vocab, -(-run.tokenizer.vocab_size // 64) * 64)
    assert run.model.vocab_size == expected > old_vocab
    new_ids = run.tokenizer.encode(TEXT)
    sid = run.tokenizer.encode("<a_1><b_7><c_3>")
    assert [run.tokenizer.decode([i]) for i in sid] == ["<a_1>", "<b_7>", "<c_3>"]
    assert min(sid) >= len(old_tok)  # after the old tokens: their ids do not move

    ours = our_logits(run, state, old_ids)
    assert ours.shape[-1] == expected
    np.testing.assert_allclose(ours[:, :old_vocab], torch_logits(ckpt, old_ids), atol=2e-4)
    # New rows are drawn from the old rows' statistics: finite, not all equal, not copies of zeros.
    head_new = ours[:, old_vocab:]
    assert np.isfinite(head_new).all() and head_new.std() > 0

    export.export_hf(run, state["params"], cfg.export_hf_path)
    out = str(cfg.export_hf_path)
    reloaded = transformers.AutoTokenizer.from_pretrained(out)
    assert reloaded.encode(TEXT) == new_ids
    assert transformers.AutoConfig.from_pretrained(out).vocab_size == expected
    np.testing.assert_allclose(torch_logits(out, new_ids), our_logits(run, state, new_ids), atol=2e-4)
    saved = transformers.AutoTokenizer.from_pretrained(tmp_path / "r" / "tokenizer")
    assert saved.encode(TEXT) == new_ids


def test_sid_index_tokens_and_a_resumed_stage_load_the_grown_checkpoint(tmp_path):
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"0": ["<a_1>", "<b_2>", "<c_3>"], "1": ["<a_1>", "<b_9>", "<c_0>"]}))
    assert vocab.read_tokens(str(index)) == ["<a_1>", "<b_2>", "<b_9>", "<c_0>", "<c_3>"]
    # The built-in tokenizer with a random model: the model is built at the grown size directly.
    cfg = make_cfg(extra_tokens=index, vocab_pad_multiple=8, vocab_size=64, base_output_directory=tmp_path)
    run, _ = build_run(cfg)
    assert run.tokenizer.vocab_size == 100 + 5 and run.model.vocab_size == 112
    assert run.tokenizer.encode("<a_1><b_9>") == [100, 102]


def test_bad_token_files_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("<a_1>\n <b_2>\n")
    with pytest.raises(DataError, match=r"bad.txt:2: a token line may not start or end with whitespace"):
        vocab.read_tokens(str(bad))
    index = tmp_path / "index.json"
    index.write_text('{"0": "<a_1>"}')
    with pytest.raises(DataError, match="item '0' must map to a non-empty list"):
        vocab.read_tokens(str(index))
    with pytest.raises(ConfigError, match="vocab_pad_multiple"):
        make_cfg(vocab_pad_multiple=0)
