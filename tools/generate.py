"""Samples completions from a model built exactly as training builds it (same config system).

    python tools/generate.py CONFIG_YML [key=value ...] (--prompt TEXT ... | --prompt-file FILE)
        [--max-new-tokens 64] [--temperature 0.0] [--top-p 1.0] [--top-k 0] [--n 1] [--seed 0] [--chat] [--json]
        [--beam W]

Point `load_parameters_path` at an HF checkpoint dir or a unitrain run's checkpoints dir and set
model_name (or the dimensions) and tokenizer_path as for training. A prompt is [BOS] + its tokens (no
BOS when the tokenizer has none); with --chat it is rendered as one user message through the
tokenizer's chat template, generation prompt included. --prompt-file holds one prompt per line (blank
lines skipped). Temperature 0 is greedy; each completion ends at EOS or after --max-new-tokens and is
decoded up to and including the EOS. Plain output: a header line per sample, then its text; --json:
one object per line {prompt, sample, completion, tokens, logprob_sum}. --beam W prints each prompt's
W beams of beam search instead (engines/beam.py), best first, `sample` being the rank; with
sid_index_path in the config the beams are constrained to its SIDs (and last one SID plus EOS), and
extra_tokens extends the tokenizer as training does. User errors: exit 2 with `generate: <message>`
on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax

from unitrain import sharding, vocab
from unitrain.checks import load_checked
from unitrain.data.tokenizer import load_tokenizer
from unitrain.engines.base import SamplingParams
from unitrain.engines.colocated import ColocatedSampler
from unitrain.errors import ConfigError, UserError
from unitrain.models import sources
from unitrain.recsys.rollout import sid_beams
from unitrain.run import device_layout


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="generate", description="Sample completions from a unitrain model.")
    p.add_argument("config", nargs="+", help="CONFIG_YML [key=value ...]")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompt-file", help="one prompt per line; blank lines skipped")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="render each prompt as a user message (chat template)")
    p.add_argument("--json", action="store_true", help="one JSON object per sample")
    p.add_argument(
        "--beam", type=int, default=0, help="beam search of this width (0 = sample); sid_index_path constrains it"
    )
    return p.parse_intermixed_args(argv)


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\r\n") for line in f if line.strip()]
        except OSError as e:
            raise ConfigError(f"--prompt-file {args.prompt_file}: {e.strerror}") from None
    if not prompts:
        raise ConfigError("no prompt given; pass --prompt TEXT or --prompt-file FILE")
    return prompts


def run(args) -> None:
    prompts = read_prompts(args)
    if args.n < 1:
        raise ConfigError(f"--n must be >= 1, got {args.n}")
    if args.beam < 0:
        raise ConfigError(f"--beam must be >= 0 (0 = sample), got {args.beam}")
    cfg = load_checked(args.config)
    layout = device_layout(cfg)
    tok = load_tokenizer(cfg.tokenizer_path, cfg.trust_remote_code)
    cfg = vocab.extend(cfg, tok)
    texts = [tok.render_prompt([{"role": "user", "content": p}]) if args.chat else p for p in prompts]
    bos = [] if args.chat or tok.bos_id is None else [tok.bos_id]  # a chat template owns its specials
    ids = [bos + tok.encode(t) for t in texts]
    try:
        params = SamplingParams(args.max_new_tokens, args.temperature, args.top_k, args.top_p, (tok.eos_id,))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    mesh = sharding.trainer_mesh(cfg, layout)
    sampler = ColocatedSampler(sources.build(cfg, mesh), pad_id=tok.pad_id, mesh=mesh, rules=cfg.logical_axis_rules)
    if args.beam:
        beams = sid_beams(cfg.replace(rollout_max_response_len=args.max_new_tokens), tok, args.beam)
        out, args.n = sampler.beam_search(ids, beams, jax.random.key(args.seed)).completions(), args.beam
    else:
        out = sampler.generate([p for p in ids for _ in range(args.n)], params, jax.random.key(args.seed))
    if jax.process_index() != 0:
        return
    for r, (tokens, n, logprobs) in enumerate(zip(out.tokens, out.lengths, out.logprobs)):
        prompt, sample, toks = prompts[r // args.n], r % args.n, [int(t) for t in tokens[:n]]
        text, lp = tok.decode(toks, skip_special_tokens=False), float(logprobs[:n].sum())
        if args.json:
            print(
                json.dumps({"prompt": prompt, "sample": sample, "completion": text, "tokens": toks, "logprob_sum": lp}),
                flush=True,
            )
        else:
            print(f"=== prompt {r // args.n} sample {sample} ({n} tokens, logprob {lp:.3f}): {prompt!r}")
            print(text, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except UserError as e:
        print(f"generate: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
