"""Multi-turn episodes (rollout/multi_turn.py) through the workflow driver (rollout/driver.py) against
a scripted sampler (one call per turn, live rows only, in order), trajectories token in and token
out (the loss mask is exactly the sampled tokens; the sampler's logprobs equal a full forward of the
trajectory), every way an episode ends (an environment that hangs past env_timeout included), and
bad input as a recorded end or one line."""

import dataclasses
import threading
import time
import types

import jax
import numpy as np
import pytest
from flax import nnx

from helpers import REPO, ScriptEnv, make_cfg
from unitrain import train
from unitrain.data.prompt_ids import Prompt
from unitrain.data.tokenizer import load_tokenizer
from unitrain.engines.base import Completions, SamplingParams
from unitrain.engines.buckets import bucket_prompt_length
from unitrain.engines.factory import make_sampler
from unitrain.errors import ConfigError
from unitrain.rollout.driver import make_group, run_groups
from unitrain.rollout.multi_turn import MultiTurn
from unitrain.rollout.workflow import Generate, Sampled, Trajectory, Transcript, Workflow, WorkflowError

TEMPLATE = str(REPO / "configs" / "templates" / "tiny_chat.jinja")
TOK = load_tokenizer("", chat_template_file=TEMPLATE)
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'


class ScriptedSampler:
    """Answers each row with script[prompt][its turn] + EOS, the prompt found in the decoded context and
    the turn counted by the EOS tokens in it; logs the rows of every call."""

    def __init__(self, script: dict[str, list[str]]):
        self.script, self.calls, self.version = script, [], 0

    def update_weights(self, params, version):
        self.version = version

    def generate(self, prompt_ids, sampling, key):
        rows = []
        for context in prompt_ids:
            text = TOK.decode(context, skip_special_tokens=False)
            prompt = next(p for p in self.script if f"Q:{p}\n" in text)
            turn = sum(1 for t in context if t == TOK.eos_id)
            rows.append(TOK.encode(self.script[prompt][turn]) + [TOK.eos_id])
        self.calls.append([TOK.decode(c) for c in prompt_ids])
        n = sampling.max_new_tokens
        tokens = np.zeros((len(rows), n), np.int32)
        lengths = np.asarray([min(len(r), n) for r in rows], np.int32)
        for i, r in enumerate(rows):
            tokens[i, : lengths[i]] = r[:n]
        mask = (np.arange(n)[None] < lengths[:, None]).astype(np.int32)
        logprobs = -0.5 * mask.astype(np.float32)
        return Completions(tokens, mask, logprobs, lengths, self.version)


def workflow(**overrides):
    cfg = make_cfg(
        mode="grpo",
        workflow="multi_turn",
        chat_template_file=TEMPLATE,
        **{"env": "helpers:ScriptEnv", "max_turns": 4, "episode_max_tokens": 256, "rollout_max_response_len": 128}
        | overrides,
    )
    return MultiTurn(types.SimpleNamespace(cfg=cfg, tokenizer=TOK))


def episodes(sampler, wf, records, sampling, key) -> list:
    """One episode of each record through the driver: its trajectory, or None where rejected."""
    groups = {g.prompt.text: g.trajectories[0] for g in run_groups(sampler, wf, records, 1, sampling, key, None)}
    return [groups.get(r.text) for r in records]


def play(wf, script, sampling_len=128):
    sampler = ScriptedSampler(script)
    records = [Prompt((), p, "") for p in script]
    out = episodes(sampler, wf, records, SamplingParams(sampling_len, stop_token_ids=(TOK.eos_id,)), jax.random.key(0))
    return out, sampler


def test_one_sampler_call_per_turn_with_the_live_episodes_in_order():
    script = {"a": ["done"], "b": ["x", "y", "done"], "c": ["x", "done"]}
    episodes, sampler = play(workflow(), script)
    # Turn 0: all three; turn 1: b and c (a finished); turn 2: b only.
    assert [len(c) for c in sampler.calls] == [3, 2, 1]
    assert [c[0].split("Q:")[1][0] for c in sampler.calls] == ["a", "b", "b"]
    assert [t.turns for t in episodes] == [1, 3, 2]
    assert [t.end for t in episodes] == ["env_done"] * 3
    assert [t.reward for t in episodes] == [1.0, 1.5, 1.25]


