"""The packages form a hierarchy (the README's "how it works" lists it): each imports only those
below it, the core is torch-free (the simulator runs it), and nothing imports the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import conveyor

ROOT = Path(conveyor.__file__).parent
# Lowest first; a package may import its own modules and those of lower layers only.
LAYERS = [
    {"outputs", "sampling_params", "settings", "process", "logs"},
    {"core"},
    {"kernels"},
    {"config"},
    {"model"},
    {"worker"},
    {"engine"},
    {"llm"},
    {"conveyor"},  # (the package's __init__: the public API)
    {"server", "bench"},
    {"cli"},
]


def unit(module: str) -> str:
    """``conveyor.server.data_parallel.front`` -> ``server``: a sub-package is its package's."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imports() -> dict[str, set[tuple[str, str]]]:
    """For each package: (importing file, imported package) of every conveyor import."""
    out: dict[str, set[tuple[str, str]]] = {}
    for path in ROOT.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] in ("conveyor", "torch"):
                    target = unit(name) if name.startswith("conveyor") else "torch"
                    out.setdefault(unit(module), set()).add((path.name, target))
    return out


def test_every_package_has_a_layer():
    packages = set(imports()) | {t for edges in imports().values() for _, t in edges}
    assert packages - {"torch"} <= set().union(*LAYERS)


def test_packages_import_only_lower_layers():
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    upward = sorted((package, path, target) for package, edges in imports().items()
                    for path, target in edges
                    if target not in ("torch", package) and layer[target] >= layer[package])
    assert upward == []


def test_core_is_torch_free_and_nothing_imports_the_cli():
    edges = imports()
    assert not [path for path, target in edges["core"] if target == "torch"]
    assert not [(p, path) for p, e in edges.items() for path, target in e if target == "cli"]
