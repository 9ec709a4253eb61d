"""Where cgroup v2 is and what gpud's run cgroups are called: the pure parsing of ``gpud.host.cgroups``,
and the reasons ``RunCgroups.probe`` gives when it cannot have one (on files of the test's own)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpud.host.cgroups import (
    RunCgroups,
    Unavailable,
    cgroup2_mount,
    daemon_key,
    directory,
    events,
    own_cgroup,
    parse_run_name,
    run_name,
)

# This machine's layout (hybrid: v1 controllers, the v2 hierarchy at /sys/fs/cgroup/unified).
HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
UNIFIED = """\
22 1 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw
25 21 0:24 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
"""
# A container that sees only its own part of the hierarchy, at a path with a space (octal-escaped).
CONTAINER = "1301 1290 0:27 /kubepods/pod1 /sys/fs/my\\040cgroup ro,nosuid master:9 - cgroup2 cgroup rw\n"


def test_the_cgroup2_mount_is_found_in_a_hybrid_layout_and_a_unified_one() -> None:
    assert cgroup2_mount(HYBRID) == ("/sys/fs/cgroup/unified", "/")
    assert cgroup2_mount(UNIFIED) == ("/sys/fs/cgroup", "/")
    assert cgroup2_mount(CONTAINER) == ("/sys/fs/my cgroup", "/kubepods/pod1")
    assert cgroup2_mount(HYBRID.replace("cgroup2 cgroup2", "cgroup cgroup")) is None  # v1 only
    assert cgroup2_mount("garbage\n\n41 31 0:38 / - cgroup2\n") is None


def test_the_own_cgroup_is_the_v2_line_of_proc_self_cgroup() -> None:
    assert own_cgroup("9:name=systemd:/\n4:memory:/x\n0::/\n") == "/"
    assert own_cgroup("0::/system.slice/gpud.service\n") == "/system.slice/gpud.service"
    assert own_cgroup("0::/gone (deleted)\n") == "/gone"
    assert own_cgroup("4:memory:/x\n") is None  # v1 only
    assert own_cgroup("0::relative\n") is None


def test_a_cgroup_path_is_found_below_the_mount_that_shows_it() -> None:
    assert directory(("/sys/fs/cgroup/unified", "/"), "/") == "/sys/fs/cgroup/unified"
    assert (
        directory(("/sys/fs/cgroup", "/"), "/system.slice/gpud.service") == "/sys/fs/cgroup/system.slice/gpud.service"
    )
    assert directory(("/c", "/kubepods/pod1"), "/kubepods/pod1/ctr") == "/c/ctr"
    assert directory(("/c", "/kubepods/pod1"), "/kubepods/pod10/ctr") is None  # not below the root it shows
    assert directory(("/c", "/kubepods/pod1"), "/") is None


def test_cgroup_events_are_read_as_numbers() -> None:
    assert events("populated 1\nfrozen 0\n") == {"populated": 1, "frozen": 0}
    assert events("frozen 1\nnonsense\n") == {"frozen": 1}


def test_run_names_carry_the_daemons_key_and_name_a_program_for_good() -> None:
    key = daemon_key("/var/lib/gpud")
    assert len(key) == 8 and key == daemon_key("/var/lib/gpud/") and key != daemon_key("/tmp/other")
    name = run_name(key, 1234, 987654)
    assert parse_run_name(name, key) == (1234, 987654)
    assert parse_run_name(name, daemon_key("/tmp/other")) is None  # another daemon's: never touched
    for other in ("cgroup.procs", "run-xyz-1-2", f"{name}x", "gpud-runs"):
        assert parse_run_name(other, key) is None


def _fake_host(tmp_path: Path, mountinfo: str, own: str = "0::/\n") -> tuple[str, str]:
    (tmp_path / "mountinfo").write_text(mountinfo)
    (tmp_path / "cgroup").write_text(own)
    return str(tmp_path / "mountinfo"), str(tmp_path / "cgroup")


def test_probe_says_why_there_is_no_cgroup(tmp_path: Path) -> None:
    with pytest.raises(Unavailable, match="turned off"):
        RunCgroups.probe("off", "00000000")
    mi, own = _fake_host(tmp_path, "22 1 0:21 / /proc rw - proc proc rw\n")
    with pytest.raises(Unavailable, match="no cgroup v2 hierarchy"):
        RunCgroups.probe("auto", "00000000", mountinfo=mi, own=own)
    mount = tmp_path / "cg"
    mount.mkdir()
    mi, own = _fake_host(tmp_path, f"41 31 0:38 / {mount} rw - cgroup2 cgroup2 rw\n", "4:memory:/x\n")
    with pytest.raises(Unavailable, match="own cgroup"):
        RunCgroups.probe("auto", "00000000", mountinfo=mi, own=own)
    with pytest.raises(Unavailable, match="not a cgroup below the cgroup2 mount"):
        RunCgroups.probe("/elsewhere/runs", "00000000", mountinfo=mi, own=own)
    mi, own = _fake_host(tmp_path, f"41 31 0:38 / {mount} rw - cgroup2 cgroup2 rw\n")
    with pytest.raises(Unavailable, match="no cgroup.freeze"):  # a plain directory, not a cgroup
        RunCgroups.probe("auto", "00000000", mountinfo=mi, own=own)
    assert (mount / "gpud-runs").is_dir()  # the base it tried
