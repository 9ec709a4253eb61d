"""The few API server calls gpud-k8s makes, through ``kubernetes_asyncio``, in the API's own JSON.

Objects are read and written as the JSON the API server speaks (``_preload_content=False``), not
through the client's generated models: a model drops fields newer than the client (a claim's
``consumedCapacity`` and ``shareID``), and gpud-k8s must see the claim exactly as the scheduler
allocated it.
"""

from __future__ import annotations

import json
from typing import Any

import structlog
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.rest import ApiException

from gpud_k8s.claims import DRIVER

log = structlog.get_logger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def connect(kubeconfig: str | None = None, host: str | None = None) -> client.ApiClient:
    """In a pod: its service account (in-cluster); else ``kubeconfig`` or ``host`` (a plain URL)."""
    conf = client.Configuration()
    if host is not None:
        conf.host = host
    elif kubeconfig is not None:
        await config.load_kube_config(config_file=kubeconfig, client_configuration=conf)
    else:
        config.load_incluster_config(client_configuration=conf)  # type: ignore[no-untyped-call]
    return client.ApiClient(conf)


async def _json(call: Any) -> dict[str, Any]:
    """The JSON of one call made with ``_preload_content=False`` (which raises on no HTTP status: an
    error's Status is read here and raised as ``ApiError``, with the API server's message)."""
    try:
        response = await call
    except ApiException as exc:
        raise ApiError(exc.status or 0, str(exc.reason)) from None
    body = await response.read()
    try:
        out: dict[str, Any] = json.loads(body) if body else {}
    except ValueError:
        out = {}
    if response.status >= 400:
        raise ApiError(response.status, str(out.get("message") or body[:200].decode(errors="replace")))
    return out


class Kube:
    def __init__(self, api: client.ApiClient, driver: str = DRIVER) -> None:
        self.api = api
        self.driver = driver
        self.resource = client.ResourceV1Api(api)
        self.core = client.CoreV1Api(api)

    async def close(self) -> None:
        await self.api.close()

    async def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """The ResourceClaim; ``LookupError`` when there is none."""
        try:
            return await _json(self.resource.read_namespaced_resource_claim(name, namespace, _preload_content=False))
        except ApiError as exc:
            if exc.status == 404:
                raise LookupError("not found (deleted?)") from None
            raise

    async def node_uid(self, node: str) -> str | None:
        try:
            node_obj = await _json(self.core.read_node(node, _preload_content=False))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        uid = (node_obj.get("metadata") or {}).get("uid")
        return uid if isinstance(uid, str) else None

    async def server_version(self) -> tuple[int, int]:
        info = await _json(client.VersionApi(self.api).get_code(_preload_content=False))
        return int(info.get("major", 0)), int("".join(ch for ch in str(info.get("minor", "0")) if ch.isdigit()) or 0)

    async def get_slice(self, name: str) -> dict[str, Any] | None:
        try:
            return await _json(self.resource.read_resource_slice(name, _preload_content=False))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def put_slice(self, obj: dict[str, Any]) -> None:
        """Create the slice, or replace the one there (at its resourceVersion; a conflict: read again)."""
        name = obj["metadata"]["name"]
        for _ in range(5):
            current = await self.get_slice(name)
            try:
                if current is None:
                    await _json(self.resource.create_resource_slice(obj, _preload_content=False))  # type: ignore[arg-type]  # (its JSON)
                else:
                    meta = {**obj["metadata"], "resourceVersion": current["metadata"]["resourceVersion"]}
                    call = self.resource.replace_resource_slice(name, {**obj, "metadata": meta}, _preload_content=False)  # type: ignore[arg-type]
                    await _json(call)
                return
            except ApiError as exc:
                if exc.status not in (404, 409):  # someone else changed or removed it: again
                    raise
        raise ApiError(409, f"ResourceSlice {name} kept changing under gpud-k8s")

    async def delete_slices(self, node: str, keep: str | None = None) -> None:
        """This driver's slices of ``node`` other than ``keep`` (left by an earlier agent)."""
        selector = f"spec.nodeName={node},spec.driver={self.driver}"
        listing = await _json(self.resource.list_resource_slice(field_selector=selector, _preload_content=False))
        for item in listing.get("items") or []:
            name = item["metadata"]["name"]
            if name == keep:
                continue
            try:
                await _json(self.resource.delete_resource_slice(name, _preload_content=False))
            except ApiError as exc:
                if exc.status != 404:
                    raise

    async def evict(self, namespace: str, name: str, uid: str | None = None) -> str:
        """Evict the pod through the Eviction API (``policy/v1``), which keeps its disruption budgets:
        ``evicted``, ``blocked`` (429: a budget allows no disruption now; ask again later) or ``gone``
        (no such pod, or another pod of that name: ``uid`` differs)."""
        body: dict[str, Any] = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
        }
        if uid is not None:
            body["deleteOptions"] = {"preconditions": {"uid": uid}}
        try:
            await _json(self.core.create_namespaced_pod_eviction(name, namespace, body, _preload_content=False))  # type: ignore[arg-type]  # (its JSON)
        except ApiError as exc:
            if exc.status == 429:
                return "blocked"
            if exc.status in (404, 409):  # gone, or a new pod of that name (the uid precondition)
                return "gone"
            raise
        return "evicted"

    async def set_claim_condition(
        self, claim: dict[str, Any], devices: list[tuple[str, str, str]], condition: dict[str, Any]
    ) -> None:
        """Say ``condition`` (a metav1.Condition) on this driver's allocated devices ``(pool, device, share
        id or "")`` in the claim's ``status.devices``, keeping every other entry; at the claim's
        resourceVersion (a conflict raises: the claim changed)."""
        meta = claim.get("metadata") or {}
        status = claim.get("status") or {}
        mine = set(devices)
        others = [d for d in status.get("devices") or [] if _device_key(d, self.driver) not in mine]
        ours = []
        for pool, device, share in devices:
            entry = {"driver": self.driver, "pool": pool, "device": device, "conditions": [condition]}
            if share:
                entry["shareID"] = share
            ours.append(entry)
        patch = {"metadata": {"resourceVersion": meta.get("resourceVersion")}, "status": {"devices": others + ours}}
        call = self.resource.patch_namespaced_resource_claim_status(  # type: ignore[call-arg]  # (_content_type: its JSON merge patch)
            str(meta.get("name")),
            str(meta.get("namespace")),
            patch,  # type: ignore[arg-type]  # (its JSON)
            _preload_content=False,
            _content_type="application/merge-patch+json",
        )
        await _json(call)

    async def list_node_pods(self, node: str) -> list[dict[str, Any]]:
        """The pods scheduled to ``node`` (one list, every page)."""
        items: list[dict[str, Any]] = []
        cont: str | None = None
        while True:
            kwargs: dict[str, Any] = {"field_selector": f"spec.nodeName={node}", "limit": 500}
            if cont:
                kwargs["_continue"] = cont
            page = await _json(self.core.list_pod_for_all_namespaces(_preload_content=False, **kwargs))
            items += page.get("items") or []
            cont = (page.get("metadata") or {}).get("continue")
            if not cont:
                return items


def _device_key(entry: dict[str, Any], driver: str) -> tuple[str, str, str] | None:
    if entry.get("driver") != driver:
        return None
    return str(entry.get("pool")), str(entry.get("device")), str(entry.get("shareID") or "")
