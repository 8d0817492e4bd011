"""What a non-editable install ships: every package of radixserve, and every C++ source and
header the kernels' first-use build compiles (pyproject's explicit lists had missed
radixserve.distributed and the header)."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

from radixserve.native import extension

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_is_listed():
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "radixserve").rglob("__init__.py")
    }
    assert found - set(SETUPTOOLS["packages"]) == set()


def test_every_kernel_source_and_header_is_package_data():
    patterns = SETUPTOOLS["package-data"]["radixserve.native"]
    for path in [*extension.SOURCES, *extension.HEADERS, *extension.CSRC.iterdir()]:
        relative = str(path.relative_to(extension.CSRC.parent))
        assert any(fnmatch.fnmatch(relative, pattern) for pattern in patterns), relative
