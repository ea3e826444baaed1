"""`workflow: multi_turn`: a conversation with an environment (envs/base.py) in the chat template's
turns, token in and token out (rollout/workflow.py's episode form; rollout/driver.py runs it), and
what the step logs of episodes: their metrics and their text."""

from __future__ import annotations

import collections
import logging
from collections.abc import Generator

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

EPISODE_ENDS = ("env_done", "max_turns", "length", "env_error")


class MultiTurn(Workflow):
    """`workflow: multi_turn`: a conversation with the environment named by `env` (envs/base.py).

    The prompt is the chat template over the system prompt, the environment's first messages and its
    tools; each turn the model answers (up to rollout_max_response_len tokens), its tool calls are
    parsed (tool_call_format), and the environment's reply is appended as the template's ids for that
    message delta (data/turns.py), never by re-encoding the conversation. The episode ends when the
    environment says done (env_done), after max_turns turns (max_turns), when a turn is cut without its
    stop token or the episode reaches episode_max_tokens (length), or when the environment raises
    (env_error); the environment's reply to the last allowed turn, which no turn answers, is left out.
    Its reward is the sum of the environment's rewards. An episode whose first prompt has more than
    max_prompt_length ids, or whose environment's reset raises, is rejected; a step whose episodes all
    fail their resets stops the run with one line.
    """

    def __init__(self, run):
        super().__init__(run)
        cfg = run.cfg
        if not cfg.env:
            raise ConfigError("workflow multi_turn needs an environment: set env (calculator, guess_number, ...)")
        self.cfg, self.make_env = cfg, env_factory(cfg)
        self.chat = ChatTurns(self.tokenizer, self._tools() or None)
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
        cfg, env = self.cfg, self.make_env(self.cfg)
        try:
            first = env.reset({"prompt": record.text, "label": record.label})
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
                result = env.step(parsed)
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
        """Success rate, turns, tool calls and their validity, sampled tokens, the sampler's live rows,
        and why episodes ended."""
        if not trajectories:
            return {}
        calls = sum(t.tool_calls for t in trajectories)
        ends = collections.Counter(t.end for t in trajectories)
        metrics = {
            "episode_success_rate": np.mean([t.success for t in trajectories]),
            "episode_turns_mean": np.mean([t.turns for t in trajectories]),
            "episode_tool_calls_mean": calls / len(trajectories),
            "episode_tool_call_valid_rate": 1.0 - sum(t.invalid_tool_calls for t in trajectories) / calls
            if calls
            else 1.0,
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
