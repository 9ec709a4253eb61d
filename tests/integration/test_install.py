"""`make install` into a DESTDIR: a virtual environment at /opt/gpud whose scripts name
their final path, links in /usr/local/bin, units that name those links and pass
`systemd-analyze verify` under the staged root, a daemon that runs from the installed
package alone, and `make uninstall` taking back every file it made. The environment is
built on the system's /usr/bin/python3 unless PYTHON= names another, and an interpreter
that the service or another user could not run (in a home directory, or closed to other
users) is refused before anything is written.

One install (pip, from its cache where it can) serves the module; the tests that
change a tree work on copies of it."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

import gpud

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "/opt/gpud"  # the virtual environment, as the default install names it
STAGED_VENV = PREFIX.lstrip("/")  # the same under DESTDIR
SYSTEM_PYTHON = "/usr/bin/python3"  # what the install builds on unless PYTHON= names another
CHECK = ROOT / "install/check_python.py"
pytestmark = [
    pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed"),
    pytest.mark.timeout(600),  # pip may have to fetch the dependencies on a fresh machine
]


def run_make(*args: str, env: Mapping[str, str] = {}, umask: int = -1) -> subprocess.CompletedProcess[str]:
    # Under `make test` the outer make's MAKEFLAGS (its variables, its jobserver) would
    # leak into this one, and a PYTHON in the environment would choose the interpreter;
    # the install must see only what is passed here.
    leaks = {"MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES", "PYTHON"}
    return subprocess.run(
        ["make", "-C", str(ROOT), *args],
        env={k: v for k, v in os.environ.items() if k not in leaks} | dict(env),
        umask=umask,
        capture_output=True,
        text=True,
        timeout=540,
    )


def make(*args: str, umask: int = -1) -> subprocess.CompletedProcess[str]:
    out = run_make(*args, umask=umask)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def passes_the_check(python: str) -> bool:
    if not os.access(python, os.X_OK):
        return False
    return subprocess.run([python, str(CHECK), python], capture_output=True, timeout=60).returncode == 0


def open_dir() -> Path:
    """A fresh directory under /tmp that every user may enter (mkdtemp's are closed)."""
    top = Path(tempfile.mkdtemp(prefix="gpud-stage-", dir="/tmp")).resolve()
    top.chmod(0o755)
    return top


def files_under(root: Path) -> list[str]:
    """Everything but directories: files and links, relative to ``root``."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_symlink() or not p.is_dir())


def away_from_the_checkout() -> dict[str, str]:
    """No PYTHONPATH or other PYTHON* settings: run from a cwd that holds no gpud package,
    only the staged venv's site-packages can answer an import."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}


def installed_python(staged: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(staged / STAGED_VENV / "bin/python"), *args],
        env=away_from_the_checkout(),
        cwd=staged,
        capture_output=True,
        text=True,
        timeout=60,
    )


