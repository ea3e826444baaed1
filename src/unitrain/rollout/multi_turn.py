"""`workflow: multi_turn`: a conversation with an environment (envs/base.py) in the chat template's
turns, token in and token out (rollout/workflow.py's episode form; rollout/driver.py runs it), and
what the step logs of episodes: their metrics and their text."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Generator

import numpy as np

from unitrain import plugins
from unitrain.data.prompt_ids import Prompt
from unitrain.data.turns import ChatTurns
from unitrain.envs.base import StepResult
from unitrain.envs.factory import env_factory
from unitrain.envs.tool_calls import parse_turn
from unitrain.errors import ConfigError, UserError
from unitrain.rollout.workflow import Generate, Sampled, Trajectory, Transcript, Workflow

log = logging.getLogger("unitrain")

EPISODE_ENDS = ("env_done", "max_turns", "length", "env_error", "env_timeout")


class MultiTurn(Workflow):
    """`workflow: multi_turn`: a conversation with the environment named by `env` (envs/base.py).

    The prompt is the chat template over the system prompt, the environment's first messages and its
    tools; each turn the model answers (up to rollout_max_response_len tokens), its tool calls are
    parsed (tool_call_format), and the environment's reply is appended as the template's ids for that
    message delta (data/turns.py), never by re-encoding the conversation. The episode ends when the
    environment says done (env_done), after max_turns turns (max_turns), when a turn is cut without its
    stop token or the episode reaches episode_max_tokens (length), when the environment raises
    (env_error), or when a step does not return within the time the episode has left (env_timeout);
    the environment's reply to the last allowed turn, which no turn answers, is left out. Its reward
    is the sum of the environment's rewards. An episode whose first prompt has more than
    max_prompt_length ids, or whose environment's reset raises or does not return in time, is
    rejected; a step whose episodes all fail their resets stops the run with one line.

    env_timeout > 0 bounds an episode's environment calls (reset and steps) together: each runs on a
    daemon thread waited on for the time left, and one still running then is abandoned with its
    environment, which the episode never calls again (a thread cannot be stopped: it runs on, but
    never holds the process at exit). The episode is recorded as it stands: every token sampled so
    far, the reward so far. With 0 the calls run inline. The limit is wall-clock time: with several
    processes, each playing the same episodes, set it well above the calls' usual times (it is for
    the call that hangs), or one process may end an episode that another goes on with.
    """

    def __init__(self, run):
        super().__init__(run)
        cfg = run.cfg
        if not cfg.env:
            raise ConfigError("workflow multi_turn needs an environment: set env (calculator, guess_number, ...)")
        self.cfg, self.make_env = cfg, env_factory(cfg)
        self.has_tools = bool(tools := self._tools())
        self.chat = ChatTurns(self.tokenizer, tools or None)
        self.system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
        # The episodes a step samples before it gives up short (rollout/executor.py): if none of them could
        # reset, the environment is broken, not the prompts.
        self.step_episodes = (
            (cfg.over_sampling_batch_size or cfg.rollout_batch_size)
            * cfg.n_samples_per_prompt
            * cfg.max_sampling_rounds
        )
        self.resets, self.failed_resets, self.first_reset_error = 0, 0, ""

    def _tools(self) -> list[dict]:
        """The environment's tool schemas; a factory that cannot make one stops the run with one line."""
        try:
            return self.make_env(self.cfg).tools
        except UserError:
            raise
        except Exception as e:
            raise ConfigError(f"env {self.cfg.env}: making the environment raised {plugins.one_line(e)}") from None

    def _reset_failed(self, record: Prompt, e: Exception) -> None:
        """Logs a rejected episode; stops the run once a step's episodes have all failed their resets."""
        log.warning("env %s: reset failed on prompt %r, episode rejected: %s", self.cfg.env, record.text[:80], e)
        self.failed_resets += 1
        self.first_reset_error = self.first_reset_error or plugins.one_line(e)
        if not self.resets and self.failed_resets >= self.step_episodes:
            raise ConfigError(
                f"env {self.cfg.env}: reset failed on all {self.failed_resets} episodes a step samples, so every "
                f"episode was rejected; the first error: {self.first_reset_error}"
            )

    def episode(self, record: Prompt) -> Generator[Generate, Sampled, Trajectory | None]:
        cfg, env, clock = self.cfg, self.make_env(self.cfg), _TimeLimit(self.cfg.env_timeout)
        try:
            first = clock.call(env.reset, {"prompt": record.text, "label": record.label})
        except Exception as e:  # no conversation to record: the episode is rejected, and said so
            self._reset_failed(record, e)
            return None
        self.resets += 1
        messages = [*self.system, *first]
        prompt = self.chat.prompt(messages)
        if len(prompt) > cfg.max_prompt_length:  # as over-long prompts are dropped
            log.warning("env %s: a first prompt of %d ids > max_prompt_length, episode rejected", cfg.env, len(prompt))
            return None
        transcript = Transcript(prompt)
        reward, end, calls, invalid = 0.0, "max_turns", 0, 0
        for number in range(1, cfg.max_turns + 1):
            budget = min(cfg.rollout_max_response_len, cfg.episode_max_tokens - len(transcript))
            if budget < 1:
                end = "length"
                break
            turn = yield Generate(transcript.context(), budget)
            transcript.add_sampled(turn)
            text = self.tokenizer.decode(turn.tokens[:-1] if turn.stopped else turn.tokens)
            messages.append({"role": "assistant", "content": text})
            if not turn.stopped:
                end = "length"
                break
            parsed = parse_turn(text, cfg.tool_call_format)
            calls += len(parsed.tool_calls) + len(parsed.tool_call_errors)
            invalid += len(parsed.tool_call_errors)
            try:
                result = clock.call(env.step, parsed)
            except EnvTimeout as e:  # the tokens so far are the episode: recorded, trained on
                log.warning(
                    "env %s: a step on prompt %r: %s, episode ended (env_timeout)", cfg.env, record.text[:80], e
                )
                end = "env_timeout"
                break
            except Exception as e:
                log.warning("env %s: step failed, episode ended (env_error): %s", cfg.env, e)
                end = "env_error"
                break
            if not isinstance(result, StepResult):
                raise ConfigError(
                    f"env {cfg.env}: step returned a {type(result).__name__}, not an envs.base.StepResult"
                )
            reward += float(result.reward)
            if result.done:
                end = "env_done"
                break
            if number == cfg.max_turns:  # no turn answers the environment's reply: neither built nor kept
                break
            reply = self.chat.close(int(turn.tokens[-1])) + self.chat.delta(result.messages)
            if len(transcript) + len(reply) >= cfg.episode_max_tokens:
                end = "length"
                break
            transcript.add_context(reply)
            messages += result.messages
        return transcript.trajectory(
            reward,
            end,
            per_reward={"env": reward},
            text=self.tokenizer.decode(transcript.ids, skip_special_tokens=False),
            tool_calls=calls,
            invalid_tool_calls=invalid,
            messages=tuple(messages),
        )

    def metrics(self, trajectories: list[Trajectory], prefix: str = "") -> dict:
        """Success rate, turns, tool calls and their validity (where the environment has tools or its
        episodes made calls), sampled tokens, the sampler's live rows, and why episodes ended."""
        if not trajectories:
            return {}
        calls = sum(t.tool_calls for t in trajectories)
        ends = collections.Counter(t.end for t in trajectories)
        tool_calls = {
            "episode_tool_calls_mean": calls / len(trajectories),
            "episode_tool_call_valid_rate": 1.0 - sum(t.invalid_tool_calls for t in trajectories) / calls
            if calls
            else 1.0,
        }
        metrics = {
            "episode_success_rate": np.mean([t.success for t in trajectories]),
            "episode_turns_mean": np.mean([t.turns for t in trajectories]),
            **(tool_calls if self.has_tools or calls else {}),
            "episode_sampled_tokens_mean": np.mean([int(t.loss_mask.sum()) for t in trajectories]),
            # The driver's rows that were live episodes over a round's turns (1: none waited on another);
            # exact for a step of one round, whose sampler calls are its longest episode's turns.
            "episode_live_rows_fraction": sum(t.turns for t in trajectories)
            / (len(trajectories) * max(t.turns for t in trajectories) or 1),
            **{f"episode_end_{reason}": ends[reason] / len(trajectories) for reason in EPISODE_ENDS},
        }
        return {prefix + k: float(v) for k, v in metrics.items()}

    def markdown(self, groups: list, count: int = 2) -> str:
        """A few whole episodes as TensorBoard markdown, each message under its role (tool and
        environment messages marked as such)."""
        parts = []
        for i, t in enumerate([t for g in groups for t in g.trajectories][:count]):
            lines = [f"**episode {i}** reward {t.reward:.3f}, {t.turns} turns, ended: {t.end}"]
            lines += [f"**[{m['role']}]** {m.get('content', '')}" for m in t.messages]
            parts.append("\n\n".join(lines))
        return "\n\n---\n\n".join(parts)


class EnvTimeout(Exception):
    """An environment call still running when its episode's env_timeout ran out."""


class _TimeLimit:
    """An episode's environment calls, `limit` seconds for all of them together (0: no limit, each
    call inline)."""

    def __init__(self, limit: float):
        self.limit, self.left = limit, limit

    def call(self, fn: Callable, arg):
        """fn(arg): its result or its exception; EnvTimeout when it has not returned in the time left."""
        if not self.limit:
            return fn(arg)
        outcome, start = concurrent.futures.Future(), time.monotonic()
        # A daemon thread, not a pool's: a pool joins its threads at exit, and a hung call never ends.
        threading.Thread(target=_settle, args=(outcome, fn, arg), name="env call", daemon=True).start()
        done, _ = concurrent.futures.wait([outcome], timeout=max(self.left, 0.0))
        self.left -= time.monotonic() - start
        if not done:
            raise EnvTimeout(f"no answer within env_timeout={self.limit:g}s, the call abandoned")
        return outcome.result()


def _settle(outcome: concurrent.futures.Future, fn: Callable, arg) -> None:
    try:
        outcome.set_result(fn(arg))
    except BaseException as e:  # the caller's thread raises it, as an inline call would
        outcome.set_exception(e)
