"""The sync client's surface is generated from the asyncio one's (client/tools/unasync.py): the file in
the checkout (ignored by git, written by the client's build and by make) is what the generator gives,
and the generator's rules do what its docstring says. That every build of the client writes it is in
tests/integration/test_client_build.py."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from types import ModuleType

import pytest

TOOL = Path(__file__).resolve().parents[2] / "client" / "tools" / "unasync.py"


def load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("unasync", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


unasync = load_tool()

ASYNCIO = '''\
# unasync: asyncio
"""The asyncio one: ``async with``."""
# unasync: sync
# """The sync one.
#
#     an indented line"""
# unasync: end
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from gpud_client import _async_driver as driver


class AsyncSession(driver.AsyncSessionBase):
    async def __aenter__(self) -> AsyncSession:
        return self


class AsyncClient(driver.AsyncDriver):
    """Get one with ``await AsyncClient.connect()``; it awaits nothing else. AsyncClientish stays."""

    @asynccontextmanager
    async def lease(self) -> AsyncIterator[int]:
        async with self.lock:  # async with: a comment is text as well
            yield await self.call(1)
        # unasync: sync
        # self.sync_only()
        # unasync: end

    async def __aexit__(self, *exc: object) -> None:
        # unasync: asyncio
        await self.asyncio_only()
        # unasync: end
        await self.close()
'''

SYNC = '''\
"""The sync one.

    an indented line"""
from collections.abc import Iterator
from contextlib import contextmanager

from gpud_client import _sync_driver as driver


class Session(driver.SyncSessionBase):
    def __enter__(self) -> Session:
        return self


class Client(driver.SyncDriver):
    """Get one with ``Client.connect()``; it awaits nothing else. AsyncClientish stays."""

    @contextmanager
    def lease(self) -> Iterator[int]:
        with self.lock:  # with: a comment is text as well
            yield self.call(1)
        self.sync_only()

    def __exit__(self, *exc: object) -> None:
        self.close()
'''


def test_the_sync_client_in_the_checkout_is_what_the_generator_gives() -> None:
    for target, source in unasync.GENERATED.items():
        path = unasync.PACKAGE / target
        assert path.exists(), f"{target} is missing: run python client/tools/unasync.py (or make test)"
        want = unasync.unasync((unasync.PACKAGE / source).read_text(), source)
        assert path.read_text() == want, f"{target} is not what {source} gives: run python client/tools/unasync.py"
    assert unasync.stale() == {}


def test_git_ignores_the_generated_file() -> None:
    """It is a build product: a copy in git would be a second source, and one that can go stale."""
    ignored = (unasync.PACKAGE.parents[1] / ".gitignore").read_text().splitlines()
    for target in unasync.GENERATED:
        assert f"/client/gpud_client/{target}" in ignored


def test_the_rules_on_a_small_module() -> None:
    assert unasync.unasync(ASYNCIO, "small.py") == unasync.header("small.py") + SYNC


def test_the_header_says_the_file_is_generated_and_what_to_run() -> None:
    first = unasync.header("aio.py").splitlines()[0]
    assert first.startswith("# Generated from aio.py by client/tools/unasync.py: do not edit")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("# unasync: sync\nx = 1\n# unasync: end\n", "small.py:2: a line of the sync client's part must be a comment"),
        ("# unasync: end\n", "small.py:1: '# unasync: end' out of order (in the shared lines)"),
        ("# unasync: sync\n# unasync: asyncio\n", "small.py:2: '# unasync: asyncio' out of order (in the sync lines)"),
        ("# unasync: asyncio\nx = 1\n", "small.py: the asyncio lines have no '# unasync: end'"),
    ],
)
def test_marks_out_of_order_are_refused_with_their_line(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        unasync.unasync(text, "small.py")


def test_check_names_a_stale_file_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "aio.py").write_text("async def f() -> None:\n    await g()\n")
    assert unasync.main(["--check"], package=tmp_path) == 1
    said = capsys.readouterr().err
    assert "client.py is missing: run python client/tools/unasync.py" in said
    assert not (tmp_path / "client.py").exists()

    assert unasync.main([], package=tmp_path) == 0
    assert (tmp_path / "client.py").read_text() == unasync.header("aio.py") + "def f() -> None:\n    g()\n"
    assert unasync.main(["--check"], package=tmp_path) == 0

    (tmp_path / "client.py").write_text("edited by hand\n")
    assert unasync.main(["--check"], package=tmp_path) == 1
    assert "client.py is not what its source gives: run python client/tools/unasync.py" in capsys.readouterr().err


def test_generate_writes_only_what_is_missing_or_stale(tmp_path: Path) -> None:
    """What the client's build calls: a current file keeps its time (make's rule touches it), and no
    half-written file or leftover is seen beside it."""
    (tmp_path / "aio.py").write_text("async def f() -> None:\n    await g()\n")
    assert unasync.generate(tmp_path) == [tmp_path / "client.py"]
    assert unasync.stale(tmp_path) == {}
    os.utime(tmp_path / "client.py", ns=(1, 1))
    assert unasync.generate(tmp_path) == []
    assert (tmp_path / "client.py").stat().st_mtime_ns == 1

    (tmp_path / "aio.py").write_text("async def h() -> None:\n    await g()\n")
    assert list(unasync.stale(tmp_path)) == [tmp_path / "client.py"]
    assert unasync.generate(tmp_path) == [tmp_path / "client.py"]
    assert "def h() -> None:" in (tmp_path / "client.py").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["aio.py", "client.py"]
