"""The fake kube-apiserver (fake_apiserver.py) through the real kubernetes_asyncio client: what gpud-k8s's tests
rely on it for. Each test runs its own asyncio loop (the suite runs trio_mode; kubernetes_asyncio needs asyncio)."""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.client.exceptions import ApiException

from .fake_apiserver import ApiError, FakeApiServer, ThreadedFakeApiServer, canonical_quantity, parse_quantity

DRIVER = "gpu.gpud.io"
NS = "team-a"
JSON = dict[str, Any]


def run(body: Callable[[], Awaitable[None]]) -> None:
    """One test's asyncio loop, bounded well past any wait (a loaded two-core machine)."""

    async def bounded() -> None:
        await asyncio.wait_for(body(), 120)

    asyncio.run(bounded())


def status_of(err: ApiException) -> JSON:
    status: JSON = json.loads(err.body)
    assert status["kind"] == "Status" and status["apiVersion"] == "v1" and status["status"] == "Failure"
    assert status["code"] == err.status
    return status


def resource_slice(node: str, name: str | None = None, *, memory: str = "16Gi", labels: JSON | None = None) -> JSON:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name or f"{node}-gpu.gpud.io", **({"labels": labels} if labels else {})},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "gpu-0",
                    "attributes": {"uuid": {"string": "GPU-0f3c"}, "index": {"int": 0}},
                    "capacity": {
                        "gpu.gpud.io/cores": {
                            "value": "100",
                            "requestPolicy": {"default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}},
                        },
                        "gpu.gpud.io/memory": {"value": memory},
                    },
                    "allowMultipleAllocations": True,
                }
            ],
        },
    }


def resource_claim(name: str = "claim-a") -> JSON:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {"deviceClassName": DRIVER, "capacity": {"requests": {"gpu.gpud.io/cores": "25"}}},
                    }
                ]
            }
        },
    }


def allocation(share_id: str) -> JSON:
    return {
        "devices": {
            "results": [
                {
                    "request": "gpu",
                    "driver": DRIVER,
                    "pool": "node-a",
                    "device": "gpu-0",
                    "shareID": share_id,
                    "consumedCapacity": {"gpu.gpud.io/cores": "25", "gpu.gpud.io/memory": "4096Mi"},
                }
            ]
        },
        "nodeSelector": {
            "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-a"]}]}]
        },
    }


def pod(name: str, *, ready: bool = True, labels: JSON | None = None) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels or {"app": "trainer"}},
        "spec": {"nodeName": "node-a", "containers": [{"name": "main", "image": "trainer:1"}]},
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


async def collect(events: Any, n: int) -> list[tuple[str, JSON]]:
    """The first ``n`` events of a watch stream, as (type, raw object)."""
    out = []
    async for ev in events:
        out.append((ev["type"], ev["raw_object"]))
        if len(out) == n:
            break
    return out


def test_quantities_are_written_back_canonical() -> None:
    cases = {
        "1024Mi": "1Gi",
        "1000": "1k",
        "100": "100",
        "0.5": "500m",
        "1.5Gi": "1536Mi",
        "1e3": "1e3",
        "1500": "1500",
    }
    for given, canonical in cases.items():
        assert canonical_quantity(*parse_quantity(given)) == canonical, given
    with pytest.raises(ValueError):
        parse_quantity("12 GiB")


