"""The house reads one way: no import cycle among the modules of src/unitrain and adapters/ (every
import statement counts, those inside functions too, and a module that reads a registry table,
`registry.TABLE`, imports the modules its "module:symbol" entries name), `import
unitrain.config` loads no JAX and no unitrain module but its leaves, and no test file imports another
(their shared builders are in tests/helpers.py)."""

import ast
import json
import subprocess
import sys

from helpers import REPO

# What `import unitrain.config` may load of unitrain: the packages on the way and the leaves below it.
CONFIG_LEAVES = {
    "unitrain",
    "unitrain.config",
    "unitrain.errors",
    "unitrain.registry",
    "unitrain.plugins",  # did_you_mean: config's hints are the plugins' (it imports errors and registry alone)
    "unitrain.adapters",
    "unitrain.adapters.hf_config",
}


def module_files() -> dict:
    """{dotted module name: path} of unitrain's modules; adapters/ is installed as unitrain.adapters."""
    files = {}
    for root, package in ((REPO / "src" / "unitrain", "unitrain"), (REPO / "adapters", "unitrain.adapters")):
        for path in root.rglob("*.py"):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imported_names(module: str, path, modules) -> set:
    """The modules of `modules` that `module` imports anywhere in its file: `from pkg import x` names
    pkg and pkg.x when that is a module; importing a module also runs its parent packages."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    with_parents = {".".join(name.split(".")[:i]) for name in names for i in range(1, name.count(".") + 2)}
    return {name for name in with_parents if name in modules and name != module}


def resolved_names(path, tables: dict, modules) -> set:
    """The modules named by the registry tables that the file reads (`registry.TABLE`)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and getattr(node.value, "id", "") == "registry":
            names |= {spec.split(":")[0] for spec in tables.get(node.attr, ())}
    return names & set(modules)


def registry_tables() -> dict:
    """{TABLE: its "module:symbol" specs} of the registry's seam tables (dicts) and spec lists (tuples)."""
    from unitrain import registry

    tables = {k: v.values() if isinstance(v, dict) else v for k, v in vars(registry).items() if k.isupper()}
    return {
        k: [s for s in v if isinstance(s, str) and ":" in s] for k, v in tables.items() if isinstance(v, (dict, tuple))
    }


def import_graph() -> dict:
    files, tables = module_files(), registry_tables()
    return {
        module: (imported_names(module, path, files) | resolved_names(path, tables, files)) - {module}
        for module, path in files.items()
    }


def cycles(graph: dict) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted."""
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        reach[start] = seen
    components = {frozenset({m} | {n for n in reach[m] if m in reach[n]}) for m in graph}
    return sorted(sorted(c) for c in components if len(c) > 1)


def test_the_graph_sees_function_level_relative_and_parent_imports(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from . import b\n")
    (package / "b.py").write_text("from .c import x\nimport pkg.d.e\n")
    modules = {"pkg": 0, "pkg.a": 0, "pkg.b": 0, "pkg.c": 0, "pkg.d": 0, "pkg.d.e": 0}
    assert imported_names("pkg.a", package / "a.py", modules) == {"pkg", "pkg.b"}
    assert imported_names("pkg.b", package / "b.py", modules) == {"pkg", "pkg.c", "pkg.d", "pkg.d.e"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    (package / "e.py").write_text("from pkg import registry\nplugins.resolve(name, registry.SEAM, 'key')\n")
    assert resolved_names(package / "e.py", {"SEAM": ["pkg.c:f", "other:g"]}, modules) == {"pkg.c"}
    (package / "f.py").write_text("from pkg import registry\nfor spec in registry.CHECKS:\n    pass\n")
    assert resolved_names(package / "f.py", {"CHECKS": ["pkg.d.e:CHECKS"]}, modules) == {"pkg.d.e"}


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles, each among these modules: " + "; ".join(" <-> ".join(c) for c in found)


def test_importing_config_loads_no_jax_and_only_its_leaves():
    code = "import json, sys, unitrain.config; print(json.dumps(sorted(sys.modules)))"
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout))
    assert not {"jax", "jaxlib", "flax", "optax"} & loaded
    assert {m for m in loaded if m == "unitrain" or m.startswith("unitrain.")} <= CONFIG_LEAVES


def test_no_test_file_imports_another():
    """A test file takes shared builders from helpers.py (or conftest.py's fixtures), never from another
    test file: importing one would also run its module-level set-up and tie the two files' edits."""
    tests = {path.stem: path for path in (REPO / "tests").rglob("test_*.py")}
    found = {
        f"{name} imports {imported}" for name, path in tests.items() for imported in imported_names(name, path, tests)
    }
    assert not found, sorted(found)
