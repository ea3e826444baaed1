"""env reasoning_gym (envs/reasoning_gym.py) against reasoning-gym's own datasets: the entry a record
draws, the scoring of answers by the dataset's score_answer, the retry after a wrong answer, the
demonstration, and the one-line errors (package missing, unknown or unusable task)."""

import hashlib
import os
import subprocess
import sys
import types

import pytest
import reasoning_gym

from helpers import REPO, make_cfg
from unitrain.checks import load_checked
from unitrain.envs.base import AssistantTurn, Environment
from unitrain.envs.reasoning_gym import FEEDBACK, make_reasoning_gym
from unitrain.errors import ConfigError

TASKS = ["basic_arithmetic", "chain_sum", "leg_counting"]
RECORD = {"prompt": "What is 12 + 30?", "label": "42"}


def cfg(task, seed=0):
    return types.SimpleNamespace(reasoning_gym_task=task, reasoning_gym_seed=seed)


def reference_entry(task, seed, prompt):
    """The entry the contract names: sha256 of the prompt, first 8 bytes big-endian, modulo the size of
    a dataset made afresh by reasoning-gym itself."""
    dataset = reasoning_gym.create_dataset(task, seed=seed)
    index = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") % len(dataset)
    return dataset, dataset[index]


def reply(text):
    return AssistantTurn(text=text, content=text)


@pytest.mark.parametrize("task", TASKS)
def test_the_question_is_the_entry_and_its_answer_ends_the_episode(task):
    env = make_reasoning_gym(cfg(task, seed=5))
    assert isinstance(env, Environment) and env.tools == []
    dataset, entry = reference_entry(task, 5, RECORD["prompt"])
    assert env.reset(RECORD) == [{"role": "user", "content": entry["question"]}]
    assert dataset.score_answer(entry["answer"], entry) == 1.0
    result = env.step(reply(entry["answer"]))
    assert (result.reward, result.done, result.messages) == (1.0, True, [])


@pytest.mark.parametrize("task", TASKS)
def test_a_wrong_answer_gets_feedback_and_the_next_try_counts(task):
    env = make_reasoning_gym(cfg(task))
    _, entry = reference_entry(task, 0, RECORD["prompt"])
    env.reset(RECORD)
    wrong = env.step(reply("I do not know."))
    assert (wrong.reward, wrong.done) == (0.0, False)
    assert wrong.messages == [{"role": "user", "content": FEEDBACK}]
    # the second try, reasoning first and the answer in reasoning-gym's tags
    right = env.step(reply(f"Adding it all up.\n<answer>{entry['answer']}</answer>"))
    assert (right.reward, right.done) == (1.0, True)


def test_a_partly_right_answer_is_wrong():
    # the base scorer gives len(answer) / len(reply) when the reply contains the answer: not correct
    env = make_reasoning_gym(cfg("leg_counting"))
    _, entry = reference_entry("leg_counting", 0, RECORD["prompt"])
    env.reset(RECORD)
    assert 0 < env.dataset.score_answer(f"{entry['answer']} legs", entry) < 1
    assert env.step(reply(f"{entry['answer']} legs")).done is False


def test_a_scorer_that_raises_is_a_wrong_answer(monkeypatch):
    env = make_reasoning_gym(cfg("basic_arithmetic"))
    env.reset(RECORD)

    def broken(answer, entry):
        raise ValueError(f"cannot parse {answer!r}")

    monkeypatch.setattr(env.dataset, "score_answer", broken)
    assert env.step(reply("<answer>((</answer>")).messages == [{"role": "user", "content": FEEDBACK}]


def test_the_same_record_draws_the_same_entry_in_every_process():
    prompts = [f"prompt {i}" for i in range(12)]
    first = [make_reasoning_gym(cfg("chain_sum")).reset({"prompt": p})[0]["content"] for p in prompts]
    again = [make_reasoning_gym(cfg("chain_sum")).reset({"prompt": p})[0]["content"] for p in prompts]
    assert first == again
    assert len(set(first)) > 6  # the prompts spread over the dataset
    # another process with another str hash seed draws the same entries
    code = (
        "import sys, types; from unitrain.envs.reasoning_gym import make_reasoning_gym\n"
        "env = make_reasoning_gym(types.SimpleNamespace(reasoning_gym_task='chain_sum', reasoning_gym_seed=0))\n"
        "for p in sys.argv[1:]: print(repr(env.reset({'prompt': p})[0]['content']))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code, *prompts], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [repr(q) for q in first]


def test_the_seed_picks_the_dataset():
    questions = {
        seed: [make_reasoning_gym(cfg("basic_arithmetic", seed)).reset({"prompt": f"p{i}"}) for i in range(5)]
        for seed in (0, 1)
    }
    assert questions[0] != questions[1]
    _, entry = reference_entry("basic_arithmetic", 1, "p3")
    assert questions[1][3][0]["content"] == entry["question"]


def test_the_demonstration_answers_the_question_right():
    env = make_reasoning_gym(cfg("basic_arithmetic"))
    _, entry = reference_entry("basic_arithmetic", 0, RECORD["prompt"])
    demo = env.demonstration(RECORD)
    assert [m["role"] for m in demo] == ["user", "assistant"]
    assert demo[0]["content"] == entry["question"]
    assert env.reset(RECORD) == demo[:1]
    assert env.step(reply(demo[1]["content"])).done is True


def test_a_task_without_reference_answers_has_no_demonstration():
    env = make_reasoning_gym(cfg("rush_hour"))
    env.reset(RECORD)  # its episodes still run: the scorer checks the moves
    with pytest.raises(ConfigError, match="rush_hour has no reference answers to demonstrate"):
        env.demonstration(RECORD)


def test_the_recipe_and_the_base_config_make_the_environment():
    recipe = load_checked([str(REPO / "configs" / "reasoning_gym_grpo.yml")])
    assert (recipe.workflow, recipe.env, recipe.max_turns) == ("multi_turn", "reasoning_gym", 3)
    for config in (recipe, make_cfg(reasoning_gym_task="leg_counting", reasoning_gym_seed=7)):
        _, entry = reference_entry(config.reasoning_gym_task, config.reasoning_gym_seed, RECORD["prompt"])
        assert make_reasoning_gym(config).reset(RECORD)[0]["content"] == entry["question"]


def test_an_unknown_task_names_real_ones():
    with pytest.raises(ConfigError) as error:
        make_reasoning_gym(cfg("chainsum"))
    message = str(error.value)
    assert "\n" not in message and "'chainsum' is not a reasoning-gym dataset" in message
    assert "chain_sum" in message


def test_a_task_that_cannot_be_made_is_one_line():
    # composite combines other datasets and needs a config of its own
    with pytest.raises(ConfigError, match="reasoning-gym cannot make dataset 'composite'"):
        make_reasoning_gym(cfg("composite"))


def test_the_missing_package_is_one_line_naming_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "reasoning_gym" or m.startswith("reasoning_gym.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(ConfigError) as error:
        make_reasoning_gym(cfg("basic_arithmetic"))
    message = str(error.value)
    assert "\n" not in message and "pip install 'unitrain[envs]'" in message