def test_slices_create_get_list_pages_and_selectors() -> None:
    async def body() -> None:
        async with FakeApiServer(version="1.37") as api, ApiClient(Configuration(host=api.url)) as c:
            r = client.ResourceV1Api(c)
            assert api.schema_version.startswith("1.37")
            for node in ("node-a", "node-b", "node-c"):
                created = await r.create_resource_slice(resource_slice(node, memory="16384Mi", labels={"node": node}))
                assert created.metadata.uid and created.metadata.creation_timestamp and created.metadata.generation == 1
            got = await r.read_resource_slice("node-b-gpu.gpud.io")
            assert got.spec.devices[0].capacity["gpu.gpud.io/memory"].value == "16Gi"  # canonical, as a real server
            with pytest.raises(ApiException) as err:
                await r.create_resource_slice(resource_slice("node-b"))
            status = status_of(err.value)
            assert (status["code"], status["reason"]) == (409, "AlreadyExists")
            assert status["message"] == 'resourceslices.resource.k8s.io "node-b-gpu.gpud.io" already exists'
            with pytest.raises(ApiException) as err:
                await r.read_resource_slice("nowhere")
            assert status_of(err.value)["message"] == 'resourceslices.resource.k8s.io "nowhere" not found'

            first = await r.list_resource_slice(limit=2)
            assert [s.metadata.name for s in first.items] == ["node-a-gpu.gpud.io", "node-b-gpu.gpud.io"]
            assert first.metadata._continue and first.metadata.remaining_item_count == 1
            await r.delete_resource_slice("node-c-gpu.gpud.io")  # the pages are one snapshot
            rest = await r.list_resource_slice(limit=2, _continue=first.metadata._continue)
            assert [s.metadata.name for s in rest.items] == ["node-c-gpu.gpud.io"]
            assert rest.metadata.resource_version == first.metadata.resource_version and not rest.metadata._continue

            on_b = await r.list_resource_slice(field_selector="spec.nodeName=node-b")
            assert [s.metadata.name for s in on_b.items] == ["node-b-gpu.gpud.io"]
            not_b = await r.list_resource_slice(label_selector="node!=node-b")
            assert [s.metadata.name for s in not_b.items] == ["node-a-gpu.gpud.io"]
            in_set = await r.list_resource_slice(label_selector="node in (node-a,node-b),!gone")
            assert len(in_set.items) == 2
            with pytest.raises(ApiException) as err:
                await r.list_resource_slice(field_selector="spec.pool.name=node-a")
            assert status_of(err.value)["message"] == "field label not supported: spec.pool.name"

            # An update that changes nothing writes nothing; a change of spec is a new generation.
            current = await r.read_resource_slice("node-a-gpu.gpud.io")
            same = await r.replace_resource_slice("node-a-gpu.gpud.io", current)
            assert same.metadata.resource_version == current.metadata.resource_version
            changed = resource_slice("node-a", labels={"node": "node-a"})
            changed["spec"]["pool"]["generation"] = 2
            after = await r.replace_resource_slice("node-a-gpu.gpud.io", changed)
            assert after.metadata.generation == 2 and int(after.metadata.resource_version) > int(
                current.metadata.resource_version
            )
            assert api.count("create", "resourceslices") == 4 and api.count("list") == 6

    run(body)


