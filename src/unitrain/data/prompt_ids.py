"""Prompts as the sampler takes them: a record's prompt text (or conversation) as token ids, with
its text and label (Prompt); the first records of a list that fit max_prompt_length. A leaf under
the prompt streams (prompts.py) and the evaluators, which read no data format."""

from __future__ import annotations

import dataclasses

from unitrain.config import check
from unitrain.data.images import IMAGES_NEED_A_MODEL, PromptImages, Vision
from unitrain.errors import ConfigError, DataError

# How many records the not-empty check (and eval prompts) read before concluding that nothing fits;
# files are checked whole, but the built-in stream has a million problems of near-equal length.
BUILTIN_SCAN_LIMIT = 1000


@dataclasses.dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]  # token ids fed to the sampler (BOS or chat template applied)
    text: str  # the prompt as the reward sees it: the raw text, before any template
    label: str  # the gold answer for the reward
    images: PromptImages | None = None  # the images of its image pads (a vision-language model's)


def prompt_fn(cfg, tokenizer):
    """record -> {"prompt": Prompt or None (over-long, dropped), "length": number of ids}."""
    if cfg.chat_template and not tokenizer.has_chat_template:
        raise ConfigError(
            f"chat_template is true but tokenizer_path={tokenizer.path!r} has no chat template; "
            "use a chat tokenizer or chat_template=false"
        )
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    chat, max_len = cfg.chat_template, cfg.max_prompt_length
    vision = Vision(cfg) if cfg.max_image_patches else None

    def to_prompt(record: dict) -> dict:
        text, images = record["prompt"], None
        if isinstance(text, list) and "type" in text[0]:  # a user turn's parts: the chat template places the images
            ids = tokenizer.encode(tokenizer.render_prompt([*system, {"role": "user", "content": text}]))
            if "images" in record:
                if vision is None:
                    raise DataError(f"{record['where']}: {IMAGES_NEED_A_MODEL}")
                ids, images = vision.prompt(ids, record)
            text = " ".join(p["text"] for p in text if p["type"] == "text")
        elif isinstance(text, list):  # a conversation before its assistant turn (SFT chat eval files)
            ids, text = tokenizer.encode(tokenizer.render_prompt(text)), text[-1]["content"]
        elif chat:
            ids = tokenizer.encode(tokenizer.render_prompt([*system, {"role": "user", "content": text}]))
        else:
            ids = bos + tokenizer.encode(text)
        fits = len(ids) <= max_len
        return {
            "prompt": Prompt(tuple(int(i) for i in ids), text, record["label"], images) if fits else None,
            "length": len(ids),
        }

    return to_prompt


def fitting_prompts(cfg, tokenizer, count: int, records, path: str) -> list[Prompt]:
    """The first `count` of `records` whose prompts fit max_prompt_length, in order (`path`: where
    they came from, for the error line when none fits)."""
    to_prompt = prompt_fn(cfg, tokenizer)
    out, shortest = [], None
    for i in range(len(records)):
        if len(out) >= count:
            break
        element = to_prompt(records[i])
        if element["prompt"] is not None:
            out.append(element["prompt"])
            continue
        shortest = element["length"] if shortest is None else min(shortest, element["length"])
        if not out and path == "builtin" and i + 1 >= BUILTIN_SCAN_LIMIT:
            break
    if count > 0 and not out:
        raise DataError(
            f"no eval prompt of {path!r} fits in max_prompt_length={cfg.max_prompt_length}; the "
            f"shortest has {shortest} tokens"
        )
    return out


@check("system_prompt", "chat_template", "workflow")
def _system_prompt(c) -> str | None:
    if c["chat_template"] or c["workflow"] != "single_turn" or not c["system_prompt"]:
        return None
    return "system_prompt is set but chat_template is false; a system prompt needs the chat template (or write it into the data)"


CONFIG_CHECKS = (_system_prompt,)
