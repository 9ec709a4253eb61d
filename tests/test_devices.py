"""GPU discovery with a stand-in NVML module, and the simulated fallback."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from structlog.testing import capture_logs

from gpud.host.devices import DEFAULT_SIMULATION, discover, simulated_gpus


class FakeNvml:
    """Just enough of pynvml's surface for discovery."""

    def __init__(self, names: list[str], fail: bool = False) -> None:
        self.names, self.fail, self.inits = names, fail, 0

    def nvmlInit(self) -> None:
        if self.fail:
            raise RuntimeError("NVML Shared Library Not Found")
        self.inits += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.names)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return self.names[h].encode()

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-0000000{h}"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(total=(h + 1) * 2**30, used=0, free=(h + 1) * 2**30)

    def nvmlDeviceGetPciInfo(self, h: int) -> SimpleNamespace:
        if h == 1:
            raise RuntimeError("Not Supported")  # (NVMLError: a GPU that does not say)
        return SimpleNamespace(busId=b"00000000:17:00.0")


def test_nvml_devices_are_discovered() -> None:
    gpus = discover(nvml=FakeNvml(["NVIDIA A100", "NVIDIA L4"]))
    assert [(g.index, g.uuid, g.name, g.memory_total_bytes, g.simulated, g.pci_bus_id) for g in gpus] == [
        (0, "GPU-00000000", "NVIDIA A100", 2**30, False, "00000000:17:00.0"),
        (1, "GPU-00000001", "NVIDIA L4", 2 * 2**30, False, None),
    ]


@pytest.mark.parametrize("nvml", [FakeNvml([], fail=True), FakeNvml([])])
def test_no_driver_falls_back_to_simulated_gpus_with_a_warning(nvml: FakeNvml) -> None:
    with capture_logs() as logs:
        gpus = discover(nvml=nvml)
    assert gpus == simulated_gpus(DEFAULT_SIMULATION)
    assert [e["event"] for e in logs] == ["gpus_simulated_fallback"]
    assert logs[0]["log_level"] == "warning" and logs[0]["reason"]


def test_simulate_overrides_nvml_and_uuids_are_stable() -> None:
    gpus = discover("3x24GiB", nvml=FakeNvml(["NVIDIA A100"]))
    assert [g.simulated for g in gpus] == [True] * 3
    assert gpus[0].memory_total_bytes == 24 * 2**30 and gpus[0].name == "Simulated GPU 24GiB"
    assert [g.uuid for g in gpus] == [g.uuid for g in simulated_gpus("3x24GiB")]
    assert len({g.uuid for g in gpus}) == 3


def test_the_daemon_refuses_a_bad_simulate_value() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gpud.main", "--socket", "/tmp/gpud-never/s", "--simulate", "0x8GiB"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert "bad --simulate value '0x8GiB'" in out.stderr
