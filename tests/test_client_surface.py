"""The sync and asyncio clients have one public surface, and the client's modules stay small."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import gpud_client
from gpud_client import AsyncClient, AsyncSession, Client, Session

CLIENT_DIR = Path(gpud_client.__file__).parent
MAX_LINES = 420  # "about 400"; protocol.py, the one definition of every message, is exempt


def public(cls: type) -> dict[str, object]:
    return {name: inspect.getattr_static(cls, name) for name in dir(cls) if not name.startswith("_")}


def shape(member: object) -> object:
    """What must match across the two clients: the parameters' names, kinds and defaults."""
    if isinstance(member, property):
        return "property"
    fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
    if not callable(fn):
        return type(member).__name__
    params = inspect.signature(fn).parameters.values()
    return [(p.name, p.kind, p.default) for p in params]


@pytest.mark.parametrize(("sync", "aio"), [(Client, AsyncClient), (Session, AsyncSession)])
def test_both_clients_have_the_same_public_methods_and_signatures(sync: type, aio: type) -> None:
    mine, theirs = public(sync), public(aio)
    assert sorted(mine) == sorted(theirs)
    for name in mine:
        assert shape(mine[name]) == shape(theirs[name]), name
    assert shape(sync.__init__) == shape(aio.__init__)


@pytest.mark.parametrize("cls", [AsyncClient, AsyncSession])
def test_every_asyncio_method_is_awaited_or_entered(cls: type) -> None:
    for name, member in public(cls).items():
        fn = member.__func__ if isinstance(member, classmethod) else member
        if isinstance(fn, property) or not callable(fn):
            continue
        wrapped = getattr(fn, "__wrapped__", None)  # asynccontextmanager: lease(), slice()
        assert inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(wrapped), name


def test_every_client_module_but_the_protocol_stays_under_about_400_lines() -> None:
    sizes = {
        str(path.relative_to(CLIENT_DIR)): len(path.read_text().splitlines())
        for path in CLIENT_DIR.rglob("*.py")
        if path.name != "protocol.py"
    }
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}
