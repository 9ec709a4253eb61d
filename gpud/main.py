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


def parse_args(argv: list[str] | None) -> Config:
    ap = argparse.ArgumentParser(prog="gpud", description="Share this node's GPUs among processes.")
    ap.add_argument("--socket", help=f"Unix socket path (default: ${SOCKET_ENV} or /run/gpud/gpud.sock)")
    ap.add_argument("--simulate", metavar="N[xSIZE]", help="run on N simulated GPUs, e.g. 2 or 2x80GiB")
    ap.add_argument("--tq", type=float, default=30.0, metavar="SECONDS", help="time quantum (default 30)")
    ap.add_argument(
        "--drop-timeout", type=float, default=10.0, metavar="SECONDS",
        help="revoke a holder that ignores DROP_LOCK this long (default 10)",
    )
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ap.add_argument("--log-format", default="auto", choices=["auto", "json", "console"])
    ap.add_argument("--version", action="version", version=f"gpud {__version__}")
    args = ap.parse_args(argv)
    try:
        return msgspec.convert(
            {
                "socket": resolve_socket_path(args.socket),
                "simulate": args.simulate,
                "tq_s": args.tq,
                "drop_timeout_s": args.drop_timeout,
                "log_level": args.log_level,
                "log_format": args.log_format,
            },
            Config,
        )
    except msgspec.ValidationError as exc:
        ap.error(f"bad option: {exc}")
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
