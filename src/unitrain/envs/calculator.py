"""The calculator tool and the tool-using environment (`env: calculator`): a safe arithmetic evaluator
(the ast of + - * / // % ** and parentheses over int and float literals, never eval), ToolEnvironment (any
tools: runs the turn's calls and answers with tool messages until a turn without calls, the final answer
the configured reward scores) and the calculator's expert demonstration of the built-in arithmetic task.
"""

from __future__ import annotations

import ast
import functools
import operator
from collections.abc import Callable

from unitrain.envs.base import AssistantTurn, StepResult, Tool, ToolCall
from unitrain.rewards import make_reward_fn

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**100  # every value met on the way, so no step can build a huge number
_MAX_BITS = MAX_MAGNITUDE.bit_length()
INVALID_CALL = "invalid_tool_call"  # the name on the tool message that answers a malformed call

_UNSUPPORTED = {
    ast.Attribute: "attribute access",
    ast.Call: "function calls",
    ast.Subscript: "subscripts",
    ast.Compare: "comparisons",
    ast.BoolOp: "and/or",
    ast.Lambda: "lambdas",
}
_OPERATOR_SYMBOLS = {ast.BitXor: "^", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<", ast.RShift: ">>"}


def _power(base, exponent):
    # Only an int to a non-negative int power is exact arithmetic of unbounded cost: bound it before.
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if (abs(base).bit_length() - 1) * exponent > _MAX_BITS:
            raise ValueError(f"the power {base}**{exponent} is too large (limit {MAX_MAGNITUDE:.0e})")
    result = base**exponent
    if isinstance(result, complex):
        raise ValueError(f"{base}**{exponent} has no real value")
    return result


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: _power,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ValueError saying why for anything else."""
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be a string, not {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):  # bool is an int, and no number
            raise ValueError(f"unsupported literal {node.value!r}: only int and float numbers")
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp):
        if type(node.op) not in _BINARY:
            symbol = _OPERATOR_SYMBOLS.get(type(node.op), type(node.op).__name__)
            raise ValueError(f"unsupported operator {symbol} (operators: + - * / // % **)")
        left, right = _value(node.left), _value(node.right)
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError(f"the result is too large (limit {MAX_MAGNITUDE:.0e})") from None
    what = f"the name {node.id}" if isinstance(node, ast.Name) else _UNSUPPORTED.get(type(node), type(node).__name__)
    raise ValueError(f"unsupported: {what}; only arithmetic")


def _bounded(value: int | float) -> int | float:
    if not abs(value) <= MAX_MAGNITUDE:  # also catches inf and nan
        raise ValueError(f"the result is too large (limit {MAX_MAGNITUDE:.0e})")
    return value


def format_number(value: int | float) -> str:
    """An integral value as an int ("6/3" -> "2"), others to 12 significant digits (0.1+0.2 -> "0.3")."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.12g}"


def calculate(expression: str) -> str:
    return format_number(evaluate(expression))


def calculator_tool() -> Tool:
    return Tool(
        name="calculator",
        description="Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "the expression, e.g. (12+3)*4"}},
            "required": ["expression"],
        },
        run=calculate,
    )


_JSON_TYPES = {"string": str, "number": (int, float), "integer": int, "boolean": bool, "object": dict, "array": list}


def argument_problem(tool: Tool, arguments: dict) -> str | None:
    """What is wrong with a call's arguments by the tool's schema, or None."""
    properties = tool.parameters.get("properties", {})
    missing = [name for name in tool.parameters.get("required", []) if name not in arguments]
    if missing:
        return f"{tool.name} needs the argument {', '.join(missing)}"
    for name, value in arguments.items():
        if name not in properties:
            return f"{tool.name} has no argument {name} (arguments: {', '.join(properties)})"
        expected = _JSON_TYPES.get(properties[name].get("type"), object)
        if not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
            return f"the argument {name} of {tool.name} must be a {properties[name]['type']}"
    return None


class ToolEnvironment:
    """The model may call `tools` for as many turns as it likes; a turn without calls is the final answer,
    scored by score(prompt, answer, label). Every call and every malformed call gets a tool message."""

    def __init__(self, tools: list[Tool], score: Callable[[str, str, str], float]):
        self._by_name = {tool.name: tool for tool in tools}
        self.tools = [tool.schema() for tool in tools]
        self._score = score

    def reset(self, record: dict) -> list[dict]:
        self._prompt, self._label = record["prompt"], record["label"]
        return [{"role": "user", "content": self._prompt}]

    def step(self, turn: AssistantTurn) -> StepResult:
        if not turn.tool_calls and not turn.tool_call_errors:
            return StepResult([], reward=float(self._score(self._prompt, turn.content, self._label)), done=True)
        messages = [_tool_message(call.name, self._run(call)) for call in turn.tool_calls]
        messages += [_tool_message(INVALID_CALL, f"error: {error}") for error in turn.tool_call_errors]
        return StepResult(messages)

    def _run(self, call: ToolCall) -> str:
        tool = self._by_name.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name} (tools: {', '.join(self._by_name) or 'none'})"
        problem = argument_problem(tool, call.arguments)
        if problem:
            return f"error: {problem}"
        try:
            return tool.run(**call.arguments)
        except ValueError as e:
            return f"error: {e}"


def _tool_message(name: str, content: str) -> dict:
    return {"role": "tool", "name": name, "content": content}


class CalculatorEnvironment(ToolEnvironment):
    """ToolEnvironment with the calculator, and the expert's play of the built-in arithmetic task."""

    def __init__(self, score: Callable[[str, str, str], float]):
        super().__init__([calculator_tool()], score)

    def demonstration(self, record: dict) -> list[dict]:
        """For a prompt "<expression>=" (e.g. "12*34=", label "408"): one calculator call, then the label."""
        prompt, label = record["prompt"], record["label"]
        expression = prompt.strip()[:-1]
        try:
            if not prompt.strip().endswith("="):
                raise ValueError("it does not end in '='")
            result = calculate(expression)
        except ValueError as e:
            raise ValueError(
                f"no demonstration for {prompt[:80]!r}: no arithmetic expression ending in '=' ({e})"
            ) from None
        if result != label.strip():
            raise ValueError(f"no demonstration for {prompt!r}: the calculator gives {result}, the label {label!r}")
        call = ToolCall("calculator", {"expression": expression})
        return [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": "", "tool_calls": [call.message()]},
            _tool_message("calculator", result),
            {"role": "assistant", "content": label},
        ]


def make_calculator(cfg) -> CalculatorEnvironment:
    """`env: calculator`: the calculator tool, the final answer scored by the configured reward's total."""
    return CalculatorEnvironment(_final_answer_score(cfg))


@functools.lru_cache(maxsize=4)
def _final_answer_score(cfg):
    """The configured reward's total for one answer, made once per config, not once per episode."""
    reward_fn = make_reward_fn(cfg)
    return lambda prompt, answer, label: float(reward_fn([prompt], [answer], [label])[0][0])
