"""The fake API server as a pytest fixture: ``apiserver``, a fresh ThreadedFakeApiServer (Kubernetes 1.37's schemas)
per test, on an event loop in a thread of its own, so that it outlives no test and serves tests that run their own
loops (``asyncio.run`` per test under pytest-trio's trio_mode, or trio itself). Its ``url`` is the host for
``kubernetes_asyncio.client.Configuration``; ``put``/``get``/``objects``/``fail_next``/``count``... act on it from
the test's thread; ``await apiserver.wait_for(predicate)`` from an asyncio loop, ``apiserver.wait_for_blocking``
from a thread.

Use it from tests/k8s/conftest.py with ``from .apiserver_fixtures import apiserver  # noqa: F401``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .fake_apiserver import ThreadedFakeApiServer


@pytest.fixture
def apiserver() -> Iterator[ThreadedFakeApiServer]:
    """A fake kube-apiserver, empty, validating against Kubernetes 1.37, on http://127.0.0.1:<port>."""
    with ThreadedFakeApiServer(version="1.37") as api:
        yield api
