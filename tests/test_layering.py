"""Imports point down: (server, frontend_lang, train) -> client -> engine -> cache / model /
attention / sampling -> native (the C++ kernels' builder). A request reaches the core through
client/ and never climbs back into server/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "radixserve"
ABOVE = {
    "reasoning": ("engine", "client", "server", "frontend_lang", "sampling", "model", "cache"),
    "client": ("server", "frontend_lang"),
    "train": ("server", "frontend_lang"),  # train-eagle drives a ModelRunner, serves nothing
    "engine": ("client", "server", "frontend_lang"),
    "cache": ("engine", "client", "server", "frontend_lang"),
    "model": ("engine", "client", "server", "frontend_lang"),
    "attention": ("engine", "client", "server", "frontend_lang"),
    "sampling": ("engine", "client", "server", "frontend_lang"),
    "native": (
        "model",
        "attention",
        "cache",
        "sampling",
        "engine",
        "client",
        "server",
        "frontend_lang",
    ),
}

CORE_MODULES = ("core", "core_loop", "core_process", "wire", "scheduler")
"""What runs the core or speaks its pipe: only client/ uses them."""


def imported_modules(path: Path) -> list[tuple[str, int]]:
    """(module, line) of every import in `path`, at any depth (lazy imports too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node.lineno))
    return found


@pytest.mark.parametrize("package", sorted(ABOVE))
def test_no_import_points_up(package: str):
    assert (PACKAGE / package).is_dir()
    above = tuple(f"radixserve.{name}" for name in ABOVE[package])
    upward = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for module, line in imported_modules(path)
        if module in above or module.startswith(tuple(f"{name}." for name in above))
    ]
    assert not upward, "\n".join(upward)


def test_server_reaches_the_core_only_through_the_client():
    """server/ may name the core's message types, never run the core itself."""
    core = {f"radixserve.engine.{name}" for name in CORE_MODULES}
    direct = [
        f"{path.name}:{line} imports {module}"
        for path in sorted((PACKAGE / "server").rglob("*.py"))
        for module, line in imported_modules(path)
        if module in core
    ]
    assert not direct, "\n".join(direct)
