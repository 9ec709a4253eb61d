"""Kubernetes: how long the kubelet waits for gpud-k8s to prepare and unprepare a ResourceClaim.

What is measured: the kubelet's NodePrepareResources and NodeUnprepareResources calls to gpud's DRA
plugin, each from the call to its answer, stamped with ``time.perf_counter_ns()`` in the kubelet's own
event loop. The node (bench/k8s_fixtures.py): a real gpud on simulated GPUs (``--gpus``, 80 GiB each), a
real ``gpud-k8s`` process, and the fake kubelet and fake API server of gpud-k8s's tests, which run in this
process, each in a thread of its own, over real gRPC on Unix sockets and real HTTP. Every claim is a real
ResourceClaim in the API server, allocated by the scheduler on this node: a share of one GPU by consumable
capacity (``cores`` and ``memory``). Preparing one reads it from the API server, allocates the share in
gpud, opens its socket there, writes its record and CDI spec; unpreparing undoes all of it.

- ``one``: one claim at a time (a quarter of a GPU: 25 cores and 20 GiB), ``--repeat`` times: one
  NodePrepareResources with that one claim, then its NodeUnprepareResources. Each call timed.
- ``batch``: ``--claims`` claims (default 100) spread over the GPUs, each GPU shared equally among its
  claims, arriving at once as the kubelet meets them: the kubelet prepares a pod's claims in one call per
  driver, and its pods in parallel (pkg/kubelet/cm/dra/manager.go), so each claim is a pod of its own and
  its own call, all in flight together. Then all are unprepared the same way. Each call timed, and the
  whole batch's wall time, from the first call to the last answer.

- ``shares`` (on a node of its own: one GPU): two claims of 25 and 75 cores with ``timeSlice``, each held
  by a pod whose one container is a busy process that knows nothing of gpud, in a real cgroup laid out
  as the kubelet and containerd lay it (below a cgroup of the benchmark's own), started with its claim's
  CDI environment as a runtime starts it; gpud freezes and thaws them by their turns. After a warm-up of
  2 s of CPU time, the containers' CPU time (their cgroups' ``cpu.stat``) is read until they used
  ``--shares-seconds`` between them: each one's part of it against its claim's share, and the wall
  time it took (one at a time: about the CPU time; both at once would take half). Needs a writable
  cgroup v2 (root); else reported as skipped, with why.

Before the parts, one claim is prepared and unprepared untimed (the first call connects the kubelet's
gRPC channel, the agent's API client and its gpud connection). Every answer must say the claim was
prepared (or unprepared) without error, and gpud must hold no allocation after each part; no sample is
dropped. Percentiles are nearest rank (bench/percentiles.py). It never touches a real GPU, kubelet or API
server: the node lives in one temporary folder, removed after.

    .venv/bin/python bench/k8s_prepare.py [--json] [--claims N] [--repeat N] [--gpus N] [--shares-seconds S]

A further part is one function of ``(node, options)`` that returns its own key, added to ``PARTS``, with
its lines in ``table``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from harness import Run, machine_line, progress  # bench/, on the path when run as a script
from k8s_fixtures import DRIVER, NODE, ROOT, ClaimRef, KubeNode, NodeError, claim, load_fake, share_memory
from percentiles import percentile


@dataclass(frozen=True, kw_only=True)
class Options:
    claims: int = 100
    repeat: int = 200
    gpus: int = 4
    shares_s: float = 20.0  # CPU seconds the time-sliced containers use between them; 0: not measured


ONE_CORES = 25  # the one-at-a-time claim: a quarter of a GPU
ONE_MEMORY = share_memory(4)


# --- timing, in the kubelet's loop ------------------------------------------------------------------


async def timed_calls(kubelet: Any, verb: str, calls: list[list[ClaimRef]]) -> tuple[list[float], float]:
    """Every call of ``verb`` (``prepare`` or ``unprepare``) in flight at once; each one's ms, and the wall ms.
    A claim refused fails the run: the figure would be of something else."""
    call = kubelet.prepare if verb == "prepare" else kubelet.unprepare

    async def one(claims: list[ClaimRef]) -> float:
        t0 = time.perf_counter_ns()
        outcome = await call(DRIVER, claims)
        t1 = time.perf_counter_ns()
        if not outcome.ok:
            raise NodeError(outcome.error)
        return (t1 - t0) / 1e6

    t0 = time.perf_counter_ns()
    each = await asyncio.gather(*(one(c) for c in calls))
    return list(each), (time.perf_counter_ns() - t0) / 1e6


def calls_of(node: KubeNode, verb: str, calls: list[list[ClaimRef]]) -> tuple[list[float], float]:
    return node.in_kubelet(lambda kubelet: timed_calls(kubelet, verb, calls))


def figures(samples: list[float]) -> dict[str, Any]:
    return {
        "p50_ms": round(percentile(samples, 50), 2),
        "p99_ms": round(percentile(samples, 99), 2),
        "max_ms": round(max(samples), 2),
        "n": len(samples),
    }


def cpu_ms_per_claim(before: dict[str, float], after: dict[str, float], claims: int) -> dict[str, float]:
    return {who: round((after[who] - before[who]) * 1000 / claims, 2) for who in before}


def left_empty(node: KubeNode, part: str) -> None:
    left = node.allocations()
    if left:
        raise NodeError(f"{part}: gpud still holds {len(left)} allocations after every claim was unprepared")


# --- the parts ----------------------------------------------------------------------------------------


def warm_up(node: KubeNode) -> None:
    ref = node.put(claim("bench-warm-up", 0, cores=ONE_CORES, memory=ONE_MEMORY))
    calls_of(node, "prepare", [[ref]])
    calls_of(node, "unprepare", [[ref]])
    left_empty(node, "warm-up")


def measure_one(node: KubeNode, opts: Options) -> dict[str, Any]:
    progress(f"one: {opts.repeat} claims, each prepared then unprepared on its own")
    refs = [
        node.put(claim(f"bench-one-{i}", i % opts.gpus, cores=ONE_CORES, memory=ONE_MEMORY)) for i in range(opts.repeat)
    ]
    prepare: list[float] = []
    unprepare: list[float] = []
    cpu = node.cpu_s()
    for ref in refs:
        prepare += calls_of(node, "prepare", [[ref]])[0]
        unprepare += calls_of(node, "unprepare", [[ref]])[0]
    cpu = cpu_ms_per_claim(cpu, node.cpu_s(), opts.repeat)
    left_empty(node, "one")
    return {"prepare_one": figures(prepare), "unprepare_one": figures(unprepare), "cpu_ms_per_claim_one": cpu}


def measure_batch(node: KubeNode, opts: Options) -> dict[str, Any]:
    per_gpu = math.ceil(opts.claims / opts.gpus)
    cores, memory = 100 // per_gpu, share_memory(per_gpu)
    progress(f"batch: {opts.claims} claims of {cores} cores and {memory / 2**30:g} GiB, prepared together")
    refs = [node.put(claim(f"bench-batch-{i}", i % opts.gpus, cores=cores, memory=memory)) for i in range(opts.claims)]
    calls = [[ref] for ref in refs]  # a pod each: a call each
    cpu = node.cpu_s()
    prepare, prepare_wall = calls_of(node, "prepare", calls)
    held = len(node.allocations())
    if held != opts.claims:
        raise NodeError(f"batch: gpud holds {held} allocations for {opts.claims} claims prepared")
    unprepare, unprepare_wall = calls_of(node, "unprepare", calls)
    cpu = cpu_ms_per_claim(cpu, node.cpu_s(), opts.claims)
    left_empty(node, "batch")
    return {
        "prepare_batch": {"claims": opts.claims, "calls": len(calls), "wall_ms": round(prepare_wall, 1)}
        | figures(prepare),
        "unprepare_batch": {"claims": opts.claims, "calls": len(calls), "wall_ms": round(unprepare_wall, 1)}
        | figures(unprepare),
        "batch_share": {"cores": cores, "memory_bytes": memory, "claims_per_gpu": per_gpu},
        "cpu_ms_per_claim_batch": cpu,
    }


PARTS: list[Callable[[KubeNode, Options], dict[str, Any]]] = [measure_one, measure_batch]


SHARE_CORES = (25, 75)


def measure_shares(opts: Options) -> dict[str, Any]:
    """Two time-sliced claims' containers on one GPU: their parts of the CPU time against their shares."""
    cgroups = load_fake("testcgroups", ROOT / "tests")
    why_not = cgroups.usable()
    if why_not is not None:
        return {"shares": {"skipped": why_not}}
    pods = load_fake("pods")
    tree = cgroups.CgroupTree()
    progress(f"shares: two time-sliced claims of {SHARE_CORES} cores on one GPU, {opts.shares_s:g} s of CPU time")
    try:
        agent_args = ("--cgroup-root", str(tree.root), "--find-interval", "0.05")
        with KubeNode(1, agent_args=agent_args) as node:
            made, refs = [], []
            for cores in SHARE_CORES:
                obj = claim(f"share-{cores}", 0, cores=cores, memory=share_memory(4), config={"timeSlice": True})
                meta = obj["metadata"]
                pod = pods.Pod(f"share-{cores}-pod", meta["name"], meta["uid"], meta["namespace"], NODE)
                created = node.api.put(pod.object())
                pod.uid, pod.container_id = created["metadata"]["uid"], uuid.uuid4().hex + uuid.uuid4().hex
                obj["status"]["reservedFor"] = [{"resource": "pods", "name": pod.name, "uid": pod.uid}]
                refs.append(node.put(obj))
                made.append(pod)
            listed = pods.pod_resources(made)
            node.in_kubelet(lambda kubelet: _set_pods(kubelet, listed))
            calls_of(node, "prepare", [refs])
            for pod in made:  # the runtime starts each container with its claim's CDI edits
                tree.spawn(pod.cgroup, env=pods.cdi_env(node.root / "cdi" / f"gpud.io-claim_{pod.claim_uid}.json"))
            _until(lambda: len(node.adopted()) == len(made), "the containers handed to gpud", 60)

            def cpu() -> list[float]:
                return [tree.cpu_usec(pod.cgroup) / 1e6 for pod in made]

            def used_since(start: list[float], seconds: float) -> bool:
                return sum(cpu()) - sum(start) >= seconds

            warm = cpu()
            _until(lambda: used_since(warm, 2.0), "the warm-up", 120)
            start, t0 = cpu(), time.monotonic()
            _until(lambda: used_since(start, opts.shares_s), "the measured CPU time", 30 + 10 * opts.shares_s)
            wall = time.monotonic() - t0
            used = [b - a for a, b in zip(start, cpu(), strict=True)]
            calls_of(node, "unprepare", [refs])
            left_empty(node, "shares")
    finally:
        tree.close()
    got = [u / sum(used) for u in used]
    return {
        "shares": {
            "targets": [c / 100 for c in SHARE_CORES],
            "got": [round(g, 4) for g in got],
            "error_pp": round(max(abs(g - c / 100) * 100 for g, c in zip(got, SHARE_CORES, strict=True)), 2),
            "cpu_s": round(sum(used), 2),
            "wall_s": round(wall, 2),
        }
    }


