"""Every public client error survives pickling with its fields: Ray and Airflow carry a task's
exception to the driver by pickle, and ``except LockLost`` must catch what arrives there."""

from __future__ import annotations

import inspect
import pickle

import pytest

from gpud_client import errors, protocol
from gpud_client.errors import (
    DaemonUnavailable,
    GpudError,
    LockLost,
    MemoryLimitExceeded,
    PermissionDenied,
    ProtocolError,
    error_from,
)
from gpud_client.protocol import ErrorCode, FrameTooLarge

EXAMPLES: list[BaseException] = [
    GpudError("something went wrong"),
    DaemonUnavailable("gpud at /run/gpud/gpud.sock did not answer HELLO"),
    ProtocolError(ErrorCode.UNKNOWN_GPU, "no GPU 7"),
    ProtocolError("a_code_from_a_newer_daemon", "what it said"),
    PermissionDenied(ErrorCode.PERMISSION_DENIED, "needs admin rights"),
    error_from(ErrorCode.PERMISSION_DENIED, "another client's limits"),
    LockLost(3, 1, "revoked: DROP_LOCK ignored for 10 s"),
    LockLost(3, 1, "the connection to gpud was lost", in_use=False),
    MemoryLimitExceeded(4, 9 << 30, 8 << 30),
    FrameTooLarge(70_000, 65_536),
]


def fields(exc: BaseException) -> dict[str, object]:
    return {k: v for k, v in vars(exc).items() if not k.startswith("_")}


@pytest.mark.parametrize("exc", EXAMPLES, ids=lambda e: type(e).__name__)
def test_an_error_round_trips_through_pickle_with_its_fields(exc: BaseException) -> None:
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    assert back.args == exc.args
    assert fields(back) == fields(exc)


def test_every_public_error_class_has_an_example() -> None:
    """A new error class is caught here until it is shown to pickle."""
    public = {
        obj
        for mod in (errors, protocol)
        for _, obj in inspect.getmembers(mod, inspect.isclass)
        if issubclass(obj, Exception) and obj.__module__ == mod.__name__
    }
    assert public == {type(e) for e in EXAMPLES}


def test_a_pickled_lock_lost_is_caught_as_one() -> None:
    with pytest.raises(LockLost) as caught:
        raise pickle.loads(pickle.dumps(LockLost(1, 0, "connection lost")))
    assert (caught.value.session, caught.value.gpu, caught.value.why) == (1, 0, "connection lost")
