"""An unmodified program for ``gpuctl run``'s containment tests: it burns CPU, and so does a descendant
it leaves behind in a session of its own (setsid, then a second fork: the descendant's parent is no
longer the program, and no process group of the program's holds it).

It imports nothing of gpud. It appends ``start PID`` (its own) and ``orphan PID`` (the descendant's) to
FILE, then both burn CPU until killed. A paused program's CPU time (utime + stime in /proc/PID/stat)
does not grow; that is what the tests look at.
"""

from __future__ import annotations

import os
import sys


def burn() -> None:
    x = 0
    while True:
        x += 1


def main() -> int:
    path = sys.argv[1]
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(r)
        os.setsid()
        if os.fork() > 0:
            os._exit(0)  # the second fork: the descendant is orphaned, re-parented to the subreaper
        os.write(w, f"{os.getpid()}\n".encode())
        os.close(w)
        burn()
    os.close(w)
    os.waitpid(child, 0)
    orphan = int(os.read(r, 64).decode().strip())
    with open(path, "a") as out:
        out.write(f"start {os.getpid()}\norphan {orphan}\n")
    burn()
    return 0


if __name__ == "__main__":
    sys.exit(main())