def test_watch_sees_changes_in_order_resumes_and_expires() -> None:
    async def body() -> None:
        async with FakeApiServer() as api, ApiClient(Configuration(host=api.url)) as c:
            r = client.ResourceV1Api(c)
            start = (await r.list_resource_slice()).metadata.resource_version
            await r.create_resource_slice(resource_slice("node-a", labels={"pool": "a"}))
            await r.patch_resource_slice(
                "node-a-gpu.gpud.io",
                {"metadata": {"labels": {"seen": "yes"}}},
                _content_type="application/merge-patch+json",
            )
            await r.delete_resource_slice("node-a-gpu.gpud.io")
            async with watch.Watch() as w:
                events = await collect(w.stream(r.list_resource_slice, resource_version=start, timeout_seconds=60), 3)
            assert [t for t, _ in events] == ["ADDED", "MODIFIED", "DELETED"]
            assert events[1][1]["metadata"]["labels"] == {"pool": "a", "seen": "yes"}
            versions = [int(o["metadata"]["resourceVersion"]) for _, o in events]
            assert versions == sorted(versions) and all(o["kind"] == "ResourceSlice" for _, o in events)

            # Resumed from the MODIFIED event's resourceVersion: only what came after.
            async with watch.Watch() as w:
                rest = await collect(
                    w.stream(r.list_resource_slice, resource_version=str(versions[1]), timeout_seconds=60), 1
                )
            assert [t for t, _ in rest] == ["DELETED"]

            # Live, through a label selector: an object that stops matching is DELETED for the watch.
            async def live() -> list[tuple[str, JSON]]:
                async with watch.Watch() as w:
                    return await collect(
                        w.stream(r.list_resource_slice, label_selector="pool=b", timeout_seconds=60), 3
                    )

            watching = asyncio.create_task(live())
            await api.wait_for(lambda: api.watches("resourceslices") == 1)
            await r.create_resource_slice(resource_slice("node-b", labels={"pool": "b"}))
            await r.create_resource_slice(resource_slice("node-c", labels={"pool": "c"}))  # not seen
            await r.patch_resource_slice("node-b-gpu.gpud.io", {"metadata": {"labels": {"x": "1"}}})
            await r.patch_resource_slice("node-b-gpu.gpud.io", {"metadata": {"labels": {"pool": "c"}}})
            seen = await watching
            assert [(t, o["metadata"]["name"]) for t, o in seen] == [
                ("ADDED", "node-b-gpu.gpud.io"),
                ("MODIFIED", "node-b-gpu.gpud.io"),
                ("DELETED", "node-b-gpu.gpud.io"),
            ]
            await api.wait_for(lambda: api.watches() == 0)

            # Compacted history: a watch from before it is 410 Expired.
            api.compact()
            with pytest.raises(ApiException) as err:
                async with watch.Watch() as w:
                    await collect(w.stream(r.list_resource_slice, resource_version=start, timeout_seconds=60), 1)
            assert err.value.status == 410 and "too old resource version" in str(err.value.reason)

            # A watch from "0" starts with the state; a BOOKMARK when asked at the end of its time.
            async with watch.Watch() as w:
                now = await collect(
                    w.stream(
                        r.list_resource_slice, resource_version="0", allow_watch_bookmarks=True, timeout_seconds=1
                    ),
                    3,
                )
            assert [t for t, _ in now] == ["ADDED", "ADDED", "BOOKMARK"]

    run(body)


def test_claim_status_allocation_and_reservations() -> None:
    async def body() -> None:
        async with FakeApiServer() as api, ApiClient(Configuration(host=api.url)) as c:
            r = client.ResourceV1Api(c)
            created = await r.create_namespaced_resource_claim(NS, resource_claim())
            assert created.spec.devices.requests[0].exactly.allocation_mode == "ExactCount"  # defaulted
            assert created.spec.devices.requests[0].exactly.count == 1

            share = str(uuid.uuid4())
            claim = (await r.read_namespaced_resource_claim("claim-a", NS)).to_dict()
            raw = api.get("resourceclaims", NS, "claim-a")
            assert raw is not None
            raw["status"] = {"allocation": allocation(share)}
            # The main resource ignores status; the status subresource takes it.
            plain = await r.replace_namespaced_resource_claim("claim-a", NS, raw)
            assert plain.status.allocation is None
            raw["metadata"]["resourceVersion"] = plain.metadata.resource_version
            allocated = await r.replace_namespaced_resource_claim_status("claim-a", NS, raw)
            result = allocated.status.allocation.devices.results[0]
            assert result.share_id == share
            assert result.consumed_capacity == {"gpu.gpud.io/cores": "25", "gpu.gpud.io/memory": "4Gi"}

            # Reservations merge by uid (strategic merge patch, the client's default for a dict).
            for i in (1, 2):
                await r.patch_namespaced_resource_claim_status(
                    "claim-a",
                    NS,
                    {"status": {"reservedFor": [{"resource": "pods", "name": f"p{i}", "uid": f"uid-{i}"}]}},
                )
            reserved = (await r.read_namespaced_resource_claim("claim-a", NS)).status.reserved_for
            assert [x.name for x in reserved] == ["p1", "p2"]
            await r.patch_namespaced_resource_claim_status(
                "claim-a", NS, {"status": {"reservedFor": [{"uid": "uid-1", "$patch": "delete"}]}}
            )
            assert [x.name for x in (await r.read_namespaced_resource_claim("claim-a", NS)).status.reserved_for] == [
                "p2"
            ]

            # What a real server refuses: a changed allocation, a share ID that is no UUID, a spec change, the
            # status of a device that is not allocated.
            for path, value, field, message in [
                ("status.allocation.devices.results.0.device", "gpu-1", "status.allocation", "field is immutable"),
                ("spec.devices.requests.0.name", "other", "spec", "field is immutable"),
                ("status.devices", [{"driver": DRIVER, "pool": "node-a", "device": "gpu-7"}], "status.devices[0]",
                 "must be an allocated device in the claim"),
            ]:  # fmt: skip
                current = api.get("resourceclaims", NS, "claim-a")
                assert current is not None
                changed = copy.deepcopy(current)
                target: Any = changed
                *walk, last = path.split(".")
                for part in walk:
                    target = target[int(part)] if part.isdigit() else target[part]
                target[int(last) if last.isdigit() else last] = value
                call = (
                    r.replace_namespaced_resource_claim
                    if field == "spec"
                    else r.replace_namespaced_resource_claim_status
                )
                with pytest.raises(ApiException) as err:
                    await call("claim-a", NS, changed)
                status = status_of(err.value)
                assert (status["code"], status["reason"]) == (422, "Invalid")
                assert status["message"].startswith('ResourceClaim.resource.k8s.io "claim-a" is invalid: ' + field)
                assert [(x["field"], message in x["message"]) for x in status["details"]["causes"]] == [(field, True)]
            fresh = resource_claim("claim-b")
            await r.create_namespaced_resource_claim(NS, fresh)
            bad = api.get("resourceclaims", NS, "claim-b")
            assert bad is not None
            bad["status"] = {"allocation": allocation("not-a-uuid")}
            with pytest.raises(ApiException) as err:
                await r.replace_namespaced_resource_claim_status("claim-b", NS, bad)
            causes = status_of(err.value)["details"]["causes"]
            assert [x["field"] for x in causes] == ["status.allocation.devices.results[0].shareID"]
            assert claim["metadata"]["name"] == "claim-a"

    run(body)


