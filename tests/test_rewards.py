"""Tests for unitrain.rewards: the built-in rewards on true examples (math-verify's real behaviour, real
GSM8K lines), weights, plugins imported only when named, and one-sentence errors."""

import json
import math
import sys
import threading

import numpy as np
import pytest

from helpers import REPO
from unitrain.checks import load_checked
from unitrain.errors import ConfigError, UserError
from unitrain.rewards import RewardError, final_answer, make_reward_fn, overlong_penalty

GSM8K_TEST = REPO.parent / "shared/data/gsm8k/test.jsonl"


def rewards(*overrides):
    return make_reward_fn(load_checked([str(REPO / "configs/base.yml"), *overrides]))


def score(fn, completion, label, prompt="question?"):
    total, _ = fn([prompt], [completion], [label])
    return float(total[0])


def config_error(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        rewards(*overrides)
    return str(e.value)


def test_defaults():
    fn = rewards()
    assert fn.names == ("exact_match",) and fn.weights == (1.0,)


# ---------------------------------------------------------------- math


@pytest.mark.parametrize(
    "label, completion, expected",
    [
        ("\\frac{1}{2}", "The answer is $\\boxed{0.5}$", 1.0),
        ("\\frac{1}{2}", "Halving gives $\\frac{2}{4}$, so the answer is $\\boxed{\\dfrac{2}{4}}$", 1.0),
        ("\\frac{1}{2}", "so the answer is 1/2", 1.0),
        ("\\frac{1}{2}", "The answer is $\\boxed{0.25}$", 0.0),
        # A bare LaTeX label is parsed inside $...$: raw, "\sqrt{2}/2" parses to nothing and "3\sqrt{3}" to 3.
        ("\\sqrt{2}/2", "$\\boxed{\\frac{1}{\\sqrt{2}}}$", 1.0),
        ("3\\sqrt{3}", "so $\\boxed{\\sqrt{27}}$", 1.0),
        ("3\\sqrt{3}", "so $\\boxed{3}$", 0.0),
        ("$\\boxed{\\pi}$", "The answer is $\\pi$.", 1.0),
        ("\\frac{1}{2}", "I do not know.", 0.0),
        # GSM8K labels count by their final answer only.
        ("She sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "48 + 24 = 72 clips, so the answer is 72", 1.0),
        ("She sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "#### 72", 1.0),
        ("She sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "#### 24", 0.0),
        ("... #### 1,000", "The answer is 1000", 1.0),
    ],
)
def test_math(label, completion, expected):
    assert score(rewards("reward=math"), completion, label) == expected


# Adversarial completions: only the final answer counts (the last \\boxed{}, "####" line or "the
# answer is"); an intermediate result equal to the gold one is no answer. Each reward sees them all.
ADVERSARIAL = [
    # no final answer at all: the gold number only as an intermediate result
    ("We compute 5*4=20 and then we are not sure about the rest", "20", 0.0),
    ("48 + 24 = 72 clips, so 72", "#### 72", 0.0),
    ("Let me find the answer: 5*4=20, then I add 3 and get something.", "20", 0.0),
    # several boxed answers: the last one counts
    ("First $\\boxed{20}$, no wait, the result is $\\boxed{23}$", "20", 0.0),
    ("First $\\boxed{23}$, no wait, the result is $\\boxed{20}$", "20", 1.0),
    # the final answer wrong, the gold one met on the way
    ("5*4=20, and 20+3=23.\n#### 23", "20", 0.0),
    ("The answer is 17, since 4*5=20.", "20", 0.0),
    # trailing chatter after the final answer does not move it
    ("So 4*5=20.\n#### 20\nLet me double-check: 4*5 is 20, minus 3 is 17, plus 1 is 18.", "20", 1.0),
    ("The answer is 20. To check: 20-3=17, 17+1=18", "20", 1.0),
    ("\\boxed{20}. I double-checked, and the answer is indeed right; 9 + 9 = 18.", "20", 1.0),
    # a completion that is nothing but its answer states it
    ("20", "20", 1.0),
    ("20.", "#### 20", 1.0),
    # an unclosed box states nothing
    ("5*4 = 20 so \\boxed{20", "20", 0.0),
]


@pytest.mark.parametrize("reward", ["math", "gsm8k"])
@pytest.mark.parametrize("completion, label, expected", ADVERSARIAL)
def test_only_the_final_answer_counts(reward, completion, label, expected):
    assert score(rewards(f"reward={reward}"), completion, label) == expected


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("72", "72"),
        ("1,000.", "1,000"),
        ("$\\frac12$", "$\\frac12$"),
        ("I think 72", None),
        ("To get the answer: 5*4=20", None),
        ("The answer is $\\boxed{0.5}$", "0.5"),
        ("$\\boxed{\\frac{1}{2}}$ is the answer", "\\frac{1}{2}"),
        ("#### $1,000 dollars", "$1,000"),
        ("The answer is $13.", "$13"),
        ("Answer: $x = 5$ and more", "$x = 5$"),
        ("Final Answer: The final answer is $\\frac{1}{2}$. I hope it is correct.", "$\\frac{1}{2}$"),
    ],
)
def test_final_answer(completion, expected):
    assert final_answer(completion) == expected


def test_math_unparseable_label_scores_zero_and_warns(caplog):
    with caplog.at_level("WARNING", logger="unitrain"):
        assert score(rewards("reward=math"), "42", "") == 0.0
    assert "cannot parse the label" in caplog.text


def test_math_outside_the_main_thread():
    """math-verify's timeouts use signal.alarm, which raises off the main thread: there they are off."""
    fn, out = rewards("reward=math"), []
    thread = threading.Thread(target=lambda: out.append(score(fn, "$\\boxed{0.5}$", "\\frac{1}{2}")))
    thread.start()
    thread.join()
    assert out == [1.0]


# ---------------------------------------------------------------- gsm8k


def test_gsm8k_on_real_lines():
    if not GSM8K_TEST.exists():
        pytest.skip(f"{GSM8K_TEST} is absent")
    rows = [json.loads(line) for line in GSM8K_TEST.read_text().splitlines()[:50]]
    answers = [r["answer"] for r in rows]
    fn = rewards("reward=gsm8k")
    total, per = fn([r["question"] for r in rows], answers, answers)
    assert total.tolist() == [1.0] * 50 and per["gsm8k"].dtype == np.float32
    # The same solutions with the final number changed: all wrong.
    wrong = []
    for a in answers:
        head, _, gold = a.rpartition("####")
        wrong.append(f"{head}#### {int(gold.strip().replace(',', '')) + 1}")
    assert fn([""] * 50, wrong, answers)[0].tolist() == [0.0] * 50
    # Without a #### line only a stated answer counts, not the last number of the reasoning.
    gold = answers[0].rpartition("####")[2].strip()
    assert score(fn, f"So she makes {gold} dollars.", answers[0]) == 0.0
    assert score(fn, f"So the answer is {gold} dollars.", answers[0]) == 1.0


@pytest.mark.parametrize(
    "completion, label, expected",
    [
        ("so the answer is 1,000 dollars", "... #### 1,000", 1.0),
        ("#### 1000", "... #### 1,000", 1.0),
        ("#### 1,000", "... #### 1000", 1.0),
        ("#### 1,000.", "#### 1000", 1.0),
        ("#### 3.50", "#### 3.5", 1.0),
        ("#### -7", "#### -7", 1.0),
        ("#### 7", "#### -7", 0.0),
        ("I think 72 but #### 73", "#### 72", 0.0),  # the #### line wins over earlier numbers
        ("no number at all", "#### 72", 0.0),
        ("72", "72", 1.0),  # a label reduced to its answer already
    ],
)
def test_gsm8k_numbers(completion, label, expected):
    assert score(rewards("reward=gsm8k"), completion, label) == expected


def test_gsm8k_label_without_number_is_an_error():
    with pytest.raises(RewardError, match="reward 'gsm8k' raised ValueError: the label has no number"):
        score(rewards("reward=gsm8k"), "#### 3", "three")


# ---------------------------------------------------------------- exact_match and format


def test_exact_match():
    fn = rewards("reward=exact_match")
    assert fn([""] * 3, [" 42\n", "42.", "41"], ["42", "42", "42"])[0].tolist() == [1.0, 0.0, 0.0]


def test_format_default_pattern():
    fn = rewards("reward=format")
    completions = ["step 1\nstep 2\n#### 1,234", "####72", "#### -0.5", "The answer is 72", "#### seventy"]
    assert fn([""] * 5, completions, [""] * 5)[0].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_format_custom_pattern_spans_lines():
    fn = rewards("reward=format", "format_reward_pattern=^<think>.*</think>\\s*<answer>.*</answer>$")
    assert score(fn, "<think>a\nb</think>\n<answer>7</answer>", "") == 1.0
    assert score(fn, "<answer>7</answer>", "") == 0.0
    assert "config key 'format_reward_pattern' is not a valid regular expression" in config_error(
        "reward=format", "format_reward_pattern=("
    )


# ---------------------------------------------------------------- weights


def test_weights_combine():
    fn = rewards("reward=exact_match,format", "reward_weights=[2.0, 0.5]")
    total, per = fn(["p"] * 3, ["#### 7", "#### 8", "7"], ["#### 7", "#### 7", "#### 7"])
    assert fn.names == ("exact_match", "format")
    assert per["exact_match"].tolist() == [1.0, 0.0, 0.0] and per["format"].tolist() == [1.0, 1.0, 0.0]
    assert total.dtype == np.float32 and total.shape == (3,)
    np.testing.assert_allclose(total, 2.0 * per["exact_match"] + 0.5 * per["format"])
    np.testing.assert_allclose(rewards("reward=exact_match,format")(["p"], ["#### 7"], ["#### 7"])[0], [2.0])


def test_weight_errors():
    assert "config key 'reward_weights' has 1 weights but config key 'reward' names 2 rewards" in config_error(
        "reward=math,format", "reward_weights=[1.0]"
    )
    assert "reward_weights' expects a non-empty list of finite numbers" in config_error("reward_weights=[1, .nan]")
    assert "config key 'reward' expects a comma list" in config_error("reward=math,,format")
    assert "names a reward twice" in config_error("reward=format,format")


# ---------------------------------------------------------------- plugins and errors

PLUGIN = """
import math
CONSTANT = 3
def score(prompt, completion, label):
    return len(completion) / 10
def explode(prompt, completion, label):
    if completion.startswith("bad"):
        raise ValueError("boom")
    return 1.0
def nan(prompt, completion, label):
    return math.nan
def text(prompt, completion, label):
    return "1.0"
"""


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    (tmp_path / "myplug.py").write_text(PLUGIN)
    (tmp_path / "otherplug.py").write_text("raise RuntimeError('imported although not named')\n")
    (tmp_path / "brokenplug.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("myplug", "otherplug", "brokenplug"):  # forget them again after the test
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield tmp_path
    for name in ("myplug", "otherplug", "brokenplug"):
        sys.modules.pop(name, None)


def test_plugin_is_used_and_only_named_modules_are_imported(plugin_dir):
    fn = rewards("reward=myplug:score,exact_match", "reward_weights=[1.0, 10.0]")
    total, per = fn(["p", "p"], ["abcd", "xy"], ["abcd", "zz"])
    np.testing.assert_allclose(per["myplug:score"], [0.4, 0.2])
    np.testing.assert_allclose(total, [10.4, 0.2])
    assert "myplug" in sys.modules and "otherplug" not in sys.modules and "brokenplug" not in sys.modules


def test_plugin_name_errors(plugin_dir):
    assert "config key 'reward' names 'nosuchmod_xyz:f' but module 'nosuchmod_xyz' is not found" in config_error(
        "reward=nosuchmod_xyz:f"
    )
    assert "has no attribute 'scor'; did you mean 'score'?" in config_error("reward=myplug:scor")
    assert "'CONSTANT' is a int, not a function" in config_error("reward=myplug:CONSTANT")
    msg = config_error("reward=brokenplug:f")
    assert "importing 'brokenplug' failed: ModuleNotFoundError" in msg and "no_such_dependency_xyz" in msg
    assert "not of the form pkg.module:symbol" in config_error("reward=myplug:")


def test_unknown_builtin_did_you_mean():
    msg = config_error("reward=mathh")
    assert "config key 'reward' names unknown reward 'mathh'; did you mean 'math'?" in msg
    assert "\n" not in msg


def test_reward_that_raises(plugin_dir):
    fn = rewards("reward=myplug:explode")
    long_prompt = "Q" * 1000
    with pytest.raises(RewardError) as e:
        fn(["ok", long_prompt], ["fine", "bad completion"], ["l1", "gold label"])
    msg = str(e.value)
    assert isinstance(e.value, UserError) and "\n" not in msg
    assert "reward 'myplug:explode' raised ValueError: boom" in msg
    assert "completion='bad completion'" in msg and "label='gold label'" in msg
    assert "Q" * 200 + "..." in msg and "Q" * 201 not in msg  # the prompt is clipped


@pytest.mark.parametrize("name, shown", [("nan", "nan"), ("text", "'1.0'")])
def test_reward_returning_a_non_number(plugin_dir, name, shown):
    with pytest.raises(
        RewardError, match=f"reward 'myplug:{name}' returned {shown}, not a finite number on the sample"
    ):
        rewards(f"reward=myplug:{name}")(["p"], ["c"], ["l"])


def test_inputs_must_match_in_length():
    with pytest.raises(ValueError, match="differ in length"):
        rewards()(["p"], ["a", "b"], ["l", "l"])
    total, per = rewards()([], [], [])
    assert total.shape == (0,) and math.isclose(total.sum(), 0.0) and per["exact_match"].shape == (0,)


def test_overlong_penalty_is_dapos_linear_buffer():
    lengths = np.arange(0, 21)
    got = overlong_penalty(lengths, max_len=20, buffer_len=4, factor=2.0)
    # Independent: 0 up to L_max - L_cache = 16, then -factor * (len - 16) / 4, -2 at 20.
    want = [0.0 if n <= 16 else -2.0 * (n - 16) / 4 for n in lengths]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got.dtype == np.float32 and got[18] == -1.0 and got[20] == -2.0
