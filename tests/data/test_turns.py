"""Token in, token out: an episode's ids, built as an episode builds them (the first prompt, each
turn's sampled ids, and ChatTurns' close and delta between turns), against transformers'
apply_chat_template of the whole conversation, for the real Llama 3, Qwen2.5 and Qwen3 chat
templates on tiny local tokenizers. Where a template is not prefix-stable (Qwen3 rewrites earlier
turns), the test names the exact span it differs by and checks the episode keeps the sampled ids.
Then the shipped tiny_chat template on the built-in tokenizer, and the errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from chat_templates import FAMILIES, make_hf_tokenizer
from unitrain.config import SHIPPED_CONFIGS
from unitrain.data.tokenizer import _builtin_hf_tokenizer, load_tokenizer
from unitrain.data.turns import ChatTurns
from unitrain.errors import ConfigError, DataError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluates an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
QUESTION = {"role": "user", "content": "What is (17 + 25) * 3 - 4?"}
CALLS = ("17 + 25", "42 * 3 - 4")
RESULTS = ("42", "122")
ANSWER = "The answer is 122."
REASONING = ("Add first.", "Then multiply and subtract.", "Done.")


def tool_call(expression: str) -> dict:
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


def tool_episode(reasoning: tuple[str, ...] | None = None) -> list[dict]:
    """user question -> call -> result -> call -> result -> answer; each assistant turn with its
    reasoning where given (Qwen3's reasoning_content)."""
    turns = [
        {"role": "assistant", "content": "", "tool_calls": [tool_call(CALLS[0])]},
        {"role": "assistant", "content": "", "tool_calls": [tool_call(CALLS[1])]},
        {"role": "assistant", "content": ANSWER},
    ]
    if reasoning is not None:
        turns = [dict(t, reasoning_content=r) for t, r in zip(turns, reasoning)]
    results = [{"role": "tool", "content": r} for r in RESULTS]
    return [QUESTION, turns[0], results[0], turns[1], results[1], turns[2]]


def qwen_call(expression: str) -> str:
    return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'


def think(reasoning: str) -> str:
    return f"<think>\n{reasoning}\n</think>\n\n" if reasoning else "<think>\n\n</think>\n\n"


# What each family's model samples for the episode's assistant turns, its end-of-turn token included.
SAMPLED = {
    "llama3": [
        *(f'{{"name": "calculator", "parameters": {{"expression": "{e}"}}}}<|eot_id|>' for e in CALLS),
        f"{ANSWER}<|eot_id|>",
    ],
    "qwen2.5": [*(qwen_call(e) + "<|im_end|>" for e in CALLS), ANSWER + "<|im_end|>"],
    "qwen3": [think(r) + t + "<|im_end|>" for r, t in zip(REASONING, [*map(qwen_call, CALLS), ANSWER])],
}
MESSAGES = {"llama3": tool_episode(), "qwen2.5": tool_episode(), "qwen3": tool_episode(REASONING)}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """family -> a saved tokenizer with its real chat template, its BPE trained on the family's
    rendering of the tool episode (so the conversation's pieces have merges to get wrong)."""
    made = {}

    def get(family: str) -> str:
        if family not in made:
            text = make_hf_tokenizer(family, ["seed"]).apply_chat_template(
                MESSAGES[family], tools=TOOLS, tokenize=False
            )
            made[family] = tmp_path_factory.mktemp(family.replace(".", ""))
            make_hf_tokenizer(family, [text] * 4).save_pretrained(made[family])
        return str(made[family])

    return get


def reference_ids(path: str, messages: list[dict], tools: list[dict] | None = TOOLS) -> list[int]:
    """transformers' own rendering and tokenization of the whole conversation, from the saved files."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)


def run_episode(turns: ChatTurns, messages: list[dict], sampled_texts: list[str]) -> tuple[list[int], list[int]]:
    """run_sampled with each turn's ids the tokenizer's encoding of its text (as a model mostly samples it)."""
    return run_sampled(turns, messages, [turns.tokenizer.encode(text) for text in sampled_texts])


def run_sampled(turns: ChatTurns, messages: list[dict], sampled: list[list[int]]) -> tuple[list[int], list[int]]:
    """(the episode's ids, where each sampled turn starts in them): the first prompt, then per turn
    the ids the model sampled, the close of the turn and the delta of the messages that follow it."""
    at = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids, starts = turns.prompt(messages[:at]), []
    for turn in sampled:
        starts.append(len(ids))
        ids += turn + turns.close(turn[-1])
        new, at = [], at + 1
        while at < len(messages) and messages[at]["role"] != "assistant":
            new, at = [*new, messages[at]], at + 1
        if new:
            ids += turns.delta(new)
    assert at == len(messages)
    return ids, starts


def with_spans(reference: list[int], spans: list[tuple[int, list[int]]]) -> list[int]:
    """`reference` with each span inserted where the episode has it (positions in the episode's ids,
    ascending): the episode's ids when the template dropped exactly these spans."""
    out = list(reference)
    for at, ids in spans:
        out[at:at] = ids
    return out


def contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tool_episode_ids_equal_the_template_of_the_whole_conversation(family, tokenizer_dir):
    path = tokenizer_dir(family)
    tok = load_tokenizer(path)
    episode, starts = run_episode(ChatTurns(tok, TOOLS), MESSAGES[family], SAMPLED[family])
    assert episode == reference_ids(path, MESSAGES[family])
    for start, text in zip(starts, SAMPLED[family]):
        assert episode[start : start + len(tok.encode(text))] == tok.encode(text)
    # The template's text of the conversation holds each sampled turn's text as sampled, and the
    # tools offered in the prompt.
    whole = tok.decode(episode, skip_special_tokens=False)
    assert all(text in whole for text in SAMPLED[family]) and '"name": "calculator"' in whole


def test_sampled_ids_are_kept_where_a_re_encoding_would_change_them(tokenizer_dir):
    """Token drift: the model sampled a word of the answer as single characters, not as the merged
    token the tokenizer writes; the text is the same, a re-encoding of it is not what was sampled."""
    path = tokenizer_dir("llama3")
    tok = load_tokenizer(path)
    sampled = [tok.encode(text) for text in SAMPLED["llama3"]]
    answer = sampled[2]
    merged = next(i for i, t in enumerate(answer) if len(tok.decode([t])) > 1 and t != tok.eos_id)
    spelled = [tok.encode(c)[0] for c in tok.decode([answer[merged]])]
    sampled[2] = answer[:merged] + spelled + answer[merged + 1 :]
    assert tok.decode(sampled[2]) == tok.decode(answer) and len(spelled) > 1
    episode, starts = run_sampled(ChatTurns(tok, TOOLS), MESSAGES["llama3"], sampled)
    reference = reference_ids(path, MESSAGES["llama3"])
    assert tok.decode(episode, skip_special_tokens=False) == tok.decode(reference, skip_special_tokens=False)
    assert episode[starts[2] :] == sampled[2] and not contains(reference, sampled[2])
    assert episode[: starts[2]] == reference[: starts[2]]


@pytest.mark.parametrize(
    "family, end, after, other_stop",
    [("llama3", "<|eot_id|>", "", "<|eom_id|>"), ("qwen2.5", "<|im_end|>", "\n", "<|endoftext|>")],
)
def test_close_writes_what_follows_the_end_token(family, end, after, other_stop, tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir(family))
    turns = ChatTurns(tok, TOOLS)
    [end_id], [other_id] = tok.encode(end), tok.encode(other_stop)
    assert turns.end_of_turn_id == end_id == tok.eos_id
    assert turns.close(end_id) == tok.encode(after)  # the model sampled the end token itself
    assert turns.close(other_id) == turns.close(None) == tok.encode(end + after)  # it did not


def test_qwen3_drops_an_empty_think_block_of_an_earlier_turn(tokenizer_dir):
    """A turn that thought nothing: its sampled '<think>\\n\\n</think>\\n\\n' is in the episode, while
    the template leaves it out of every assistant turn but the last."""
    path = tokenizer_dir("qwen3")
    tok = load_tokenizer(path)
    reasoning = (REASONING[0], "", REASONING[2])
    messages = tool_episode(reasoning)
    sampled = [think(r) + t + "<|im_end|>" for r, t in zip(reasoning, [*map(qwen_call, CALLS), ANSWER])]
    episode, starts = run_episode(ChatTurns(tok, TOOLS), messages, sampled)
    dropped = tok.encode("<think>\n\n</think>\n\n")
    assert episode == with_spans(reference_ids(path, messages), [(starts[1], dropped)])
    assert episode[starts[1] : starts[1] + len(tok.encode(sampled[1]))] == tok.encode(sampled[1])


def test_qwen3_drops_the_reasoning_of_turns_before_the_last_user_message(tokenizer_dir):
    """A game whose environment answers as the user: the template keeps the reasoning of the turns
    after the last user message only, so a re-rendered conversation loses the earlier turns'
    <think> blocks (ids the model sampled and the trainer must score); the episode keeps them."""
    path = tokenizer_dir("qwen3")
    tok = load_tokenizer(path)
    guesses = [("Start in the middle.", "5"), ("Between 6 and 10.", "8"), ("Only 6 or 7 are left.", "7")]
    feedback = ["Higher.", "Lower."]
    messages = [{"role": "user", "content": "Guess my number from 1 to 10."}]
    for (reasoning, guess), reply in zip(guesses, [*feedback, None]):
        messages.append({"role": "assistant", "content": guess, "reasoning_content": reasoning})
        messages += [{"role": "user", "content": reply}] if reply else []
    sampled = [think(r) + g + "<|im_end|>" for r, g in guesses]
    episode, starts = run_episode(ChatTurns(tok, None), messages, sampled)
    reference = reference_ids(path, messages, tools=None)
    dropped = [tok.encode(think(r)) for r, _ in guesses[:2]]
    assert episode == with_spans(reference, list(zip(starts[:2], dropped)))
    for start, text in zip(starts, sampled):
        assert episode[start : start + len(tok.encode(text))] == tok.encode(text)
    assert not contains(reference, tok.encode(sampled[0])) and contains(reference, tok.encode(sampled[2]))


def test_chat_segments_offer_tools_to_sft_conversations(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir("qwen2.5"))
    pieces = tok.chat_segments(MESSAGES["qwen2.5"], tools=TOOLS)
    assert [text for text, assistant in pieces if assistant] == [s + "\n" for s in SAMPLED["qwen2.5"]]
    assert "<tools>" in pieces[0][0] and "".join(text for text, _ in pieces) == tok.render_chat(
        MESSAGES["qwen2.5"], False, TOOLS
    )


def test_a_conversation_the_template_refuses_is_a_data_error(tokenizer_dir):
    path = tokenizer_dir("llama3")
    two_calls = {"role": "assistant", "content": "", "tool_calls": [tool_call("1+1"), tool_call("2+2")]}
    with pytest.raises(DataError, match=f"chat template of '{path}' cannot render .* single tool-calls at once"):
        load_tokenizer(path).chat_segments([QUESTION, two_calls], tools=TOOLS)


TINY_CHAT = str(SHIPPED_CONFIGS / "templates" / "tiny_chat.jinja")


def test_tiny_chat_template_on_the_builtin_tokenizer(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the shipped template is found by its configs/ name from anywhere
    tok = load_tokenizer("", chat_template_file="configs/templates/tiny_chat.jinja")
    messages = [{"role": "system", "content": "Use the calculator."}, *tool_episode()]
    calls = [f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{e}"}}}}</tool_call>' for e in CALLS]
    sampled = [f"{text}<eos>" for text in [*calls, ANSWER]]
    turns = ChatTurns(tok, TOOLS)
    assert turns.end_of_turn_id == tok.eos_id and turns.close(tok.eos_id) == tok.encode("\n")
    episode, _ = run_episode(turns, messages, sampled)
    text = (
        f"<bos>Use the calculator.\nQ:{QUESTION['content']}\n"
        + "".join(f"A:{s}\nR:{r}\n" for s, r in zip(sampled, RESULTS))
        + f"A:{sampled[2]}\n"
    )
    reference = _builtin_hf_tokenizer()
    reference.chat_template = Path(TINY_CHAT).read_text()
    assert reference.apply_chat_template(messages, tokenize=False) == text
    assert episode == reference.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert tok.decode(episode, skip_special_tokens=False) == text and episode.count(tok.eos_id) == 3
    assert turns.delta([]) == tok.encode("A:")  # consecutive turns: the generation prompt alone


def save_with_template(path, template: str | None) -> str:
    hf = _builtin_hf_tokenizer()
    hf.chat_template = template
    hf.save_pretrained(path)
    return str(path)


CHATML = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<eos>{% endfor %}"


def test_a_template_that_rewrites_the_assistant_turn_is_refused_for_deltas(tmp_path):
    # Earlier assistant turns lose their content, as some templates drop their reasoning.
    rewrites = CHATML.replace("{{ m.content }}", "{{ m.content if m.role != 'assistant' or loop.last else '' }}")
    path = save_with_template(tmp_path / "tok", rewrites + "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    turns = ChatTurns(load_tokenizer(path), None)
    with pytest.raises(DataError, match=f"chat template of '{path}' is not prefix-stable for a message delta"):
        turns.delta([{"role": "user", "content": "Higher."}])


def test_a_template_without_an_end_of_turn_is_refused(tmp_path):
    path = save_with_template(tmp_path / "tok", CHATML.replace("<eos>", ""))
    with pytest.raises(DataError, match=f"chat template of '{path}' writes no end-of-turn token"):
        ChatTurns(load_tokenizer(path), None)


def test_chat_template_file_replaces_the_template_and_bad_files_are_config_errors(tmp_path, tokenizer_dir):
    (tmp_path / "plain.jinja").write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    tok = load_tokenizer(tokenizer_dir("qwen2.5"), chat_template_file=str(tmp_path / "plain.jinja"))
    assert tok.render_chat([QUESTION], False) == f"[user]{QUESTION['content']}"
    with pytest.raises(ConfigError, match="chat_template_file='nowhere.jinja' cannot be read"):
        load_tokenizer("", chat_template_file="nowhere.jinja")
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m.content }}")
    with pytest.raises(ConfigError, match="broken.jinja' is not a valid Jinja template"):
        load_tokenizer("", chat_template_file=str(tmp_path / "broken.jinja"))
    (tmp_path / "sp.model").write_bytes(b"")
    with pytest.raises(ConfigError, match="is a SentencePiece file, which has no chat templates"):
        load_tokenizer(str(tmp_path / "sp.model"), chat_template_file=TINY_CHAT)
