"""May this interpreter carry gpud's service? `make install` asks it before it builds anything:
``/usr/bin/python3 install/check_python.py /usr/bin/python3`` (the interpreter runs this file
about itself; the argument is its name as make was given it).

The environment at /opt/gpud links its python to the interpreter that built it, and the service
and every user of gpuctl start that interpreter through the link. So:
- none of the paths the link goes through, nor the standard library, may lie in a home directory:
  ProtectHome=yes in gpud.service hides /home, /root and /run/user from the service, and an
  interpreter in a user's home (pyenv, uv, conda) is that user's to change or remove;
- other users must be able to read and run it: the service's user and whoever runs gpuctl are
  other users, so the interpreter and its standard library need the "others" r and x bits, and
  every directory above them x;
- it must be recent enough for gpud (requires-python) and able to make an environment (ensurepip).

It prints one sentence and exits 1 when it refuses, or says what the install will use; it never
writes anything. The rules (``refusal`` and what it calls) are pure: facts in, a sentence or
None out; ``main`` gathers the facts. The interpreter may be too old for gpud, so the file reads
on old Pythons far enough to say so: quoted annotations, no dataclasses.

GPUD_INSTALL_HOMES (directories, colon-separated) counts more directories as home directories;
the tests use it to stand in for a user's home. It can only make the check refuse more.
"""

import argparse
import importlib.util
import os
import pwd
import re
import sys
import sysconfig
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# What ProtectHome=yes makes inaccessible to the service (systemd.exec(5)).
PROTECTED_HOMES = ("/home", "/root", "/run/user")
# Homes the passwd database may name that hold the system's own software, never one user's.
NOT_HOMES = frozenset(
    {
        "/",
        "/bin",
        "/sbin",
        "/lib",
        "/usr",
        "/usr/bin",
        "/usr/sbin",
        "/usr/local",
        "/opt",
        "/var",
        "/srv",
        "/nonexistent",
    }
)
OTHERS_X = 0o001  # a directory others may pass through
OTHERS_RX = 0o005  # a file others may run, a directory others may list and pass through
FIX = "install with PYTHON=/usr/bin/python3, or another python3 outside home directories that every user can read"


class Interpreter(NamedTuple):
    named: str  # as make was given it
    runs: "tuple[str, ...]"  # the executable the environment will link to, then each link it goes through
    real: str  # where those links end
    stdlib: "tuple[str, ...]"  # the standard library's directories, real paths
    version: "tuple[int, int]"
    has_ensurepip: bool


class Unit(NamedTuple):
    user: str  # User= of the service
    protect_home: bool  # ProtectHome= hides /home, /root and /run/user (yes or tmpfs; read-only leaves them seen)


def unit_settings(text: str) -> Unit:
    """User= and ProtectHome= of a unit file's [Service] section (the last of each wins, as in systemd)."""
    values: dict[str, str] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith(("#", ";")):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return Unit(
        user=values.get("User") or "root",
        protect_home=values.get("ProtectHome", "no").lower() in ("yes", "true", "on", "1", "tmpfs"),
    )


def login_uid_min(text: str) -> int:
    """UID_MIN of /etc/login.defs: the first uid of a login user (1000 where it says nothing)."""
    match = re.search(r"^\s*UID_MIN\s+(\d+)", text, re.MULTILINE)
    return int(match.group(1)) if match else 1000


def home_dirs(passwd: "Iterable[tuple[int, str]]", uid_min: int, extra: "Iterable[str]" = ()) -> "frozenset[str]":
    """/home, /root, /run/user, and the homes that the passwd database names for root and for login
    users (uid_min and up); a system user's home is its service's data, and `/` or a system tree
    is nobody's own. ``extra`` counts as homes too."""
    found = set(PROTECTED_HOMES) | {os.path.normpath(d) for d in extra if d}
    for uid, home in passwd:
        home = os.path.normpath(home) if home else "/"
        if (uid == 0 or uid >= uid_min) and home not in NOT_HOMES:
            found.add(home)
    return frozenset(found)


def home_of(path: str, homes: "Iterable[str]") -> "str | None":
    """The home directory ``path`` lies in (the innermost), or None."""
    inside = [h for h in homes if path == h or path.startswith(h.rstrip("/") + "/")]
    return max(inside, key=len) if inside else None


def above(path: str) -> "list[str]":
    """The directories above ``path``, from / down."""
    dirs: list[str] = []
    parent = os.path.dirname(path)
    while parent not in dirs:
        dirs.append(parent)
        parent = os.path.dirname(parent)
    return dirs[::-1]


def needs(interp: Interpreter) -> "list[tuple[str, int]]":
    """Each path other users must get through to start the interpreter, with the bits they need."""
    out: dict[str, int] = {}
    for path in interp.runs + (interp.real,) + interp.stdlib:
        for d in above(path):
            out.setdefault(d, OTHERS_X)
    for path in (interp.real,) + interp.stdlib:
        out[path] = OTHERS_RX
    return list(out.items())


