"""The ``cgroup`` backend: the program lives in a cgroup that someone else holds and freezes for us.

A frozen cgroup runs no code of any of its processes, whatever signal they get, and the kernel
keeps every child (setsid'd, double-forked) in it: SIGCONT from the program's own user, from
anywhere, cannot wake it. The run's user must not be able to write the cgroup, so the run cannot
freeze it itself: a ``Freezer`` does (for ``gpuctl run``, gpud, over the run's connection:
``gpud_client.run.contain``), and answers once the kernel says the cgroup is frozen.

It composes with a backend that acts on the GPU work (``inner``, the CUDA driver's lock): a pause
locks first and freezes after, a resume thaws first and unlocks after, and a park thaws around the
checkpoint: the driver's calls hang on a frozen process, and a locked one makes no GPU calls while
its CPU threads run for the checkpoint. When the freezer cannot be reached (gpud restarting), the
tree is stopped with SIGSTOP instead, watched for escapes (``SignalBackend``), until a resume.

It never continues a process it did not stop, and never calls ``inner`` on a frozen tree.
"""

from __future__ import annotations

from typing import Protocol

from gpud_client.proctl.base import Backend, ControlError, Paused
from gpud_client.proctl.signals import SignalBackend
from gpud_client.proctl.tree import ProcessTree


class FreezerAway(ControlError):
    """The freezer cannot be reached now (its daemon is away); not fatal: the tree is stopped instead."""


class Freezer(Protocol):
    def freeze(self) -> None:
        """Return once the program's cgroup is frozen. Raises FreezerAway, or ControlError (fatal: it
        may still run)."""
        ...

    def thaw(self) -> None:
        """Thaw the program's cgroup. Raises FreezerAway or ControlError."""
        ...


class CgroupBackend:
    def __init__(
        self, freezer: Freezer, *, inner: Backend | None = None, fallback: SignalBackend | None = None
    ) -> None:
        self.freezer = freezer
        self.inner = inner
        self.fallback = fallback or SignalBackend()
        self.name = f"{inner.name}+cgroup" if inner is not None else "cgroup"
        self._frozen = False
        self._stopped = False  # the fallback stopped the tree: the freezer could not be reached

    @property
    def can_park(self) -> bool:
        return self.inner is not None and self.inner.can_park

    def pause(self, tree: ProcessTree) -> Paused:
        done = self.inner.pause(tree) if self.inner is not None else Paused()
        self._freeze_or_stop(tree, done)
        return done

    def resume(self, tree: ProcessTree) -> None:
        if self._frozen:
            self.freezer.thaw()  # FreezerAway: not fatal, the run gives its turn back and waits
            self._frozen = False
        if self._stopped:
            self.fallback.resume(tree)
            self._stopped = False
        if self.inner is None:
            return
        try:
            self.inner.resume(tree)
        except ControlError as exc:
            if not exc.fatal:  # it stays paused (parked memory that does not fit): frozen again
                self._freeze_or_stop(tree, Paused())
            raise

    def park(self, tree: ProcessTree) -> int:
        if self.inner is None or not self.inner.can_park:
            raise ControlError("this backend cannot park GPU memory (it needs the CUDA driver's checkpoint API)")
        if self._stopped:
            raise ControlError(
                "the program was stopped with SIGSTOP while gpud could not be reached, and a stopped process "
                "cannot be checkpointed; nothing was parked"
            )
        if self._frozen:
            self.freezer.thaw()  # the driver's calls hang on a frozen process; a locked one makes no GPU calls
            self._frozen = False
        try:
            return self.inner.park(tree)
        finally:
            self._freeze_or_stop(tree, Paused())

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
        self.fallback.close()

    def _freeze_or_stop(self, tree: ProcessTree, done: Paused) -> None:
        try:
            self.freezer.freeze()
        except FreezerAway as exc:
            done.stopped += self.fallback.pause(tree).stopped
            self._stopped = True
            done.fallbacks.append(f"its cgroup could not be frozen ({exc}): stopped with SIGSTOP until gpud is back")
            return
        self._frozen = True