def test_the_loss_mask_is_exactly_the_sampled_tokens_and_the_context_is_the_template_delta():
    (t,), _ = play(workflow(), {"b": ["x", "done"]})
    sampled = [TOK.encode("x") + [TOK.eos_id], TOK.encode("done") + [TOK.eos_id]]
    # Everything after the prompt: turn 0, the template's glue and the user's "ok", turn 1.
    chat = workflow().chat
    reply = chat.close(TOK.eos_id) + chat.delta([{"role": "user", "content": "ok"}])
    assert t.ids.tolist() == sampled[0] + reply + sampled[1]
    assert t.loss_mask.tolist() == [1] * len(sampled[0]) + [0] * len(reply) + [1] * len(sampled[1])
    assert np.all(t.logprobs[t.loss_mask == 1] == -0.5) and np.all(t.logprobs[t.loss_mask == 0] == 0)
    assert t.turn_index.tolist() == [0] * len(sampled[0]) + [-1] * len(reply) + [1] * len(sampled[1])
    assert set(t.versions[t.loss_mask == 0].tolist()) == {-1}


def test_every_way_an_episode_ends():
    script = {
        "never": ["x"] * 10,  # never done: max_turns
        "boom": ["boom"],  # the environment raises: env_error, the run goes on
        "long": ["y" * 40],  # cut at the turn's budget without EOS: length
    }
    episodes, _ = play(workflow(max_turns=3, rollout_max_response_len=20), script)
    assert [t.end for t in episodes] == ["max_turns", "env_error", "length"]
    assert episodes[0].turns == 3 and episodes[0].reward == 0.75
    assert episodes[2].loss_mask.sum() == 20
    # The episode budget counts every id after the prompt: the second turn does not fit.
    (t,), _ = play(workflow(episode_max_tokens=8), {"tight": ["abcde", "done"]})
    assert t.end == "length" and t.turns == 1 and len(t.ids) < 8


class SlowEnv(ScriptEnv):
    """ScriptEnv whose reset of the prompt "stuck" and step on "hang" take 30 s, and step on "nap"
    0.6 s; it notes the thread of each step."""

    threads = []

    def reset(self, record):
        if record["prompt"] == "stuck":
            time.sleep(30)
        return super().reset(record)

    def step(self, turn):
        SlowEnv.threads.append(threading.current_thread())
        time.sleep(30 if "hang" in turn.content else 0.6 if "nap" in turn.content else 0)
        return super().step(turn)


def slow(**overrides):
    return workflow(env="test_episodes:SlowEnv", **overrides)


def test_a_step_past_env_timeout_ends_the_episode_as_it_stands_without_waiting_for_it():
    start = time.monotonic()
    (t, fine), _ = play(slow(env_timeout=0.5), {"late": ["x", "hang"], "fine": ["x", "done"]})
    assert time.monotonic() - start < 10  # the 30 s step is abandoned at the limit
    # Every sampled token and the reward so far: a recorded episode, trained on as any other.
    assert (t.end, t.turns, t.reward, fine.end) == ("env_timeout", 2, 0.25, "env_done")
    last = TOK.encode("hang") + [TOK.eos_id]
    assert t.ids[-len(last) :].tolist() == last and t.loss_mask.sum() == len(TOK.encode("x")) + 1 + len(last)
    assert slow().metrics([t, fine])["episode_end_env_timeout"] == 0.5


def test_env_timeout_bounds_an_episodes_environment_calls_together():
    (t,), _ = play(slow(env_timeout=1.5), {"naps": ["nap"] * 4})
    assert (t.end, t.turns, t.reward) == ("env_timeout", 3, 0.5)  # 0.6 s twice, the third past 1.5 s


def test_a_reset_past_env_timeout_rejects_the_episode(caplog):
    wf, start = slow(env_timeout=0.5), time.monotonic()
    (stuck, fine), sampler = play(wf, {"stuck": ["done"], "fine": ["done"]})
    assert time.monotonic() - start < 10
    assert stuck is None and fine.end == "env_done" and len(sampler.calls[0]) == 1
    assert wf.failed_resets == 1  # toward the line of a step whose every reset fails
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "env test_episodes:SlowEnv: reset failed on prompt 'stuck', episode rejected: no answer within "
        "env_timeout=0.5s, the call abandoned"
    ]


def test_the_environment_runs_inline_without_env_timeout_and_on_a_daemon_thread_with_it():
    SlowEnv.threads.clear()
    play(slow(), {"a": ["done"]})
    play(slow(env_timeout=5), {"a": ["done"]})
    inline, limited = SlowEnv.threads
    assert inline is threading.main_thread() and limited is not inline and limited.daemon


def test_a_negative_env_timeout_is_one_line():
    with pytest.raises(ConfigError, match="config key 'env_timeout' expects a number of seconds >= 0"):
        make_cfg(env_timeout=-1)


