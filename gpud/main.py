"""`gpud`: the daemon's entry point. Flags -> Config -> devices -> serve."""

from __future__ import annotations

import argparse
import functools
import gc
import os
import resource
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping

import structlog
import trio
from prometheus_client import CollectorRegistry, start_http_server

from gpud import __version__
from gpud.host import lockfile, systemd
from gpud.host.config import (
    DEFAULT_CONFIG_PATH,
    Config,
    ConfigError,
    build,
    parse_metrics_addr,
    read_environment,
    read_file,
)
from gpud.host.devices import Gpu, discover
from gpud.host.logging import configure_logging
from gpud.host.metrics import Metrics
from gpud.serving.listener import open_listener, serve, socket_origin
from gpud.serving.server import Daemon

log = structlog.get_logger(__name__)


# (flag, Config field, type, metavar, help); a flag left out keeps the file's,
# the environment's or the default value.
_OPTIONS: list[tuple[str, str, type, str, str]] = [
    ("--socket", "socket", str, "PATH", "Unix socket (default: $GPUD_SOCKET or /run/gpud/gpud.sock)"),
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
    ("--metrics-addr", "metrics_addr", str, "HOST:PORT", "Prometheus endpoint, or off (127.0.0.1:9402)"),
    ("--state-dir", "state_dir", str, "DIR", "where allocations are kept (/var/lib/gpud)"),
    ("--log-level", "log_level", str, "LEVEL", "debug, info, warning or error (default info)"),
    ("--log-format", "log_format", str, "FORMAT", "auto, json or console (default auto)"),
]


def parse_args(argv: list[str] | None) -> tuple[Config, Callable[[], Config]]:
    """The configuration, and how to read it again on SIGHUP (same file and flags)."""
    ap = argparse.ArgumentParser(prog="gpud", description="Share this node's GPUs among processes.")
    ap.add_argument("--config", metavar="PATH", help=f"TOML configuration (default: {DEFAULT_CONFIG_PATH} if present)")
    for flag, key, kind, metavar, text in _OPTIONS:
        ap.add_argument(flag, dest=key, type=kind, metavar=metavar, help=text)
    ap.add_argument("--version", action="version", version=f"gpud {__version__}")
    args = ap.parse_args(argv)
    values = {key: getattr(args, key) for _, key, *_ in _OPTIONS if getattr(args, key) is not None}

    def load() -> Config:
        file_values = read_file(args.config)
        env_values = read_environment(os.environ)
        try:
            return build(file_values, env_values, values)
        except ConfigError as exc:
            flag = next((f for f, key, *_ in _OPTIONS if f"$.{key}`" in str(exc) and key in values), None)
            raise ConfigError(f"bad value for {flag}: {str(exc).split(': ', 1)[1]}" if flag else str(exc)) from None

    try:
        return load(), load
    except ConfigError as exc:
        ap.error(str(exc))
        raise  # unreachable: ap.error exits


def start_metrics(config: Config, registry: CollectorRegistry) -> None:
    addr = parse_metrics_addr(config.metrics_addr)
    if addr is None:
        return
    host, port = addr
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise RuntimeError(f"cannot serve metrics on {config.metrics_addr}: {exc.strerror or exc}") from None
    log.info("metrics_listening", addr=host, port=server.server_port)


async def run(config: Config, reload_config: Callable[[], Config]) -> None:
    inherited = systemd.listen_fds()  # first: `starting` names the socket gpud will serve
    activated = inherited[0] if inherited else None
    socket_path, socket_from = socket_origin(config, activated)
    log.info(
        "starting",
        version=__version__,
        pid=os.getpid(),
        socket=socket_path,
        socket_from=socket_from,
        mode=str(config.mode),
        state_dir=config.state_dir,
        metrics_addr=config.metrics_addr,
    )
    state = lockfile.acquire(config.state_dir)  # one daemon per state directory; was the last one's a crash?
    clean = False
    try:
        grace_s = config.restart_grace_s if state.crashed_pid is not None else 0.0
        if state.crashed_pid is not None:
            log.warning(
                "restarted_after_crash",
                previous_pid=state.crashed_pid,
                restart_grace_s=grace_s,
                hint="nothing is granted during the grace, so former holders learn they lost the lock first",
            )
        gpus = await _discover(config)
        registry = CollectorRegistry()
        daemon = Daemon(config, gpus, Metrics(registry), restart_grace_us=round(grace_s * 1e6))
        # What start-up built lives as long as the daemon: out of the collector's generations, so a
        # collection walks only what requests made since (shorter pauses on the lock path).
        gc.collect()
        gc.freeze()
        try:
            await _serve(daemon, config, registry, reload_config, state, activated)
        finally:
            daemon.allocations.store.close()  # after the last write: every request is refused by now
        clean = True
    finally:
        state.release(clean=clean)


