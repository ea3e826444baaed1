"""The environment protocol of multi-turn episodes (rollout/multi_turn.py drives it), gymnasium-style.

`env:` names a factory, a built-in from registry.ENVS or `pkg.module:make_env`; the workflow calls
`make_env(cfg) -> Environment` once per episode, then

    messages = env.reset(record)     # the first messages of the conversation (chat dicts)
    result = env.step(turn)          # turn: the assistant's reply, its tool calls parsed
    # -> StepResult(messages, reward, done): what comes back (tool results, the user's feedback),
    #    this turn's reward and whether the episode is over

`record` is the prompt record, {"prompt": str, "label": str}. The same record must start the same
episode: the n episodes of a record form one GRPO group that shares its prompt, and every process
runs the same episodes (an environment's randomness is seeded from its record). `tools` are the
tool schemas (the "function" format of chat templates and OpenAI) the prompt offers the model.
A malformed tool call reaches `step` as an entry of `turn.tool_call_errors`: feedback for the
model, not an exception. An exception raised by step ends that episode (recorded as end reason
"env_error" and logged); one raised by reset rejects it (logged: there is no conversation to train
on, and the record's group is left out). With `env_timeout`, a step that has not returned when the
episode's time is up ends it too ("env_timeout"), a reset rejects it, and the environment is never
called again (the call runs on a thread of its own, and is left to itself). None of these stops
the run, unless every reset of a step's episodes fails: that is one line naming the environment
and the first error.

Optional capability (DemonstratingEnvironment): `demonstration(record) -> messages`, an expert's
whole conversation for the record (assistant turns with their tool calls), which `mode=sft` trains
on with `dataset_path: builtin` and `env` set: the demos' warm start before GRPO.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict

    def message(self) -> dict:
        """The call as an assistant message's `tool_calls` entry (the chat templates' format)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class AssistantTurn:
    text: str  # the decoded turn, tool-call markup included, without the end-of-turn token
    content: str  # the text outside tool calls
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_errors: tuple[str, ...] = ()  # each malformed call: what was wrong with it


@dataclasses.dataclass(frozen=True)
class StepResult:
    messages: list[dict]  # what the environment says next (role "tool" or "user"); [] when done
    reward: float = 0.0
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    tools: list[dict]  # tool schemas offered in the prompt; [] = none

    def reset(self, record: dict) -> list[dict]:
        """The conversation's first messages for this record."""

    def step(self, turn: AssistantTurn) -> StepResult:
        """The environment's answer to the assistant's turn."""


@runtime_checkable
class DemonstratingEnvironment(Environment, Protocol):
    def demonstration(self, record: dict) -> list[dict]:
        """An expert's whole conversation for the record: the SFT demonstration of its episode."""


@dataclasses.dataclass(frozen=True)
class Tool:
    """A function the model may call: its schema for the chat template and the code that runs it."""

    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    run: Callable[..., str]  # run(**arguments) -> the result text; raises ValueError on bad arguments

    def schema(self) -> dict:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }
