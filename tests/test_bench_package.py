"""The bench is a tool beside the runtime: radixserve never imports radixserve_bench except to
run `radixserve bench`, and holds no benchmark pass/fail targets."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.cli import main

ROOT = Path(__file__).resolve().parents[1]
BENCH_MODES = ("serve", "offline", "compare", "simulate")


def run_fresh(code: str) -> subprocess.CompletedProcess:
    """`code` in a new interpreter started in the checkout, so nothing is imported yet."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_serve_does_not_import_the_bench():
    code = (
        "import contextlib, io, sys\n"
        "import radixserve, radixserve.cli, radixserve.server.launch, radixserve.server.app\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    radixserve.cli.main(['serve', '--help'])\n"
        "bench = sorted(m for m in sys.modules if m.startswith('radixserve_bench'))\n"
        "assert not bench, bench\n"
    )
    proc = run_fresh(code)
    assert proc.returncode == 0, proc.stderr


def bench_imports(path: Path) -> list[tuple[str, int]]:
    """(enclosing function or '<module>', line) of each import of radixserve_bench in `path`."""
    found = []

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
                continue
            names = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                names = [child.module or ""]
            if any(n.split(".")[0] == "radixserve_bench" for n in names):
                found.append((scope, child.lineno))
            visit(child, scope)

    visit(ast.parse(path.read_text()), "<module>")
    return found


def test_only_the_bench_command_imports_the_bench():
    imports = {
        str(path.relative_to(ROOT)): bench_imports(path)
        for path in sorted((ROOT / "radixserve").rglob("*.py"))
    }
    imports = {path: found for path, found in imports.items() if found}
    assert list(imports) == ["radixserve/cli.py"]
    assert [scope for scope, _ in imports["radixserve/cli.py"]] == ["run_bench"]


def test_no_bench_targets_in_product_code():
    names = [
        (str(path.relative_to(ROOT)), node.id)
        for path in (ROOT / "radixserve").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Name) and "TARGET" in node.id  # constants such as HIT_RATE_TARGET
    ]
    assert names == []


def test_radixserve_help_lists_bench(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "bench" in capsys.readouterr().out


def test_bench_help_shows_the_bench_modes(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: radixserve bench")
    assert all(mode in out for mode in BENCH_MODES)


def test_bench_mode_help_keeps_its_options(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "compare", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: radixserve bench compare")
    assert "--systems" in out and "--max-concurrency" in out


def test_bench_without_a_mode_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench"])
    assert exit_info.value.code == 2
    assert "radixserve bench" in capsys.readouterr().err


class HideBench:
    """A meta path finder that makes radixserve_bench look not installed."""

    def find_spec(self, name: str, path=None, target=None):
        if name == "radixserve_bench":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def test_bench_missing_says_to_reinstall(monkeypatch):
    for name in [m for m in sys.modules if m.startswith("radixserve_bench")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [HideBench(), *sys.meta_path])
    with pytest.raises(SystemExit, match="radixserve_bench is not installed"):
        main(["bench", "--help"])