DISCOVERY_TIMEOUT_S = 30.0


async def _discover(config: Config) -> list[Gpu]:
    """The GPUs, read in a thread: a driver that hangs at start-up fails the start with a
    clear reason (systemd retries) rather than leaving a daemon that never gets ready."""
    with trio.move_on_after(DISCOVERY_TIMEOUT_S):
        return await trio.to_thread.run_sync(discover, config.simulate, abandon_on_cancel=True)
    raise RuntimeError(
        f"NVML did not answer within {DISCOVERY_TIMEOUT_S:g} s at start-up (a hung driver or GPU?); "
        f"check nvidia-smi, then start gpud again"
    )


async def _serve(
    daemon: Daemon,
    config: Config,
    registry: CollectorRegistry,
    reload_config: Callable[[], Config],
    state: lockfile.StateLock,
    activated: socket.socket | None,
) -> None:
    daemon.links.descriptor_room = descriptor_room()
    if daemon.links.max_connections < config.max_connections:
        log.warning(
            "max_connections_lowered",
            max_connections=daemon.links.max_connections,
            configured=config.max_connections,
            reason="RLIMIT_NOFILE leaves no room for more",
        )
    systemd.open_notify_socket()  # now, while descriptors are free: the watchdog must ping even when none are
    start_metrics(config, registry)
    listener, own_socket = await open_listener(config, activated)
    socket_path, socket_from = socket_origin(config, activated)
    try:
        # Signals are caught before READY=1: a reload or stop sent as soon as systemd (or anyone)
        # hears READY must find gpud's handlers, not the default actions that end the process.
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(daemon.runs.run)  # runs' cgroups: leftovers (before any HELLO), freezes
                # Marked before the first accept, never after a grant: from here a death is a crash that
                # clients may have to learn of (the restart grace); a start that failed before is none.
                state.mark_serving()
                await nursery.start(
                    functools.partial(serve, socket_path=socket_path, socket_from=socket_from), daemon, listener
                )
                systemd.notify(f"READY=1\nSTATUS={_status(daemon)}")
                interval = systemd.watchdog_interval_s()
                if interval:
                    nursery.start_soon(_watchdog, daemon, interval)
                async for signum in signals:
                    if signum == signal.SIGHUP:
                        _reload(daemon, reload_config)
                        continue
                    log.info("shutdown", signal=signal.Signals(signum).name, clients=len(daemon.links.connections))
                    systemd.notify("STOPPING=1")
                    daemon.farewell(f"gpud received {signal.Signals(signum).name}")
                    await trio.sleep(0.05)  # let the writers flush the goodbyes
                    nursery.cancel_scope.cancel()
                    break
    finally:
        if own_socket is not None:  # an activated socket belongs to systemd
            own_socket.remove()


# Descriptors kept for everything but client connections: the store, NVML, the metrics
# endpoint and its scrapes, worker threads, the listener.
FD_RESERVE = 64


