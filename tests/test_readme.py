"""The README's training commands, read as a new user runs them one after another: each trains a run
of its own (run_name or a recipe's), and each mode but SFT says how many steps it wants."""

import re
import shlex
from collections import Counter

from helpers import REPO
from unitrain.config import load_config

ENTRY = "python -m unitrain.train "


def readme_commands() -> list[list[str]]:
    """The arguments of every `python -m unitrain.train` line of the README's code blocks."""
    blocks = re.findall(r"```(?:bash)?\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line.split(ENTRY, 1)[1].split("#")[0]) for line in lines if ENTRY in line]


def test_each_training_command_of_the_readme_has_a_run_of_its_own_and_a_length():
    trains = [args for args in readme_commands() if args[0] != "--help" and not any("action=" in a for a in args)]
    trains = [args for args in trains if not any(a.startswith("resume_step=") for a in args)]
    configs = [load_config([str(REPO / args[0]), *args[1:]]) for args in trains]
    assert len(configs) >= 15
    runs = Counter(cfg.run_name for cfg in configs)
    assert [name for name, n in runs.items() if n > 1] == [], runs
    for cfg in configs:
        if not cfg.stages and cfg.mode != "sft":
            assert not cfg.is_default("steps"), f"{cfg.run_name}: mode={cfg.mode} takes SFT's steps"