def test_stale_resource_version_conflicts() -> None:
    async def body() -> None:
        async with FakeApiServer() as api, ApiClient(Configuration(host=api.url)) as c:
            r = client.ResourceV1Api(c)
            first = await r.create_resource_slice(resource_slice("node-a"))
            stale = first.to_dict()
            await r.patch_resource_slice("node-a-gpu.gpud.io", {"metadata": {"labels": {"a": "b"}}})
            body = api.get("resourceslices", None, "node-a-gpu.gpud.io")
            assert body is not None
            body["metadata"]["resourceVersion"] = first.metadata.resource_version
            with pytest.raises(ApiException) as err:
                await r.replace_resource_slice("node-a-gpu.gpud.io", body)
            status = status_of(err.value)
            assert (status["code"], status["reason"]) == (409, "Conflict")
            assert status["message"] == (
                'Operation cannot be fulfilled on resourceslices.resource.k8s.io "node-a-gpu.gpud.io": the object has '
                "been modified; please apply your changes to the latest version and try again"
            )
            assert status["details"] == {
                "name": "node-a-gpu.gpud.io",
                "group": "resource.k8s.io",
                "kind": "resourceslices",
            }
            with pytest.raises(ApiException) as err:
                await r.delete_resource_slice(
                    "node-a-gpu.gpud.io",
                    body=client.V1DeleteOptions(
                        preconditions=client.V1Preconditions(resource_version=stale["metadata"]["resource_version"])
                    ),
                )
            assert status_of(err.value)["reason"] == "Conflict"
            assert api.get("resourceslices", None, "node-a-gpu.gpud.io") is not None

    run(body)