def test_an_episode_that_uses_all_its_turns_ends_max_turns_without_the_unanswered_reply():
    chat = workflow().chat
    turn = TOK.encode("x") + [TOK.eos_id]
    reply = chat.close(TOK.eos_id) + chat.delta([{"role": "user", "content": "ok"}])
    two_turns = turn + reply + turn
    # The last reply would pass episode_max_tokens, but no turn answers it: it is neither kept nor counted.
    for budget in (len(two_turns) + len(reply), 256):
        (t,), _ = play(workflow(max_turns=2, episode_max_tokens=budget), {"never": ["x"] * 3})
        assert (t.end, t.turns, t.reward) == ("max_turns", 2, 0.5)
        assert t.ids.tolist() == two_turns and t.loss_mask.tolist() == [1] * len(turn) + [0] * len(reply) + [1] * len(
            turn
        )
        assert [m["content"] for m in t.messages if m["role"] != "system"][-2:] == ["ok", "x"]


def test_an_episode_whose_first_prompt_is_too_long_is_rejected():
    episodes, sampler = play(workflow(max_prompt_length=12), {"short": ["done"], "a much longer question": ["done"]})
    assert episodes[0].end == "env_done" and episodes[1] is None and len(sampler.calls[0]) == 1


def unreachable_env(cfg):
    raise RuntimeError("no game server at localhost:9")


def test_an_environment_factory_that_raises_at_start_is_one_line_naming_it():
    with pytest.raises(ConfigError) as e:
        workflow(env="test_episodes:unreachable_env")
    assert str(e.value) == (
        "env test_episodes:unreachable_env: making the environment raised RuntimeError: no game server at localhost:9"
    )


def test_an_environment_that_returns_the_wrong_type_is_one_line():
    with pytest.raises(ConfigError, match="step returned a tuple, not an envs.base.StepResult"):
        play(workflow(), {"t": ["tuple"]})


def test_a_reset_that_raises_rejects_the_episode_and_bad_tool_calls_are_feedback():
    episodes, sampler = play(workflow(), {"bad": ["done"], "ok": ["<tool_call>{not json</tool_call>", CALL, "done"]})
    assert episodes[0] is None and len(sampler.calls[0]) == 1
    t = episodes[1]
    assert (t.tool_calls, t.invalid_tool_calls, t.end) == (2, 1, "env_done")
    assert [m["content"] for m in t.messages if m["role"] == "tool"] == ["errors=1", "errors=0"]
    m = workflow().metrics([t])
    assert m["episode_tool_call_valid_rate"] == 0.5 and m["episode_success_rate"] == 1.0
    quiet = dataclasses.replace(t, tool_calls=0, invalid_tool_calls=0)
    game = workflow(env="guess_number").metrics([quiet])  # no tools, no calls: no tool-call figures
    assert not any("tool" in k for k in game) and game["episode_success_rate"] == 1.0


class ClosedEnv(ScriptEnv):
    def reset(self, record):
        raise RuntimeError("the game server refused the record")


