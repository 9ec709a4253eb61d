"""The rules of install/check_python.py: which interpreter `make install` may build the
service's environment on. Facts in, a sentence or None out; the staged install in
tests/integration/test_install.py runs the script itself."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_python", ROOT / "install/check_python.py")
assert _spec is not None and _spec.loader is not None
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

DIR, FILE = 0o040000, 0o100000
SYSTEM = check.Interpreter(
    named="/usr/bin/python3",
    runs=("/usr/bin/python3", "/usr/bin/python3.11"),
    real="/usr/bin/python3.11",
    stdlib=("/usr/lib/python3.11",),
    version=(3, 11),
    has_ensurepip=True,
)
GPUD = check.Unit(user="gpud", protect_home=True)
HOMES = check.home_dirs([(0, "/root"), (1000, "/home/alice"), (1001, "/data/bob")], 1000)
FIX = "install with PYTHON=/usr/bin/python3, or another python3 outside home directories that every user can read."


def open_modes(interp: check.Interpreter) -> dict[str, int]:
    """Every path the interpreter needs, open to all (0755)."""
    return {path: (FILE if path == interp.real else DIR) | 0o755 for path, _ in check.needs(interp)}


def refusal(interp: check.Interpreter, **kw: object) -> str | None:
    args: dict[str, object] = {
        "homes": HOMES,
        "modes": open_modes(interp),
        "unit": GPUD,
        "minimum": (3, 11),
    } | kw
    return check.refusal(interp, **args)


def pyenv(version: str = "3.12.1") -> check.Interpreter:
    real = f"/root/.pyenv/versions/{version}/bin/python{version[:4]}"
    return SYSTEM._replace(
        named="/usr/local/bin/python3",
        runs=("/usr/local/bin/python3", real),
        real=real,
        stdlib=(f"/root/.pyenv/versions/{version}/lib/python{version[:4]}",),
    )


def test_the_system_python_may_carry_the_service() -> None:
    assert refusal(SYSTEM) is None


def test_an_interpreter_whose_real_path_is_in_roots_home_is_refused_in_one_sentence() -> None:
    assert refusal(pyenv()) == (
        "make install: refusing /usr/local/bin/python3 (/root/.pyenv/versions/3.12.1/bin/python3.12): "
        "/root/.pyenv/versions/3.12.1/bin/python3.12 lies in the home directory /root, and ProtectHome=yes "
        f"in gpud.service hides it from the service; {FIX}"
    )


def test_a_link_through_a_home_is_refused_though_it_ends_outside() -> None:
    """The environment links to the interpreter as named: a hop in a home is hidden from the service."""
    interp = SYSTEM._replace(named="/opt/py3", runs=("/opt/py3", "/home/alice/bin/python3", "/usr/bin/python3.11"))
    said = refusal(interp)
    assert said is not None and "/home/alice/bin/python3 lies in the home directory /home/alice," in said


def test_a_standard_library_in_a_home_is_refused() -> None:
    said = refusal(SYSTEM._replace(stdlib=("/home/alice/.local/lib/python3.11",)))
    assert said is not None and "lies in the home directory /home/alice, and ProtectHome=yes" in said


def test_a_home_that_protecthome_does_not_hide_is_refused_as_one_users_own() -> None:
    interp = SYSTEM._replace(named="/data/bob/py/bin/python3", runs=("/data/bob/py/bin/python3",))
    said = refusal(interp._replace(real="/data/bob/py/bin/python3"))
    assert said is not None and "lies in the home directory /data/bob, and it is one user's own;" in said


def test_a_directory_that_only_starts_like_a_home_is_not_one() -> None:
    assert check.home_of("/homestead/bin/python3", HOMES) is None
    assert check.home_of("/home/alice/x", HOMES | {"/home/alice/x"}) == "/home/alice/x"  # the innermost
    assert check.home_of("/home", HOMES) == "/home"


def test_the_homes_are_roots_and_login_users_never_a_system_tree() -> None:
    passwd = [
        (0, "/root"),
        (1, "/usr/sbin"),  # daemon
        (2, "/bin"),  # bin: /bin is /usr/bin on a merged /usr
        (101, "/var/lib/postgresql"),  # a service's data
        (998, "/"),
        (1000, "/home/alice/"),
        (1001, "/data/bob"),
        (1002, "/"),
        (1003, "/usr"),
        (1004, ""),
        (65534, "/nonexistent"),
    ]
    assert check.home_dirs(passwd, 1000, ["/tmp/carol", ""]) == {
        "/home",
        "/root",
        "/run/user",
        "/home/alice",
        "/data/bob",
        "/tmp/carol",
    }


def test_uid_min_comes_from_login_defs() -> None:
    assert check.login_uid_min("# UID_MIN 10\nUID_MIN\t\t\t  500\nUID_MAX 60000\n") == 500
    assert check.login_uid_min("#UID_MIN 10\n") == 1000
    assert check.login_uid_min("") == 1000


def test_the_shipped_unit_runs_as_gpud_behind_protecthome() -> None:
    assert check.unit_settings((ROOT / "systemd/gpud.service").read_text()) == GPUD


def test_the_unit_settings_are_the_service_sections_last() -> None:
    text = "[Unit]\nUser=nobody\n[Service]\nUser=a\nUser=b\nProtectHome=tmpfs\n# ProtectHome=no\n"
    assert check.unit_settings(text) == check.Unit(user="b", protect_home=True)
    assert check.unit_settings("[Service]\nProtectHome=read-only\n") == check.Unit(user="root", protect_home=False)


@pytest.mark.parametrize(
    ("path", "mode", "words"),
    [
        ("/opt", DIR | 0o750, "other users may not pass through /opt (mode 0750)"),
        ("/opt/py/bin/python3.12", FILE | 0o750, "other users may not read and run /opt/py/bin/python3.12 (mode 0750)"),
        ("/opt/py/lib/python3.12", DIR | 0o711, "other users may not read and run /opt/py/lib/python3.12 (mode 0711)"),
    ],
)
def test_what_other_users_cannot_reach_is_refused_with_its_mode(path: str, mode: int, words: str) -> None:
    interp = check.Interpreter(
        named="/opt/py/bin/python3",
        runs=("/opt/py/bin/python3",),
        real="/opt/py/bin/python3.12",
        stdlib=("/opt/py/lib/python3.12",),
        version=(3, 12),
        has_ensurepip=True,
    )
    said = refusal(interp, modes=open_modes(interp) | {path: mode})
    assert said is not None
    assert said.startswith("make install: refusing /opt/py/bin/python3 (/opt/py/bin/python3.12): " + words)
    assert "so the service's user gpud and gpuctl's users could not run it; install with PYTHON=" in said


def test_a_root_service_still_needs_gpuctls_users_to_reach_it() -> None:
    modes = open_modes(SYSTEM) | {"/usr/lib": DIR | 0o700}
    said = refusal(SYSTEM, modes=modes, unit=check.Unit(user="root", protect_home=True))
    assert said is not None and "so the users who run gpuctl could not run it" in said


def test_a_path_that_could_not_be_looked_at_is_refused() -> None:
    modes = open_modes(SYSTEM)
    del modes["/usr/bin"]
    said = refusal(SYSTEM, modes=modes)
    assert said is not None and "/usr/bin cannot be looked at" in said


def test_every_directory_above_is_passed_through_and_the_ends_are_read() -> None:
    needs = dict(check.needs(SYSTEM))
    assert needs == {
        "/": check.OTHERS_X,
        "/usr": check.OTHERS_X,
        "/usr/bin": check.OTHERS_X,
        "/usr/lib": check.OTHERS_X,
        "/usr/bin/python3.11": check.OTHERS_RX,
        "/usr/lib/python3.11": check.OTHERS_RX,
    }


@given(st.lists(st.integers(0, 0o777), min_size=6, max_size=6))
def test_it_refuses_exactly_when_some_path_lacks_its_bits(perms: list[int]) -> None:
    needs = check.needs(SYSTEM)
    modes = {path: perm for (path, _), perm in zip(needs, perms)}
    closed = any(modes[path] & bits != bits for path, bits in needs)
    assert (refusal(SYSTEM, modes=modes) is not None) == closed


def test_too_old_a_python_is_refused_before_anything_else() -> None:
    said = refusal(pyenv("3.9.18")._replace(version=(3, 9)))
    assert said is not None and said.endswith(
        "it is Python 3.9, and gpud needs 3.11 or newer; name one with PYTHON=/path/to/python3.11"
    )
    assert refusal(SYSTEM._replace(version=(3, 9)), minimum=None) is None


def test_an_interpreter_without_ensurepip_is_refused() -> None:
    said = refusal(SYSTEM._replace(has_ensurepip=False))
    assert said is not None and "(Debian and Ubuntu: apt install python3-venv)" in said


def test_the_oldest_python_is_pyprojects() -> None:
    assert check.requires_python((ROOT / "pyproject.toml").read_text()) == (3, 11)
    assert check.requires_python('requires-python = "~=3.11"') is None


def test_the_chain_names_each_link_and_the_directories_behind_links(tmp_path: Path) -> None:
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    (real_dir / "python3.11").touch()
    (real_dir / "python3").symlink_to("python3.11")
    (tmp_path / "dir").symlink_to(real_dir)
    (tmp_path / "py").symlink_to(tmp_path / "dir/python3")
    assert check.link_chain(str(tmp_path / "py")) == (
        str(tmp_path / "py"),
        str(tmp_path / "dir/python3"),
        str(real_dir / "python3"),
        str(real_dir / "python3.11"),
    )


def test_main_refuses_this_interpreter_when_its_directory_counts_as_a_home(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    home = os.path.dirname(os.path.realpath(sys._base_executable))
    monkeypatch.setenv("GPUD_INSTALL_HOMES", f"/nowhere:{home}")
    assert check.main(["python3"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("make install: refusing python3 (")
    assert f" lies in the home directory {home}" in out.err
