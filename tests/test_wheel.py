"""The wheel, built once from a clean copy of the checkout: it holds every module and the shipped configs
(base.yml, the model ymls, the recipes, the chat templates) as files, and installed without the checkout (into a fresh venv
that borrows this interpreter's installed requirements) its `unitrain` command runs the built-in run,
configs/base.yml and a recipe naming `base_config: base.yml` from a directory outside the checkout.
The rule behind it, in process: a relative yml path that does not exist is the shipped config."""

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import REPO, SFT_FAST, cpu_env
from unitrain.checks import load_checked
from unitrain.config import DEFAULT_CONFIG, root_config
from unitrain.errors import ConfigError

CONFIGS = REPO / "src" / "unitrain" / "configs"
# The built-in run, small: 5 steps of a few short rows, no eval.
FAST = [*SFT_FAST, "steps=5"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Built from a clean copy: setuptools would add a stale build/ folder's modules to the wheel.
    # No build isolation: the build uses the setuptools installed here, so it needs no network.
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    for name in ("src", "adapters"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*pip_wheel, "-w", str(tmp / "dist"), str(source)], check=True)
    (built,) = (tmp / "dist").glob("unitrain-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed; the requirements come from this interpreter's
    site-packages through a .pth file (whose own .pth files, such as an editable unitrain's, are not
    run), so the only unitrain it can import is the wheel's."""
    path = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    (site,) = path.glob("lib/python*/site-packages")
    installed = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    (site / "requirements_of_the_tests.pth").write_text("".join(f"{p}\n" for p in installed))
    python = path / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "--no-deps", "--ignore-installed", "-q", str(wheel)], check=True)
    return path


def unitrain(venv: Path, cwd: Path, *args) -> subprocess.CompletedProcess:
    """The venv's `unitrain` command run in `cwd`, on one CPU device."""
    return subprocess.run(
        [venv / "bin" / "unitrain", *args], cwd=cwd, env=cpu_env(1), capture_output=True, text=True, timeout=600
    )


def trained_steps(metrics_file: Path) -> list[int]:
    return [line["step"] for line in map(json.loads, metrics_file.open()) if "loss" in line]


def test_wheel_holds_every_module_and_the_configs_as_files(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = [("unitrain", REPO / "src" / "unitrain"), ("unitrain/adapters", REPO / "adapters")]
    modules = {
        f"{package}/{path.relative_to(folder).as_posix()}"
        for package, folder in sources
        for path in folder.rglob("*.py")
    }
    assert "unitrain/engines/colocated.py" in modules
    assert not modules - names, f"modules missing from the wheel: {sorted(modules - names)}"
    assert not any(n.startswith("adapters/") for n in names)  # never a top-level `adapters` package
    shipped = [*CONFIGS.rglob("*.yml"), *CONFIGS.rglob("*.jinja")]  # the chat templates too
    configs = {f"unitrain/configs/{p.relative_to(CONFIGS).as_posix()}": p for p in shipped}
    assert {
        "unitrain/configs/base.yml",
        "unitrain/configs/models/tiny.yml",
        "unitrain/configs/gsm8k_grpo.yml",
        "unitrain/configs/templates/tiny_chat.jinja",
    } <= set(configs)
    with zipfile.ZipFile(wheel) as archive:
        for name, path in configs.items():
            assert name in names, f"config missing from the wheel: {name}"
            assert archive.read(name) == path.read_bytes(), name  # the file itself, not a link to it


def test_wheel_installs_unitrain_adapters(wheel, tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(tmp_path / "site"), str(wheel)],
        check=True,
    )
    # -S: no site-packages, so only the wheel's copy can be found (the package __init__s import nothing heavy).
    out = subprocess.run(
        [sys.executable, "-S", "-c", "import unitrain.adapters as a; print(a.__file__)"],
        env={"PYTHONPATH": str(tmp_path / "site")},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == str(tmp_path / "site" / "unitrain" / "adapters" / "__init__.py")


def test_the_installed_unitrain_is_the_wheels(venv, tmp_path):
    out = subprocess.run(
        [venv / "bin" / "python", "-c", "import unitrain.config as c; print(c.__file__); print(c.DEFAULT_CONFIG)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    module, base = map(Path, out.stdout.split())
    assert module.is_relative_to(venv) and base.is_relative_to(venv) and base.is_file(), out.stdout
    assert not module.resolve().is_relative_to(REPO)


def test_builtin_run_from_outside_the_checkout(venv, tmp_path):
    proc = unitrain(venv, tmp_path, *FAST)  # no yml: the shipped base.yml
    assert proc.returncode == 0, proc.stderr
    assert trained_steps(tmp_path / "runs" / "default" / "metrics.jsonl") == [0, 1, 2, 3, 4]


def test_shipped_base_yml_and_a_recipe_from_outside_the_checkout(venv, tmp_path):
    assert not (tmp_path / "configs").exists()
    proc = unitrain(venv, tmp_path, "configs/base.yml", "run_name=base", *FAST)
    assert proc.returncode == 0, proc.stderr
    shipped = next(line for line in proc.stdout.splitlines() if "taking the shipped" in line)
    assert str(venv) in shipped and shipped.endswith("unitrain/configs/base.yml")
    assert trained_steps(tmp_path / "runs" / "base" / "metrics.jsonl") == [0, 1, 2, 3, 4]

    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "mine.yml").write_text("base_config: base.yml\nrun_name: mine\nseed: 3\n")
    proc = unitrain(venv, tmp_path, "recipes/mine.yml", *FAST)
    assert proc.returncode == 0, proc.stderr
    assert trained_steps(tmp_path / "runs" / "mine" / "metrics.jsonl") == [0, 1, 2, 3, 4]
    assert "seed: 3" in (tmp_path / "runs" / "mine" / "config.yml").read_text()


def test_a_missing_relative_yml_is_the_shipped_one(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    caplog.set_level("INFO", logger="unitrain")
    assert root_config(Path("configs/base.yml")) == DEFAULT_CONFIG
    assert "config configs/base.yml: no such file here, taking the shipped" in caplog.text
    assert load_checked(["configs/gsm8k_grpo.yml"]).model_name == "qwen2.5-0.5b"
    (tmp_path / "recipe.yml").write_text("base_config: base.yml\nseed: 3\n")
    assert root_config(Path("recipe.yml")) == DEFAULT_CONFIG and load_checked(["recipe.yml"]).seed == 3
    # a base.yml beside the recipe comes first
    (tmp_path / "base.yml").write_text(DEFAULT_CONFIG.read_text().replace("seed: 0 ", "seed: 5 "))
    (tmp_path / "models").symlink_to(DEFAULT_CONFIG.parent / "models")
    (tmp_path / "other.yml").write_text("base_config: base.yml\n")
    assert root_config(Path("other.yml")) == tmp_path / "base.yml" and load_checked(["other.yml"]).seed == 5
    # a path that names no shipped config keeps its own message
    with pytest.raises(ConfigError, match="cannot read config file configs/nothing.yml"):
        load_checked(["configs/nothing.yml"])
