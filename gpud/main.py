"""`gpud`: the daemon's entry point. Flags -> Config -> devices -> serve."""

from __future__ import annotations

import argparse
import os
import signal
import sys

import msgspec
import structlog
import trio

from gpud import __version__
from gpud.config import Config
from gpud.devices import discover
from gpud.logging import configure_logging
from gpud.server import Daemon, open_listener, serve
from gpud_client.protocol import SOCKET_ENV, resolve_socket_path

log = structlog.get_logger("gpud")


# (flag, Config field, type, metavar, help); a flag left out keeps the default.
_OPTIONS: list[tuple[str, str, type, str, str]] = [
    ("--simulate", "simulate", str, "N[xSIZE]", "run on N simulated GPUs, e.g. 2 or 2x80GiB"),
    ("--tq", "tq_s", float, "SECONDS", "time quantum (default 30)"),
    ("--drop-timeout", "drop_timeout_s", float, "SECONDS", "revoke a holder ignoring DROP_LOCK this long (10)"),
    ("--mode", "mode", str, "MODE", "serial, concurrent or auto (default auto)"),
    ("--memory-reserve", "memory_reserve_percent", int, "PERCENT", "GPU memory kept free by admission (10)"),
    ("--window", "compute_window_s", float, "SECONDS", "compute-limit window (default 2)"),
    ("--sample-interval", "quota_sample_interval_s", float, "SECONDS", "longest timer sleep while limited (0.05)"),
    ("--carryover", "quota_carryover_percent", int, "PERCENT", "overshoot carried into the next window (100)"),
    ("--drop-tail", "drop_tail_billing_percent", int, "PERCENT", "billing rate between DROP_LOCK and release (100)"),
    ("--share-windows", "share_windows", int, "N", "windows in the recent-share figure (10)"),
    ("--log-level", "log_level", str, "LEVEL", "debug, info, warning or error (default info)"),
    ("--log-format", "log_format", str, "FORMAT", "auto, json or console (default auto)"),
]


def parse_args(argv: list[str] | None) -> Config:
    ap = argparse.ArgumentParser(prog="gpud", description="Share this node's GPUs among processes.")
    ap.add_argument("--socket", help=f"Unix socket path (default: ${SOCKET_ENV} or /run/gpud/gpud.sock)")
    for flag, key, kind, metavar, text in _OPTIONS:
        ap.add_argument(flag, dest=key, type=kind, metavar=metavar, help=text)
    ap.add_argument("--version", action="version", version=f"gpud {__version__}")
    args = ap.parse_args(argv)
    values = {key: getattr(args, key) for _, key, *_ in _OPTIONS if getattr(args, key) is not None}
    values["socket"] = resolve_socket_path(args.socket)
    try:
        return msgspec.convert(values, Config)
    except msgspec.ValidationError as exc:
        flag = next((f for f, key, *_ in _OPTIONS if f"$.{key}" in str(exc)), None)
        ap.error(f"bad value for {flag}: {exc}" if flag else f"bad option: {exc}")
        raise  # unreachable: ap.error exits


async def run(config: Config) -> None:
    gpus = discover(config.simulate)
    daemon = Daemon(config, gpus)
    listener = await open_listener(config)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, daemon, listener)
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("shutdown", signal=signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    break
    finally:
        try:
            os.unlink(config.socket)
        except FileNotFoundError:
            pass


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    configure_logging(config.log_level, config.log_format)
    try:
        trio.run(run, config)
    except ValueError as exc:  # a bad --simulate spec and the like
        print(f"gpud: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"gpud: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