def wait_ready(notify: socket.socket, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> None:
    """Until the daemon sends READY=1 on NOTIFY_SOCKET; fails with its log if it exits first."""
    notify.settimeout(0.5)  # how often to look at the process, not how long to wait
    deadline = time.monotonic() + timeout
    while True:
        try:
            if "READY=1" in notify.recv(4096).decode():
                return
        except TimeoutError:
            assert proc.poll() is None, f"gpud exited with {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"no READY=1 within {timeout} s:\n{log.read_text()}"


def exec_start(unit: Path) -> str:
    (line,) = [s for s in unit.read_text().splitlines() if s.startswith("ExecStart=")]
    return line.removeprefix("ExecStart=")


@pytest.fixture(scope="module")
def python() -> str:
    """An interpreter the install accepts: the system's, else the base of the one running the tests."""
    for candidate in (SYSTEM_PYTHON, sys._base_executable):
        if passes_the_check(candidate):
            return candidate
    pytest.skip(f"neither {SYSTEM_PYTHON} nor {sys._base_executable} can carry the service here")


@pytest.fixture(scope="module")
def build_args(python: str) -> list[str]:
    """What make install is given to build on ``python``: nothing at all for the system's."""
    return [] if python == SYSTEM_PYTHON else [f"PYTHON={python}"]


@pytest.fixture(scope="module")
def staged(build_args: list[str]) -> Iterator[Path]:
    """Staged where another user can reach it, by a shell whose umask (077, as a hardened
    root's may be) would close everything the install writes if the install let it."""
    top = open_dir()
    try:
        make("install", f"DESTDIR={top / 'root'}", *build_args, umask=0o077)
        yield top / "root"
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_the_environment_is_built_on_the_system_python_by_default(staged: Path, build_args: list[str]) -> None:
    if build_args:
        pytest.skip(f"{SYSTEM_PYTHON} cannot carry the service on this machine")
    assert "home = /usr/bin" in (staged / STAGED_VENV / "pyvenv.cfg").read_text().splitlines()
    assert os.path.realpath(staged / STAGED_VENV / "bin/python") == os.path.realpath(SYSTEM_PYTHON)


def test_what_install_writes_is_open_to_other_users_whatever_the_umask(staged: Path) -> None:
    closed = []
    for path in [staged, *staged.rglob("*")]:
        if not path.is_symlink():
            mode = path.stat().st_mode
            need = 0o005 if path.is_dir() or mode & 0o100 else 0o004
            if mode & need != need:
                closed.append(f"{path.relative_to(staged)} {mode & 0o777:o}")
    assert closed == []


@pytest.mark.skipif(os.geteuid() != 0, reason="running a program as another user needs root")
def test_another_user_runs_the_installed_gpuctl(staged: Path) -> None:
    """The old failure: built on root's pyenv Python, gpuctl failed for everyone else with
    Permission denied."""
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody")
    bindir = staged / STAGED_VENV / "bin"
    out = subprocess.run(
        [str(bindir / "python"), str(bindir / "gpuctl"), "--version"],
        user=nobody.pw_uid,
        group=nobody.pw_gid,
        extra_groups=[],
        env=away_from_the_checkout() | {"HOME": "/nonexistent"},
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and f"gpuctl {gpud.__version__}" in out.stdout, out.stdout + out.stderr


def refused(*args: str, env: Mapping[str, str] = {}) -> str:
    """make install's refusal: what it said, having written nothing under DESTDIR."""
    top = open_dir()
    try:
        out = run_make("install", f"DESTDIR={top / 'root'}", *args, env=env)
        assert out.returncode != 0 and not (top / "root").exists(), out.stdout + out.stderr
        return out.stderr
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_an_interpreter_in_a_home_directory_is_refused_and_nothing_is_installed(python: str) -> None:
    """As pyenv leaves it: a python3 outside the home that links to an interpreter inside one."""
    top = open_dir()
    try:
        home = top / "home/alice"
        inside = home / ".pyenv/versions/3/bin/python3"
        inside.parent.mkdir(parents=True)
        shutil.copy2(os.path.realpath(python), inside)  # a copy finds its library where it was built
        if subprocess.run([inside, "-c", "pass"], capture_output=True, timeout=60).returncode != 0:
            pytest.skip(f"a copy of {python} does not run elsewhere")
        link = top / "bin/python3"
        link.parent.mkdir()
        link.symlink_to(inside)
        said = refused(f"PYTHON={link}", env={"GPUD_INSTALL_HOMES": str(home)})
        assert f"make install: refusing {link} ({inside}): {inside} lies in the home directory {home}" in said, said
        assert "install with PYTHON=/usr/bin/python3, or another python3 outside home directories" in said, said
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_an_interpreter_other_users_cannot_reach_is_refused_and_nothing_is_installed(python: str) -> None:
    top = open_dir()
    try:
        locked = top / "locked"
        locked.mkdir(mode=0o750)
        locked.chmod(0o750)  # whatever the umask
        link = locked / "python3"
        link.symlink_to(os.path.realpath(python))
        said = refused(f"PYTHON={link}")
        assert f"make install: refusing {link} (" in said, said
        assert f"other users may not pass through {locked} (mode 0750)" in said, said
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_the_links_and_scripts_name_the_final_paths(staged: Path) -> None:
    bindir = staged / "usr/local/bin"
    assert sorted(os.listdir(bindir)) == ["gpuctl", "gpud"]
    for name in ("gpud", "gpuctl"):
        assert os.readlink(bindir / name) == f"{PREFIX}/bin/{name}"
        script = (staged / STAGED_VENV / "bin" / name).read_text()
        # pip writes a /bin/sh trampoline instead when the staged path is too long for #!
        first = script.splitlines()[0]
        assert first == f"#!{PREFIX}/bin/python" or (first == "#!/bin/sh" and f'"{PREFIX}/bin/python"' in script)
    for path in (staged / STAGED_VENV / "bin").iterdir():
        if path.is_file() and not path.is_symlink():
            assert str(staged) not in path.read_text(errors="replace"), path
    # quoted or not, as the Python that built it writes it
    activate = (staged / STAGED_VENV / "bin/activate").read_text().splitlines()
    assert {f"VIRTUAL_ENV={PREFIX}", f'VIRTUAL_ENV="{PREFIX}"', f"VIRTUAL_ENV='{PREFIX}'"} & set(activate), activate


def test_the_installed_package_runs_from_its_own_site_packages(staged: Path) -> None:
    gpud_script = str(staged / STAGED_VENV / "bin/gpud")
    assert installed_python(staged, gpud_script, "--version").stdout.strip() == f"gpud {gpud.__version__}"
    out = installed_python(staged, "-c", "import gpud, gpud_client; print(gpud.__file__); print(gpud_client.__file__)")
    site = staged / STAGED_VENV / "lib"
    for found in out.stdout.split():
        assert Path(found).is_relative_to(site) and "site-packages" in found, out.stdout + out.stderr
    assert str(ROOT) not in out.stdout  # the checkout's editable install does not leak in


def test_a_daemon_from_the_installed_venv_answers_its_gpuctl(staged: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="gpud-in-", dir="/tmp"))  # a Unix socket path must stay short
    sock, log = str(work / "gpud.sock"), work / "gpud.log"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(work / "notify"))
    bindir = staged / STAGED_VENV / "bin"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                str(bindir / "python"),
                str(bindir / "gpud"),
                "--simulate",
                "1",
                "--socket",
                sock,
                "--state-dir",
                str(work / "state"),
                "--metrics-addr",
                "off",
            ],
            env=away_from_the_checkout() | {"NOTIFY_SOCKET": str(work / "notify")},
            cwd=work,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
        )
    try:
        wait_ready(notify, proc, log)
        status = installed_python(staged, str(bindir / "gpuctl"), "--socket", sock, "status")
        assert status.returncode == 0, status.stdout + status.stderr
        assert f"gpud {gpud.__version__}" in status.stdout and "Simulated GPU" in status.stdout
    finally:
        proc.kill()
        proc.wait()
        notify.close()
        shutil.rmtree(work, ignore_errors=True)


