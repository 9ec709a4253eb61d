"""The keeper: the parent of a run's program, which never lets the program outlive the run.

``Keeper.start`` starts ``python -m gpud_client.proctl.keeper`` with a socket to
the run. The keeper makes itself a child subreaper (every orphan of the program
is re-parented to it, so the whole tree stays below it: ``ProcessTree(keeper.pid)``)
and forks the program's process at once (in a process group of its own, with
``PR_SET_PDEATHSIG``), held before its exec: its pid is known before gpud is asked
for anything. ``go`` hands it its environment and CPU set and lets it exec (once
the run holds the lock); the keeper reports whether the exec worked and, when the
program ends, its exit status
(the code, or 128 + N for signal N) after ending what it left behind. When the
run goes away, killed included, its end of the socket closes: the keeper ends the
whole tree with SIGKILL (a stopped process dies of it too) and exits. So a
program never goes on unarbitrated after its run.

The keeper is a tiny process that does nothing else; it is not part of the tree
it keeps, and is never paused.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence

from gpud_client.proctl.tree import ProcessTree

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def exit_status(wait_status: int) -> int:
    """A shell's exit status for a ``waitpid`` status: the code, or 128 + N for signal N."""
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.waitstatus_to_exitcode(wait_status)


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


class Keeper:
    """The run's side: start the keeper, let the program go, learn its pid and its end."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.proc = proc
        self.sock = sock
        self.file = sock.makefile("rb")
        self.pid = proc.pid
        self.program_pid = 0

    @classmethod
    def start(cls, argv: Sequence[str], *, cwd: str | None = None) -> Keeper:
        ours, theirs = socket.socketpair()
        args = [sys.executable, "-m", "gpud_client.proctl.keeper", str(theirs.fileno()), "--", *argv]
        proc = subprocess.Popen(args, cwd=cwd, pass_fds=(theirs.fileno(),))
        theirs.close()
        keeper = cls(proc, ours)
        line = keeper.file.readline().split()
        if len(line) != 2 or line[0] != b"pid":
            keeper.close()
            raise OSError(1, "the keeper could not start the program's process")
        keeper.program_pid = int(line[1])
        return keeper

    def go(self, env: Mapping[str, str], cpus: Sequence[int] = ()) -> None:
        """Let the program (held before its exec) run with ``env`` on ``cpus`` (all: empty). Raises
        OSError with the shell's status (127: not found, 126: not executable) in ``errno`` when it
        could not be executed."""
        self.sock.sendall(b"go\n" + json.dumps({"env": dict(env), "cpus": list(cpus)}).encode() + b"\n")
        line = self.file.readline().decode().split(maxsplit=2)
        if line and line[0] == "started":
            return
        if line and line[0] == "exec-error":
            raise OSError(int(line[1]), line[2].strip() if len(line) > 2 else "cannot execute")
        raise OSError(1, "the keeper ended before it started the program")

    def fileno(self) -> int:
        """Readable when the program has ended (``exit_code`` then answers at once)."""
        return self.sock.fileno()

    def exit_code(self) -> int:
        """Wait for the program's end; its exit status."""
        line = self.file.readline().decode().split()
        self.proc.wait()
        if line and line[0] == "exit":
            return int(line[1])
        return 128 + signal.SIGKILL  # the keeper itself was killed: the program went with it

    def close(self) -> None:
        """End the program and its tree (if still there) and the keeper. Shut down first: a thread
        waiting on the socket keeps it open past a plain close, and the keeper would never know."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # the keeper has gone already
        try:
            self.sock.close()
        finally:
            self.file.close()
            self.proc.wait()


# --- the keeper process --------------------------------------------------------------------------


def _kill_tree(root: int) -> None:
    tree = ProcessTree(root)
    for _ in range(100):  # until no descendant is left (one that forks meanwhile is caught next round)
        pids = tree.pids()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap()


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _main(fd: int, argv: list[str]) -> int:
    os.set_inheritable(fd, False)  # the program must not hold the run's socket: its end is the run's end
    sock = socket.socket(fileno=fd)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the run forwards what the program must see
    f = sock.makefile("rb")
    go_r, go_w = os.pipe()
    err_r, err_w = os.pipe()
    os.set_inheritable(err_w, False)  # closed by a successful exec: EOF on err_r means it ran
    pid = os.fork()
    if pid == 0:  # the program, held before its exec until the run has the lock
        try:
            sock.close()
            os.close(go_w)
            os.close(err_r)
            os.setpgid(0, 0)
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the keeper killed outright: the program goes too
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            with os.fdopen(go_r, "rb") as go:
                how = go.read()
            if not how:
                os._exit(0)  # the run went away before the program started
            terms = json.loads(how)
            if terms["cpus"]:
                os.sched_setaffinity(0, terms["cpus"])
            os.execvpe(argv[0], argv, terms["env"])
        except OSError as e:
            os.write(err_w, f"{e.errno} {e.strerror}".encode())
        finally:
            os._exit(127)
    os.close(go_r)
    os.close(err_w)
    sock.sendall(f"pid {pid}\n".encode())
    if f.readline().strip() != b"go":
        _kill_tree(os.getpid())  # the run went away before the program started
        return 0
    os.write(go_w, f.readline())
    os.close(go_w)
    with os.fdopen(err_r, "rb") as err:
        failure = err.read().decode()
    if failure:
        errno_, _, why = failure.partition(" ")
        code = 127 if int(errno_) == 2 else 126  # ENOENT: not found; anything else: found, not executable
        os.waitpid(pid, 0)
        sock.sendall(f"exec-error {code} {argv[0]}: {why}\n".encode())
        return code
    sock.sendall(b"started\n")
    me = os.getpid()

    def watch_run() -> None:
        f.read()  # returns at EOF: the run has gone
        _kill_tree(me)

    threading.Thread(target=watch_run, daemon=True).start()
    status = 0
    while True:  # reap orphans as they come, until the program itself ends
        child, wstatus = os.waitpid(-1, 0)
        if child == pid:
            status = exit_status(wstatus)
            break
    _kill_tree(me)  # what the program left behind never runs on unarbitrated
    try:
        sock.sendall(f"exit {status}\n".encode())
    except OSError:
        pass
    return status


if __name__ == "__main__":
    sep = sys.argv.index("--")
    sys.exit(_main(int(sys.argv[1]), sys.argv[sep + 1 :]))
