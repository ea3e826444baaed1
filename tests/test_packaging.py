"""`adapters/` ships as the subpackage unitrain.adapters, in editable and in wheel installs, and a wheel holds every module."""

import shutil
import subprocess
import sys
import zipfile

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
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(source)], check=True)
    (wheel,) = (tmp_path / "dist").glob("unitrain-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    sources = [("unitrain", REPO / "src" / "unitrain"), ("unitrain/adapters", REPO / "adapters")]
    modules = {f"{package}/{path.relative_to(folder).as_posix()}" for package, folder in sources
               for path in folder.rglob("*.py")}
    assert "unitrain/rollout/colocated.py" in modules
    assert not modules - set(names), f"modules missing from the wheel: {sorted(modules - set(names))}"
    assert not any(n.startswith("adapters/") for n in names)  # never a top-level `adapters` package
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(tmp_path / "site"),
                    str(wheel)], check=True)
    # -S: no site-packages, so only the wheel's copy can be found (the package __init__s import nothing heavy).
    out = subprocess.run([sys.executable, "-S", "-c", "import unitrain.adapters as a; print(a.__file__)"],
                         env={"PYTHONPATH": str(tmp_path / "site")}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(tmp_path / "site" / "unitrain" / "adapters" / "__init__.py")