def test_a_run_whose_every_reset_fails_says_so_in_one_line(tmp_path, capsys):
    keys = dict(rollout_batch_size=2, n_samples_per_prompt=4, max_sampling_rounds=2)
    argv = [f"base_output_directory={tmp_path}", "mode=grpo", "workflow=multi_turn", "env=test_episodes:ClosedEnv"]
    argv += [f"chat_template_file={TEMPLATE}", "steps=1", "eval_interval=0", "per_device_batch_size=1"]
    assert train.main([str(REPO / "configs" / "base.yml"), *argv, *(f"{k}={v}" for k, v in keys.items())]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and "ran out" not in err
    assert err.startswith("unitrain: env test_episodes:ClosedEnv: reset failed on all 16 episodes")  # 2 x 4 x 2
    assert err.endswith("the first error: RuntimeError: the game server refused the record")


class BadWorkflow(Workflow):
    def __init__(self, how):
        self.how = how

    def episode(self, record):
        if self.how == "yield":
            yield "not a request"
        if self.how == "raise" and record.text != "fine":
            raise KeyError("label")
        turn = yield Generate(TOK.encode(f"Q:{record.text}\n"), 2)
        if self.how == "raise":
            return Transcript(TOK.encode("Q:fine\n")).trajectory(1.0, "stop")
        return {"tokens": turn.tokens}


@pytest.mark.parametrize(
    "how, says",
    [
        ("yield", "workflow test_episodes:BadWorkflow: an episode yielded 'not a request'; it must yield Generate"),
        ("return", "workflow test_episodes:BadWorkflow: an episode returned a dict; it returns a Trajectory or None"),
    ],
)
def test_a_workflow_plugin_that_breaks_the_contract_is_one_line(how, says):
    with pytest.raises(WorkflowError, match=says):
        episodes(
            ScriptedSampler({"q": ["a"]}), BadWorkflow(how), [Prompt((), "q", "")], SamplingParams(4), jax.random.key(0)
        )


def test_a_workflow_that_raises_leaves_its_group_out_and_every_group_raising_is_one_line(caplog):
    records = [Prompt((), p, "") for p in ("fine", "q")]
    sampler, sampling = ScriptedSampler({"fine": ["a"], "q": ["a"]}), SamplingParams(4)
    played = episodes(sampler, BadWorkflow("raise"), records, sampling, jax.random.key(0))
    assert played[0].end == "stop" and played[1] is None
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning == "workflow test_episodes:BadWorkflow raised on prompt 'q', its group left out: KeyError: 'label'"
    with pytest.raises(WorkflowError) as e:  # an evaluation's every prompt: no group at all
        episodes(sampler, BadWorkflow("raise"), records[1:] * 2, sampling, jax.random.key(0))
    assert str(e.value) == (
        "workflow test_episodes:BadWorkflow raised on 2 groups in a row, so no group comes out; "
        "the first error: KeyError: 'label'"
    )


def test_episodes_of_a_record_form_a_group_over_everything_after_the_prompt():
    def trajectory(n_sampled, reward):
        tr = Transcript([7, 8])
        tr.add_sampled(
            Sampled(
                np.arange(n_sampled, dtype=np.int32) + 10,
                np.full(n_sampled, -1.0, np.float32),
                np.full(n_sampled, 3),
                True,
            )
        )
        tr.add_context([5, 5])
        return tr.trajectory(reward, "max_turns", per_reward={"env": reward})

    group = make_group(Prompt((1,), "p", "l"), [trajectory(2, 0.0), trajectory(4, 1.0)])
    assert group.prompt.ids == (7, 8) and [len(t.ids) for t in group.trajectories] == [4, 6]
    assert [t.loss_mask.tolist() for t in group.trajectories] == [[1, 1, 0, 0], [1, 1, 1, 1, 0, 0]]
    assert group.version == 3 and group.rewards.tolist() == [0.0, 1.0] and group.correct.tolist() == [False, True]
    other = Trajectory((9,), *(np.zeros(0, np.int32),) * 5, 0.0, 0, "max_turns")
    with pytest.raises(Exception, match="start from different prompts"):
        make_group(Prompt((1,), "p", "l"), [trajectory(2, 0.0), other])


def test_multi_turn_needs_an_environment():
    with pytest.raises(ConfigError, match="workflow multi_turn needs an environment"):
        make_cfg(mode="grpo", workflow="multi_turn")


def test_sampler_logprobs_of_a_multi_turn_episode_equal_a_full_forward():
    """The colocated sampler on the tiny model, four episodes of three turns: at every sampled token
    the sampler's logprob equals log_softmax of the trajectory's plain forward."""
    from unitrain.run import build_run

    cfg = make_cfg(
        mode="grpo",
        model_name="tiny",
        workflow="multi_turn",
        env="helpers:ScriptEnv",
        chat_template_file=TEMPLATE,
        max_turns=3,
        rollout_max_response_len=6,
        episode_max_tokens=64,
        per_device_batch_size=1,
    )
    run, state = build_run(cfg)
    sampler = make_sampler(run)
    sampler.update_weights(state["params"], 5)
    wf = MultiTurn(run)
    # A random model seldom samples EOS: any letter or digit ends a turn too, so episodes go on.
    stops = (run.tokenizer.eos_id, *run.tokenizer.encode("abcdefghijklmnopqrstuvwxyz0123456789"))
    sampling = SamplingParams(6, temperature=1.0, stop_token_ids=stops)
    records = [Prompt((), p, "") for p in ("12+3=", "7*8=", "1-1=", "40+2=")]
    played = episodes(sampler, wf, records, sampling, jax.random.key(3))
    model = nnx.merge(run.graphdef, state["params"])
    checked = 0
    for t in played:
        seq = np.asarray([*t.prompt_ids, *t.ids], np.int32)
        n, p = len(seq), len(t.prompt_ids)
        logits = model(seq[None], np.arange(n, dtype=np.int32)[None], np.ones((1, n), np.int32))[0][0]
        logp = np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float32), axis=-1))
        expected = logp[np.arange(p - 1, n - 1), seq[p:]]
        sampled = t.loss_mask == 1
        np.testing.assert_allclose(t.logprobs[sampled], expected[sampled], atol=2e-4)
        assert set(t.versions[sampled].tolist()) == {5}
        checked += int(sampled.sum())
    assert checked > 0 and any(t.turns > 1 for t in played)


