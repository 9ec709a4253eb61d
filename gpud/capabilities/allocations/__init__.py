"""The shell's side of allocations: requests in, ledger decisions, SQLite out.

The ledger (``gpud.core.ledger``) decides; this package checks who may ask (``part``), commits every
change to the store before it answers, so that nothing acknowledged is ever lost (``durable``), answers
waiters and tells holders what the ledger did (``telling``, with whom to tell and signal decided by
``gpud.core.contacts``), and reclaims allocations whose owner process died (``reaping``). Each task's
parties are kept in one place (``tasks``). It never decides placement.

A change is the ledger's decision and its record, together: the ledger is checkpointed first, and
when the store cannot record the change (disk full, an I/O error, the database locked) the ledger is
rolled back to exactly that checkpoint, waiters the change would have served included, and the
request is refused with ``store_failed``. Only then is anything answered.
"""

from gpud.capabilities.allocations.part import STORE_RETRY_US, Allocations

__all__ = ["STORE_RETRY_US", "Allocations"]
