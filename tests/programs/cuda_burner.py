"""An unmodified "CUDA" program for the cuda backend's tests: it knows nothing of gpud.

It makes a context of the stand-in driver (tests/fakecuda/fakecuda_app.py), launches short
kernels in a loop, and appends its progress to PROGRESS as JSON lines {pid, kind, n, t}: one with
n = 0 once it has started, then one after each kernel (n counts them, t is time.time()).
``--fork N`` starts N children doing the same (each with its own context), ``--plain N``
children with no context that burn CPU in the same slices (a data loader, say): a process
tree. Each process ends by itself after --max-seconds, so none outlives a test that died.

    python cuda_burner.py PROGRESS [--kernel-ms 10] [--device-mib 64] [--fork N] [--plain N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fakecuda"))

from fakecuda_app import Context  # noqa: E402

MiB = 2**20


def run(args: argparse.Namespace, *, cuda: bool) -> None:
    ctx = Context(args.device_mib * MiB) if cuda else None
    kernel_s = args.kernel_ms / 1000
    stop_at = time.monotonic() + args.max_seconds
    fd = os.open(args.progress, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    kind = "cuda" if cuda else "plain"
    n = 0
    try:
        while True:
            line = json.dumps({"pid": os.getpid(), "kind": kind, "n": n, "t": time.time()}) + "\n"
            os.write(fd, line.encode())  # one O_APPEND write: the tree's lines never interleave
            if time.monotonic() >= stop_at:
                return
            if ctx is not None:
                ctx.launch(kernel_s)
            else:
                end = time.time() + kernel_s
                while time.time() < end:
                    pass
            n += 1
    finally:
        os.close(fd)
        if ctx is not None:
            ctx.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("progress", help="the file progress lines are appended to")
    parser.add_argument("--kernel-ms", type=float, default=10.0, help="each kernel's length")
    parser.add_argument("--device-mib", type=int, default=64, help="GPU memory each context holds")
    parser.add_argument("--fork", type=int, default=0, metavar="N", help="children doing the same")
    parser.add_argument("--plain", type=int, default=0, metavar="N", help="children with no CUDA context")
    parser.add_argument("--max-seconds", type=float, default=60.0, help="each process ends after this")
    args = parser.parse_args()
    for cuda in [True] * args.fork + [False] * args.plain:
        if os.fork() == 0:
            try:
                run(args, cuda=cuda)
            finally:
                os._exit(0)
    run(args, cuda=True)


if __name__ == "__main__":
    main()
