"""A claim's containers as ``gpud_client.proctl``'s backends see a program: their processes
(``CgroupProcesses``, for the CUDA driver's lock and, while gpud cannot be reached, SIGSTOP) and gpud
as the freezer of their cgroups (``GpudFreezer``), so that they are paused and resumed by the same
``CgroupBackend`` as a ``gpuctl run`` program."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Protocol

import structlog

from gpud_client.proctl.tree import ProcessTree

log = structlog.get_logger(__name__)


class Freezing(Protocol):
    """What freezes a claim's containers: its keeper, through gpud (``Keeper.freeze``)."""

    @property
    def name(self) -> str: ...

    async def freeze(self, frozen: bool) -> bool: ...


class CgroupProcesses(ProcessTree):
    """The processes of a claim's containers (every process in their cgroups), for the backends that act
    on processes (the CUDA driver's lock, SIGSTOP while gpud cannot be reached)."""

    def __init__(self) -> None:
        super().__init__(0)
        self.folders: tuple[Path, ...] = ()

    def pids(self) -> list[int]:
        found: list[int] = []
        for folder in self.folders:
            for here, _, _ in os.walk(folder):
                try:
                    found += [int(x) for x in Path(here, "cgroup.procs").read_text().split()]
                except (OSError, ValueError):
                    continue
        return found


class GpudFreezer:
    """``proctl.cgroup``'s Freezer for a claim: gpud freezes the cgroups handed on the claim's connection.
    Called from the backend's thread; the calls run in the agent's loop."""

    def __init__(self, keeper: Freezing, loop: asyncio.AbstractEventLoop) -> None:
        self.keeper = keeper
        self.loop = loop

    def freeze(self) -> None:
        if not asyncio.run_coroutine_threadsafe(self.keeper.freeze(True), self.loop).result():
            log.warning(
                "claim_freeze_slow", claim=self.keeper.name, why="not frozen yet; the kernel freezes it as it can"
            )

    def thaw(self) -> None:
        asyncio.run_coroutine_threadsafe(self.keeper.freeze(False), self.loop).result()
