"""One small tokenizer interface over HF tokenizer dirs, SentencePiece files and a built-in one.

The rest of unitrain sees only `Tokenizer`: encode/decode without implicit special tokens, the
special ids, and the chat template (the tokenizer's own, or a Jinja file that replaces it:
`chat_template_file`): `render_chat` renders a conversation, `chat_segments` splits one into
context and assistant pieces (the SFT loss), `render_prompt` renders a prompt for generation; each
may offer the model tools (the chat templates' "function" schemas).
"""

from __future__ import annotations

import os
from pathlib import Path

from unitrain.config import find_config_file
from unitrain.errors import ConfigError, DataError

# Built-in character tokenizer: specials first (<pad> must be 0), then printable ASCII and newline,
# enough for the built-in arithmetic task and for any plain-ASCII toy text.
BUILTIN_SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
BUILTIN_CHARS = tuple(chr(c) for c in range(32, 127)) + ("\n",)
_PROBE = "The answer is 42."  # any usable tokenizer encodes this to at least one token


class Tokenizer:
    """Wraps a transformers tokenizer or a SentencePiece processor behind one interface. `text_bos` is
    [BOS] where transformers' tokenizer(text) puts one before the text, else []."""

    def __init__(self, *, hf=None, spm=None, path: str = ""):
        self._hf, self._spm, self.path = hf, spm, path
        if hf is not None:
            self.vocab_size = len(hf)
            self.bos_id = hf.bos_token_id
            self.eos_id = hf.eos_token_id
            self.pad_id = hf.pad_token_id
            # Encode with the Rust backend directly: the Python wrapper redoes padding/truncation
            # set-up on every call (and mutates shared state doing it), for nothing here.
            self._backend = hf.backend_tokenizer if getattr(hf, "is_fast", False) else None
            # GPT-2 and NeoX style tokenizers define a BOS that tokenizer(text) does not add.
            self.text_bos = [i for i in hf(_PROBE)["input_ids"][:1] if i == self.bos_id]
        else:
            self.vocab_size = spm.get_piece_size()
            self.bos_id, self.eos_id, self.pad_id = (
                i if i >= 0 else None for i in (spm.bos_id(), spm.eos_id(), spm.pad_id())
            )
            self.text_bos = [] if self.bos_id is None else [self.bos_id]  # as Llama's SentencePiece tokenizer adds it
        if not self.encode(_PROBE):
            raise ConfigError(
                f"tokenizer_path={path!r}: the tokenizer encodes ordinary text to no tokens (a folder without "
                "tokenizer files, such as a bare export, loads as an empty tokenizer); point it at a "
                "folder with tokenizer.json / tokenizer_config.json or a SentencePiece .model file"
            )
        if self.eos_id is None:
            raise ConfigError(
                f"tokenizer_path={path!r}: the tokenizer has no EOS token, which SFT needs to end completions"
            )
        if self.pad_id is None:
            self.pad_id = self.eos_id  # only ever written where the segmentation is 0

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOS (special tokens written in the text are kept)."""
        if self._spm is not None:
            return self._spm.encode(text)
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self._hf.encode(text, add_special_tokens=False)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if self._spm is not None:
            return self._spm.decode(ids)
        return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def vocabulary(self) -> dict[str, int]:
        """token -> id, added tokens included: two tokenizers equal here give every id one meaning."""
        if self._spm is not None:
            return {self._spm.id_to_piece(i): i for i in range(self.vocab_size)}
        return self._hf.get_vocab()

    @property
    def has_chat_template(self) -> bool:
        return self._hf is not None and bool(getattr(self._hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict]) -> tuple[str, str]:
        """Renders a conversation as (prompt_text, completion_text): the completion is the last
        assistant turn, everything before it (and the template's generation prompt) the prompt."""
        prompt, completion = (text for text, _ in self.chat_segments(messages, last_assistant_only=True))
        return prompt, completion

    def _require_template(self) -> None:
        if not self.has_chat_template:
            raise ConfigError(
                f"tokenizer_path={self.path!r} has no chat template, so it cannot render chat messages "
                "(a 'messages' field, chat_template=true or an episode); use a chat tokenizer, chat_template_file "
                "or plain prompt/completion data"
            )

    def render_chat(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        """The chat template's text of `messages` (and of its generation prompt where asked), the tools
        offered where given; a conversation the template refuses (its raise_exception) is a DataError."""
        self._require_template()
        from jinja2 import TemplateError

        try:
            return self._hf.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except TemplateError as e:
            raise DataError(f"the chat template of {self.path!r} cannot render the conversation: {e}") from None

    def chat_segments(
        self, messages: list[dict], last_assistant_only: bool = False, tools: list[dict] | None = None
    ) -> list[tuple[str, bool]]:
        """Renders a conversation as consecutive (text, is_assistant) pieces of the template's full
        rendering: an assistant piece is what the template writes for that turn after the generation
        prompt (its end-of-turn tokens included), the loss of SFT; the rest is context. With
        `last_assistant_only`, earlier assistant turns are context too.

        Each piece is found by rendering the conversation's prefixes, so a template whose rendering of
        a prefix is not a prefix of the whole (one that rewrites earlier turns) is refused. The template
        owns all special tokens of a chat (BOS, end-of-turn), so the SFT path adds none of its own.
        """
        self._require_template()
        if not messages or messages[-1].get("role") != "assistant":
            raise DataError("a 'messages' conversation must end with an assistant turn to train on")
        render = lambda upto, generation: self.render_chat(messages[:upto], generation, tools)
        full = render(len(messages), False)
        turns = (
            [len(messages) - 1]
            if last_assistant_only
            else [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        )
        pieces, done = [], 0
        for i in turns:
            before, through = render(i, True), render(i + 1, False)
            if not (through.startswith(before) and full.startswith(through) and len(before) >= done):
                raise DataError(
                    f"the chat template of {self.path!r} does not render the conversation up to assistant turn "
                    f"{i} as a prefix of the whole; train on the last turn only (chat_loss_on=last_assistant)"
                )
            pieces += [(full[done : len(before)], False), (full[len(before) : len(through)], True)]
            done = len(through)
        return pieces + [(full[done:], False)] if done < len(full) else pieces

    def render_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """Renders a conversation that stops before the assistant's turn, with the template's
        generation prompt, as the text a sampler continues (the GRPO prompt path)."""
        return self.render_chat(messages, True, tools)

    def add_tokens(self, tokens: list[str]) -> int:
        """Adds the tokens the vocabulary lacks, each then encoded as one id after the existing ones
        (unitrain.vocab); returns how many were new."""
        if self._hf is None:
            raise NotImplementedError(
                f"tokenizer_path={self.path!r} is a SentencePiece file; tokens can be added to an HF tokenizer only"
            )
        added = self._hf.add_tokens(tokens)
        self.vocab_size = len(self._hf)
        return added

    def save(self, path: str) -> None:
        """Writes the tokenizer, chat template included, as AutoTokenizer.from_pretrained(path) loads it
        (an HF tokenizer only: config.py stops an export with a SentencePiece file before the run)."""
        self._hf.save_pretrained(path)


def load_tokenizer(path: str, trust_remote_code: bool = False, chat_template_file: str = "") -> Tokenizer:
    """`""` -> built-in character tokenizer; `*.model` -> SentencePiece; a directory -> HF tokenizer.
    `chat_template_file`: a Jinja chat template that replaces the tokenizer's own."""
    template = _read_chat_template(chat_template_file) if chat_template_file else None
    if path == "":
        return Tokenizer(hf=_with_template(_builtin_hf_tokenizer(), template), path="")
    if path.endswith(".model") and os.path.isfile(path):
        if template is not None:
            raise ConfigError(
                f"chat_template_file={chat_template_file!r}: tokenizer_path={path!r} is a SentencePiece file, "
                "which has no chat templates; use an HF tokenizer directory"
            )
        import sentencepiece

        return Tokenizer(spm=sentencepiece.SentencePieceProcessor(model_file=path), path=path)
    if not os.path.isdir(path):
        raise ConfigError(f"tokenizer_path={path!r} is neither a tokenizer directory nor a SentencePiece .model file")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    return Tokenizer(hf=_with_template(hf, template), path=path)


def _read_chat_template(name: str) -> str:
    """The Jinja text of `name`: a file, else the shipped template it names (a leading `configs/`
    dropped, as config ymls are found), so the recipes' templates work from any directory. A
    template that does not parse is refused here rather than at the first conversation."""
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    found = find_config_file(name, Path.cwd())
    try:
        with open(found, encoding="utf-8") as f:
            text = f.read()
        _compile_jinja_template(text)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"chat_template_file={name!r} cannot be read: {e}") from None
    except TemplateSyntaxError as e:
        raise ConfigError(f"chat_template_file={name!r} is not a valid Jinja template: {e} (line {e.lineno})") from None
    return text


def _with_template(hf, template: str | None):
    if template is not None:
        hf.chat_template = template
    return hf


def _builtin_hf_tokenizer():
    """A real PreTrainedTokenizerFast built in memory: one token per character, no files needed;
    tokenizer(text) adds BOS, as the SFT and prompt paths do with it."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(BUILTIN_SPECIALS + BUILTIN_CHARS)}
    rust = RustTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char
    rust.decoder = decoders.Fuse()  # join characters back without spaces
    pad, bos, eos, unk = BUILTIN_SPECIALS
    rust.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    return PreTrainedTokenizerFast(tokenizer_object=rust, pad_token=pad, bos_token=bos, eos_token=eos, unk_token=unk)
