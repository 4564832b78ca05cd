"""Kernel tests. ``TRITON_INTERPRET=1`` is set here, before any Triton kernel module is imported."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from rlfw.kernels.invariant import InvariantOps  # noqa: E402


@pytest.fixture(scope="session")
def inv() -> InvariantOps:
    """The exact torch path."""
    return InvariantOps(backend="torch")


@pytest.fixture(scope="session")
def tri() -> InvariantOps:
    """The Triton path (under the interpreter on CPU); skipped where triton does not import."""
    pytest.importorskip("triton")
    return InvariantOps(backend="triton")