def test_the_shipped_unit_starts_the_link_that_install_makes() -> None:
    # The old failure: the unit named /usr/local/bin/gpud, where only some pips put it.
    assert exec_start(ROOT / "systemd/gpud.service") == "/usr/local/bin/gpud"


def test_the_installed_units_name_the_link_and_their_files_are_in_place(staged: Path) -> None:
    unit = staged / "etc/systemd/system/gpud.service"
    assert exec_start(unit) == "/usr/local/bin/gpud"
    assert os.readlink(staged / "usr/local/bin/gpud") == f"{PREFIX}/bin/gpud"
    for path, shipped in (
        (unit, "gpud.service"),
        (staged / "etc/systemd/system/gpud.socket", "gpud.socket"),
        (staged / "usr/lib/sysusers.d/gpud.conf", "gpud.sysusers.conf"),
        (staged / "usr/lib/tmpfiles.d/gpud.conf", "gpud.tmpfiles.conf"),
    ):
        assert path.stat().st_mode & 0o777 == 0o644, path
        assert path.read_text() == (ROOT / "systemd" / shipped).read_text(), path


def host_unit_dir() -> Path:
    for d in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")):
        if (d / "sysinit.target").exists():
            return d
    pytest.skip("no systemd system units on this machine (sysinit.target)")


