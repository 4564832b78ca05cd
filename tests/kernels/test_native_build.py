"""The compiled CPU kernels' build: shared by every copy of the sources, and not stopped by the lock file
a build killed midway leaves behind."""

from __future__ import annotations

import subprocess
import sys

from rlfw.kernels import cpu_native


def test_a_dead_builds_lock_file_does_not_block_the_next_load() -> None:
    cpu_native.module()  # built (or found) once
    lock = cpu_native.build_folder() / "lock"
    lock.touch()  # what torch leaves when the process building the extension is killed
    code = "from rlfw.kernels import cpu_native; print(cpu_native.module().vectorised())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert not lock.exists()


def test_the_build_is_keyed_by_the_sources_and_built_from_its_own_copy() -> None:
    folder = cpu_native.build_folder()
    cpu_native.module()
    copies = sorted(p.name for p in (folder / "src").iterdir())
    assert copies == sorted(s.name for s in cpu_native.SOURCES + cpu_native.HEADERS)
    for source in cpu_native.SOURCES + cpu_native.HEADERS:
        assert (folder / "src" / source.name).read_bytes() == source.read_bytes()
    assert len(cpu_native.build_key()) == 16 and cpu_native.build_key() == cpu_native.build_key()