def test_patches_merge_json_and_strategic() -> None:
    async def body() -> None:
        async with FakeApiServer() as api, ApiClient(Configuration(host=api.url)) as c:
            r = client.ResourceV1Api(c)
            await r.create_resource_slice(resource_slice("node-a", labels={"keep": "1", "drop": "1"}))
            merged = await r.patch_resource_slice(
                "node-a-gpu.gpud.io",
                {"metadata": {"labels": {"drop": None, "new": "1"}}, "spec": {"pool": {"generation": 5}}},
                _content_type="application/merge-patch+json",
            )
            assert merged.metadata.labels == {"keep": "1", "new": "1"}
            assert merged.spec.pool.generation == 5 and merged.spec.pool.name == "node-a"
            patched = await r.patch_resource_slice(
                "node-a-gpu.gpud.io",
                [{"op": "test", "path": "/spec/pool/generation", "value": 5},
                 {"op": "replace", "path": "/spec/devices/0/attributes/index", "value": {"int": 3}}],
            )  # fmt: skip
            assert patched.spec.devices[0].attributes["index"].int == 3
            with pytest.raises(ApiException) as err:
                await r.patch_resource_slice(
                    "node-a-gpu.gpud.io", [{"op": "test", "path": "/spec/pool/generation", "value": 9}]
                )
            assert (err.value.status, status_of(err.value)["reason"]) == (422, "Invalid")
            with pytest.raises(ApiException) as err:  # a patch that makes the object invalid is refused
                await r.patch_resource_slice(
                    "node-a-gpu.gpud.io", {"spec": {"devices": None}, "metadata": {"labels": {"Bad Key": "x"}}},
                    _content_type="application/merge-patch+json",
                )  # fmt: skip
            assert status_of(err.value)["details"]["causes"][0]["field"] == "metadata.labels"
            with pytest.raises(ApiException) as err:
                await r.patch_resource_slice(
                    "node-a-gpu.gpud.io", {"a": 1}, _content_type="application/apply-patch+yaml"
                )
            assert err.value.status == 415

    run(body)


def test_delete_collection_by_field_selector() -> None:
    async def body() -> None:
        async with FakeApiServer() as api, ApiClient(Configuration(host=api.url)) as c:
            r = client.ResourceV1Api(c)
            await r.create_resource_slice(resource_slice("node-a"))
            await r.create_resource_slice(resource_slice("node-a", name="node-a-gpu.gpud.io-2"))
            await r.create_resource_slice(resource_slice("node-b"))
            await r.delete_collection_resource_slice(field_selector=f"spec.nodeName=node-a,spec.driver={DRIVER}")
            assert [s["metadata"]["name"] for s in api.objects("resourceslices")] == ["node-b-gpu.gpud.io"]
            assert [t for t, _ in api.history("resourceslices")] == ["ADDED"] * 3 + ["DELETED"] * 2
            assert api.count("deletecollection", "resourceslices") == 1

    run(body)


def test_eviction_allowed_then_refused_by_a_disruption_budget() -> None:
    async def body() -> None:
        async with FakeApiServer() as api, ApiClient(Configuration(host=api.url)) as c:
            core, policy = client.CoreV1Api(c), client.PolicyV1Api(c)
            for name in ("p1", "p2", "p3"):
                api.put(pod(name))
            api.put(pod("other", labels={"app": "web"}))
            await policy.create_namespaced_pod_disruption_budget(
                NS,
                {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "trainers"},
                 "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "trainer"}}}},
            )  # fmt: skip
            budget = await policy.read_namespaced_pod_disruption_budget("trainers", NS)
            assert (budget.status.disruptions_allowed, budget.status.current_healthy) == (1, 3)

            evicted = client.V1Eviction(metadata=client.V1ObjectMeta(name="p1", namespace=NS))
            await core.create_namespaced_pod_eviction("p1", NS, evicted)
            await api.wait_for(lambda: api.get("pods", NS, "p1") is None)  # gone (the fake kubelet)
            p1 = [
                (t, "deletionTimestamp" in o["metadata"])
                for t, o in api.history("pods")
                if o["metadata"]["name"] == "p1"
            ]
            assert p1 == [("ADDED", False), ("MODIFIED", True), ("DELETED", True)]  # deletionTimestamp first

            with pytest.raises(ApiException) as err:
                await core.create_namespaced_pod_eviction(
                    "p2", NS, client.V1Eviction(metadata=client.V1ObjectMeta(name="p2", namespace=NS))
                )
            status = status_of(err.value)
            assert (status["code"], status["reason"]) == (429, "TooManyRequests")
            assert status["message"] == "Cannot evict pod as it would violate the pod's disruption budget."
            assert status["details"]["causes"] == [
                {
                    "reason": "DisruptionBudget",
                    "message": "The disruption budget trainers needs 2 healthy pods and has 2 currently",
                }
            ]
            assert api.get("pods", NS, "p2") is not None
            await core.create_namespaced_pod_eviction(  # no budget selects it
                "other", NS, client.V1Eviction(metadata=client.V1ObjectMeta(name="other", namespace=NS))
            )
            await api.wait_for(lambda: api.get("pods", NS, "other") is None)
            with pytest.raises(ApiException) as err:
                await core.create_namespaced_pod_eviction(
                    "gone", NS, client.V1Eviction(metadata=client.V1ObjectMeta(name="gone", namespace=NS))
                )
            assert status_of(err.value)["message"] == 'pods "gone" not found'
            assert api.count("create", "pods/eviction") == 4

    run(body)


