"""Every build of the client carries the sync client that aio.py gives: git ignores
gpud_client/client.py, and the client's build (client/setup.py) runs the generator,
client/tools/unasync.py, before anything else. A wheel carries it, an editable install
writes it into the package folder it serves from (a stale one made current), and a
generator that refuses aio.py fails the build, editable or not, rather than leaving an
old file in place. The generator's own rules are tested in tests/client/test_unasync.py.

Each test builds a copy of the client's build sources without client.py, with pip as
`make install` and a user run it (an isolated build; setuptools from pip's cache where it can)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "client"
pytestmark = pytest.mark.timeout(600)  # pip may have to fetch setuptools on a fresh machine


def load_generator(client: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("unasync_copy", client / "tools" / "unasync.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def copy_of_the_client(tmp_path: Path) -> Path:
    """What `make install` copies of the client (BUILD_SOURCES), less the generated files and any build."""
    client = tmp_path / "client"
    client.mkdir()
    for name in ("pyproject.toml", "setup.py"):
        shutil.copy2(CLIENT / name, client / name)
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist")
    shutil.copytree(CLIENT / "tools", client / "tools", ignore=skip)
    shutil.copytree(CLIENT / "gpud_client", client / "gpud_client", ignore=skip)
    for target in load_generator(client).GENERATED:
        (client / "gpud_client" / target).unlink(missing_ok=True)
    return client


def wanted(client: Path) -> dict[str, str]:
    """Each generated file of the copy, by its path in the wheel, as the generator gives it."""
    generator = load_generator(client)
    return {
        f"gpud_client/{target}": generator.unasync((client / "gpud_client" / source).read_text(), source)
        for target, source in generator.GENERATED.items()
    }


def pip(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # No PYTHONPATH or other PYTHON* settings of the test run's: pip's build sees the copy alone.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {"PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pip", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=540
    )


def test_a_wheel_of_the_client_carries_the_generated_sync_client(tmp_path: Path) -> None:
    client = copy_of_the_client(tmp_path)
    out = pip("wheel", "--no-deps", "--wheel-dir", str(tmp_path / "dist"), str(client), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = (tmp_path / "dist").glob("gpud_client-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for name, text in wanted(client).items():
            assert name in names, f"{wheel.name} has no {name}"
            assert z.read(name).decode() == text, f"{name} in {wheel.name} is not what the generator gives"
    assert not any(n.startswith(("tools/", "setup.py")) for n in names), "the build's own files are not installed"


def test_an_editable_install_writes_the_current_sync_client_where_it_serves_from(tmp_path: Path) -> None:
    client = copy_of_the_client(tmp_path)
    package = client / "gpud_client"
    (package / "client.py").write_text("# stale: an older aio.py's\n")
    venv = tmp_path / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    out = pip("--python", python, "install", "--no-deps", "--editable", str(client), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    for name, text in wanted(client).items():
        assert (client / name).read_text() == text, f"the editable install left {name} stale"
    # The installed package is the copy's folder, so the file written there is the one imported.
    where = subprocess.run(
        [python, "-c", "import importlib.util as u; print(*u.find_spec('gpud_client').submodule_search_locations)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).resolve() == package.resolve()


@pytest.mark.parametrize("editable", [False, True], ids=["wheel", "editable"])
def test_a_source_the_generator_refuses_fails_the_build(tmp_path: Path, editable: bool) -> None:
    """setuptools only warns when a customised build_py fails in an editable build; the generator
    runs as a step of its own, so its error stops the install."""
    client = copy_of_the_client(tmp_path)
    with (client / "gpud_client" / "aio.py").open("a") as f:
        f.write("# unasync: asyncio\n")
    if editable:
        venv = tmp_path / "venv"
        subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        args = ["--python", str(venv / "bin" / "python"), "install", "--no-deps", "--editable", str(client)]
    else:
        args = ["wheel", "--no-deps", "--wheel-dir", str(tmp_path / "dist"), str(client)]
    out = pip(*args, cwd=tmp_path)
    assert out.returncode != 0
    assert "aio.py: the asyncio lines have no '# unasync: end'" in out.stdout + out.stderr
    assert not (client / "gpud_client" / "client.py").exists()
