"""The docs a newcomer follows are true: to the daemon, to the examples they quote, and to each other.

What is checked, in README.md and every docs/*.md page:
- every log event the daemon emits and every metric it exports is named in docs/metrics-and-logs.md, so
  an operator can look up what a line or a series means;
- a quoted example is marked by an HTML comment right before its fenced block,
  ``<!-- quote: examples/NAME -->``, and the block is the file's text: for a .py file everything below
  its docstring, for any other file the whole file. The README quotes one example per way of using gpud,
  and the page of each way quotes it too; the tests run the examples against a real daemon;
- every relative link points at a file that exists, and its #fragment, if any, at a heading of that file
  (a same-page ``#fragment`` at one of the page's own), by GitHub's slugs: lower case, every character but
  letters, digits, ``_``, ``-`` and spaces dropped, spaces turned to ``-``, ``-1``, ``-2``… added to a
  repeated slug; a link inside a heading counts by its text;
- every ```python block that is no quote parses (``ast.parse``) and every ```toml block parses
  (``tomllib``). A block that is meant as a fragment is marked by ``<!-- fragment -->`` right before it and
  is then parsed only as far as a fragment can be: a python fragment must tokenize whole (brackets
  balanced, strings closed, indentation consistent; it may use names it never defines or leave a body
  out), and each line of a toml fragment that is not blank or a comment must parse on its own (a
  ``key = value`` line or a ``[table]`` header), so a fragment may leave its table or its neighbours out;
- README.md, a landing page, stays under 300 lines.
"""

from __future__ import annotations

import ast
import io
import json
import os
import re
import subprocess
import sys
import tokenize
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
METRICS_AND_LOGS = (ROOT / "docs" / "metrics-and-logs.md").read_text()
SOURCES = sorted((ROOT / "gpud").rglob("*.py"))
LOG_EVENT = re.compile(r"""(?:log\.(?:debug|info|warning|error|exception|critical)|faults\.often)\(\s*"([a-z_]+)\"""")
METRIC = re.compile(r'"(gpud_[a-z_]+)"')

FENCE = re.compile(r"^( *)```(\w*)\s*$")
MARK = re.compile(r"^<!--\s*(quote:\s*(\S+)|fragment)\s*-->$")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`[^`\n]*`")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str  # the lines between the fences, the fence's indentation taken off, each ending in "\n"
    mark: str | None  # "fragment", "quote: examples/…" or None

    @property
    def quotes(self) -> str | None:
        return self.mark.split(":", 1)[1].strip() if self.mark and self.mark.startswith("quote:") else None

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def split(page: Path) -> tuple[list[Block], list[str]]:
    """A page's fenced blocks, and its prose lines (those outside the blocks)."""
    blocks: list[Block] = []
    prose: list[str] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            prose.append(lines[i])
            i += 1
            continue
        indent, lang = len(opening[1]), opening[2]
        end = next((j for j in range(i + 1, len(lines)) if lines[j] == " " * indent + "```"), None)
        assert end is not None, f"{page.relative_to(ROOT)}:{i + 1}: a fence that is never closed"
        body = [line[indent:] if line.startswith(" " * indent) else line.lstrip(" ") for line in lines[i + 1 : end]]
        before = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
        mark = MARK.match(before)
        blocks.append(Block(page, i + 1, lang, "".join(f"{line}\n" for line in body), mark[1] if mark else None))
        i = end + 1
    return blocks, prose


def slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in split(page)[1]:
        if m := HEADING.match(line):
            base = slug(m[2])
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def quoted_text(example: Path) -> str:
    """What a quote of ``example`` must be: a .py file below its docstring, any other file whole."""
    text = example.read_text()
    if example.suffix == ".py":
        return text.split('"""\n\n', 1)[1]
    return text


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in split(page)[0]]


def found(pattern: re.Pattern[str]) -> set[str]:
    return {m for path in SOURCES for m in pattern.findall(path.read_text())}


def test_every_log_event_is_documented() -> None:
    events = found(LOG_EVENT)
    assert len(events) > 30  # the pattern still finds them
    assert sorted(e for e in events if f"`{e}`" not in METRICS_AND_LOGS) == []


def test_every_metric_is_documented() -> None:
    metrics = found(METRIC)
    assert len(metrics) > 20
    assert sorted(m for m in metrics if m not in METRICS_AND_LOGS) == []


def test_every_quoted_example_is_quoted_as_it_is() -> None:
    quotes = [b for b in all_blocks() if b.quotes]
    assert len(quotes) >= 6  # the marks are still found
    for block in quotes:
        example = ROOT / block.quotes  # type: ignore[operator]
        assert example.is_file(), f"{block} quotes {block.quotes}, which does not exist"
        assert block.lang == {".py": "python", ".sh": "sh"}[example.suffix], f"{block}: a {block.lang} block"
        assert block.text == quoted_text(example), f"{block} is not {block.quotes} as it is"


