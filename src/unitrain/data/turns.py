"""The token ids an episode adds between its sampled turns, from the chat template: token in, token out.

An episode's ids are its prompt, each assistant turn's ids exactly as the sampler sampled them, and
between turns what the chat template writes that the model did not sample: the rest of the
assistant's end of turn (`close`), then the environment's messages and the next generation prompt
(`delta`). Each piece comes from the template applied once to that piece, never from re-encoding the
whole conversation, so no decode/re-encode round trip changes the ids the trainer scores (the token
drift of trl#5224, verl#6719). The text the template writes for new messages is found as verl and TRL
find it: render a fixed conversation that ends in an assistant turn, alone and followed by the new
messages, and keep what the second writes after that turn. A template that rewrites earlier turns
when more follow (Qwen3 drops their <think> part) still gives the new messages' text here; the
episode keeps its sampled ids, where the template's rendering of the whole conversation would not.
"""

from __future__ import annotations

from unitrain.data.tokenizer import Tokenizer
from unitrain.errors import DataError

# The fixed conversation the deltas are cut from. The assistant's content is a marker no template
# trims or splits (no whitespace, no <think>), so what follows it is the template's end of turn.
_MARKER = "unitrain-assistant-turn-0x5f3a"
_BASE = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": _MARKER})


class ChatTurns:
    """The template's ids around an episode's sampled turns, for one tokenizer and one set of tools."""

    def __init__(self, tokenizer: Tokenizer, tools: list[dict] | None):
        self.tokenizer, self.tools = tokenizer, tools or None
        base = tokenizer.render_chat(list(_BASE), False, self.tools)
        at = base.rfind(_MARKER)
        if at < 0:
            raise DataError(f"the chat template of {tokenizer.path!r} does not write an assistant message's content")
        end_text = base[at + len(_MARKER) :]
        self.end_of_turn = tokenizer.encode(end_text)  # what the template writes after an assistant's content
        if not self.end_of_turn:
            raise DataError(
                f"the chat template of {tokenizer.path!r} writes no end-of-turn token after an assistant message, "
                "so an episode cannot tell where a turn ends"
            )
        self.end_of_turn_id = self.end_of_turn[0]  # the token that ends a sampled turn (a stop token)
        self._turn_end = _MARKER + end_text

    def prompt(self, messages: list[dict]) -> list[int]:
        """The first prompt: the conversation so far with the generation prompt and the tools."""
        return self.tokenizer.encode(self.tokenizer.render_prompt(messages, self.tools))

    def close(self, last_sampled_id: int | None) -> list[int]:
        """The end-of-turn ids the model did not sample after a turn that ended with `last_sampled_id`:
        the rest of the template's end of turn after its end token (Qwen's newline, nothing for Llama 3),
        or all of it where the turn did not end with that token (another stop token, a cut turn: None)."""
        if last_sampled_id == self.end_of_turn_id:
            return self.end_of_turn[1:]
        return list(self.end_of_turn)

    def delta(self, messages: list[dict]) -> list[int]:
        """The ids of `messages` (the environment's tool or user turns, all of one step) and the next
        generation prompt, as the template writes them after a closed assistant turn."""
        full = self.tokenizer.render_chat([*_BASE, *messages], True, self.tools)
        at = full.find(self._turn_end)
        if at < 0:
            roles = ", ".join(str(m.get("role")) for m in messages) or "no"
            raise DataError(
                f"the chat template of {self.tokenizer.path!r} is not prefix-stable for a message delta: "
                f"followed by {roles} messages, an assistant turn does not end as {self._turn_end[len(_MARKER) :]!r} "
                "as it does when it ends the conversation"
            )
        return self.tokenizer.encode(full[at + len(self._turn_end) :])