def test_invalid_slices_are_refused_naming_the_field() -> None:
    def broken(change: Callable[[JSON], None]) -> JSON:
        s = resource_slice("node-a")
        change(s)
        return s

    cases = [
        (lambda s: s["spec"]["devices"][0]["attributes"]["uuid"].update(strng="x"),
         "spec.devices[0].attributes[uuid].strng", "field not declared in schema"),
        (lambda s: s["spec"].pop("driver"), "spec.driver", "Required value"),
        (lambda s: s["spec"].update(allNodes=True), "spec", "exactly one of `nodeName`, `nodeSelector`"),
        (lambda s: s["spec"]["devices"][0].update(name="GPU_0"), "spec.devices[0].name", "RFC 1123 label"),
        (lambda s: s["spec"]["devices"][0].pop("allowMultipleAllocations"),
         "spec.devices[0].capacity[gpu.gpud.io/cores].requestPolicy", "allowMultipleAllocations must be true"),
        (lambda s: s["spec"]["devices"][0]["capacity"]["gpu.gpud.io/cores"]["requestPolicy"].update(default="150"),
         "spec.devices[0].capacity[gpu.gpud.io/cores].requestPolicy.validRange.default", "default is more than max: 100"),
        (lambda s: s["spec"]["devices"][0]["capacity"]["gpu.gpud.io/memory"].update(value="16 GiB"),
         "spec.devices[0].capacity[gpu.gpud.io/memory].value", "quantities must match"),
        (lambda s: s["spec"]["pool"].update(resourceSliceCount=0), "spec.pool.resourceSliceCount", "greater than zero"),
    ]  # fmt: skip

    async def body() -> None:
        async with FakeApiServer() as api, ApiClient(Configuration(host=api.url)) as c:
            r = client.ResourceV1Api(c)
            for change, field, message in cases:
                with pytest.raises(ApiException) as err:
                    await r.create_resource_slice(broken(change))
                status = status_of(err.value)
                assert (status["code"], status["reason"]) == (422, "Invalid"), status
                assert status["message"].startswith('ResourceSlice.resource.k8s.io "node-a-gpu.gpud.io" is invalid: ')
                causes = [(x["field"], x["message"]) for x in status["details"]["causes"]]
                assert any(f == field and message in m for f, m in causes), (field, causes)
            with pytest.raises(ApiException) as err:  # fieldValidation=Strict: the real server's 400
                await r.create_resource_slice(broken(cases[0][0]), field_validation="Strict")
            assert status_of(err.value)["message"] == (
                'strict decoding error: unknown field "spec.devices[0].attributes[uuid].strng"'
            )
            ignored = await r.create_resource_slice(broken(cases[0][0]), field_validation="Ignore")
            assert ignored.spec.devices[0].attributes["uuid"].string == "GPU-0f3c"
            with pytest.raises(ApiError) as refused:  # put from a test is checked as any write
                api.put(broken(cases[1][0]))
            assert refused.value.code == 422 and "spec.driver: Required value" in str(refused.value)
            assert api.objects("resourceslices") == [api.get("ResourceSlice", None, "node-a-gpu.gpud.io")]

    run(body)


