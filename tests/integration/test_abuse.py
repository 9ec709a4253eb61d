"""Abuse from other processes costs well-behaved clients nothing, and never the daemon its life.

bench/abuse.py's attackers (random bytes, broken and oversized frames, wrong
types, 64-bit extremes in every integer field, deep nesting, names and labels
at and over their limits, floods on connections that never read, 20 000 task
types, connection churn, idle connections without HELLO) run for ABUSE_S
against a real daemon while two good clients hand GPU 0's lock back and forth
and take leases on GPU 1. The good clients go on for one reap interval after
the abuse, so a failure the abuse arms for later (a dead owner's allocation
reclaimed) is seen too.

bench/ is no package: the module is loaded from its file, with bench/ on
sys.path for its own import of percentiles and for the worker processes,
which import it by name.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from gpud.tools.spawn import DaemonProcess

BENCH = Path(__file__).resolve().parents[2] / "bench"
QUIET_S = 1.0
ABUSE_S = 6.0


@pytest.fixture
def abuse(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("abuse", BENCH / "abuse.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "abuse", module)
    spec.loader.exec_module(module)
    return module


def test_abusers_never_reach_good_clients_nor_kill_the_daemon(abuse: ModuleType) -> None:
    d = DaemonProcess("--simulate", "2x16GiB", "--log-level", "warning").start()
    try:
        seen = abuse.run_scenario(d, abuse.Plan(quiet_s=QUIET_S, abuse_s=ABUSE_S))
        log = d.log()
    finally:
        d.cleanup()
    # Every failure is gathered, so that one run tells all that went wrong.
    problems = []
    if not seen.alive:
        tail = "\n".join(log.splitlines()[-40:])
        problems.append(f"the daemon died (exit code {seen.exit_code}) or stopped answering STATUS; log tail:\n{tail}")
    _, tracebacks = abuse.log_findings(log)
    if tracebacks:
        kinds = "\n".join(f"  {n} x {kind}" for kind, n in abuse.traceback_kinds(tracebacks).items())
        problems.append(f"the daemon logged {len(tracebacks)} tracebacks:\n{kinds}\nthe first:\n{tracebacks[0]}")
    if seen.errors:
        errors = "\n".join(f"  {seen.phase_of(t)}: {text}" for t, text in seen.errors[:20])
        problems.append(f"the good clients saw {len(seen.errors)} errors:\n{errors}")
    assert not problems, "\n\n".join(problems)
    # The test means something only if every attack was made.
    broken = [r["missing"] for r in seen.abusers if "missing" in r]
    broken += [f"{name}: {why}" for r in seen.abusers for name, why in r.get("failures", {}).items()]
    assert not broken, f"abusers failed: {broken}"
    sent = {name: n for r in seen.abusers for name, n in r.get("sent", {}).items()}
    assert all(sent.get(name, 0) > 0 for name in abuse.ATTACKS), f"attacks that sent nothing: {sent}"
