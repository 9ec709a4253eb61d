"""Programs gpud holds and freezes: runs' programs in gpud's own cgroups (``gpuctl run``: CONTAIN),
and cgroups an admin hands it (ADOPT: a Kubernetes claim's containers), frozen and thawed alike
(FREEZE, THAW). ``programs`` is the capability; ``adopted`` judges and writes the adopted cgroups."""

from gpud.capabilities.runs.programs import Runs

__all__ = ["Runs"]