def test_grpo_rows_of_episodes_put_the_loss_on_sampled_tokens_only():
    from unitrain.rollout.shaping import overlong_filter
    from unitrain.tasks.rl import RLTask, turn_discounts

    def episode(turns, end):
        tr = Transcript([1, 7, 8])
        for i, n in enumerate(turns):
            tr.add_sampled(
                Sampled(np.full(n, 40 + i, np.int32), np.full(n, -0.1 * (i + 1), np.float32), np.full(n, i), True)
            )
            if i + 1 < len(turns):
                tr.add_context([5, 6, 7])
        return tr.trajectory(1.0, end)

    group = make_group(Prompt((), "p", "l"), [episode([2, 3], "env_done"), episode([4], "length")])
    task = types.SimpleNamespace(
        cfg=types.SimpleNamespace(n_samples_per_prompt=2, max_image_patches=0),
        run=types.SimpleNamespace(tokenizer=TOK),
        max_completion=64,
        replay=False,
    )
    rows = RLTask.to_rows(task, [group])
    P, C = bucket_prompt_length(3), bucket_prompt_length(8)  # the prompt's and the longest episode's ids
    assert rows["inputs"].shape == (2, P + C) and rows["targets"].shape == (2, C)
    first, pad = [40, 40, 5, 6, 7, 41, 41, 41], [0] * (C - 8)
    assert rows["inputs"][0, P - 3 : P + 8].tolist() == [1, 7, 8, *first] and rows["targets"][0, :8].tolist() == first
    assert rows["loss_mask"].tolist() == [[1, 1, 0, 0, 0, 1, 1, 1, *pad], [1, 1, 1, 1, 0, 0, 0, 0, *pad]]
    np.testing.assert_allclose(rows["sampler_logprobs"][0, :8], [-0.1, -0.1, 0, 0, 0, -0.2, -0.2, -0.2])
    assert overlong_filter([group])[0].tolist() == [True, False]
    # A later turn's tokens get the episode's advantage in full, an earlier one's discounted per turn after it.
    np.testing.assert_allclose(
        turn_discounts([group], C, 0.5), [[0.5, 0.5, 0, 0, 0, 1, 1, 1, *pad], [1, 1, 1, 1, 0, 0, 0, 0, *pad]]
    )


class NoEpisode:
    def __init__(self, run):
        pass


def test_a_workflow_class_that_is_not_a_workflow_is_one_line():
    from unitrain.rollout.driver import make_workflow

    cfg = make_cfg(mode="grpo", workflow="test_episodes:NoEpisode")
    with pytest.raises(ConfigError, match="is not a subclass of unitrain.rollout.workflow.Workflow"):
        make_workflow(types.SimpleNamespace(cfg=cfg, tokenizer=TOK))


def test_sft_on_an_environments_demonstrations_trains_on_the_assistant_turns():
    """env under mode=sft: the built-in task's records become the calculator's demonstrations (a
    tool call, its result, the answer), rendered by the chat template; the loss is on the assistant's
    turns (the call and the answer, each with the template's end of turn), not on the question or the
    tool's result."""
    from unitrain.data.sft import make_sft_dataset
    from unitrain.envs.factory import demonstrations

    cfg = make_cfg(mode="sft", env="calculator", chat_template_file=TEMPLATE, max_target_length=128, packing=False)
    batch = next(iter(make_sft_dataset(cfg, TOK, 4, demonstration=demonstrations(cfg))))
    for row in range(4):
        ids, weights = batch["inputs"][row], batch["targets_segmentation"][row] > 0
        targets = batch["targets"][row]
        text = TOK.decode(ids, skip_special_tokens=False)
        assert "<tool_call>" in text and "R:" in text
        trained = TOK.decode(targets[weights], skip_special_tokens=False)
        call = text.split("A:")[1].split("<eos>")[0]
        final = text.split("A:")[2].split("<eos>")[0]
        assert trained == f"{call}<eos>\n{final}<eos>\n"  # each turn as the template ends it


def test_config_refuses_an_environment_nothing_uses():
    with pytest.raises(ConfigError, match="is the environment of workflow multi_turn"):
        make_cfg(mode="grpo", env="calculator")
    with pytest.raises(ConfigError, match="trains on its demonstrations of dataset_path builtin"):
        make_cfg(mode="sft", env="calculator", dataset_path="/data/x.jsonl")
    with pytest.raises(ConfigError, match="rolls out RL episodes; mode=sft"):
        make_cfg(mode="sft", workflow="multi_turn", env="calculator")
