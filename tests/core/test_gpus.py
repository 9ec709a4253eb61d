from __future__ import annotations

import pytest

from gpud.core.gpus import GpuIdentity, parse_bytes, parse_simulate, resolve_gpu

GPUS = [GpuIdentity(0, "GPU-aaaa"), GpuIdentity(1, "GPU-bbbb")]


@pytest.mark.parametrize(
    ("text", "value"),
    [("1024", 1024), ("8GiB", 8 * 2**30), ("512MiB", 512 * 2**20), ("16GB", 16 * 10**9), ("1.5GiB", 3 * 2**29)],
)
def test_sizes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["-1", "8 parsecs", "GiB", "", "1.3B", "eight"])
def test_bad_sizes_are_refused_naming_the_input(text: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_bytes(text)
    assert repr(text) in str(err.value)


def test_simulate_specs() -> None:
    assert parse_simulate("2") == (2, 80 * 2**30)
    assert parse_simulate("4x24GiB") == (4, 24 * 2**30)
    for bad in ["0", "x", "2x", "2xlots", "100", "-1x8GiB"]:
        with pytest.raises(ValueError, match="--simulate"):
            parse_simulate(bad)


@pytest.mark.parametrize(("ref", "index"), [(0, 0), (1, 1), ("gpu:1", 1), ("1", 1), ("GPU-BBBB", 1)])
def test_gpu_references(ref: int | str, index: int) -> None:
    assert resolve_gpu(ref, GPUS) == index


@pytest.mark.parametrize("ref", [2, "gpu:9", "GPU-cccc", "gpu:", "cuda:0"])
def test_unknown_gpus_are_named(ref: int | str) -> None:
    with pytest.raises(ValueError, match="unknown GPU") as err:
        resolve_gpu(ref, GPUS)
    assert "0, 1" in str(err.value)
