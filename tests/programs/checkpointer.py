"""An unmodified program for ``gpuctl run`` preemption tests: it counts, checkpoints and resumes.

It imports nothing of gpud and reads only the environment a run gives it. At start it appends
``start PID CUDA_VISIBLE_DEVICES GPUD_ON_PREEMPT GPUD_PREEMPT_SIGNAL GPUD_RESUME GPUD_PREEMPT_GRACE_S`` to the log
(``-`` for what is not set); started with ``GPUD_RESUME=1`` it reads its counter back from the
checkpoint file and appends ``resume N`` (``resume -`` and 0 when it has none: a restart on
other devices that saved nothing). It then counts, one step every ``--every`` seconds, and
appends ``count N`` after each step. On the signal GPUD_PREEMPT_SIGNAL names (SIGUSR1 when unset)
it saves its counter to the checkpoint file (written whole, then renamed), appends ``checkpoint N``
and exits 0. SIGTERM appends ``signal 15`` and exits 3.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("checkpoint")
    ap.add_argument("--every", type=float, default=0.02)
    args = ap.parse_args()
    out = open(args.log, "a", buffering=1)
    env = os.environ
    fields = ("CUDA_VISIBLE_DEVICES", "GPUD_ON_PREEMPT", "GPUD_PREEMPT_SIGNAL", "GPUD_RESUME", "GPUD_PREEMPT_GRACE_S")
    out.write(f"start {os.getpid()} " + " ".join(env.get(k) or "-" for k in fields) + "\n")
    count = 0
    if env.get("GPUD_RESUME") == "1":
        try:
            with open(args.checkpoint) as f:
                count = int(f.read())
            out.write(f"resume {count}\n")
        except FileNotFoundError:
            out.write("resume -\n")

    def checkpoint(signum: int, frame: object) -> None:
        tmp = args.checkpoint + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(count))
        os.replace(tmp, args.checkpoint)
        out.write(f"checkpoint {count}\n")
        out.close()
        os._exit(0)

    def terminate(signum: int, frame: object) -> None:
        out.write(f"signal {signum}\n")
        out.close()
        os._exit(3)

    signal.signal(signal.Signals[env.get("GPUD_PREEMPT_SIGNAL") or "SIGUSR1"], checkpoint)
    signal.signal(signal.SIGTERM, terminate)
    while True:
        time.sleep(args.every)
        count += 1
        out.write(f"count {count}\n")


if __name__ == "__main__":
    sys.exit(main())
