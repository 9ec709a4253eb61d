"""Fixtures for gpud-k8s's tests: a fake kubelet (fake_kubelet.py) and a fake API server (apiserver_fixtures.py)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .apiserver_fixtures import apiserver  # noqa: F401  (a fixture)
from .fake_kubelet import KubeletThread


@pytest.fixture
def fake_kubelet() -> Iterator[KubeletThread]:
    """A started fake kubelet on a fresh kubelet root, in a thread and event loop of its own
    (``KubeletThread``); stopped, and its root removed, after the test.

    The root is a short folder under /tmp, not pytest's tmp_path: a Unix socket's path must fit in
    108 bytes, and a plugin's sockets lie two or three folders down (plugins/<driver>/dra.sock)."""
    root = Path(tempfile.mkdtemp(prefix="kubelet-", dir="/tmp"))
    kubelet = KubeletThread(root)
    try:
        kubelet.start()
        yield kubelet
    finally:
        kubelet.close()
        shutil.rmtree(root, ignore_errors=True)