def analyze_verify(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", "verify", *map(str, args)], capture_output=True, text=True, timeout=60)


def verify_under_root(staged: Path, root: Path) -> tuple[Callable[[], subprocess.CompletedProcess[str]], Path]:
    """verify --root resolves ExecStart= inside the root: /usr/local/bin/gpud, then the link
    to /opt/gpud/bin/gpud, must be an executable there. What else it checks belongs to the
    OS (the targets the units are ordered against, ExecReload's /bin/kill): copied in from
    this machine, into a copy of the staged tree."""
    shutil.copytree(staged, root, symlinks=True)
    shutil.copytree(host_unit_dir(), root / "usr/lib/systemd/system", symlinks=True, dirs_exist_ok=True)
    (root / "bin").mkdir(exist_ok=True)
    shutil.copy2("/bin/kill", root / "bin/kill")
    return (lambda: analyze_verify(f"--root={root}", "gpud.service", "gpud.socket")), root / STAGED_VENV / "bin/gpud"


def verify_at_real_paths(
    base: Path, build_args: list[str]
) -> tuple[Callable[[], subprocess.CompletedProcess[str]], Path]:
    """For a systemd-analyze that cannot verify under --root (systemd 249 and older): a second
    install, to real paths where the unit's ExecStart= and its link resolve on this machine."""
    make(
        "install",
        *build_args,
        f"PREFIX={base}/venv",
        f"BINDIR={base}/bin",
        f"UNITDIR={base}/units",
        f"SYSUSERSDIR={base}/sysusers.d",
        f"TMPFILESDIR={base}/tmpfiles.d",
    )
    assert exec_start(base / "units/gpud.service") == f"{base}/bin/gpud"
    return (lambda: analyze_verify(base / "units/gpud.service", base / "units/gpud.socket")), base / "venv/bin/gpud"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_installed_units_pass_verify_against_the_installed_gpud(
    staged: Path, build_args: list[str], tmp_path: Path
) -> None:
    verify, installed_gpud = verify_under_root(staged, tmp_path / "root")
    out = verify()
    if "only supported for cat-config" in out.stderr:
        verify, installed_gpud = verify_at_real_paths(tmp_path / "real", build_args)
        out = verify()
    problems = [line for line in (out.stdout + out.stderr).splitlines() if "gpud" in line]
    assert out.returncode == 0 and not problems, out.stdout + out.stderr
    installed_gpud.unlink()  # it is the installed script that verify found
    out = verify()
    assert out.returncode != 0 and "bin/gpud is not executable" in out.stderr, out.stdout + out.stderr


def test_uninstall_takes_back_every_file_install_made(staged: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(staged, root, symlinks=True)  # the staged tree held nothing before install
    assert files_under(root)
    make("uninstall", f"DESTDIR={root}")
    assert files_under(root) == []


def test_the_demo_installs_neither_ray_nor_airflow_nor_the_test_tools() -> None:
    """`make demo` on a fresh checkout installs gpud and its client; the tests' extras (and the Kubernetes
    agent's, which the tests run) come with `make test`."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        ["make", "-n", "--always-make", "-C", str(root), "demo"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "MAKEFLAGS": ""},
    )
    installs = [line for line in out.stdout.splitlines() if "pip install" in line]
    assert installs and not any(x in line for line in installs for x in ("ray", "airflow", "test", "k8s")), installs
    test = subprocess.run(
        ["make", "-n", "--always-make", "-C", str(root), "test"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "MAKEFLAGS": ""},
    ).stdout
    assert "'./client[ray,airflow]'" in test and "'.[test,k8s]'" in test
