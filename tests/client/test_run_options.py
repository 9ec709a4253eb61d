"""What ``gpuctl run`` is given, refused by ``parse`` before anything starts: a ``--trace`` file the run
could not append to, options that do nothing with whole GPUs, a GPU that is no GPU's name."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from gpud_client import argtypes as at
from gpud_client.argtypes import UsageError
from gpud_client.run import run_program
from gpud_client.run.options import RunOptions, parse


def refused(*args: str) -> str:
    with pytest.raises(UsageError) as err:
        parse([*args, "--", "true"], "gpuctl run")
    assert "\n" not in err.value.message
    return err.value.message


def test_a_trace_file_in_a_directory_that_is_not_there_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "f"
    assert (
        refused("--trace", str(missing)) == f"argument --trace: cannot create {missing}: no directory {missing.parent}"
    )


def test_a_trace_file_that_is_a_directory_is_refused(tmp_path: Path) -> None:
    assert refused("--trace", str(tmp_path)) == f"argument --trace: {tmp_path} is a directory: give a file to append to"


def test_a_trace_file_under_a_file_is_refused(tmp_path: Path) -> None:
    """A regular file as a directory component (ENOTDIR): no uid, root included, can create it."""
    (tmp_path / "plain").write_text("")
    bad = tmp_path / "plain" / "f"
    assert refused("--trace", str(bad)) == f"argument --trace: cannot create {bad}: {bad.parent} is not a directory"


def test_an_empty_trace_file_name_is_refused() -> None:
    assert refused("--trace", "") == "argument --trace: give a file to append to"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_trace_file_the_user_cannot_write_is_refused(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "old").write_text("")
    (locked / "old").chmod(0o400)
    locked.chmod(0o500)
    try:
        assert refused("--trace", str(locked / "new")) == (
            f"argument --trace: cannot create {locked / 'new'}: permission denied in {locked}"
        )
        assert (
            refused("--trace", str(locked / "old"))
            == f"argument --trace: cannot write {locked / 'old'}: permission denied"
        )
    finally:
        locked.chmod(0o700)


def test_a_trace_file_that_can_be_made_or_appended_to_is_taken_and_not_made_yet(tmp_path: Path) -> None:
    new, old = tmp_path / "new.jsonl", tmp_path / "old.jsonl"
    old.write_text("kept\n")
    assert parse(["--trace", str(new), "--", "true"]).trace == str(new)
    assert parse(["--trace", str(old), "--", "true"]).trace == str(old)
    assert not new.exists() and old.read_text() == "kept\n"  # the run makes it, once it runs


def test_a_trace_file_that_cannot_be_opened_when_the_run_starts_is_bad_usage_and_nothing_runs(tmp_path: Path) -> None:
    """Options built without ``parse`` (or a file gone since): the run opens the file before anything starts."""
    ran, err = tmp_path / "ran", io.StringIO()
    opts = RunOptions(command=["touch", str(ran)], trace=str(tmp_path / "gone" / "f"), on_missing="run")
    assert run_program(opts, prog="gpuctl run", err=err, forward_signals=False) == 2
    assert err.getvalue() == (
        f"gpuctl run: error: argument --trace: cannot append to {tmp_path / 'gone' / 'f'}: no such file or directory\n"
    )
    assert not ran.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--gpus", "1", "--core-limit", "50"],
            "--core-limit is for a share of one GPU and does nothing with whole GPUs (--gpus 1): "
            "the program has them to itself and is never paused",
        ),
        (
            ["--gpus", "1..2", "--core-limit", "50", "--mem-limit", "1GiB"],
            "--core-limit and --mem-limit are for a share of one GPU and do nothing with whole GPUs (--gpus 1..2)",
        ),
        (
            ["--gpus", "2", "--core-limit", "50", "--mem-limit", "1GiB", "--idle-release", "5"],
            "--core-limit, --mem-limit and --idle-release are for a share of one GPU and do nothing",
        ),
    ],
)
def test_options_for_a_share_of_one_gpu_are_refused_with_whole_gpus(args: list[str], message: str) -> None:
    assert message in refused(*args)


GPU_WORDS = "must be a GPU index 0..1023, gpu:N or a GPU's UUID"


@pytest.mark.parametrize("text", ["-1", "-0", "gpu:-1", "gpu:", "gpu:x", "gpu:1024", "1024", "cuda0", "x y", ""])
def test_what_names_no_gpu_is_refused(text: str) -> None:
    assert refused("--gpu", text) == f"argument --gpu: {GPU_WORDS}, got {text!r}"
    assert refused(f"--gpu={text}") == f"argument --gpu: {GPU_WORDS}, got {text!r}"


@pytest.mark.parametrize(
    ("text", "ref"),
    [
        ("0", 0),
        ("1023", 1023),
        ("gpu:3", "gpu:3"),
        ("GPU-8f2c3d4e-0000-1111-2222-333344445555", "GPU-8f2c3d4e-0000-1111-2222-333344445555"),
        ("gpu-fake", "gpu-fake"),  # gpud compares UUIDs without case
        ("MIG-1a2b3c4d-0000-1111-2222-333344445555", "MIG-1a2b3c4d-0000-1111-2222-333344445555"),
    ],
)
def test_a_gpu_is_an_index_a_key_or_a_uuid(text: str, ref: int | str) -> None:
    assert at.gpu_arg(text) == ref
    assert parse(["--gpu", text, "--", "true"]).gpu == ref
