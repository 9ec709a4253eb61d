"""The in-process daemon tests' fixture: nodes whose stores live under the test's ``tmp_path``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from inprocess import Node


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    """``nodes(gpus, **config)``: a new in-process ``Node`` (``Config``'s fields as keywords), its
    store under ``tmp_path``; every store is closed at the end."""
    made: list[Node] = []

    def make(gpus: str = "2x16GiB", **config: Any) -> Node:
        node = Node(gpus, state_dir=str(tmp_path / f"state-{len(made)}"), **config)
        made.append(node)
        return node

    try:
        yield make
    finally:
        for node in made:
            node.close_store()
