#!/usr/bin/env python3
"""Generate the sync client's surface from the asyncio client's: ``client.py`` from ``aio.py``.

``aio.py`` is written by hand and ``client.py`` is generated from it (httpcore's direction: taking
``await`` out is mechanical, putting it in is not), so the two surfaces cannot drift. The machinery
under them differs for real and is written twice, small: ``_sync_driver.py`` and ``_async_driver.py``
over ``_base.py``. The rules, line by line, on code, docstrings and comments alike:

- ``async def``, ``async with`` and ``async for`` lose their ``async``; ``await `` goes;
- each name in ``NAMES`` becomes its sync name, whole words only;
- the lines after ``# unasync: asyncio`` are the asyncio client's alone: left out;
- the lines after ``# unasync: sync``, up to ``# unasync: end``, are the sync client's, written as
  comments: each is put in without its ``# `` (and left as it is).

Text in, text out: it imports and runs nothing it reads, and needs nothing but the standard library.
The generated file is a build product that git ignores, made afresh wherever the client is built:
the client's build (``client/setup.py``) runs ``generate`` before anything else, so an editable
install, a wheel and an sdist all carry the file that ``aio.py`` gives, and ``make``'s ``demo``,
``test`` and ``check`` run this script whenever ``aio.py`` or the script is newer than the file.
``--check`` writes nothing and exits 1, naming each generated file that is missing or not what its
source gives (``make check`` runs it). It lives beside the package, not in it: the build reads it,
the installed client does not.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gpud_client"
GENERATED = {"client.py": "aio.py"}  # generated file -> its source, both in the package
NAMES = {
    "AsyncClient": "Client",
    "AsyncSession": "Session",
    "AsyncDriver": "SyncDriver",
    "AsyncSessionBase": "SyncSessionBase",
    "_async_driver": "_sync_driver",
    "AsyncIterator": "Iterator",
    "asynccontextmanager": "contextmanager",
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
}
KEYWORDS = re.compile(r"\basync (?=(?:def|with|for)\b)|\bawait ")
WORDS = re.compile(r"\b(?:" + "|".join(map(re.escape, NAMES)) + r")\b")
COMMENTED = re.compile(r"(\s*)#(?: (.*))?\n?")
# Each mark: the parts it may come in, and the part it starts ("shared": the lines of both clients).
MARKS = {
    "# unasync: asyncio": (("shared",), "asyncio"),
    "# unasync: sync": (("shared", "asyncio"), "sync"),
    "# unasync: end": (("asyncio", "sync"), "shared"),
}


def header(source: str) -> str:
    return (
        f"# Generated from {source} by client/tools/unasync.py: do not edit. Change {source}, then run\n"
        "# `python client/tools/unasync.py` (git ignores this file; building the client makes it afresh).\n"
    )


def unasync_line(line: str) -> str:
    """One line both clients share, as the sync client has it."""
    return WORDS.sub(lambda m: NAMES[m.group()], KEYWORDS.sub("", line))


def unasync(text: str, source: str) -> str:
    """The sync module generated from the asyncio module ``text`` (named ``source`` in its header).
    Raises ValueError, naming the line, where the marks are out of order or a sync line is no comment."""
    out: list[str] = []
    part = "shared"
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        mark = line.strip()
        if mark in MARKS:
            may_come_in, part_after = MARKS[mark]
            if part not in may_come_in:
                raise ValueError(f"{source}:{number}: {mark!r} out of order (in the {part} lines)")
            part = part_after
        elif part == "shared":
            out.append(unasync_line(line))
        elif part == "sync":
            commented = COMMENTED.fullmatch(line)
            if commented is None:
                raise ValueError(f"{source}:{number}: a line of the sync client's part must be a comment")
            indent, rest = commented.groups()
            out.append(f"{indent}{rest}\n" if rest is not None else "\n")
    if part != "shared":
        raise ValueError(f"{source}: the {part} lines have no '# unasync: end'")
    return header(source) + "".join(out)


def stale(package: Path = PACKAGE) -> dict[Path, str]:
    """Each generated file in ``package`` that is missing or not what its source gives: its text as it should be."""
    out: dict[Path, str] = {}
    for target, source in GENERATED.items():
        want = unasync((package / source).read_text(), source)
        path = package / target
        if not (path.exists() and path.read_text() == want):
            out[path] = want
    return out


def generate(package: Path = PACKAGE) -> list[Path]:
    """Write each generated file in ``package`` that is missing or stale; the files written. A file that is
    current is left as it is, its time too. Each is written whole under another name and then renamed over
    the old one, so a reader (or a second run at the same time) never sees half a file."""
    written: list[Path] = []
    for path, want in stale(package).items():
        part = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            part.write_text(want)
            os.replace(part, path)
        finally:
            part.unlink(missing_ok=True)
        written.append(path)
    return written


def main(argv: list[str] | None = None, package: Path = PACKAGE) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each missing or stale file")
    if not parser.parse_args(argv).check:
        for path in generate(package):
            print(f"wrote {os.path.relpath(path)}")
        return 0
    wrong = stale(package)
    for path in wrong:
        name = os.path.relpath(path)
        state = "is missing" if not path.exists() else "is not what its source gives"
        print(f"{name} {state}: run python client/tools/unasync.py to generate it", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
