"""The built-in environments and tool-call formats (unitrain/envs): the calculator against Python's own
arithmetic, its refusals, both tool-call formats (well-formed, malformed, several calls, the rendering
round trip), the environments' step sequences and their demonstrations replayed to reward 1."""

import json
import math
import operator
import os
import random
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from helpers import make_cfg
from unitrain.data.builtin import builtin_problem
from unitrain.envs.base import AssistantTurn, Environment, ToolCall
from unitrain.envs.calculator import (
    INVALID_CALL,
    CalculatorEnvironment,
    ToolEnvironment,
    calculate,
    calculator_tool,
    evaluate,
    make_calculator,
)
from unitrain.envs.guess import GuessNumber, make_guess_number
from unitrain.envs.tool_calls import FORMATS, parse_turn, render_call
from unitrain.errors import ConfigError

exact = lambda prompt, answer, label: float(answer.strip() == label.strip())

# ---------------------------------------------------------------- the calculator

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
_OPS.update({"//": operator.floordiv, "%": operator.mod, "**": operator.pow})


def _random_tree(rng: random.Random, depth: int):
    """A random expression: a number, or (op, left, right) with a small int exponent for "**"."""
    if depth == 0 or rng.random() < 0.3:
        return rng.choice([rng.randint(-999, 999), round(rng.uniform(-50, 50), rng.randint(1, 3))])
    op = rng.choice(list(_OPS))
    right = rng.randint(-2, 3) if op == "**" else _random_tree(rng, depth - 1)
    return op, _random_tree(rng, depth - 1), right


def _text(tree, rng: random.Random) -> str:
    if not isinstance(tree, tuple):
        return f"({tree})" if tree < 0 else str(tree)
    op, left, right = tree
    space = rng.choice(["", " "])
    return f"({_text(left, rng)}){space}{op}{space}({_text(right, rng)})"


def _reference(tree):
    """The value by the operator module; OverflowError where a value on the way passes 1e100."""
    if not isinstance(tree, tuple):
        return tree
    op, left, right = tree
    value = _OPS[op](_reference(left), _reference(right))
    if abs(value) > 10**100:
        raise OverflowError
    return value


def test_calculator_equals_python_arithmetic():
    rng = random.Random(0)
    outcomes = {"value": 0, "division by zero": 0, "too large": 0}
    for _ in range(3000):
        tree = _random_tree(rng, depth=3)
        text = _text(tree, rng)
        try:
            expected = _reference(tree)
        except (ZeroDivisionError, OverflowError) as e:
            reason = "division by zero" if isinstance(e, ZeroDivisionError) else "too large"
            with pytest.raises(ValueError, match=reason):
                evaluate(text)
            outcomes[reason] += 1
            continue
        assert evaluate(text) == expected, text
        shown = calculate(text)
        if isinstance(expected, int):
            assert shown == str(expected), text
        else:
            assert math.isclose(float(shown), expected, rel_tol=1e-11, abs_tol=1e-12), (text, shown, expected)
        outcomes["value"] += 1
    assert outcomes["value"] > 2000 and outcomes["division by zero"] > 0, outcomes


@pytest.mark.parametrize(
    "expression, shown",
    [("12*34", "408"), ("6/3", "2"), ("0.1+0.2", "0.3"), ("1/3", "0.333333333333"), ("-0.0", "0"), ("7//2", "3")],
)
def test_calculator_prints_integral_values_as_ints_and_rounds_floats(expression, shown):
    assert calculate(expression) == shown


@pytest.mark.parametrize(
    "expression, reason",
    [
        ("x+1", "the name x"),
        ("__import__('os')", "function calls"),
        ("abs(-1)", "function calls"),
        ("(1).real", "attribute access"),
        ("[1][0]", "subscripts"),
        ("1<2", "comparisons"),
        ("'a'*3", "literal"),
        ("True+1", "literal"),
        ("2j", "literal"),
        ("2^3", r"operator \^"),
        ("1<<100000", "operator <<"),
        ("9**9**9", "too large"),
        ("2**100000000", "too large"),
        ("(-2)**1111", "too large"),
        ("10.0**400", "too large"),
        ("10**100+1", "too large"),
        ("1e400", "too large"),
        ("(-8)**0.5", "no real value"),
        ("1/0", "division by zero"),
        ("1%0.0", "division by zero"),
        ("0**-1", "division by zero"),
        ("1+" * 100 + "1", "longer than 200"),
        ("", "not an arithmetic expression"),
        ("12*34=", "not an arithmetic expression"),
    ],
)
def test_calculator_refuses(expression, reason):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=reason):
        evaluate(expression)
    assert time.perf_counter() - start < 1.0


