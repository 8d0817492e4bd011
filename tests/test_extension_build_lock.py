"""The C++ kernels' build folder after a build that was killed midway: torch's builder leaves
its marker file ('lock') behind and waits on it forever at every later start; radixserve
removes it under its own flock, which dies with its holder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from radixserve.native import extension


def test_a_stale_torch_baton_does_not_hang_the_next_start(tmp_path):
    """A copy of this session's build in a cache folder of its own (ninja finds it up to
    date), a 'lock' file planted in it as a killed build leaves it: a new process still loads
    the kernels, and the file is gone."""
    try:
        extension.load_cpu_ops()
    except extension.CpuExtensionUnavailable as exc:
        pytest.skip(str(exc))
    flags = extension.compiler_flags()
    cache = tmp_path / "cache"
    target = cache / extension.build_folder(flags).relative_to(extension.cache_root())
    shutil.copytree(extension.build_folder(flags), target, ignore=shutil.ignore_patterns("*.lock"))
    code = textwrap.dedent(
        """
        import sys
        from radixserve.native import extension
        folder = extension.build_folder(extension.compiler_flags())
        folder.mkdir(parents=True, exist_ok=True)
        (folder / extension.TORCH_BATON).write_text("")
        ops = extension.load_cpu_ops()
        assert not (folder / extension.TORCH_BATON).exists()
        print("loaded", hasattr(ops, "int4_block_mm"))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,  # a rebuild, should ninja not find the copy up to date; a hang fails here
        env=os.environ | {"RADIXSERVE_CACHE_DIR": str(cache)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "loaded True", proc.stdout
    assert "did not finish" in proc.stderr


def test_the_baton_is_cleared_only_when_present(tmp_path):
    extension.clear_stale_baton(tmp_path)  # nothing there: nothing happens
    (tmp_path / extension.TORCH_BATON).write_text("")
    extension.clear_stale_baton(tmp_path)
    assert not (tmp_path / extension.TORCH_BATON).exists()
