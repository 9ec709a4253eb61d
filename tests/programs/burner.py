"""An unmodified program for ``gpuctl run`` tests: it burns CPU and counts its own progress.

It imports nothing of gpud. Every ``--every`` seconds it appends ``monotonic_time count``
to the progress file, a count of fixed-size chunks of work done so far; a paused program
adds nothing. Options: ``--seconds`` to stop after that long (exit 0), ``--exit N`` to
exit with N at the end, ``--sleep`` to sleep instead of burning (an idle program),
``--children N`` to start N more burners writing to FILE.1, FILE.2 ... (a process tree).
SIGTERM and SIGINT write ``signal N`` to the file and exit with 3.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

CHUNK = 20_000  # about 1 ms of work on a laptop core


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--seconds", type=float, default=3600.0)
    ap.add_argument("--every", type=float, default=0.05)
    ap.add_argument("--exit", type=int, default=0)
    ap.add_argument("--sleep", action="store_true")
    ap.add_argument("--children", type=int, default=0)
    args = ap.parse_args()
    out = open(args.file, "a", buffering=1)

    def on_signal(signum: int, frame: object) -> None:
        out.write(f"signal {signum}\n")
        out.close()
        os._exit(3)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    kids = [
        subprocess.Popen([sys.executable, __file__, f"{args.file}.{i + 1}", "--every", str(args.every)])
        for i in range(args.children)
    ]
    out.write(f"start {os.getpid()} {os.environ.get('CUDA_VISIBLE_DEVICES', '-')} {os.environ.get('GPUD_CPUS', '-')}\n")
    count = 0
    end = time.monotonic() + args.seconds
    next_write = time.monotonic() + args.every
    while (now := time.monotonic()) < end:
        if args.sleep:
            time.sleep(args.every)
        else:
            x = 0
            for i in range(CHUNK):
                x += i
            count += 1
        if now >= next_write:
            out.write(f"{now:.6f} {count}\n")
            next_write = now + args.every
    out.write(f"{time.monotonic():.6f} {count}\nend\n")
    for k in kids:
        k.terminate()
    return args.exit


if __name__ == "__main__":
    sys.exit(main())