async def _set_pods(kubelet: Any, listed: list[Any]) -> None:
    kubelet.set_pods(listed)


def _until(check: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise NodeError(f"shares: {what} did not come within {timeout:g} s")
        time.sleep(0.05)


def measure(opts: Options) -> dict[str, Any]:
    """Every part in turn, on one node started for them all; each leaves gpud as it found it. Then the
    shares, on a node of their own."""
    progress(f"starting gpud ({opts.gpus} simulated GPUs), the fake API server and kubelet, gpud-k8s")
    result: dict[str, Any] = {}
    with KubeNode(opts.gpus) as node:
        warm_up(node)
        for part in PARTS:
            result |= part(node, opts)
    if opts.shares_s > 0:
        result |= measure_shares(opts)
    return result


# --- report -------------------------------------------------------------------------------------------


def _row(name: str, f: dict[str, Any]) -> str:
    wall = f"{f['wall_ms']:.0f}" if "wall_ms" in f else ""
    return f"{name:<34}{f['n']:>6}{f['p50_ms']:>10.2f}{f['p99_ms']:>10.2f}{f['max_ms']:>10.2f}{wall:>10}"


def _cpu(f: dict[str, float]) -> str:
    return f"agent {f['agent']:.2f}, gpud {f['gpud']:.2f}, kubelet and API server {f['kubelet_and_api_server']:.2f}"


def table(result: dict[str, Any]) -> str:
    c = result["config"]
    share = result["batch_share"]
    lines = [
        f"{'call, ms':<34}{'n':>6}{'p50':>10}{'p99':>10}{'max':>10}{'wall':>10}",
        _row("prepare, one claim at a time", result["prepare_one"]),
        _row("unprepare, one claim at a time", result["unprepare_one"]),
        _row(f"prepare, {c['claims']} claims at once", result["prepare_batch"]),
        _row(f"unprepare, {c['claims']} claims at once", result["unprepare_batch"]),
        f"CPU ms a claim, prepared and unprepared: one at a time: {_cpu(result['cpu_ms_per_claim_one'])}",
        f"  at once: {_cpu(result['cpu_ms_per_claim_batch'])}",
        f"{c['gpus']} simulated GPUs; one at a time: {ONE_CORES} cores, {ONE_MEMORY / 2**30:g} GiB each; at once: "
        f"{share['cores']} cores, {share['memory_bytes'] / 2**30:g} GiB each, {share['claims_per_gpu']} a GPU, "
        "a call (a pod) each",
    ]
    shares = result.get("shares")
    if shares is not None and "skipped" in shares:
        lines.append(f"time-sliced claims' shares: not measured: {shares['skipped']}")
    elif shares is not None:
        lines.append(
            f"time-sliced claims of {shares['targets']} of a GPU: their containers got {shares['got']} of "
            f"{shares['cpu_s']:g} s of CPU time (error {shares['error_pp']:g} pp) in {shares['wall_s']:g} s"
        )
    lines.append(machine_line(result["machine"]))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> tuple[Options, bool]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object, last")
    ap.add_argument("--claims", type=int, default=Options.claims, help="claims prepared at once (default 100)")
    ap.add_argument("--repeat", type=int, default=Options.repeat, help="claims prepared one at a time (default 200)")
    ap.add_argument("--gpus", type=int, default=Options.gpus, help="simulated GPUs (default 4)")
    ap.add_argument(
        "--shares-seconds",
        type=float,
        default=Options.shares_s,
        help="CPU seconds the time-sliced containers use between them (default 20; 0: not measured)",
    )
    args = ap.parse_args(argv)
    if not 1 <= args.gpus <= 16:
        ap.error("--gpus: 1 to 16")
    if not 1 <= args.claims <= 100 * args.gpus:
        ap.error("--claims: 1 to 100 a GPU (a claim takes at least 1 of a GPU's 100 cores)")
    if args.repeat < 1:
        ap.error("--repeat: at least 1")
    if not 0 <= args.shares_seconds <= 3600:
        ap.error("--shares-seconds: 0 to 3600")
    return Options(claims=args.claims, repeat=args.repeat, gpus=args.gpus, shares_s=args.shares_seconds), args.json


def main(argv: list[str] | None = None) -> int:
    opts, as_json = parse_args(argv)
    run = Run()  # the load before the node starts
    try:
        result = measure(opts)
    except ImportError as exc:  # the fakes need the test extra, the agent the k8s extra
        print(f"k8s_prepare: nothing reported: {exc} (pip install -e '.[test,k8s]')", file=sys.stderr)
        return 1
    except (RuntimeError, OSError) as exc:  # NodeError, a daemon that did not start, a timeout
        print(f"k8s_prepare: nothing reported: {exc}", file=sys.stderr)
        return 1
    result |= {"config": asdict(opts) | {"batch_as": "a call per claim, all at once"}, "machine": run.machine()}
    print(json.dumps(result) if as_json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