def descriptor_room() -> int:
    """Raise the soft open-file limit to the hard one; the connections it leaves room for."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return max(1, soft - FD_RESERVE)


def _status(daemon: Daemon) -> str:
    sim = " simulated" if any(s.gpu.simulated for s in daemon.slots) else ""
    return f"{len(daemon.slots)}{sim} GPU(s), {len(daemon.links.connections)} client(s)"


async def _watchdog(daemon: Daemon, interval: float) -> None:
    """Pinged from the event loop itself: a hung loop stops the pings and systemd restarts us."""
    while True:
        try:
            systemd.notify(f"WATCHDOG=1\nSTATUS={_status(daemon)}")
        except Exception as exc:  # a ping that failed is tried again next time
            daemon.faults.record("watchdog", exc)
        await trio.sleep(interval)


def _reload(daemon: Daemon, reload_config: Callable[[], Config]) -> None:
    """SIGHUP: a configuration that cannot be read or is invalid changes nothing."""
    systemd.notify("RELOADING=1")
    try:
        config = reload_config()
    except ConfigError as exc:
        log.error("config_reload_failed", error=str(exc), kept="the running configuration")
    except Exception as exc:
        daemon.faults.record("reload", exc)
    else:
        try:
            changed, later = daemon.reload(config, daemon.now())
            configure_logging(daemon.config.log_level, daemon.config.log_format)
        except Exception as exc:
            daemon.faults.record("reload", exc)
        else:
            log.info("config_reloaded", changed=changed)
            if later:
                log.warning(
                    "config_reload_needs_restart",
                    keys=later,
                    hint="these keep their running values until gpud restarts",
                )
    systemd.notify(f"READY=1\nSTATUS={_status(daemon)}")


# A debugging aid, not configuration: log every event-loop turn longer than this many ms.
SLOW_TURN_ENV = "GPUD_DEBUG_SLOW_TURN_MS"


class SlowTurns(trio.abc.Instrument):
    """Logs (``loop_turn_slow``, a warning) every turn of the event loop longer than the threshold:
    a turn is the work done between two waits for I/O, during which no socket is served, so the
    longest turn bounds how long any client's request can wait on the daemon's own work.
    ``turn_ms`` is wall time; ``cpu_ms`` the loop thread's CPU time in it (less when the host
    preempted or stopped the daemon mid-turn: the daemon's own work); ``gc_ms`` the part spent
    in Python's garbage collector. Turned on by $GPUD_DEBUG_SLOW_TURN_MS; about 1 us a turn."""

    def __init__(self, threshold_ms: float) -> None:
        self.threshold_ns = max(0, round(threshold_ms * 1e6))
        self._began: int | None = None
        self._cpu_began = 0
        self._gc_ns = 0
        self._gc_began = 0

    def gc_phase(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter_ns()
        elif self._gc_began:
            self._gc_ns += time.perf_counter_ns() - self._gc_began

    def before_run(self) -> None:
        gc.callbacks.append(self.gc_phase)

    def after_run(self) -> None:
        gc.callbacks.remove(self.gc_phase)

    def after_io_wait(self, timeout: float) -> None:
        self._began = time.perf_counter_ns()
        self._cpu_began = time.thread_time_ns()
        self._gc_ns = 0

    def before_io_wait(self, timeout: float) -> None:
        if self._began is None:
            return
        took = time.perf_counter_ns() - self._began
        if took >= self.threshold_ns:
            cpu = time.thread_time_ns() - self._cpu_began
            log.warning(
                "loop_turn_slow",
                turn_ms=round(took / 1e6, 3),
                cpu_ms=round(cpu / 1e6, 3),
                gc_ms=round(self._gc_ns / 1e6, 3),
                threshold_ms=self.threshold_ns / 1e6,
            )


def instruments(environ: Mapping[str, str]) -> list[trio.abc.Instrument]:
    """The debugging instruments the environment asks for; a bad value is a ValueError naming it."""
    raw = environ.get(SLOW_TURN_ENV)
    if not raw:
        return []
    try:
        threshold_ms = float(raw)
    except ValueError:
        threshold_ms = -1.0
    if not threshold_ms >= 0:
        raise ValueError(f"{SLOW_TURN_ENV}={raw!r} is not a number of milliseconds >= 0")
    return [SlowTurns(threshold_ms)]


def main(argv: list[str] | None = None) -> int:
    config, reload_config = parse_args(argv)
    configure_logging(config.log_level, config.log_format)
    try:
        trio.run(run, config, reload_config, instruments=instruments(os.environ))
    except ValueError as exc:  # a bad --simulate spec and the like
        print(f"gpud: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"gpud: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
