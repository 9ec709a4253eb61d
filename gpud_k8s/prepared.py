"""The claims this node has prepared, kept on disk so that prepare and unprepare stay idempotent across
restarts of the agent, of gpud and of the kubelet: one JSON file per claim uid, written whole
(a temporary file renamed over it) before the kubelet is answered, removed once the claim is
unprepared. What a record says is enough to undo the claim without the API server (which may
have deleted the claim already): its gpud task, its socket directory and its CDI spec file."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import msgspec
import structlog

log = structlog.get_logger(__name__)


class Prepared(msgspec.Struct, kw_only=True, frozen=True):
    uid: str
    namespace: str
    name: str
    task_id: str
    state: str  # preparing: written before anything is made, so a crash in the middle is undone or finished
    devices: list[tuple[str, str, str, str]] = []  # (request, pool, device, share id or "") as the kubelet is answered
    cdi_ids: list[str] = []
    socket_dir: str = ""
    cdi_file: str = ""
    allocate: dict[str, object] = {}  # the ALLOCATE that made its allocation: held again by its terms after a restart
    gpus: list[int] = []
    time_slice: bool = False  # its containers take turns (the claim's config)
    pause: str = "freeze"
    recovery: str = "terminate"


class PreparedClaims:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _path(self, uid: str) -> Path:
        if not uid or "/" in uid or uid.startswith("."):
            raise ValueError(f"{uid!r} is not a claim uid")
        return self.dir / f"{uid}.json"

    def get(self, uid: str) -> Prepared | None:
        try:
            return msgspec.json.decode(self._path(uid).read_bytes(), type=Prepared)
        except FileNotFoundError:
            return None

    def put(self, rec: Prepared) -> None:
        path = self._path(rec.uid)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(msgspec.json.encode(rec))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def remove(self, uid: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(uid).unlink()

    def __iter__(self) -> Iterator[Prepared]:
        for path in sorted(self.dir.glob("*.json")):
            try:
                yield msgspec.json.decode(path.read_bytes(), type=Prepared)
            except (msgspec.DecodeError, OSError) as exc:  # (never torn: written whole) not ours, or damaged
                log.error("claim_record_unreadable", path=str(path), error=str(exc), hint="left in place for a person")