def test_calculator_bounds_the_largest_allowed_values():
    assert calculate("10**100") == str(10**100)
    assert calculate("-(10**100)") == str(-(10**100))
    with pytest.raises(ValueError, match="string"):
        evaluate(12)


# ---------------------------------------------------------------- tool-call formats


def test_hermes_calls_and_content():
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}\n</tool_call>'
    )
    turn = parse_turn(text, "hermes")
    assert turn.text == text and turn.content == "Let me compute."
    assert turn.tool_calls == (ToolCall("calculator", {"expression": "1+2"}), ToolCall("search", {"q": "x"}))
    assert turn.tool_call_errors == ()
    assert parse_turn("  just 42 \n", "hermes") == AssistantTurn("  just 42 \n", "just 42")


@pytest.mark.parametrize(
    "body, reason",
    [
        ('{"name": "calculator", "arguments": {"expression": "1+2"}', "invalid JSON"),
        ('{"arguments": {"expression": "1"}}', '"name" string'),
        ('{"name": 3, "arguments": {}}', '"name" string'),
        ('{"name": "calculator", "arguments": [1, 2]}', "must be a JSON object"),
        ('{"name": "calculator", "arguments": "1+2"}', "must be a JSON object"),
        ('["calculator"]', "must be a JSON object"),
    ],
)
def test_hermes_malformed_call_is_an_error_entry(body, reason):
    good = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
    turn = parse_turn(f"before {good} <tool_call>\n{body}\n</tool_call> after", "hermes")
    assert turn.tool_calls == (ToolCall("calculator", {"expression": "2*3"}),)
    assert len(turn.tool_call_errors) == 1 and reason in turn.tool_call_errors[0]
    assert "<tool_call>" in turn.tool_call_errors[0]  # says what was expected
    assert turn.content == "before   after"  # the text around the calls, as it was


def test_hermes_unterminated_call():
    turn = parse_turn('ok <tool_call>\n{"name": "calculator", "arguments": {}}', "hermes")
    assert turn.tool_calls == () and turn.content == "ok"
    assert len(turn.tool_call_errors) == 1 and "without </tool_call>" in turn.tool_call_errors[0]


def test_llama3_json_calls_and_plain_answers():
    call = ToolCall("calculator", {"expression": "7*6"})
    for text in (
        '{"name": "calculator", "parameters": {"expression": "7*6"}}',
        '<|python_tag|>{"name": "calculator", "parameters": {"expression": "7*6"}}',
        ' {"name": "calculator", "arguments": {"expression": "7*6"}}\n',
    ):
        turn = parse_turn(text, "llama3_json")
        assert turn.tool_calls == (call,) and turn.content == "" and turn.tool_call_errors == ()
    two = parse_turn('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}} done', "llama3_json")
    assert two.tool_calls == (ToolCall("a", {}), ToolCall("b", {"x": 1})) and two.content == "done"
    plain = parse_turn(" The answer is {42}. ", "llama3_json")
    assert plain.tool_calls == () and plain.tool_call_errors == () and plain.content == "The answer is {42}."


@pytest.mark.parametrize(
    "text, reason",
    [
        ('{"name": "calculator", "parameters": {"expression": "1"', "invalid JSON"),
        ('{"answer": 42}', '"name" string'),
        ('{"name": "calculator", "parameters": 5}', "must be a JSON object"),
        ("<|python_tag|>{oops}", "invalid JSON"),
    ],
)
def test_llama3_json_malformed_call_is_an_error_entry(text, reason):
    turn = parse_turn(text, "llama3_json")
    assert turn.tool_calls == () and len(turn.tool_call_errors) == 1
    assert reason in turn.tool_call_errors[0] and '"parameters"' in turn.tool_call_errors[0]


def test_render_call_writes_the_templates_text():
    call = ToolCall("calculator", {"expression": "1+2"})
    assert render_call(call, "hermes") == (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>'
    )
    assert render_call(call, "llama3_json") == '{"name": "calculator", "parameters": {"expression": "1+2"}}'
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        render_call(call, "mistral")
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        parse_turn("x", "mistral")


