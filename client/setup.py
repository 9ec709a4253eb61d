"""The client's build: its metadata is in pyproject.toml; this adds one step.

The sync client, ``gpud_client/client.py``, is generated from ``gpud_client/aio.py`` by
``tools/unasync.py`` and ignored by git. ``generate_sync_client`` writes it into the package
folder itself, where it is missing or stale, as the first of ``build``'s steps: before ``build_py``
copies the package for a wheel, and in an editable install (setuptools runs each of ``build``'s
steps, and the installed package is this folder). ``sdist`` runs it first too, and its
``get_source_files`` puts the generator in the sdist, so a wheel built from an sdist is made the
same way.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from setuptools import Command, setup
from setuptools.command.build import build
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
GENERATOR = "tools/unasync.py"
SOURCE = "gpud_client/aio.py"


def load_generator() -> ModuleType:
    """tools/unasync.py, by its path: text in, text out, the standard library alone."""
    spec = importlib.util.spec_from_file_location("unasync", HERE / GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class GenerateSyncClient(Command):
    description = f"generate gpud_client/client.py from {SOURCE} ({GENERATOR})"
    user_options: list[tuple[str, str | None, str]] = []
    editable_mode = False  # the same in both: the file is written into the package folder

    def initialize_options(self) -> None:
        pass

    def finalize_options(self) -> None:
        pass

    def run(self) -> None:
        for path in load_generator().generate(HERE / "gpud_client"):
            self.announce(f"wrote {path.relative_to(HERE)}", level=2)

    def get_source_files(self) -> list[str]:
        return [GENERATOR, SOURCE]

    def get_outputs(self) -> list[str]:
        return []  # client.py is a module of the package: build_py builds it, once this has written it

    def get_output_mapping(self) -> dict[str, str]:
        return {}


class Build(build):
    sub_commands = [("generate_sync_client", None), *build.sub_commands]


class Sdist(sdist):
    def run(self) -> None:
        self.run_command("generate_sync_client")
        super().run()


setup(cmdclass={"generate_sync_client": GenerateSyncClient, "build": Build, "sdist": Sdist})
