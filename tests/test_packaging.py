"""`adapters/` is the subpackage unitrain.adapters in an editable install, and what the modules import
when loaded is in the core requirements (the wheel: test_wheel.py)."""

import ast
import importlib.metadata
import re
import sys

import tomllib

import unitrain.adapters
from helpers import REPO


def test_editable_install_maps_adapters_folder():
    assert unitrain.adapters.__file__ == str(REPO / "adapters" / "__init__.py")
    from unitrain.adapters import hf

    assert hf.__file__ == str(REPO / "adapters" / "hf.py")


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
