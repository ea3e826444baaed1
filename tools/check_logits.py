"""Compares unitrain's logits with transformers' PyTorch forward on one HF checkpoint dir.

    python tools/check_logits.py CKPT_DIR [--dtype float32|bfloat16] [--length 1024] [--prompt-file f.txt]
                                 [--atol A] [--kl-tol K] [--seed 0] [--json]

Both models read the same directory (unitrain through unitrain.adapters.hf.load, transformers through
AutoModelForCausalLM with eager attention) and run one prompt of --length tokens: the text of
--prompt-file tokenized with the checkpoint's tokenizer (cut, or repeated, to --length), else random
token ids drawn with --seed. Prints max/mean |logit difference|, KL(torch || unitrain) per token (mean,
max; float64 from log_softmax) and top-1 agreement. Exit 0 when max |diff| <= atol and max KL <= kl-tol,
1 otherwise (with the reason), 2 for a usage error (missing dir, not a checkpoint, unreadable prompt).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

# dtype -> (atol, kl_tol). float32 is a real parity check; bfloat16 is a loose sanity check: two
# independent bf16 forwards round differently (a logit near 20 has a bf16 step of 0.125), so these
# only catch gross errors (wrong weights, mask, RoPE), not small numerical ones.
DEFAULT_TOLS = {"float32": (1e-4, 1e-6), "bfloat16": (2.0, 1e-1)}


def prompt_tokens(ckpt: Path, text: str | None, length: int, vocab_size: int, seed: int) -> np.ndarray:
    """`text` tokenized with the checkpoint's tokenizer and repeated/cut to `length`; random ids when None."""
    import transformers

    from unitrain.errors import ConfigError

    if text is None:
        return np.random.default_rng(seed).integers(0, vocab_size, length, dtype=np.int32)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{ckpt}: no usable tokenizer for --prompt-file ({str(e).splitlines()[0]})") from None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ConfigError("--prompt-file: the text tokenizes to no tokens")
    return np.resize(np.asarray(ids, np.int32), length)  # np.resize repeats the ids cyclically


def unitrain_logits(model, tokens: np.ndarray) -> np.ndarray:
    import jax
    import jax.numpy as jnp

    T = len(tokens)
    # float32 must mean float32 (as in torch on CPU): JAX's default runs f32 matmuls as TF32 on recent
    # GPUs and as bfloat16 passes on TPU, which alone exceeds a 1e-4 tolerance on a real model.
    with jax.default_matmul_precision("highest"):
        logits, _ = model(jnp.asarray(tokens)[None], jnp.arange(T, dtype=jnp.int32)[None], jnp.ones((1, T), jnp.int32))
    return np.asarray(logits[0].astype(jnp.float32))


def torch_logits(ckpt: Path, tokens: np.ndarray, dtype: str) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(ckpt), dtype=getattr(torch, dtype), attn_implementation="eager", trust_remote_code=False
    )
    with torch.no_grad():
        return model.eval()(torch.from_numpy(tokens.astype(np.int64))[None]).logits[0].float().numpy()


def compare(ref: np.ndarray, ours: np.ndarray, chunk: int = 256) -> dict:
    """Metrics over all positions; float64, in row chunks so a 150k vocab stays within memory."""
    abs_max, abs_sum, kls, top1 = 0.0, 0.0, [], 0
    for i in range(0, len(ref), chunk):
        r, o = ref[i : i + chunk].astype(np.float64), ours[i : i + chunk].astype(np.float64)
        d = np.abs(r - o)
        abs_max, abs_sum = max(abs_max, float(d.max())), abs_sum + float(d.sum())
        lr = r - np.logaddexp.reduce(r, axis=-1, keepdims=True)
        lo = o - np.logaddexp.reduce(o, axis=-1, keepdims=True)
        kls.append((np.exp(lr) * (lr - lo)).sum(-1))
        top1 += int((r.argmax(-1) == o.argmax(-1)).sum())
    kl = np.concatenate(kls)
    return dict(
        max_abs_diff=abs_max,
        mean_abs_diff=abs_sum / ref.size,
        kl_mean=float(kl.mean()),
        kl_max=float(kl.max()),
        top1_agreement=top1 / len(ref),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog="exit status: 0 within tolerance, 1 over it, 2 usage error"
    )
    p.add_argument("ckpt_dir", help="local HF checkpoint dir (config.json + safetensors [+ tokenizer])")
    p.add_argument("--dtype", default="float32", choices=sorted(DEFAULT_TOLS))
    p.add_argument("--length", type=int, default=1024, help="prompt length in tokens")
    p.add_argument("--prompt-file", help="text to tokenize with the checkpoint's tokenizer (else random ids)")
    p.add_argument("--atol", type=float, help="max |logit diff| allowed; default 1e-4 (float32), 2.0 (bfloat16)")
    p.add_argument(
        "--kl-tol",
        type=float,
        help="max per-token KL allowed; default 1e-6 (float32), 0.1 "
        "(bfloat16). The bfloat16 defaults are loose sanity checks, not a parity proof",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    a = p.parse_args(argv)
    import transformers

    from unitrain.adapters import hf
    from unitrain.errors import ConfigError, UserError

    atol = DEFAULT_TOLS[a.dtype][0] if a.atol is None else a.atol
    kl_tol = DEFAULT_TOLS[a.dtype][1] if a.kl_tol is None else a.kl_tol
    ckpt = Path(a.ckpt_dir)
    transformers.utils.logging.disable_progress_bar()
    try:
        if a.length < 1:
            raise ConfigError(f"--length must be >= 1, got {a.length}")
        if not ckpt.is_dir():
            raise ConfigError(f"{ckpt}: no such directory")
        try:
            text = None if a.prompt_file is None else Path(a.prompt_file).read_text()
        except OSError as e:
            raise ConfigError(f"--prompt-file {a.prompt_file}: cannot be read ({e.strerror})") from None
        model = hf.load(ckpt, dtype=a.dtype)
        tokens = prompt_tokens(ckpt, text, a.length, model.cfg.vocab_size, a.seed)
    except UserError as e:
        print(f"check_logits: {e}", file=sys.stderr)
        return 2
    ours = unitrain_logits(model, tokens)
    del model
    m = compare(torch_logits(ckpt, tokens, a.dtype), ours)
    failures = [f"max abs logit diff {m['max_abs_diff']:.3g} > atol {atol:g}"] * (not m["max_abs_diff"] <= atol)
    failures += [f"max per-token KL {m['kl_max']:.3g} > kl-tol {kl_tol:g}"] * (not m["kl_max"] <= kl_tol)
    reason = "; ".join(failures) or None  # `not x <= tol` also fails on NaN
    if a.json:
        print(
            json.dumps(
                dict(m, tokens=len(tokens), dtype=a.dtype, atol=atol, kl_tol=kl_tol, ok=reason is None, reason=reason)
            )
        )
    else:
        print(
            f"{ckpt} ({a.dtype}, {len(tokens)} tokens, {'prompt file' if a.prompt_file else f'random ids, seed {a.seed}'})"
        )
        print(f"  max abs diff   {m['max_abs_diff']:.3e}   (atol {atol:g})")
        print(f"  mean abs diff  {m['mean_abs_diff']:.3e}")
        print(f"  KL mean / max  {m['kl_mean']:.3e} / {m['kl_max']:.3e}   (kl-tol {kl_tol:g})")
        print(f"  top-1 agree    {m['top1_agreement']:.4f}")
        print("OK" if reason is None else f"FAIL: {reason}")
    return 0 if reason is None else 1


if __name__ == "__main__":
    sys.exit(main())
