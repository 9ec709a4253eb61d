"""Framework hooks: enforce a session's memory limit where the framework can.

Only frameworks the application has already imported are touched: gpud_client
never imports torch itself (an inference process that does not use it must not
pay for it). ``torch`` may be passed in, so tests can use a stand-in.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

log = logging.getLogger("gpud_client")


def loaded_torch_with_cuda() -> Any | None:
    """The application's torch module if it is imported and sees a GPU."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch if torch.cuda.is_available() else None
    except Exception:
        return None


def apply_torch_memory_limit(limit_bytes: int | None, device: int | None = None, torch: Any = None) -> float | None:
    """Cap PyTorch's caching allocator at ``limit_bytes`` on ``device``.

    Uses ``torch.cuda.set_per_process_memory_fraction``; None lifts the cap.
    Returns the fraction set, or None when torch with CUDA is not in use."""
    torch = torch if torch is not None else loaded_torch_with_cuda()
    if torch is None:
        return None
    dev = torch.cuda.current_device() if device is None else device
    total = torch.cuda.get_device_properties(dev).total_memory
    fraction = 1.0 if limit_bytes is None else max(0.0, min(1.0, limit_bytes / total))
    torch.cuda.set_per_process_memory_fraction(fraction, dev)
    return fraction


def torch_memory_probe(device: int | None = None, torch: Any = None) -> Callable[[], int] | None:
    """A callable returning the bytes PyTorch holds on ``device``, or None."""
    torch = torch if torch is not None else loaded_torch_with_cuda()
    if torch is None:
        return None
    dev = torch.cuda.current_device() if device is None else device
    return lambda: int(torch.cuda.memory_reserved(dev))


def torch_synchronize(device: int, torch: Any = None) -> Callable[[], None] | None:
    """``torch.cuda.synchronize(device)``, for a session's ``synchronize`` hook, when the application
    uses torch with CUDA: the lock goes back only once the GPU work queued under it has run."""
    torch = torch if torch is not None else loaded_torch_with_cuda()
    if torch is None:
        return None
    return lambda: torch.cuda.synchronize(device)


def default_memory_probe(framework_hooks: bool) -> Callable[[], int] | None:
    """PyTorch's reserved memory when the application uses torch with CUDA and hooks are on."""
    return torch_memory_probe() if framework_hooks else None


def read_memory(probe: Callable[[], int]) -> int | None:
    """The probe's reading at a slice's end; a failing probe is logged, never raised into the slice."""
    try:
        return int(probe())
    except Exception:
        log.exception("memory probe failed")
        return None


def cap_memory(limit_bytes: int | None, device: int | None = None) -> None:
    """Apply a session's new memory limit to PyTorch's allocator on ``device`` (None: the
    calling thread's current device); a failure is logged."""
    try:
        apply_torch_memory_limit(limit_bytes, device)
    except Exception:
        log.exception("could not apply the memory limit to PyTorch")


def default_memory_cap(framework_hooks: bool) -> Callable[[int | None], None] | None:
    """How a session's memory limit caps PyTorch: on the device current in the thread that makes
    the session, found now. The limit changes later on the client's reader, a thread whose
    current device is always the first. Without torch loaded yet, on the device current then."""
    if not framework_hooks:
        return None
    torch = loaded_torch_with_cuda()
    device = None if torch is None else torch.cuda.current_device()
    return lambda limit: cap_memory(limit, device)
