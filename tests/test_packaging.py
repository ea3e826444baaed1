"""`adapters/` ships as the subpackage unitrain.adapters, in editable and in wheel installs, a wheel
holds every module, and what the modules import when loaded is in the core requirements."""

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
import zipfile

import tomllib

import unitrain.adapters
from conftest import REPO


def test_editable_install_maps_adapters_folder():
    assert unitrain.adapters.__file__ == str(REPO / "adapters" / "__init__.py")
    from unitrain.adapters import hf

    assert hf.__file__ == str(REPO / "adapters" / "hf.py")


def test_wheel_contains_and_installs_unitrain_adapters(tmp_path):
    # Built from a clean copy: setuptools would add a stale build/ folder's modules to the wheel.
    source = tmp_path / "source"
    for name in ("src", "adapters"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        check=True,
    )
    (wheel,) = (tmp_path / "dist").glob("unitrain-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    sources = [("unitrain", REPO / "src" / "unitrain"), ("unitrain/adapters", REPO / "adapters")]
    modules = {
        f"{package}/{path.relative_to(folder).as_posix()}"
        for package, folder in sources
        for path in folder.rglob("*.py")
    }
    assert "unitrain/rollout/colocated.py" in modules
    assert not modules - set(names), f"modules missing from the wheel: {sorted(modules - set(names))}"
    assert not any(n.startswith("adapters/") for n in names)  # never a top-level `adapters` package
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


# Modules that a config key loads by name may import more: model_source=tunix loads adapters/tunix.py,
# which needs google-tunix (setup.sh installs it beside the tunix extra).
OPTIONAL_MODULES = {"adapters/tunix.py": {"google-tunix"}}


def _top_level_imports(path) -> set[str]:
    """The top-level package names a module imports when it is loaded (not inside functions)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"unitrain", "__future__"}


def _requirement_names(requirements) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def test_modules_import_only_what_the_core_requirements_install():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = _requirement_names(project["dependencies"])
    distributions = importlib.metadata.packages_distributions()
    files = [*(REPO / "src" / "unitrain").rglob("*.py"), *(REPO / "adapters").glob("*.py")]
    missing = []
    for path in files:
        allowed = core | OPTIONAL_MODULES.get(path.relative_to(REPO).as_posix(), set())
        for name in _top_level_imports(path):
            provided_by = {d.lower().replace("_", "-") for d in distributions.get(name, [name])}
            if not provided_by & allowed:
                missing.append(f"{path.relative_to(REPO)}: {name} (from {sorted(provided_by)})")
    assert not missing, "imported at load time but not a requirement: " + "; ".join(missing)