def test_render_then_parse_round_trips():
    rng = random.Random(1)
    values = [1, -2.5, "x", 'ünï "quoted" </tool_call>?', None, True, [1, "a"], {"nested": {"k": [1, 2]}}]
    for _ in range(200):
        calls = [
            ToolCall(
                rng.choice(["calculator", "search", "get_weather"]), {f"k{i}": rng.choice(values) for i in range(3)}
            )
            for _ in range(rng.randint(1, 3))
        ]
        hermes = parse_turn("thinking\n" + "\n".join(render_call(c, "hermes") for c in calls), "hermes")
        assert hermes.tool_calls == tuple(calls) and hermes.content == "thinking" and not hermes.tool_call_errors
        llama = parse_turn(render_call(calls[0], "llama3_json"), "llama3_json")
        assert llama.tool_calls == (calls[0],) and llama.content == "" and not llama.tool_call_errors


# ---------------------------------------------------------------- ToolEnvironment


def _turn(text: str, fmt: str = "hermes") -> AssistantTurn:
    return parse_turn(text, fmt)


def _call(expression, fmt: str = "hermes", name: str = "calculator", **extra) -> AssistantTurn:
    return _turn(render_call(ToolCall(name, {"expression": expression, **extra}), fmt), fmt)


def test_tool_environment_step_sequence():
    env = CalculatorEnvironment(exact)
    assert isinstance(env, Environment) and env.tools == [calculator_tool().schema()]
    assert env.reset({"prompt": "12*34=", "label": "408"}) == [{"role": "user", "content": "12*34="}]
    first = env.step(_call("12*34"))
    assert first.messages == [{"role": "tool", "name": "calculator", "content": "408"}]
    assert (first.reward, first.done) == (0.0, False)
    two = env.step(_turn(render_call(ToolCall("calculator", {"expression": "1/0"}), "hermes") + "<tool_call>{}"))
    assert [m["name"] for m in two.messages] == ["calculator", INVALID_CALL] and not two.done
    assert two.messages[0]["content"] == "error: division by zero"
    assert two.messages[1]["content"].startswith("error: <tool_call> without </tool_call>")
    final = env.step(_turn("408"))
    assert (final.messages, final.reward, final.done) == ([], 1.0, True)
    env.reset({"prompt": "2+2=", "label": "4"})
    assert env.step(_turn("5")).reward == 0.0


@pytest.mark.parametrize(
    "turn, error",
    [
        (_call("1+1", name="python"), "error: unknown tool python (tools: calculator)"),
        (_turn(render_call(ToolCall("calculator", {}), "hermes")), "error: calculator needs the argument expression"),
        (_call("1+1", precision=3), "error: calculator has no argument precision (arguments: expression)"),
        (_call(12), "error: the argument expression of calculator must be a string"),
        (_call(True), "error: the argument expression of calculator must be a string"),
        (_call("import os"), "error: not an arithmetic expression: 'import os'"),
    ],
)
def test_tool_environment_reports_bad_calls(turn, error):
    env = CalculatorEnvironment(exact)
    env.reset({"prompt": "1+1=", "label": "2"})
    result = env.step(turn)
    assert [m["content"] for m in result.messages] == [error] and not result.done and result.reward == 0.0


def test_make_calculator_scores_with_the_configured_reward():
    env = make_calculator(make_cfg(reward="exact_match", reward_weights="[0.5]"))
    env.reset({"prompt": "3-12=", "label": "-9"})
    assert env.step(_turn("-9")).reward == 0.5
    env.reset({"prompt": "3-12=", "label": "-9"})
    assert env.step(_turn("9")).reward == 0.0