@pytest.mark.parametrize(
    ("page", "example"),
    [
        ("README.md", "examples/training_session.py"),
        ("README.md", "examples/inference_lease.py"),
        ("README.md", "examples/alloc_recipe.sh"),
        ("docs/client.md", "examples/training_session.py"),
        ("docs/leases.md", "examples/inference_lease.py"),
        ("docs/allocations.md", "examples/alloc_recipe.sh"),
    ],
)
def test_each_way_of_use_quotes_its_example(page: str, example: str) -> None:
    assert any(b.quotes == example for b in split(ROOT / page)[0]), f"{page} does not quote {example}"


def test_every_relative_link_points_at_a_file_and_a_heading() -> None:
    broken: list[str] = []
    checked = 0
    for page in PAGES:
        for line in split(page)[1]:
            for target in LINK.findall(INLINE_CODE.sub("", line)):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto: …: not ours to check
                    continue
                checked += 1
                path, _, fragment = target.partition("#")
                file = (page.parent / path).resolve() if path else page
                if not file.exists():
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
                elif fragment and (file.suffix != ".md" or fragment not in anchors(file)):
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert checked > 30  # the pattern still finds them
    assert broken == []


def parses_as_a_fragment(block: Block) -> None:
    if block.lang == "python":
        list(tokenize.generate_tokens(io.StringIO(block.text).readline))
    elif block.lang == "toml":
        for line in block.text.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                tomllib.loads(line)


def parses(block: Block) -> None:
    if block.lang == "python":
        ast.parse(block.text)
    elif block.lang == "toml":
        tomllib.loads(block.text)


def test_every_snippet_parses() -> None:
    snippets = [b for b in all_blocks() if b.lang in ("python", "toml") and not b.quotes]
    assert {b.lang for b in snippets} == {"python", "toml"}  # the fences are still found
    for block in snippets:
        try:
            (parses_as_a_fragment if block.mark == "fragment" else parses)(block)
        except (SyntaxError, tokenize.TokenError, tomllib.TOMLDecodeError) as e:
            pytest.fail(f"{block}: a {block.lang} block that does not parse: {e}")


def test_a_fragment_is_parsed_as_far_as_it_can_be(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- fragment -->\n```python\n    return gpu.lease(\n        'gpu:0')\n```\n"
        "<!-- fragment -->\n```toml\npriority = 90\n[policies.ASR]\n```\n"
        "<!-- fragment -->\n```python\nx = f(\n```\n"
    )
    complete, toml, unclosed = split(page)[0]
    assert (complete.mark, toml.mark) == ("fragment", "fragment")
    with pytest.raises(SyntaxError):
        parses(complete)  # not a program ...
    parses_as_a_fragment(complete)  # ... but a whole fragment of one
    parses_as_a_fragment(toml)
    with pytest.raises(tokenize.TokenError):
        parses_as_a_fragment(unclosed)


def test_the_readme_is_a_landing_page() -> None:
    assert len(README.read_text().splitlines()) < 300


def run_example(name: str, socket: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "GPUD_SOCKET": socket},
    )


def test_the_training_session_example_runs(daemon: object) -> None:
    """The training loop the README and docs/client.md quote runs against a daemon."""
    out = run_example("training_session.py", daemon.socket)  # type: ignore[attr-defined]
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("trained 100 batches")


def test_the_inference_lease_example_runs(daemon: object) -> None:
    """The pipeline the README and docs/leases.md quote runs against a daemon: every stage of every
    utterance gets its lease, logged with its trace, and the long utterance's OOM is reported."""
    out = run_example("inference_lease.py", daemon.socket)  # type: ignore[attr-defined]
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "[de] Good morning",
        "[de] Where is the station",
        "[de] The train to the airport leaves from platform four",
        "handled 3 utterances",
    ]
    daemon.stop()  # type: ignore[attr-defined]  # so every line is written
    lines = [json.loads(line) for line in daemon.log().splitlines() if line.startswith("{")]  # type: ignore[attr-defined]
    leases = [(r["utterance_index"], r["stage"], r["task_type"], r["status"]) for r in lines if r["event"] == "lease"]
    assert leases == [
        (i, stage, task_type, "ACQUIRED")
        for i in range(3)
        for stage, task_type in (("asr", "ASR"), ("repair", "SEMANTIC_REPAIR"), ("nmt", "NMT"), ("tts", "TTS"))
    ]
    assert [r["task_type"] for r in lines if r["event"] == "gpu_oom_reported"] == ["TTS"]
