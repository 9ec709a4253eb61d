"""A training loop sharing GPU 0 through gpud: the README's client-library example, run by the tests.

    GPUD_SOCKET=/path/to/gpud.sock python examples/training_session.py
"""

import time

from gpud_client import Client


def train_step(batch: int) -> None:
    time.sleep(0.005)  # your model's forward and backward pass on the GPU


batches = range(100)

client = Client(name="trainer")            # --socket / $GPUD_SOCKET / /run/gpud/gpud.sock
session = client.session(gpu=0,            # index, "gpu:0" or a UUID
                         core_limit=40,     # at most 40 % of the GPU's time per window
                         mem_estimate="20GiB", mem_limit="24GiB",
                         idle_release=1.0,  # give the lock back after 1 s without a slice
                         on_drop=lambda reason: print("asked to yield:", reason),
                         on_lost=lambda err: print("lost the lock:", err),
                         synchronize=None)  # e.g. torch.cuda.synchronize, run before LOCK_RELEASED
for batch in batches:
    with session.slice():                  # takes the lock if not held
        train_step(batch)                  # at exit: released only if a DROP_LOCK is pending
client.close()
print("trained", len(batches), "batches")