def _replay(env, record, demo, fmt="hermes") -> float:
    """Plays the demo's assistant turns (rendered in `fmt`) through the env; returns the last reward
    after checking the env says what the demo says."""
    assert env.reset(record) == demo[:1]
    position, result = 1, None
    while position < len(demo):
        message = demo[position]
        assert message["role"] == "assistant" and not (result and result.done)
        calls = [ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
        text = "\n".join([message["content"]] + [render_call(c, fmt) for c in calls]).strip()
        result = env.step(parse_turn(text, fmt))
        assert result.messages == demo[position + 1 : position + 1 + len(result.messages)]
        position += 1 + len(result.messages)
    assert result.done
    return result.reward


@pytest.mark.parametrize("fmt", FORMATS)
def test_calculator_demonstrations_replay_to_reward_one(fmt):
    env = CalculatorEnvironment(exact)
    for index in range(50):
        prompt, label = builtin_problem(index, "train", digits=3, ops="+-*")
        record = {"prompt": prompt, "label": label}
        demo = env.demonstration(record)
        assert [m["role"] for m in demo] == ["user", "assistant", "tool", "assistant"]
        assert demo[1]["tool_calls"] == [ToolCall("calculator", {"expression": prompt[:-1]}).message()]
        assert demo[2]["content"] == label == demo[3]["content"]
        assert _replay(env, record, demo, fmt) == 1.0


def test_calculator_has_no_demonstration_for_other_prompts():
    env = CalculatorEnvironment(exact)
    gsm8k = {"prompt": "Natalia sold clips to 48 of her friends. How many?", "label": "72"}
    with pytest.raises(ValueError, match="no demonstration"):
        env.demonstration(gsm8k)
    with pytest.raises(ValueError, match="the calculator gives 4"):
        env.demonstration({"prompt": "2+2=", "label": "5"})


# ---------------------------------------------------------------- guess the number


def test_guess_number_secret_is_stable_and_spread():
    game = GuessNumber(1, 15)
    prompts = [f"record {i}" for i in range(300)]
    secrets = [game.secret({"prompt": p}) for p in prompts]
    assert all(1 <= s <= 15 for s in secrets) and len(set(secrets)) == 15
    assert secrets == [GuessNumber(1, 15).secret({"prompt": p}) for p in prompts]
    # Another process with another string hash seed draws the same secrets.
    code = (
        "from unitrain.envs.guess import GuessNumber; g = GuessNumber(1, 15); "
        f"print([g.secret({{'prompt': f'record {{i}}'}}) for i in range({len(prompts)})])"
    )
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == secrets


@pytest.mark.parametrize("low, high", [(1, 15), (0, 1), (-20, 100), (1, 1000)])
def test_guess_number_binary_search_demo(low, high):
    game = GuessNumber(low, high)
    bound = math.ceil(math.log2(high - low + 1)) + 1
    for i in range(60):
        record = {"prompt": f"play {i}", "label": ""}
        demo = game.demonstration(record)
        guesses = [m for m in demo if m["role"] == "assistant"]
        assert len(guesses) <= bound and int(guesses[-1]["content"]) == game.secret(record)
        assert _replay(game, record, demo) == 1.0


def test_guess_number_feedback():
    game = GuessNumber(1, 15, max_guesses=3)
    record = {"prompt": "a prompt", "label": ""}
    secret = game.secret(record)
    assert game.reset(record) == [{"role": "user", "content": "1-15?"}]
    no_number = game.step(_turn("hmm"))
    assert no_number.messages == [{"role": "user", "content": "Answer with one number between 1 and 15."}]
    assert (no_number.reward, no_number.done) == (0.0, False)
    below, above = game.step(_turn(f"{secret - 1} or so")), game.step(_turn(str(secret + 1)))
    assert below.messages[0]["content"] == "higher" and above.messages[0]["content"] == "lower"
    out_of_guesses = game.step(_turn(str(secret + 2)))
    assert (out_of_guesses.messages, out_of_guesses.reward, out_of_guesses.done) == ([], 0.0, True)
    game.reset(record)
    assert game.step(_turn(f"It is {secret}.")).reward == 1.0


def test_make_guess_number_reads_its_config_keys():
    game = make_guess_number(SimpleNamespace(guess_number_low=3, guess_number_high=9))
    assert isinstance(game, Environment) and (game.low, game.high) == (3, 9) and game.tools == []
    with pytest.raises(ConfigError, match="guess_number_low"):
        make_guess_number(SimpleNamespace(guess_number_low=9, guess_number_high=9))


# ---------------------------------------------------------------- garbage never raises


def test_garbage_turns_never_raise():
    rng = random.Random(2)
    pieces = ["<tool_call>", "</tool_call>", "<|python_tag|>", "{", "}", '"name"', ":", '"arguments"', "[", "]"]
    pieces += ['"calculator"', '"expression"', '"9**9**9"', "\\", ",", ";", "null", "-7", "ü", "\n", " ", "1e999"]
    envs = [CalculatorEnvironment(exact), GuessNumber(1, 15), ToolEnvironment([], exact)]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 25)))
        for fmt in FORMATS:
            turn = parse_turn(text, fmt)
            assert all(isinstance(e, str) for e in turn.tool_call_errors)
            env = rng.choice(envs)
            env.reset({"prompt": "1+1=", "label": "2"})
            result = env.step(turn)
            assert all(isinstance(m["content"], str) and m["role"] in ("tool", "user") for m in result.messages)