def test_injected_failures_finalizers_and_counts() -> None:
    async def body() -> None:
        async with FakeApiServer() as api, ApiClient(Configuration(host=api.url)) as c:
            r = client.ResourceV1Api(c)
            api.fail_next("list", "resourceslices", 503, message="etcd is away")
            with pytest.raises(ApiException) as err:
                await r.list_resource_slice()
            assert (err.value.status, status_of(err.value)["reason"]) == (503, "ServiceUnavailable")
            assert (await r.list_resource_slice()).items == []
            api.fail_next("update", "resourceclaims/status", 409)
            claim = resource_claim()
            claim["metadata"]["finalizers"] = ["resource.kubernetes.io/delete-protection"]
            await r.create_namespaced_resource_claim(NS, claim)
            stored = api.get("resourceclaims", NS, "claim-a")
            with pytest.raises(ApiException) as err:
                await r.replace_namespaced_resource_claim_status("claim-a", NS, stored)
            assert status_of(err.value)["reason"] == "Conflict"
            deleting = await r.delete_namespaced_resource_claim("claim-a", NS)
            assert deleting.metadata.deletion_timestamp is not None
            assert api.get("resourceclaims", NS, "claim-a") is not None  # held by its finalizer
            await r.patch_namespaced_resource_claim(
                "claim-a", NS, {"metadata": {"finalizers": None}}, _content_type="application/merge-patch+json"
            )
            assert api.get("resourceclaims", NS, "claim-a") is None
            assert [t for t, _ in api.history("resourceclaims")] == ["ADDED", "MODIFIED", "DELETED"]
            assert api.count("list", "resourceslices") == 2 and api.count("update", "resourceclaims/status") == 1

    run(body)


def test_threaded_fixture_serves_a_loop_of_its_own(apiserver: ThreadedFakeApiServer) -> None:  # noqa: F811
    apiserver.put(resource_slice("node-a"))

    async def body() -> None:
        async with ApiClient(Configuration(host=apiserver.url)) as c:
            r = client.ResourceV1Api(c)
            listed = await r.list_resource_slice()
            assert [s.metadata.name for s in listed.items] == ["node-a-gpu.gpud.io"]
            await r.delete_resource_slice("node-a-gpu.gpud.io")
        await apiserver.wait_for(lambda: not apiserver.objects("resourceslices"))

    run(body)
    assert apiserver.count("delete", "resourceslices") == 1
    assert [r.verb for r in apiserver.requests] == ["list", "delete"]


def test_pods_watched_by_node_and_held_while_terminating() -> None:
    async def body() -> None:
        async with FakeApiServer(kubelet=False) as api, ApiClient(Configuration(host=api.url)) as c:
            core, r = client.CoreV1Api(c), client.ResourceV1Api(c)
            api.put(pod("p1"))
            api.put({**pod("p2"), "metadata": {"name": "p2", "namespace": "team-b"}})
            elsewhere = pod("p3")
            elsewhere["spec"]["nodeName"] = "node-b"
            api.put(elsewhere)

            async def on_node_a() -> list[tuple[str, JSON]]:
                async with watch.Watch() as w:
                    stream = w.stream(
                        core.list_pod_for_all_namespaces, field_selector="spec.nodeName=node-a", timeout_seconds=60
                    )
                    return await collect(stream, 4)

            watching = asyncio.create_task(on_node_a())
            await api.wait_for(lambda: api.watches("pods") == 1)
            answer = await core.delete_namespaced_pod("p1", NS)  # graceful: 30 s, and no kubelet to finish it
            assert answer.metadata.deletion_grace_period_seconds == 30 and answer.metadata.deletion_timestamp
            assert api.get("pods", NS, "p1") is not None
            await core.delete_namespaced_pod("p1", NS, grace_period_seconds=0)  # as the kubelet does
            seen = [(t, o["metadata"]["name"], "deletionTimestamp" in o["metadata"]) for t, o in await watching]
            assert seen == [
                ("ADDED", "p1", False),
                ("ADDED", "p2", False),
                ("MODIFIED", "p1", True),
                ("DELETED", "p1", True),
            ]

            # The server stamps a device taint's timeAdded (SetDefaults_DeviceTaint) on every write that lacks one.
            tainted = resource_slice("node-a")
            tainted["spec"]["devices"][0]["taints"] = [
                {"key": "gpu.gpud.io/draining", "value": "true", "effect": "NoSchedule"}
            ]
            created = await r.create_resource_slice(tainted)
            assert created.spec.devices[0].taints[0].time_added is not None

    run(body)