def refusal(
    interp: Interpreter,
    homes: "Iterable[str]",
    modes: "Mapping[str, int]",
    unit: Unit,
    minimum: "tuple[int, int] | None",
) -> "str | None":
    """Why ``interp`` must not carry the service, in one sentence; None if it may. ``modes`` holds
    st_mode for what ``needs`` lists (a path missing from it could not be looked at)."""
    who = interp.named if interp.named == interp.real else f"{interp.named} ({interp.real})"
    start = f"make install: refusing {who}: "
    if minimum is not None and interp.version < minimum:
        have, need = ".".join(map(str, interp.version)), ".".join(map(str, minimum))
        return (
            start + f"it is Python {have}, and gpud needs {need} or newer; name one with PYTHON=/path/to/python{need}"
        )
    for path in interp.runs + (interp.real,) + interp.stdlib:
        home = home_of(path, homes)
        if home is not None:
            hidden = unit.protect_home and home_of(home, PROTECTED_HOMES) is not None
            why = "ProtectHome=yes in gpud.service hides it from the service" if hidden else "it is one user's own"
            return start + f"{path} lies in the home directory {home}, and {why}; {FIX}."
    readers = (
        "the users who run gpuctl" if unit.user == "root" else f"the service's user {unit.user} and gpuctl's users"
    )
    for path, bits in needs(interp):
        mode = modes.get(path)
        if mode is None:
            return start + f"{path} cannot be looked at, so {readers} could not run it; {FIX}."
        if mode & bits != bits:
            what = "read and run" if bits == OTHERS_RX else "pass through"
            return (
                start + f"other users may not {what} {path} (mode {mode & 0o7777:04o}), so {readers} could not run it; "
                f"{FIX}, or give {path} the others bits (chmod o+{'rx' if bits == OTHERS_RX else 'x'})."
            )
    if not interp.has_ensurepip:
        return start + (
            "it cannot make a virtual environment (no ensurepip); install its venv package "
            "(Debian and Ubuntu: apt install python3-venv), or name another with PYTHON=/path/to/python3"
        )
    return None


def requires_python(text: str) -> "tuple[int, int] | None":
    """The oldest Python that pyproject.toml's requires-python (">=X.Y") allows, if it says."""
    match = re.search(r'^requires-python\s*=\s*">=\s*(\d+)\.(\d+)', text, re.MULTILINE)
    return (int(match.group(1)), int(match.group(2))) if match else None


def link_chain(path: str) -> "tuple[str, ...]":
    """``path`` and every link it goes through to the file it names, each as written and with its
    directory resolved (a directory on the way may itself be a link)."""
    hops: list[str] = []
    current = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on links followed
        real_dir = os.path.realpath(os.path.dirname(current))
        hops += [current, os.path.join(real_dir, os.path.basename(current))]
        if not os.path.islink(current):
            break
        current = os.path.normpath(os.path.join(real_dir, os.readlink(current)))
    return tuple(dict.fromkeys(hops))


def this_interpreter(named: str) -> Interpreter:
    """The facts about the running interpreter. What a new environment links to is the base
    interpreter (``sys._base_executable``), as named, not resolved: a venv's python is a link to it."""
    base = getattr(sys, "_base_executable", "") or sys.executable
    paths = sysconfig.get_paths()
    return Interpreter(
        named=named,
        runs=link_chain(base),
        real=os.path.realpath(base),
        stdlib=tuple(dict.fromkeys(os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib"))),
        version=(sys.version_info[0], sys.version_info[1]),
        has_ensurepip=importlib.util.find_spec("ensurepip") is not None,
    )


def read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def this_machines_homes() -> "frozenset[str]":
    """The home directories, as the passwd database names them and with their links resolved."""
    extra = [d for d in os.environ.get("GPUD_INSTALL_HOMES", "").split(":") if d]
    entries = [(pw.pw_uid, pw.pw_dir) for pw in pwd.getpwall()]
    homes = home_dirs(entries, login_uid_min(read("/etc/login.defs")), extra)
    return homes | {os.path.realpath(h) for h in homes if os.path.realpath(h) not in NOT_HOMES}


def modes_of(paths: "Sequence[str]") -> "dict[str, int]":
    modes: dict[str, int] = {}
    for path in paths:
        try:
            modes[path] = os.stat(path).st_mode
        except OSError:
            pass
    return modes


def main(argv: "Sequence[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(description="Refuse an interpreter that gpud's service could not run.")
    parser.add_argument("named", nargs="?", default=sys.executable, help="the interpreter's name as make was given it")
    parser.add_argument("--unit", default=os.path.join(ROOT, "systemd", "gpud.service"))
    parser.add_argument("--pyproject", default=os.path.join(ROOT, "pyproject.toml"))
    args = parser.parse_args(argv)
    interp = this_interpreter(args.named)
    modes = modes_of([path for path, _ in needs(interp)])
    unit, minimum = unit_settings(read(args.unit)), requires_python(read(args.pyproject))
    why = refusal(interp, this_machines_homes(), modes, unit, minimum)
    if why is not None:
        print(why, file=sys.stderr)
        return 1
    version = ".".join(map(str, interp.version))
    print(f"make install: building on {interp.named} ({interp.real}, Python {version})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
