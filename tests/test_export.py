"""export_hf_path writes a folder transformers uses as is: AutoTokenizer encodes like the run's
tokenizer (chat template included), and AutoModelForCausalLM.generate, greedy, gives the tokens
unitrain's greedy sampler gives from the run's own checkpoint, stopping at the same EOS."""

import json

import pytest
import torch
import transformers

from generate import main as generate_main
from helpers import REPO, make_cfg, write_jsonl
from unitrain import train
from unitrain.data.tokenizer import load_tokenizer
from unitrain.errors import ConfigError

PROMPTS = ["Q: 2+2=", "Q: 3+4=", "Q: 5+1=", "Q: 6+2="]
ANSWERS = [" 4", " 7", " 6", " 8"]
TEXTS = ["Natalia sold 48 clips; #### 72", "<|im_start|>user\nhi<|im_end|>", "a\nb  c"]
# (name, keys of the run): the tiny Qwen2 checkpoint with its BPE tokenizer and chat template, and
# the built-in character tokenizer with our own random model.
QWEN2 = dict(model_family="qwen2", qkv_bias="true", tie_word_embeddings="true", rms_norm_eps="1e-6")


def _train_and_export(tmp_path, **keys):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": p, "completion": a} for p, a in zip(PROMPTS, ANSWERS)])
    cfg = make_cfg(
        base_output_directory=tmp_path,
        dataset_path=data,
        steps=30,
        learning_rate=1e-2,
        warmup_steps=2,
        max_target_length=32,
        per_device_batch_size=1,
        eval_interval=0,
        checkpoint_period=1000,
        log_period=100,
        peak_flops_per_device=1e12,
        export_hf_path=tmp_path / "export",
        **keys,
    )
    assert train.train(cfg) == 0
    return cfg


def _unitrain_greedy(cfg, capsys, arch: dict) -> list[list[int]]:
    """Greedy completions of PROMPTS by unitrain's sampler from the run's last orbax checkpoint."""
    argv = [
        str(REPO / "configs" / "base.yml"),
        f"load_parameters_path={cfg.checkpoint_dir}",
        f"tokenizer_path={cfg.tokenizer_path}",
        *(f"{k}={v}" for k, v in arch.items()),
        *[a for p in PROMPTS for a in ("--prompt", p)],
        "--json",
        "--max-new-tokens",
        "8",
    ]
    capsys.readouterr()
    assert generate_main(argv) == 0
    return [json.loads(line)["tokens"] for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("which", ["qwen2", "builtin"])
def test_export_loads_in_transformers_and_generates_like_unitrain(tmp_path, tiny_checkpoint, capsys, which):
    ckpt = tiny_checkpoint("qwen2") if which == "qwen2" else None
    # The 2-layer tiny model memorises the four answers in the 30 steps; the demo model needs more.
    arch = QWEN2 if ckpt else {"model_name": "tiny"}
    keys = dict(load_parameters_path=ckpt, tokenizer_path=ckpt, **arch) if ckpt else arch
    cfg = _train_and_export(tmp_path, **keys)
    export = tmp_path / "export"
    ours = load_tokenizer(cfg.tokenizer_path)

    # The tokenizer: same ids, same specials, the chat template kept.
    tok = transformers.AutoTokenizer.from_pretrained(export)
    for text in TEXTS:
        assert tok(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (ours.bos_id, ours.eos_id, ours.pad_id)
    if ckpt:
        source = transformers.AutoTokenizer.from_pretrained(ckpt)
        assert tok.chat_template == source.chat_template
        chat = [{"role": "user", "content": "2+2?"}]
        assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == ours.render_prompt(chat)

    # The special ids: in config.json and generation_config.json.
    config = json.loads((export / "config.json").read_text())
    generation = json.loads((export / "generation_config.json").read_text())
    for ids in (config, generation):
        assert ids["eos_token_id"] == ours.eos_id and ids["pad_token_id"] == ours.pad_id
        assert ids.get("bos_token_id") == ours.bos_id

    # generate, with nothing but the folder's own files, stops at EOS like unitrain's sampler.
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    expected = _unitrain_greedy(cfg, capsys, arch)
    bos = [] if ours.bos_id is None else [ours.bos_id]
    for prompt, answer, want in zip(PROMPTS, ANSWERS, expected):
        ids = torch.tensor([bos + tok(prompt, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8)
        got = out[0, ids.shape[1] :].tolist()
        assert got == want
        assert got[-1] == tok.eos_token_id and len(got) < 8  # learned to stop: the EOS is the export's
        assert tok.decode(got, skip_special_tokens=True) == answer


def test_export_with_a_sentencepiece_tokenizer_is_refused_before_the_run(tmp_path):
    (tmp_path / "sp.model").write_bytes(b"")
    with pytest.raises(ConfigError, match="export_hf_path writes the run's tokenizer beside the model"):
        make_cfg(tokenizer_path=tmp_path / "sp.model", export_hf_path=tmp_path / "export")


# ---------------------------------------------------------------- architectures, for engines

# What transformers' save_pretrained writes for each family's causal LM (and what HF checkpoints say).
CAUSAL_LM = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
FAMILY_KEYS = {"qwen2": dict(qkv_bias="true"), "qwen3": dict(qk_norm="true"), "mistral": dict(sliding_window=8)}


def _assert_names_its_class(path, family):
    """An engine reads `architectures` to pick the model class: AutoConfig names it and
    AutoModelForCausalLM builds it."""
    config = transformers.AutoConfig.from_pretrained(path)
    assert config.architectures == [CAUSAL_LM[family]]
    assert type(transformers.AutoModelForCausalLM.from_pretrained(path)).__name__ == CAUSAL_LM[family]


@pytest.mark.parametrize("family", sorted(CAUSAL_LM))
def test_export_names_the_causal_lm_architecture(tmp_path, family):
    """export_hf of every family, and the two other ways out: the policy folder an engine sampler
    loads (export_policy) and a LoRA model's merged export."""
    from unitrain import export
    from unitrain.run import build_run

    cfg = make_cfg(model_family=family, **FAMILY_KEYS.get(family, {}))
    run, state = build_run(cfg)
    export.export_hf(run, state["params"], str(tmp_path / "hf"))
    _assert_names_its_class(tmp_path / "hf", family)
    if family == "qwen2":
        _assert_names_its_class(export.export_policy(run, state["params"], 3, str(tmp_path / "policy")), family)
    if family == "llama":
        run, state = build_run(cfg.replace(lora_rank=4))
        export.export_hf(run, state["params"], str(tmp_path / "merged"))
        _assert_names_its_class(tmp_path / "merged", family)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Tunix 0.1.7 on jax 0.10 and flax 0.12
def test_tunix_export_of_a_source_without_architectures_names_it(tmp_path, tiny_checkpoint):
    """model_source=tunix writes its source's config.json back; one that lacks `architectures` gets it."""
    import shutil

    pytest.importorskip("tunix")  # the tunix extra

    from unitrain import export
    from unitrain.run import build_run

    source = tmp_path / "source"
    shutil.copytree(tiny_checkpoint("qwen2"), source)
    config = json.loads((source / "config.json").read_text())
    del config["architectures"]
    (source / "config.json").write_text(json.dumps(config))
    run, state = build_run(make_cfg(model_source="tunix", load_parameters_path=source, tokenizer_path=source))
    export.export_hf(run, state["params"], str(tmp_path / "hf"))
    _assert_names_its_class(tmp_path / "hf", "qwen2")
