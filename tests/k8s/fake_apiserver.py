"""A fake kube-apiserver for gpud-k8s's tests: real JSON over plain HTTP on 127.0.0.1, faithful enough that the
unmodified ``kubernetes_asyncio`` client works against it, strict enough that an object a real API server would
refuse is refused here too.

Served: ``resource.k8s.io/v1`` resourceslices, deviceclasses (cluster-scoped), resourceclaims (namespaced, with
``status``), resourceclaimtemplates (namespaced); core ``v1`` pods (with ``status`` and the ``policy/v1`` Eviction
subresource ``eviction``) and nodes (with ``status``); ``policy/v1`` poddisruptionbudgets (with ``status``, kept by
the fake as the disruption controller would). Verbs get, list, watch, create, update, patch (JSON patch, merge
patch, strategic merge patch driven by the schema's patch strategies and merge keys), delete, deletecollection.
Errors are ``Status`` objects with the real reasons and wording.

Every write (over HTTP, and ``put`` from a test) is checked three ways, in the real server's order: the body
against the strict JSON schema of the Kubernetes version given (``kubernetes_validate``'s, which rejects unknown
fields), then the server's defaulting and canonical quantities, then the rules of the real validation code that
matter to a DRA driver (names, pools, devices, attributes, capacities and their request policies, a claim's
allocation, reservations and device status, immutable fields, finalizers). A refusal is ``422 Invalid`` naming the
field, as ``Kind.group "name" is invalid: path: message``.

Start it inside the test's event loop::

    async with FakeApiServer(version="1.37") as api:
        async with ApiClient(Configuration(host=api.url)) as c:
            await client.ResourceV1Api(c).create_resource_slice(body)
        assert api.get("resourceslices", None, "node-a-gpu.gpud.io") is not None

or, for tests that run loops of their own (one ``asyncio.run`` per test, trio), in a thread of its own with
``ThreadedFakeApiServer`` (``tests/k8s/apiserver_fixtures.py`` has the fixture).

What it does not do: server-side apply (``application/apply-patch+*`` is 415); namespaces (none is served, any is
accepted); other versions (``resource.k8s.io/v1beta1``, ``v1beta2``) and other resources (404); feature gates (no
field is dropped for a disabled gate); omitempty (an empty list, map or string written is read back, where the
real server drops many); managedFields; the garbage collector (ownerReferences are kept, never followed);
admission (no quota, no NodeRestriction, no DRA admin-access check) and authentication; CEL (selector expressions
are not compiled); pod defaults beyond a few (restartPolicy, dnsPolicy, schedulerName, terminationGracePeriodSeconds,
the containers' imagePullPolicy and termination message) and most of pod validation; the scheduler; lists at an
exact or older resourceVersion (a list answers the current state; only a continued list keeps its snapshot);
bookmarks on a timer (one at a watch's end, or ``send_bookmarks()``); a disruption budget's expected count from the
pods' controllers (it is the pods the selector matches); protobuf, CBOR and YAML bodies; HTTPS and tokens.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import copy
import datetime
import importlib.resources
import json
import math
import random
import re
import threading
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import jsonschema
import kubernetes_validate.utils as kv
from aiohttp import web
from referencing import Registry, Resource

JSON = dict[str, Any]

# ---------------------------------------------------------------------------------------------------------------
# The resources served


@dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    subresources: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()  # field-selector labels besides metadata.name (and metadata.namespace)
    return_deleted: bool = True  # the registry's ReturnDeletedObject: DELETE answers the object, not a Status
    generation: bool = False  # metadata.generation set on create and bumped on every change of spec

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_resource(self) -> str:  # schema.GroupResource.String(): pods, resourceclaims.resource.k8s.io
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def group_kind(self) -> str:  # schema.GroupKind.String(): Pod, ResourceSlice.resource.k8s.io
        return f"{self.kind}.{self.group}" if self.group else self.kind

    def field_labels(self) -> tuple[str, ...]:
        return ("metadata.name", *(("metadata.namespace",) if self.namespaced else ()), *self.fields)


POD_FIELDS = (
    "spec.nodeName",
    "spec.restartPolicy",
    "spec.schedulerName",
    "spec.serviceAccountName",
    "spec.hostNetwork",
    "status.phase",
    "status.podIP",
    "status.nominatedNodeName",
)
TYPES = (
    ResourceType(
        "resource.k8s.io", "v1", "resourceslices", "ResourceSlice", False, fields=("spec.nodeName", "spec.driver"),
        generation=True,
    ),
    ResourceType("resource.k8s.io", "v1", "deviceclasses", "DeviceClass", False, generation=True),
    ResourceType("resource.k8s.io", "v1", "resourceclaims", "ResourceClaim", True, subresources=("status",)),
    ResourceType("resource.k8s.io", "v1", "resourceclaimtemplates", "ResourceClaimTemplate", True),
    ResourceType("", "v1", "pods", "Pod", True, subresources=("status", "eviction"), fields=POD_FIELDS, generation=True),
    ResourceType("", "v1", "nodes", "Node", False, subresources=("status",), fields=("spec.unschedulable",),
                 return_deleted=False),
    ResourceType("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True, subresources=("status",),
                 return_deleted=False, generation=True),
)  # fmt: skip
BY_PLURAL = {t.plural: t for t in TYPES}
BY_KIND = {t.kind: t for t in TYPES}


def resource_type(resource: str) -> ResourceType:
    """A served resource by plural (``resourceslices``), qualified plural (``resourceslices.resource.k8s.io``),
    Kind (``ResourceSlice``) or the lower-case kind."""
    name = resource.split(".", 1)[0]
    for t in TYPES:
        if name in (t.plural, t.kind, t.kind.lower()):
            return t
    raise KeyError(f"the fake API server does not serve {resource!r}")


# ---------------------------------------------------------------------------------------------------------------
# Status errors, as k8s.io/apimachinery/pkg/api/errors builds them


class ApiError(Exception):
    """A request refused: ``status`` is the Status object sent, with HTTP code ``status["code"]``."""

    def __init__(self, status: JSON, headers: dict[str, str] | None = None) -> None:
        super().__init__(status.get("message", ""))
        self.status = status
        self.headers = headers or {}

    @property
    def code(self) -> int:
        return int(self.status["code"])


REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    406: "NotAcceptable",
    409: "Conflict",
    410: "Expired",
    413: "RequestEntityTooLarge",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


def status_object(code: int, reason: str, message: str, details: JSON | None = None) -> JSON:
    status: JSON = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message}
    if reason:
        status["reason"] = reason
    if details:
        status["details"] = details
    status["code"] = code
    return status


def _details(t: ResourceType, name: str) -> JSON:
    d: JSON = {"name": name} if name else {}
    if t.group:
        d["group"] = t.group
    d["kind"] = t.plural  # "Yes we set Kind field to resource."
    return d


def not_found(t: ResourceType, name: str) -> ApiError:
    return ApiError(status_object(404, "NotFound", f'{t.group_resource} "{name}" not found', _details(t, name)))


def already_exists(t: ResourceType, name: str) -> ApiError:
    return ApiError(
        status_object(409, "AlreadyExists", f'{t.group_resource} "{name}" already exists', _details(t, name))
    )


MODIFIED_MSG = "the object has been modified; please apply your changes to the latest version and try again"


def conflict(t: ResourceType, name: str, why: str = MODIFIED_MSG) -> ApiError:
    message = f'Operation cannot be fulfilled on {t.group_resource} "{name}": {why}'
    return ApiError(status_object(409, "Conflict", message, _details(t, name)))


def bad_request(message: str) -> ApiError:
    return ApiError(status_object(400, "BadRequest", message))


def internal_error(message: str) -> ApiError:
    details = {"causes": [{"message": message}]}
    return ApiError(status_object(500, "InternalError", f"Internal error occurred: {message}", details))


def expired(message: str) -> ApiError:
    return ApiError(status_object(410, "Expired", message))


def too_many_requests(message: str, retry_after: int = 0, causes: list[JSON] | None = None) -> ApiError:
    details: JSON = {}
    if retry_after:
        details["retryAfterSeconds"] = retry_after
    if causes:
        details["causes"] = causes
    headers = {"Retry-After": str(retry_after)} if retry_after else {}
    return ApiError(status_object(429, "TooManyRequests", message, details), headers)


def no_such_resource() -> ApiError:
    return ApiError(status_object(404, "NotFound", "the server could not find the requested resource"))


def method_not_allowed(method: str) -> ApiError:
    return ApiError(status_object(405, "MethodNotAllowed", f"the server does not allow this method on the requested "
                                  f"resource ({method})"))  # fmt: skip


def injected(code: int, message: str | None, retry_after: int = 0) -> ApiError:
    reason = REASONS.get(code, "")
    if code == 500:
        return internal_error(message or "injected failure")
    if code == 429:
        return too_many_requests(message or "injected failure", retry_after)
    return ApiError(status_object(code, reason, message or f"injected failure ({code} {reason})"))


# ---------------------------------------------------------------------------------------------------------------
# Field errors, as k8s.io/apimachinery/pkg/util/validation/field formats them


def _value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    return json.dumps(v, separators=(",", ":"), sort_keys=True)


class FieldErrors:
    """field.ErrorList: each error a (cause type, field path, message body)."""

    def __init__(self) -> None:
        self.errors: list[tuple[str, str, str]] = []

    def __bool__(self) -> bool:
        return bool(self.errors)

    def add(self, kind: str, path: str, body: str) -> None:
        self.errors.append((kind, path, body))

    def required(self, path: str, detail: str = "") -> None:
        self.add("FieldValueRequired", path, "Required value" + (f": {detail}" if detail else ""))

    def invalid(self, path: str, value: Any, detail: str = "") -> None:
        self.add("FieldValueInvalid", path, f"Invalid value: {_value(value)}" + (f": {detail}" if detail else ""))

    def forbidden(self, path: str, detail: str = "") -> None:
        self.add("FieldValueForbidden", path, "Forbidden" + (f": {detail}" if detail else ""))

    def too_long(self, path: str, limit: int) -> None:
        self.add("FieldValueTooLong", path, f"Too long: may not be more than {limit} bytes")

    def too_many(self, path: str, actual: int, limit: int) -> None:
        self.add("FieldValueTooMany", path, f"Too many: {actual}: must have at most {limit} items")

    def duplicate(self, path: str, value: Any) -> None:
        self.add("FieldValueDuplicate", path, f"Duplicate value: {_value(value)}")

    def not_supported(self, path: str, value: Any, supported: Iterable[str]) -> None:
        listed = ", ".join(json.dumps(s) for s in supported)
        self.add("FieldValueNotSupported", path, f"Unsupported value: {_value(value)}: supported values: {listed}")

    def not_found(self, path: str, value: Any, detail: str = "") -> None:
        self.add("FieldValueNotFound", path, f"Not found: {_value(value)}" + (f": {detail}" if detail else ""))

    def immutable(self, path: str, value: Any) -> None:
        self.invalid(path, value, "field is immutable")

    def error(self, t: ResourceType, name: str) -> ApiError:
        """errors.NewInvalid: 422, the message every error joined, each a cause."""
        texts = [f"{path}: {body}" for _, path, body in self.errors]
        joined = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
        details: JSON = {"name": name} if name else {}
        if t.group:
            details["group"] = t.group
        details["kind"] = t.kind
        details["causes"] = [{"reason": k, "message": body, "field": path} for k, path, body in self.errors]
        message = f'{t.group_kind} "{name}" is invalid: {joined}'
        return ApiError(status_object(422, "Invalid", message, details))


# ---------------------------------------------------------------------------------------------------------------
# Name formats (k8s.io/apimachinery/pkg/util/validation)

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
UUID_FORM = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)"
    r"(\.(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*)?(\+[0-9a-zA-Z-]+(\.[0-9a-zA-Z-]+)*)?$"
)
DNS_LABEL_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end "
    "with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
DNS_SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start "
    "and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
QUALIFIED_NAME_MSG = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric "
    "character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
    "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
)
LABEL_VALUE_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and "
    "end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is "
    "'(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)
C_IDENTIFIER_MSG = (
    "a valid C identifier must start with alphabetic character or '_', followed by a string of alphanumeric "
    "characters or '_' (e.g. 'my_name',  or 'MY_NAME',  or 'MyName', regex used for validation is "
    "'[A-Za-z_][A-Za-z0-9_]*')"
)


def dns_label(e: FieldErrors, value: str, path: str) -> None:
    if len(value) > 63:
        e.invalid(path, value, "must be no more than 63 characters")
    if not DNS_LABEL.match(value):
        e.invalid(path, value, DNS_LABEL_MSG)


def dns_subdomain(e: FieldErrors, value: str, path: str) -> None:
    if len(value) > 253:
        e.invalid(path, value, "must be no more than 253 characters")
    if not DNS_SUBDOMAIN.match(value):
        e.invalid(path, value, DNS_SUBDOMAIN_MSG)


def qualified_name(e: FieldErrors, value: str, path: str) -> None:
    """IsQualifiedName: a label key, a finalizer, a taint key."""
    parts = value.split("/")
    if len(parts) > 2 or not parts[-1]:
        e.invalid(path, value, QUALIFIED_NAME_MSG.replace("name part must", "a qualified name must", 1))
        return
    if len(parts) == 2:
        if not parts[0]:
            e.invalid(path, value, "prefix part must be non-empty")
        elif len(parts[0]) > 253 or not DNS_SUBDOMAIN.match(parts[0]):
            e.invalid(path, value, "prefix part " + DNS_SUBDOMAIN_MSG)
    if len(parts[-1]) > 63:
        e.invalid(path, value, "name part must be no more than 63 characters")
    if not QUALIFIED_NAME.match(parts[-1]):
        e.invalid(path, value, QUALIFIED_NAME_MSG)


def label_value(e: FieldErrors, value: str, path: str) -> None:
    if len(value) > 63:
        e.invalid(path, value, "must be no more than 63 characters")
    if value and not QUALIFIED_NAME.match(value):
        e.invalid(path, value, LABEL_VALUE_MSG)


# ---------------------------------------------------------------------------------------------------------------
# Quantities (k8s.io/apimachinery/pkg/api/resource): parsed exactly and written back canonical, as the server does

QUANTITY_RE = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")
QUANTITY_MSG = "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
DECIMAL_SUFFIX = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
BINARY_SUFFIX = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}


def parse_quantity(q: Any) -> tuple[Fraction, str]:
    """A quantity's exact value and format (DecimalSI, BinarySI, DecimalExponent); ValueError if it is none."""
    if isinstance(q, bool) or not isinstance(q, str | int | float):
        raise ValueError(QUANTITY_MSG)
    if isinstance(q, float) and not math.isfinite(q):
        raise ValueError(QUANTITY_MSG)
    if isinstance(q, int | float):  # a JSON number: its digits, read as a quantity without suffix
        return _round_nano(Fraction(repr(q) if isinstance(q, float) else q)), "DecimalSI"
    m = QUANTITY_RE.match(q)
    if not m:
        raise ValueError(QUANTITY_MSG)
    number, suffix = m.groups()
    digits = number.lstrip("+-")
    if digits.count(".") > 1 or not digits.replace(".", ""):
        raise ValueError(QUANTITY_MSG)
    value = Fraction(number if not number.endswith(".") else number + "0")
    if suffix in DECIMAL_SUFFIX:
        value, form = value * Fraction(10) ** DECIMAL_SUFFIX[suffix], "DecimalSI"
    elif suffix in BINARY_SUFFIX:
        value, form = value * 2 ** BINARY_SUFFIX[suffix], "BinarySI"
    elif re.fullmatch(r"[eE][-+]?[0-9]+", suffix):
        value, form = value * Fraction(10) ** int(suffix[1:]), "DecimalExponent"
    else:
        raise ValueError("unable to parse quantity's suffix")
    return _round_nano(value), form


def _round_nano(value: Fraction) -> Fraction:
    nanos = value * 10**9
    if nanos.denominator != 1:  # more precise than nano: rounded away from zero, as ParseQuantity does
        nanos = Fraction(math.ceil(abs(nanos)) * (1 if nanos > 0 else -1))
    return nanos / 10**9


def canonical_quantity(value: Fraction, form: str) -> str:
    """Quantity.String(): binary suffixes while the value is a whole multiple of one, else decimal ones."""
    if value == 0:
        return "0"
    sign = "-" if value < 0 else ""
    a = abs(value)
    if form == "BinarySI" and (a < 1024 or a.denominator != 1):
        form = "DecimalSI"
    if form == "BinarySI":
        n, exp = int(a), 0
        while n % 1024 == 0 and exp < 60:
            n, exp = n // 1024, exp + 10
        return f"{sign}{n}{next(s for s, e in BINARY_SUFFIX.items() if e == exp) if exp else ''}"
    amount, exp = int(a * 10**9), -9
    while amount % 10 == 0:
        amount, exp = amount // 10, exp + 1
    down = exp % 3
    amount, exp = amount * 10**down, exp - down
    if form == "DecimalExponent":
        return f"{sign}{amount}" + (f"e{exp}" if exp else "")
    suffix = next((s for s, e in DECIMAL_SUFFIX.items() if e == exp), None)
    return f"{sign}{amount}{suffix if suffix is not None else f'e{exp}'}"


def quantity_string(q: Any) -> str:
    return canonical_quantity(*parse_quantity(q))


# ---------------------------------------------------------------------------------------------------------------
# The schemas of one Kubernetes version, from kubernetes_validate (strict: no unknown fields)


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


class Schemas:
    _cache: dict[str, Schemas] = {}
    _lock = threading.Lock()

    @classmethod
    def of(cls, version: str) -> Schemas:
        with cls._lock:
            if version not in cls._cache:
                cls._cache[version] = cls(version)
            return cls._cache[version]

    def __init__(self, version: str) -> None:
        want = _version_key(version.lstrip("v"))[:2]
        known = [v for v in kv.all_versions() if _version_key(v)[:2] <= want]
        if not known:
            raise ValueError(f"kubernetes-validate has no schemas for Kubernetes {version} or older")
        root = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
        # The newest version not newer than the one asked for that has resource.k8s.io/v1 (1.34 and later).
        usable = [v for v in known if (root / f"v{v}-local-strict" / "resourceslice-resource-v1.json").is_file()]
        if not usable:
            newest = [
                v
                for v in kv.all_versions()
                if (root / f"v{v}-local-strict" / "resourceslice-resource-v1.json").is_file()
            ]
            usable = newest[-1:]
        self.requested = version
        self.version: str = usable[-1]
        self.fell_back = _version_key(self.version)[:2] != want
        self.dir = root / f"v{self.version}-local-strict"
        document = json.loads((self.dir / "_definitions.json").read_text())
        self.defs: JSON = document["$defs"]
        self._registry: Registry[Any] = Resource.from_contents(document) @ Registry()
        self._roots: dict[tuple[str, str], JSON] = {}
        self._validators: dict[tuple[str, str], jsonschema.protocols.Validator] = {}
        self._vlock = threading.Lock()

    @staticmethod
    def _file(api_version: str, kind: str) -> str:
        group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)  # resource.k8s.io/v1: resource-v1
        return f"{kind.lower()}-{group_version}.json"

    def root(self, api_version: str, kind: str) -> JSON:
        key = (api_version, kind)
        if key not in self._roots:
            self._roots[key] = json.loads((self.dir / self._file(api_version, kind)).read_text())
        return self._roots[key]

    def validator(self, api_version: str, kind: str) -> jsonschema.protocols.Validator:
        key = (api_version, kind)
        with self._vlock:
            if key not in self._validators:
                schema = self.root(api_version, kind)
                registry = Resource.from_contents(schema) @ self._registry
                self._validators[key] = jsonschema.Draft202012Validator(schema, registry=registry)
            return self._validators[key]

    def resolve(self, s: JSON | None) -> JSON:
        while s and "$ref" in s:
            s = self.defs[s["$ref"].rsplit("/", 1)[-1]]
        return s or {}

    def child(self, s: JSON | None, key: str) -> tuple[JSON | None, bool]:
        """The schema of member ``key`` and whether it is a field (else a map entry)."""
        r = self.resolve(s)
        props = r.get("properties") or {}
        if key in props:
            return props[key], True
        extra = r.get("additionalProperties")
        return (extra if isinstance(extra, dict) else None), False

    def item(self, s: JSON | None) -> JSON | None:
        return self.resolve(s).get("items")

    def def_name(self, s: JSON | None) -> str:
        return str((s or {}).get("$ref", "")).rsplit("/", 1)[-1]

    def path(self, root: JSON, parts: Iterable[Any]) -> str:
        """A JSON path as field.Path prints it: spec.devices[0].attributes[uuid].string."""
        out, schema = "", root  # type: str, JSON | None
        for p in parts:
            if isinstance(p, int):
                out, schema = f"{out}[{p}]", self.item(schema)
            else:
                schema, is_field = self.child(schema, p)
                out = f"{out}.{p}" if is_field and out else (p if is_field else f"{out}[{p}]")
        return out


# ---------------------------------------------------------------------------------------------------------------
# Selectors


def parse_bool(raw: str | None, name: str, default: bool = False) -> bool:
    """strconv.ParseBool, as the server reads ?watch=True (which kubernetes_asyncio sends)."""
    if raw is None or raw == "":
        return default
    if raw in ("1", "t", "T", "TRUE", "true", "True"):
        return True
    if raw in ("0", "f", "F", "FALSE", "false", "False"):
        return False
    raise bad_request(f'invalid boolean value for {name}: strconv.ParseBool: parsing "{raw}": invalid syntax')


@dataclass
class Requirement:
    key: str
    op: str  # =, !=, in, notin, exists, !, gt, lt
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        has, v = self.key in labels, labels.get(self.key)
        if self.op in ("=", "in"):
            return has and v in self.values
        if self.op in ("!=", "notin"):
            return not has or v not in self.values
        if self.op == "exists":
            return has
        if self.op == "!":
            return not has
        try:
            n, bound = int(v or ""), int(self.values[0])
        except ValueError:
            return False
        return has and (n > bound if self.op == "gt" else n < bound)


def _split_top(selector: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in selector:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


LABEL_REQ = re.compile(
    r"^(?P<not>!)?\s*(?P<key>[A-Za-z0-9/._-]+)\s*(?:(?P<op>==|=|!=|>|<)\s*(?P<value>[A-Za-z0-9._-]*)"
    r"|\s+(?P<set>in|notin)\s*\((?P<values>[^()]*)\))?$"
)


def parse_label_selector(selector: str | None) -> list[Requirement]:
    """labels.Parse: =, ==, !=, in, notin, exists, !key, >, <."""
    reqs = []
    for part in _split_top(selector or ""):
        m = LABEL_REQ.match(part)
        if not m or (m["not"] and (m["op"] or m["set"])):
            raise bad_request(f"unable to parse requirement: found '{part}', expected: valid label selector")
        key = m["key"]
        e = FieldErrors()
        qualified_name(e, key, "key")
        if e:
            raise bad_request(f"unable to parse requirement: {e.errors[0][2]}")
        if m["not"]:
            reqs.append(Requirement(key, "!"))
        elif m["set"]:
            values = tuple(v.strip() for v in m["values"].split(",") if v.strip())
            reqs.append(Requirement(key, m["set"], values))
        elif m["op"]:
            op = {"==": "=", ">": "gt", "<": "lt"}.get(m["op"], m["op"])
            reqs.append(Requirement(key, op, (m["value"],)))
        else:
            reqs.append(Requirement(key, "exists"))
    return reqs


def label_selector_object(sel: JSON | None) -> list[Requirement] | None:
    """metav1.LabelSelectorAsSelector; None for a selector that selects nothing (nil or empty, as eviction reads it)."""
    if not sel or not (sel.get("matchLabels") or sel.get("matchExpressions")):
        return None
    reqs = [Requirement(k, "=", (v,)) for k, v in (sel.get("matchLabels") or {}).items()]
    ops = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}
    for expr in sel.get("matchExpressions") or []:
        reqs.append(Requirement(expr["key"], ops[expr["operator"]], tuple(expr.get("values") or ())))
    return reqs


def _unescape_field(value: str) -> str:
    return re.sub(r"\\(.)", r"\1", value)


def parse_field_selector(selector: str | None, t: ResourceType) -> list[tuple[str, str, str]]:
    out = []
    for part in re.split(r"(?<!\\),", selector or ""):
        part = part.strip()
        if not part:
            continue
        m = re.match(r"^([^=!]+?)\s*(==|=|!=)\s*(.*)$", part)
        if not m:
            raise bad_request(f"invalid selector: '{selector}'; can't understand '{part}'")
        key, op, value = m[1].strip(), "!=" if m[2] == "!=" else "=", _unescape_field(m[3].strip())
        if key not in t.field_labels():
            raise bad_request(f'field label not supported: {key}')  # fmt: skip
        out.append((key, op, value))
    return out


def field_value(obj: JSON, label: str) -> str:
    v: Any = obj
    for part in label.split("."):
        v = v.get(part) if isinstance(v, dict) else None
    if isinstance(v, bool):
        return "true" if v else "false"
    return "" if v is None else str(v)


@dataclass
class Filter:
    namespace: str | None = None
    labels: list[Requirement] = field(default_factory=list)
    fields: list[tuple[str, str, str]] = field(default_factory=list)

    def matches(self, obj: JSON) -> bool:
        meta = obj.get("metadata") or {}
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        labels = meta.get("labels") or {}
        if not all(r.matches(labels) for r in self.labels):
            return False
        return all((field_value(obj, k) == v) == (op == "=") for k, op, v in self.fields)

    @property
    def selects(self) -> bool:
        return bool(self.labels or self.fields)


# ---------------------------------------------------------------------------------------------------------------
# Patches


class PatchError(Exception):
    pass


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 (application/merge-patch+json)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f'JSON pointer "{path}" must start with "/"')
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _container(doc: Any, parts: list[str], path: str) -> Any:
    cur = doc
    for p in parts[:-1]:
        if isinstance(cur, dict) and p in cur:
            cur = cur[p]
        elif isinstance(cur, list) and p.isdigit() and int(p) < len(cur):
            cur = cur[int(p)]
        else:
            raise PatchError(f'doc is missing path: "{path}": missing value')
    return cur


def json_patch(doc: Any, ops: Any) -> Any:
    """RFC 6902 (application/json-patch+json): add, remove, replace, move, copy, test."""
    if not isinstance(ops, list):
        raise ValueError("json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    doc = copy.deepcopy(doc)

    def get(path: str) -> Any:
        parts = _pointer(path)
        if not parts:
            return doc
        c = _container(doc, parts, path)
        last = parts[-1]
        if isinstance(c, dict) and last in c:
            return c[last]
        if isinstance(c, list) and last.isdigit() and int(last) < len(c):
            return c[int(last)]
        raise PatchError(f'doc is missing path: "{path}": missing value')

    def remove(path: str, op: str) -> Any:
        parts = _pointer(path)
        c = _container(doc, parts, path)
        last = parts[-1]
        if isinstance(c, dict) and last in c:
            return c.pop(last)
        if isinstance(c, list) and last.isdigit() and int(last) < len(c):
            return c.pop(int(last))
        raise PatchError(f'{op} operation does not apply: doc is missing path: "{path}": missing value')

    def add(path: str, value: Any, op: str = "add") -> None:
        nonlocal doc
        parts = _pointer(path)
        if not parts:
            doc = value
            return
        c = _container(doc, parts, path)
        last = parts[-1]
        if isinstance(c, dict):
            c[last] = value
        elif isinstance(c, list) and (last == "-" or (last.isdigit() and int(last) <= len(c))):
            c.insert(len(c) if last == "-" else int(last), value)
        else:
            raise PatchError(f'{op} operation does not apply: doc is missing path: "{path}": missing value')

    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise ValueError("Unable to parse JSON patch operation")
        kind, path = op["op"], op["path"]
        if kind == "add":
            add(path, copy.deepcopy(op.get("value")))
        elif kind == "remove":
            remove(path, "remove")
        elif kind == "replace":
            remove(path, "replace")
            add(path, copy.deepcopy(op.get("value")), "replace")
        elif kind == "move":
            add(path, remove(op["from"], "move"), "move")
        elif kind == "copy":
            add(path, copy.deepcopy(get(op["from"])), "copy")
        elif kind == "test":
            if get(path) != op.get("value"):
                raise PatchError(f"testing value {path} failed: test failed")
        else:
            raise ValueError(f"Unexpected kind: {kind}")
    return doc


def _strategy(s: JSON | None) -> set[str]:
    return set(filter(None, (s or {}).get("x-kubernetes-patch-strategy", "").split(",")))


def strategic_merge(schemas: Schemas, original: Any, patch: Any, schema: JSON | None) -> Any:
    """application/strategic-merge-patch+json driven by the schema's x-kubernetes-patch-strategy and merge keys (the
    Go struct tags the real server reads): maps merge, null deletes, lists with ``merge`` merge by their key (or as a
    set of primitives), other lists are replaced; $patch (replace, delete, merge), $retainKeys,
    $deleteFromPrimitiveList and $setElementOrder (accepted, order not applied)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "replace":
        return _clean(patch)
    if directive == "delete":
        return None
    out = dict(original) if isinstance(original, dict) else {}
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys") or key.startswith("$setElementOrder/"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            if isinstance(out.get(name), list):
                out[name] = [v for v in out[name] if v not in (value or [])]
            continue
        if value is None:
            out.pop(key, None)
            continue
        sub, _ = schemas.child(schema, key)
        strategy = _strategy(sub)
        if isinstance(value, dict) and "replace" not in strategy:
            merged = strategic_merge(schemas, out.get(key), value, schemas.resolve(sub) if sub else None)
            if merged is None:
                out.pop(key, None)
            else:
                out[key] = merged
        elif isinstance(value, list) and "merge" in strategy:
            out[key] = _merge_list(schemas, out.get(key) or [], value, sub)
        else:
            out[key] = _clean(value)
    retain = patch.get("$retainKeys")
    if isinstance(retain, list):
        out = {k: v for k, v in out.items() if k in retain}
    return out


def _merge_list(schemas: Schemas, original: list[Any], patch: list[Any], schema: JSON | None) -> list[Any]:
    key = (schema or {}).get("x-kubernetes-patch-merge-key")
    item_schema = schemas.item(schema)
    if any(isinstance(p, dict) and p.get("$patch") == "replace" for p in patch):
        return [_clean(p) for p in patch if not (isinstance(p, dict) and "$patch" in p)]
    if not key:
        out = list(original)
        for p in patch:
            if isinstance(p, dict) and p.get("$patch") == "delete":
                continue
            if p not in out:
                out.append(_clean(p))
        return out
    out = [copy.deepcopy(o) for o in original]
    for p in patch:
        if not isinstance(p, dict) or key not in p:
            raise PatchError(f"map: {p} does not contain declared merge key: {key}")
        index = next((i for i, o in enumerate(out) if isinstance(o, dict) and o.get(key) == p[key]), None)
        if p.get("$patch") == "delete":
            if index is not None:
                out.pop(index)
        elif index is None:
            out.append(strategic_merge(schemas, {}, p, schemas.resolve(item_schema)))
        else:
            out[index] = strategic_merge(schemas, out[index], p, schemas.resolve(item_schema))
    return out


def _clean(v: Any) -> Any:
    """A patch value stored as it is, less the nulls and directives a fresh value cannot mean anything by."""
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items() if x is not None and not k.startswith("$")}
    if isinstance(v, list):
        return [_clean(x) for x in v]
    return v


def strip_nulls(v: Any) -> Any:
    """What decoding into Go types and encoding back does to a null: the field is gone."""
    if isinstance(v, dict):
        return {k: strip_nulls(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [strip_nulls(x) for x in v]
    return v


# ---------------------------------------------------------------------------------------------------------------
# Time


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def later(seconds: int) -> str:
    t = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=seconds)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


TIME_RE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$")


# ---------------------------------------------------------------------------------------------------------------
# Schema checks: the decoding step (unknown fields, types), quantities and times


def schema_errors(schemas: Schemas, obj: JSON, *, ignore_unknown: bool = False) -> tuple[FieldErrors, list[str]]:
    """The body against the strict schema of its kind: errors, and the unknown fields found (field paths)."""
    e, unknown = FieldErrors(), []
    root = schemas.root(obj["apiVersion"], obj["kind"])
    validator = schemas.validator(obj["apiVersion"], obj["kind"])
    for err in sorted(validator.iter_errors(obj), key=lambda x: [str(p) for p in x.absolute_path]):
        parts = list(err.absolute_path)
        where = schemas.path(root, parts)
        if err.validator == "additionalProperties":
            known = set((err.schema.get("properties") or {}) if isinstance(err.schema, dict) else ())
            for extra in sorted(set(err.instance) - known):
                unknown.append(f"{where}.{extra}" if where else extra)
                if not ignore_unknown:
                    e.invalid(unknown[-1], extra, "field not declared in schema")
        elif err.validator == "required":
            for missing in err.validator_value:
                if missing not in err.instance:
                    e.required(f"{where}.{missing}" if where else missing)
        elif err.validator == "type":
            wanted = [t for t in ([err.validator_value] if isinstance(err.validator_value, str) else err.validator_value)
                      if t != "null"]  # fmt: skip
            e.invalid(where, err.instance, f"must be of type {' or '.join(wanted)}")
        elif err.validator == "oneOf":
            e.invalid(where, err.instance, "must be a string or a number" if _is_quantity_schema(err.schema)
                      else f"does not match the schema: {err.message}")  # fmt: skip
        elif err.validator == "enum":
            e.not_supported(where, err.instance, [str(x) for x in err.validator_value])
        else:
            e.invalid(where, err.instance, err.message)
    return e, unknown


def _time(v: Any, micro: bool, path: str, e: FieldErrors) -> Any:
    """metav1.Time: RFC 3339 in, UTC out, to the second (MicroTime: to the microsecond)."""
    try:
        if not isinstance(v, str) or not TIME_RE.match(v):
            raise ValueError(v)
        t = datetime.datetime.fromisoformat(v.replace("Z", "+00:00")).astimezone(datetime.UTC)
    except ValueError:
        e.invalid(path, v, 'must be an RFC 3339 time such as "2006-01-02T15:04:05Z"')
        return v
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


def _is_quantity_schema(s: Any) -> bool:
    return isinstance(s, dict) and any(o.get("type") == ["number", "null"] for o in s.get("oneOf", []))


def drop_fields(obj: JSON, schemas: Schemas, paths: list[str]) -> None:
    """fieldValidation=Ignore: the unknown fields are dropped, as decoding into Go types drops them."""
    root = schemas.root(obj["apiVersion"], obj["kind"])

    def walk(v: Any, s: JSON | None) -> Any:
        if isinstance(v, dict):
            r = schemas.resolve(s)
            props, extra = r.get("properties"), r.get("additionalProperties")
            out = {}
            for k, x in v.items():
                if props is not None and k not in props and not isinstance(extra, dict):
                    continue
                out[k] = walk(x, schemas.child(s, k)[0])
            return out
        if isinstance(v, list):
            return [walk(x, schemas.item(s)) for x in v]
        return v

    if paths:
        cleaned = walk(obj, root)
        obj.clear()
        obj.update(cleaned)


def canonicalize(schemas: Schemas, obj: JSON, e: FieldErrors) -> JSON:
    """Every Quantity written back canonical (``1024Mi`` is read back ``1Gi``, ``1000`` as ``1k``), every Time checked."""
    root = schemas.root(obj["apiVersion"], obj["kind"])

    def walk(v: Any, s: JSON | None, path: str) -> Any:
        name = schemas.def_name(s)
        if name == "io.k8s.apimachinery.pkg.api.resource.Quantity":
            try:
                return quantity_string(v)
            except ValueError as err:
                e.invalid(path, v, str(err))
                return v
        if name in ("io.k8s.apimachinery.pkg.apis.meta.v1.Time", "io.k8s.apimachinery.pkg.apis.meta.v1.MicroTime"):
            return _time(v, name.endswith("MicroTime"), path, e)
        if isinstance(v, dict):
            out = {}
            for k, x in v.items():
                sub, is_field = schemas.child(s, k)
                out[k] = walk(x, sub, (f"{path}.{k}" if path else k) if is_field else f"{path}[{k}]")
            return out
        if isinstance(v, list):
            item = schemas.item(s)
            return [walk(x, item, f"{path}[{i}]") for i, x in enumerate(v)]
        return v

    return walk(obj, root, "")  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------------------------
# Defaulting (the subset of the real defaults a DRA driver's objects meet)


def apply_defaults(t: ResourceType, obj: JSON) -> None:
    if t.kind == "ResourceSlice":
        for device in (obj.get("spec") or {}).get("devices") or []:
            for taint in device.get("taints") or []:
                taint.setdefault("timeAdded", now())  # SetDefaults_DeviceTaint: on every write that lacks it
    elif t.kind == "ResourceClaim":
        _default_claim_spec(obj.get("spec") or {})
    elif t.kind == "ResourceClaimTemplate":
        _default_claim_spec(((obj.get("spec") or {}).get("spec")) or {})
    elif t.kind == "Pod":
        spec = obj.get("spec") or {}
        spec.setdefault("restartPolicy", "Always")
        spec.setdefault("terminationGracePeriodSeconds", 30)
        spec.setdefault("dnsPolicy", "ClusterFirst")
        spec.setdefault("schedulerName", "default-scheduler")
        for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
            image = c.get("image", "")
            tagged = ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest")
            c.setdefault("imagePullPolicy", "IfNotPresent" if tagged or "@" in image else "Always")
            c.setdefault("terminationMessagePath", "/dev/termination-log")
            c.setdefault("terminationMessagePolicy", "File")


def _default_claim_spec(spec: JSON) -> None:
    for request in (spec.get("devices") or {}).get("requests") or []:
        for r in ([request["exactly"]] if isinstance(request.get("exactly"), dict) else []) + list(
            request.get("firstAvailable") or []
        ):
            r.setdefault("allocationMode", "ExactCount")
            if r["allocationMode"] == "ExactCount":
                r.setdefault("count", 1)
            for toleration in r.get("tolerations") or []:
                toleration.setdefault("operator", "Equal")


# ---------------------------------------------------------------------------------------------------------------
# Validation: the rules of pkg/apis/*/validation that a DRA driver's objects meet


def validate_meta(e: FieldErrors, t: ResourceType, obj: JSON, old: JSON | None) -> None:
    meta = obj.get("metadata") or {}
    name = meta.get("name", "")
    if not name:
        e.required("metadata.name", "name or generateName is required")
    else:
        dns_subdomain(e, name, "metadata.name")
    if t.namespaced:
        ns = meta.get("namespace", "")
        if not ns:
            e.required("metadata.namespace")
        else:
            dns_label(e, ns, "metadata.namespace")
    for key, value in (meta.get("labels") or {}).items():
        qualified_name(e, key, "metadata.labels")
        label_value(e, value, f"metadata.labels[{key}]")
    annotations = meta.get("annotations") or {}
    for key in annotations:
        qualified_name(e, key.lower(), "metadata.annotations")
    if sum(len(k) + len(v) for k, v in annotations.items()) > 256 * 1024:
        e.too_long("metadata.annotations", 256 * 1024)
    for i, f in enumerate(meta.get("finalizers") or []):
        qualified_name(e, f, f"metadata.finalizers[{i}]")
    controllers = 0
    for i, ref in enumerate(meta.get("ownerReferences") or []):
        p = f"metadata.ownerReferences[{i}]"
        for key in ("apiVersion", "kind", "name", "uid"):
            if not ref.get(key):
                e.invalid(f"{p}.{key}", ref.get(key, ""), f"{key} must not be empty")
        controllers += bool(ref.get("controller"))
    if controllers > 1:
        e.invalid(
            "metadata.ownerReferences", meta["ownerReferences"], "Only one reference can have Controller set to true"
        )
    if old is not None:
        omega = old["metadata"]
        if meta.get("uid") != omega.get("uid"):
            e.immutable("metadata.uid", meta.get("uid", ""))
        added = set(meta.get("finalizers") or []) - set(omega.get("finalizers") or [])
        if omega.get("deletionTimestamp") and added:
            e.forbidden("metadata.finalizers", "no new finalizers can be added if the object is being deleted, found "
                        f"new finalizers {sorted(added)}")  # fmt: skip


def driver_name(e: FieldErrors, value: str, path: str) -> None:
    """corevalidation.ValidateCSIDriverName."""
    if not value:
        e.required(path)
        return
    if len(value) > 63:
        e.too_long(path, 63)
    if not DNS_SUBDOMAIN.match(value.lower()):
        e.invalid(path, value, DNS_SUBDOMAIN_MSG)


def pool_name(e: FieldErrors, value: str, path: str) -> None:
    if not value:
        e.required(path)
        return
    if len(value) > 253:
        e.too_long(path, 253)
    for part in value.split("/"):
        if len(part) > 253 or not DNS_SUBDOMAIN.match(part):
            e.invalid(path, part, DNS_SUBDOMAIN_MSG)


def resource_qualified_name(e: FieldErrors, name: str, path: str) -> None:
    """An attribute or capacity name: a C identifier of at most 32, optionally behind a driver's domain."""
    parts = name.split("/")
    if len(parts) > 2:
        e.invalid(path, name, "must not contain more than one slash")
        return
    if len(parts) == 2:
        if not parts[0]:
            e.invalid(path, "", "the domain must not be empty")
        else:
            driver_name(e, parts[0], path)
        if not parts[1]:
            e.invalid(path, "", "the name must not be empty")
            return
    ident = parts[-1]
    if len(ident) > 32:
        e.too_long(path, 32)
    if not C_IDENTIFIER.match(ident):
        e.invalid(path, ident, C_IDENTIFIER_MSG)


def uid_form(e: FieldErrors, value: str, path: str) -> None:
    if not UUID_FORM.match(value):
        e.invalid(path, value, "uid must be in RFC 4122 normalized form, `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` with "
                  "lowercase hexadecimal characters")  # fmt: skip


def _q(v: Any) -> Fraction:
    return parse_quantity(v)[0]


def validate_slice(e: FieldErrors, obj: JSON, old: JSON | None) -> None:
    spec = obj.get("spec") or {}
    ospec = (old or {}).get("spec")
    driver_name(e, spec.get("driver", ""), "spec.driver")
    pool = spec.get("pool") or {}
    pool_name(e, pool.get("name", ""), "spec.pool.name")
    if pool.get("resourceSliceCount", 0) <= 0:
        e.invalid("spec.pool.resourceSliceCount", pool.get("resourceSliceCount", 0), "must be greater than zero")
    if pool.get("generation", 0) < 0:
        e.invalid("spec.pool.generation", pool["generation"], "must be greater than or equal to zero")
    if ospec is not None:
        if pool.get("name") != (ospec.get("pool") or {}).get("name"):
            e.immutable("spec.pool.name", pool.get("name"))
        if spec.get("driver") != ospec.get("driver"):
            e.immutable("spec.driver", spec.get("driver"))
        if spec.get("nodeName") != ospec.get("nodeName"):
            e.immutable("spec.nodeName", spec.get("nodeName"))
    chosen = []
    if "nodeName" in spec:
        if spec["nodeName"]:
            chosen.append("`nodeName`")
            dns_subdomain(e, spec["nodeName"], "spec.nodeName")
        else:
            e.invalid("spec.nodeName", "", "must be either unset or set to a non-empty string")
    if "nodeSelector" in spec:
        chosen.append("`nodeSelector`")
        terms = spec["nodeSelector"].get("nodeSelectorTerms") or []
        if len(terms) != 1:
            e.invalid("spec.nodeSelector.nodeSelectorTerms", terms, "must have exactly one node selector term")
    for key in ("allNodes", "perDeviceNodeSelection"):
        if key in spec:
            if spec[key]:
                chosen.append(f"`{key}`")
            else:
                e.invalid(f"spec.{key}", False, "must be either unset or set to true")
    one_of = "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required"
    if not chosen:
        e.required("spec", one_of)
    elif len(chosen) > 1:
        e.invalid("spec", "{" + ", ".join(chosen) + "}", one_of + ", but multiple fields are set")
    if "sharedCounters" in spec and "devices" in spec:
        e.invalid("spec", "", "only one of `sharedCounters` or `devices` is allowed")
    devices = spec.get("devices") or []
    advanced = any(
        d.get("taints")
        or d.get("consumesCounters")
        or any(set(a) & {"bools", "ints", "strings", "versions"} for a in (d.get("attributes") or {}).values())
        for d in devices
    )
    limit = 64 if advanced else 128
    if len(devices) > limit:
        e.too_many("spec.devices", len(devices), limit)
    else:
        olds = {d.get("name"): d for d in (ospec or {}).get("devices") or []}
        seen: set[str] = set()
        for i, d in enumerate(devices):
            validate_device(
                e, d, olds.get(d.get("name")), f"spec.devices[{i}]", bool(spec.get("perDeviceNodeSelection"))
            )
            if d.get("name") in seen:
                e.duplicate(f"spec.devices[{i}]", d.get("name"))
            seen.add(d.get("name", ""))
    seen = set()
    for i, cs in enumerate(spec.get("sharedCounters") or []):
        p = f"spec.sharedCounters[{i}]"
        if not cs.get("name"):
            e.required(f"{p}.name")
        else:
            dns_label(e, cs["name"], f"{p}.name")
        if not cs.get("counters"):
            e.required(f"{p}.counters")
        for key in cs.get("counters") or {}:
            dns_label(e, key, f"{p}.counters")
        if cs.get("name") in seen:
            e.duplicate(p, cs.get("name"))
        seen.add(cs.get("name", ""))
    skip_node_operations(e, spec.get("skipNodeOperations"), "spec.skipNodeOperations")


def skip_node_operations(e: FieldErrors, ops: list[str] | None, path: str) -> None:
    ops = ops or []
    if "NodePrepareResources" in ops and "NodeUnprepareResources" not in ops and "*" not in ops:
        e.invalid(path, ops, "NodePrepareResources cannot be skipped unless NodeUnprepareResources is also skipped")


def validate_device(e: FieldErrors, d: JSON, old: JSON | None, p: str, per_device: bool) -> None:
    dns_label(e, d.get("name", ""), f"{p}.name")
    attributes, capacity = d.get("attributes") or {}, d.get("capacity") or {}
    if len(attributes) + len(capacity) > 32:
        e.invalid(
            p, len(attributes) + len(capacity), "the total number of attributes and capacities must not exceed 32"
        )
    for key, a in attributes.items():
        resource_qualified_name(e, key, f"{p}.attributes")
        device_attribute(e, a, f"{p}.attributes[{key}]")
    if old is None or old.get("capacity") != d.get("capacity"):
        multiple = bool(d.get("allowMultipleAllocations"))
        for key, c in capacity.items():
            resource_qualified_name(e, key, f"{p}.capacity")
            if "requestPolicy" not in c:
                continue
            if not multiple:
                e.forbidden(f"{p}.capacity[{key}].requestPolicy", "allowMultipleAllocations must be true")
            else:
                request_policy(e, c.get("value"), c["requestPolicy"], f"{p}.capacity[{key}].requestPolicy")
    for i, taint in enumerate(d.get("taints") or []):
        tp = f"{p}.taints[{i}]"
        qualified_name(e, taint.get("key", ""), f"{tp}.key")
        if taint.get("value"):
            label_value(e, taint["value"], f"{tp}.value")
        effect = taint.get("effect", "")
        if not effect:
            e.required(f"{tp}.effect")
        elif effect not in ("NoExecute", "NoSchedule", "None"):
            e.not_supported(f"{tp}.effect", effect, ["NoExecute", "NoSchedule", "None"])
    for i, use in enumerate(d.get("consumesCounters") or []):
        up = f"{p}.consumesCounters[{i}]"
        if not use.get("counterSet"):
            e.required(f"{up}.counterSet")
        else:
            dns_label(e, use["counterSet"], f"{up}.counterSet")
        if not use.get("counters"):
            e.required(f"{up}.counters")
    placed = [f"`{k}`" for k in ("nodeName", "nodeSelector", "allNodes") if k in d]
    if per_device:
        if "nodeName" in d and not d["nodeName"]:
            e.invalid(f"{p}.nodeName", "", "must not be empty")
        if d.get("allNodes") is False:
            e.invalid(f"{p}.allNodes", False, "must be either unset or set to true")
        one = "exactly one of `nodeName`, `nodeSelector`, or `allNodes` is required when `perDeviceNodeSelection` " \
              "is set to true in the ResourceSlice spec"  # fmt: skip
        if not placed:
            e.required(p, one)
        elif len(placed) > 1:
            e.invalid(p, "{" + ", ".join(placed) + "}", one)
    elif placed:
        e.invalid(p, None, "`nodeName`, `nodeSelector` and `allNodes` can only be set if `perDeviceNodeSelection` is "
                  "set to true in the ResourceSlice spec")  # fmt: skip
    binding_conditions(e, d.get("bindingConditions") or [], d.get("bindingFailureConditions") or [], p)


def device_attribute(e: FieldErrors, a: JSON, p: str) -> None:
    set_ = [k for k in ("bool", "int", "string", "version", "bools", "ints", "strings", "versions") if k in a]
    if "string" in a and len(a["string"]) > 64:
        e.too_long(f"{p}.string", 64)
    if "version" in a:
        if not SEMVER.match(a["version"]):
            e.invalid(f"{p}.version", a["version"], "must be a string compatible with semver.org spec 2.0.0")
        if len(a["version"]) > 64:
            e.too_long(f"{p}.version", 64)
    for key in ("bools", "ints", "strings", "versions"):
        if key in a and not a[key]:
            e.invalid(f"{p}.{key}", a[key], "must not be empty if specified")
    for i, s in enumerate(a.get("strings") or []):
        if len(s) > 64:
            e.too_long(f"{p}.strings[{i}]", 64)
    for i, s in enumerate(a.get("versions") or []):
        if not SEMVER.match(s):
            e.invalid(f"{p}.versions[{i}]", s, "must be a string compatible with semver.org spec 2.0.0")
    if len(set_) != 1:
        e.invalid(p, a if set_ else "", "exactly one value must be specified")


def request_policy(e: FieldErrors, capacity: Any, policy: JSON, p: str) -> None:
    """validateRequestPolicy: a consumable capacity's validValues or validRange, with its default."""
    try:
        cap = _q(capacity)
    except ValueError:
        return  # reported by the quantity check
    values, span, default = policy.get("validValues"), policy.get("validRange"), policy.get("default")
    cap_s = quantity_string(capacity)
    if values and span is not None:
        e.forbidden(
            p, 'exactly one policy can be specified, cannot specify "validValues" and "validRange" at the same time'
        )
        return
    if values:
        if default is None:
            e.required(f"{p}.default", "required when validValues is defined")
            return
        vp = f"{p}.validValues"
        qs = [_q(v) for v in values]
        for i in range(len(qs) - 1):
            if qs[i] > qs[i + 1]:
                e.invalid(f"{vp}[{i + 1}]", quantity_string(values[i + 1]), "values must be sorted in ascending order")
        seen: set[Fraction] = set()
        for i, (v, q) in enumerate(zip(values, qs)):
            if q > cap:
                e.invalid(f"{vp}[{i}]", quantity_string(v), f"option is larger than capacity value: {cap_s}")
            if q in seen:
                e.duplicate(f"{vp}[{i}]", quantity_string(v))
            seen.add(q)
        if _q(default) not in seen:
            e.invalid(vp, quantity_string(default), "default value is not valid according to the requestPolicy")
    elif span is not None:
        rp = f"{p}.validRange"
        if default is None:
            e.required(f"{p}.default", "required when validRange is defined")
            return
        if span.get("min") is None:
            e.required(f"{rp}.min", "required when validRange is defined")
            return
        lo, d = _q(span["min"]), _q(default)
        lo_s, d_s = quantity_string(span["min"]), quantity_string(default)
        if lo > cap:
            e.invalid(f"{rp}.min", lo_s, f"min is larger than capacity value: {cap_s}")
        if d < lo:
            e.invalid(f"{rp}.default", d_s, f"default is less than min: {lo_s}")
        if span.get("max") is not None:
            hi, hi_s = _q(span["max"]), quantity_string(span["max"])
            if lo > hi:
                e.invalid(f"{rp}.max", lo_s, f"min is larger than max: {hi_s}")
            if hi > cap:
                e.invalid(f"{rp}.max", hi_s, f"max is larger than capacity value: {cap_s}")
            if d > hi:
                e.invalid(f"{rp}.default", d_s, f"default is more than max: {hi_s}")
        if span.get("step") is not None:
            step, step_s = _q(span["step"]), quantity_string(span["step"])
            if step <= 0:
                e.invalid(f"{rp}.step", step_s, "must be greater than zero")
                return
            if lo + step > cap:
                e.invalid(f"{rp}.step", step_s, f"one step {canonical_quantity(lo + step, parse_quantity(span['min'])[1])} "
                          f"is larger than capacity value: {cap_s}")  # fmt: skip
            for v, v_s in ((d, d_s), *(((_q(span["max"]), quantity_string(span["max"])),) if span.get("max") else ())):
                if (v - lo) % step != 0:
                    e.invalid(f"{rp}.step", v_s, f"value is not a multiple of a given step ({step_s}) from ({lo_s})")


def binding_conditions(e: FieldErrors, conditions: list[str], failures: list[str], p: str) -> None:
    for key, items in (("bindingConditions", conditions), ("bindingFailureConditions", failures)):
        if len(items) > 4:
            e.too_many(f"{p}.{key}", len(items), 4)
        seen: set[str] = set()
        for i, c in enumerate(items):
            qualified_name(e, c, f"{p}.{key}[{i}]")
            if c in seen:
                e.duplicate(f"{p}.{key}[{i}]", c)
            seen.add(c)
    for i, c in enumerate(failures):
        if c in conditions:
            e.invalid(f"{p}.bindingFailureConditions[{i}]", c, "bindingFailureConditions must not overlap with "
                      "bindingConditions")  # fmt: skip
    if not conditions and failures:
        e.invalid(
            f"{p}.bindingConditions", conditions, "bindingConditions are required to use bindingFailureConditions"
        )
    if not failures and conditions:
        e.invalid(f"{p}.bindingFailureConditions", failures, "bindingFailureConditions are required to use "
                  "bindingConditions")  # fmt: skip


def request_names(spec: JSON) -> dict[str, set[str] | None]:
    names: dict[str, set[str] | None] = {}
    for r in (spec.get("devices") or {}).get("requests") or []:
        subs = r.get("firstAvailable")
        names[r.get("name", "")] = {s.get("name", "") for s in subs} if subs else None
    return names


def _has_request(names: dict[str, set[str] | None], ref: str) -> bool:
    parts = ref.split("/")
    if len(parts) > 2 or parts[0] not in names:
        return False
    subs = names[parts[0]]
    return len(parts) == 1 or (subs is not None and parts[1] in subs)


def request_ref(e: FieldErrors, names: dict[str, set[str] | None], ref: str, path: str) -> None:
    why = "must be the name of a request in the claim or the name of a request and a subrequest separated by '/'"
    parts = ref.split("/")
    if len(parts) > 2:
        e.invalid(path, ref, why)
        return
    for part in parts:
        dns_label(e, part, path)
    if not _has_request(names, ref):
        e.invalid(path, ref, why)


def toleration(e: FieldErrors, t: JSON, p: str) -> None:
    if t.get("key"):
        qualified_name(e, t["key"], f"{p}.key")
    op = t.get("operator", "")
    if op == "Exists":
        if t.get("value"):
            e.invalid(f"{p}.value", t["value"], "must be empty for operator `Exists`")
    elif op == "Equal":
        label_value(e, t.get("value", ""), f"{p}.value")
    elif not op:
        e.required(f"{p}.operator")
    else:
        e.not_supported(f"{p}.operator", op, ["Equal", "Exists"])
    if t.get("effect") and t["effect"] not in ("NoExecute", "NoSchedule", "None"):
        e.not_supported(f"{p}.effect", t["effect"], ["NoExecute", "NoSchedule", "None"])


def opaque_config(e: FieldErrors, config: JSON, p: str) -> None:
    opaque = config.get("opaque")
    if opaque is None:
        e.required(f"{p}.opaque")
        return
    driver_name(e, opaque.get("driver", ""), f"{p}.opaque.driver")
    parameters = opaque.get("parameters")
    if parameters is None:
        e.required(f"{p}.opaque.parameters")
    elif not isinstance(parameters, dict):
        e.invalid(f"{p}.opaque.parameters", "<value omitted>", "must be a valid JSON object")
    elif len(json.dumps(parameters, separators=(",", ":"))) > 10 * 1024:
        e.too_long(f"{p}.opaque.parameters", 10 * 1024)


def _exact(e: FieldErrors, r: JSON, p: str) -> None:
    cls = r.get("deviceClassName", "")
    if not cls:
        e.required(f"{p}.deviceClassName")
    else:
        dns_subdomain(e, cls, f"{p}.deviceClassName")
    selectors = r.get("selectors") or []
    if len(selectors) > 32:
        e.too_many(f"{p}.selectors", len(selectors), 32)
    for i, s in enumerate(selectors):
        if "cel" not in s:
            e.required(f"{p}.selectors[{i}].cel")
    mode, count = r.get("allocationMode", ""), r.get("count", 0)
    if mode == "All":
        if count:
            e.invalid(f"{p}.count", count, "must not be specified when allocationMode is 'All'")
    elif mode == "ExactCount":
        if count <= 0:
            e.invalid(f"{p}.count", count, "must be greater than zero")
    else:
        e.not_supported(f"{p}.allocationMode", mode, ["All", "ExactCount"])
    for i, t in enumerate(r.get("tolerations") or []):
        toleration(e, t, f"{p}.tolerations[{i}]")


def validate_claim_spec(e: FieldErrors, spec: JSON, p: str) -> None:
    devices = spec.get("devices") or {}
    requests = devices.get("requests") or []
    names = request_names(spec)
    if len(requests) > 32:
        e.too_many(f"{p}.devices.requests", len(requests), 32)
        return
    seen: set[str] = set()
    for i, r in enumerate(requests):
        rp = f"{p}.devices.requests[{i}]"
        dns_label(e, r.get("name", ""), f"{rp}.name")
        first, exactly = r.get("firstAvailable") or [], r.get("exactly")
        kinds = bool(first) + (exactly is not None)
        if kinds == 0:
            e.required(rp, "exactly one of `exactly` or `firstAvailable` is required")
        elif kinds > 1:
            e.invalid(rp, None, "exactly one of `exactly` or `firstAvailable` is required, but multiple fields are set")
        elif first:
            if len(first) > 8:
                e.too_many(f"{rp}.firstAvailable", len(first), 8)
            subs: set[str] = set()
            for j, s in enumerate(first):
                sp = f"{rp}.firstAvailable[{j}]"
                dns_label(e, s.get("name", ""), f"{sp}.name")
                _exact(e, s, sp)
                if s.get("name") in subs:
                    e.duplicate(sp, s.get("name"))
                subs.add(s.get("name", ""))
        else:
            _exact(e, exactly or {}, f"{rp}.exactly")
        if r.get("name") in seen:
            e.duplicate(rp, r.get("name"))
        seen.add(r.get("name", ""))
    for i, c in enumerate(devices.get("constraints") or []):
        cp = f"{p}.devices.constraints[{i}]"
        for j, ref in enumerate(c.get("requests") or []):
            request_ref(e, names, ref, f"{cp}.requests[{j}]")
        attr = c.get("matchAttribute") or c.get("distinctAttribute")
        which = "matchAttribute" if "matchAttribute" in c else "distinctAttribute"
        if attr is None:
            e.required(
                cp, 'exactly one of "matchAttribute" or "distinctAttribute" is required, but multiple fields are set'
            )
        else:
            resource_qualified_name(e, attr, f"{cp}.{which}")
            if "/" not in attr:
                e.invalid(
                    f"{cp}.{which}", attr, "a fully qualified name must be a domain and a name separated by a slash"
                )
    for i, c in enumerate(devices.get("config") or []):
        cp = f"{p}.devices.config[{i}]"
        for j, ref in enumerate(c.get("requests") or []):
            request_ref(e, names, ref, f"{cp}.requests[{j}]")
        opaque_config(e, c, cp)


def validate_claim_status(e: FieldErrors, claim: JSON, old_status: JSON) -> None:
    status = claim.get("status") or {}
    names = request_names(claim.get("spec") or {})
    reserved = status.get("reservedFor") or []
    if len(reserved) > 256:
        e.too_many("status.reservedFor", len(reserved), 256)
    uids: set[str] = set()
    for i, ref in enumerate(reserved):
        rp = f"status.reservedFor[{i}]"
        for key in ("resource", "name", "uid"):
            if not ref.get(key):
                e.required(f"{rp}.{key}")
        if ref.get("uid") in uids:
            e.duplicate(rp, ref.get("uid"))
        uids.add(ref.get("uid", ""))
    allocation = status.get("allocation")
    allocated = set()
    for r in ((allocation or {}).get("devices") or {}).get("results") or []:
        allocated.add((r.get("driver"), r.get("pool"), r.get("device"), r.get("shareID")))
    seen: set[tuple[Any, ...]] = set()
    for i, d in enumerate(status.get("devices") or []):
        dp = f"status.devices[{i}]"
        driver_name(e, d.get("driver", ""), f"{dp}.driver")
        pool_name(e, d.get("pool", ""), f"{dp}.pool")
        dns_label(e, d.get("device", ""), f"{dp}.device")
        if "shareID" in d:
            uid_form(e, d["shareID"], f"{dp}.shareID")
        device = (d.get("driver"), d.get("pool"), d.get("device"), d.get("shareID"))
        shown = "/".join(str(k) for k in device if k is not None)
        if device not in allocated:
            e.invalid(dp, shown, "must be an allocated device in the claim")
        if device in seen:
            e.duplicate(dp, shown)
        seen.add(device)
        if len(d.get("conditions") or []) > 8:
            e.too_many(f"{dp}.conditions", len(d["conditions"]), 8)
        if "data" in d and not isinstance(d["data"], dict):
            e.invalid(f"{dp}.data", "<value omitted>", "must be a valid JSON object")
    if reserved:
        if allocation is None:
            e.forbidden("status.reservedFor", "may not be specified when `allocated` is not set")
        elif (claim.get("metadata") or {}).get("deletionTimestamp"):
            before = {r.get("uid") for r in old_status.get("reservedFor") or []}
            if {r.get("uid") for r in reserved} - before:
                e.forbidden("status.reservedFor", "new entries may not be added while `deallocationRequested` or "
                            "`deletionTimestamp` are set")  # fmt: skip
    before_allocation = old_status.get("allocation")
    if before_allocation is not None and allocation is not None:
        if allocation != before_allocation:
            e.immutable("status.allocation", allocation)
    elif allocation is not None:
        results = (allocation.get("devices") or {}).get("results") or []
        if len(results) > 32:
            e.too_many("status.allocation.devices.results", len(results), 32)
        for i, r in enumerate(results):
            rp = f"status.allocation.devices.results[{i}]"
            request_ref(e, names, r.get("request", ""), f"{rp}.request")
            driver_name(e, r.get("driver", ""), f"{rp}.driver")
            pool_name(e, r.get("pool", ""), f"{rp}.pool")
            dns_label(e, r.get("device", ""), f"{rp}.device")
            binding_conditions(e, r.get("bindingConditions") or [], r.get("bindingFailureConditions") or [], rp)
            for j, t in enumerate(r.get("tolerations") or []):
                toleration(e, t, f"{rp}.tolerations[{j}]")
            if "shareID" in r:
                uid_form(e, r["shareID"], f"{rp}.shareID")
            skip_node_operations(e, r.get("skipNodeOperations"), f"{rp}.skipNodeOperations")
        for i, c in enumerate((allocation.get("devices") or {}).get("config") or []):
            cp = f"status.allocation.devices.config[{i}]"
            source = c.get("source", "")
            if not source:
                e.required(f"{cp}.source")
            elif source not in ("FromClaim", "FromClass"):
                e.not_supported(f"{cp}.source", source, ["FromClaim", "FromClass"])
            for j, ref in enumerate(c.get("requests") or []):
                request_ref(e, names, ref, f"{cp}.requests[{j}]")
            opaque_config(e, c, cp)


POD_MUTABLE = ("activeDeadlineSeconds", "tolerations", "terminationGracePeriodSeconds", "schedulingGates")
POD_IMMUTABLE_MSG = (
    "pod updates may not change fields other than `spec.containers[*].image`,`spec.initContainers[*].image`,"
    "`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing tolerations),"
    "`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)"
)


def _pod_spec_shape(spec: JSON) -> JSON:
    out = {k: v for k, v in spec.items() if k not in POD_MUTABLE}
    for key in ("containers", "initContainers"):
        if key in out:
            out[key] = [{k: v for k, v in c.items() if k != "image"} for c in out[key]]
    return out


def validate_pod(e: FieldErrors, pod: JSON, old: JSON | None) -> None:
    spec = pod.get("spec") or {}
    claims = {c.get("name") for c in spec.get("resourceClaims") or []}
    seen: set[str] = set()
    for i, c in enumerate(spec.get("resourceClaims") or []):
        cp = f"spec.resourceClaims[{i}]"
        dns_label(e, c.get("name", ""), f"{cp}.name")
        if c.get("name") in seen:
            e.duplicate(f"{cp}.name", c.get("name"))
        seen.add(c.get("name", ""))
        if ("resourceClaimName" in c) == ("resourceClaimTemplateName" in c):
            e.invalid(cp, c, "must specify one of: `resourceClaimName`, `resourceClaimTemplateName`")
    names: set[str] = set()
    for key in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(key) or []):
            cp = f"spec.{key}[{i}]"
            dns_label(e, c.get("name", ""), f"{cp}.name")
            if c.get("name") in names:
                e.duplicate(f"{cp}.name", c.get("name"))
            names.add(c.get("name", ""))
            if not c.get("image") and old is None:
                e.required(f"{cp}.image")
            for j, rc in enumerate((c.get("resources") or {}).get("claims") or []):
                if rc.get("name") not in claims:
                    listed = ", ".join(sorted(n for n in claims if n))
                    e.not_found(f"{cp}.resources.claims[{j}]", rc.get("name"),
                                f"must be one of the names in pod.spec.resourceClaims{': ' + listed if listed else ' which is empty'}")  # fmt: skip
    policy = spec.get("restartPolicy", "Always")
    if policy not in ("Always", "OnFailure", "Never"):
        e.not_supported("spec.restartPolicy", policy, ["Always", "OnFailure", "Never"])
    if old is not None and _pod_spec_shape(spec) != _pod_spec_shape(old.get("spec") or {}):
        e.forbidden("spec", POD_IMMUTABLE_MSG)


def validate_pdb(e: FieldErrors, pdb: JSON) -> None:
    spec = pdb.get("spec") or {}
    if "minAvailable" in spec and "maxUnavailable" in spec:
        e.invalid("spec", spec, "minAvailable and maxUnavailable cannot be both set")
    for key in ("minAvailable", "maxUnavailable"):
        v = spec.get(key)
        if isinstance(v, int) and v < 0:
            e.invalid(f"spec.{key}", v, "must be greater than or equal to 0")
        elif isinstance(v, str):
            m = re.fullmatch(r"(\d+)%", v)
            if not m:
                e.invalid(f"spec.{key}", v, "a valid percent string must be a numeric string followed by an ending '%' "
                          "(e.g. '1%',  or '93%', regex used for validation is '[0-9]+%')")  # fmt: skip
            elif int(m[1]) > 100:
                e.invalid(f"spec.{key}", v, "must not be greater than 100%")
    policy = spec.get("unhealthyPodEvictionPolicy")
    if policy is not None and policy not in ("IfHealthyBudget", "AlwaysAllow"):
        e.not_supported("spec.unhealthyPodEvictionPolicy", policy, ["AlwaysAllow", "IfHealthyBudget"])


def validate_device_class(e: FieldErrors, dc: JSON) -> None:
    spec = dc.get("spec") or {}
    for key in ("selectors", "config"):
        if len(spec.get(key) or []) > 32:
            e.too_many(f"spec.{key}", len(spec[key]), 32)
    for i, s in enumerate(spec.get("selectors") or []):
        if "cel" not in s:
            e.required(f"spec.selectors[{i}].cel")
    for i, c in enumerate(spec.get("config") or []):
        opaque_config(e, c, f"spec.config[{i}]")


def validate(t: ResourceType, obj: JSON, old: JSON | None, subresource: str = "") -> FieldErrors:
    """The semantic checks of one write (create when ``old`` is None)."""
    e = FieldErrors()
    validate_meta(e, t, obj, old)
    ospec = (old or {}).get("spec")
    if t.kind == "ResourceSlice":
        validate_slice(e, obj, old)
    elif t.kind == "ResourceClaim":
        if subresource == "status" or old is None:
            if old is None:
                validate_claim_spec(e, obj.get("spec") or {}, "spec")
            validate_claim_status(e, obj, (old or {}).get("status") or {})
        elif obj.get("spec") != ospec:
            e.immutable("spec", obj.get("spec"))
    elif t.kind == "ResourceClaimTemplate":
        if old is None:
            validate_claim_spec(e, (obj.get("spec") or {}).get("spec") or {}, "spec.spec")
        elif obj.get("spec") != ospec:
            e.immutable("spec", obj.get("spec"))
    elif t.kind == "DeviceClass":
        validate_device_class(e, obj)
    elif t.kind == "Pod" and subresource != "status":
        validate_pod(e, obj, old)
    elif t.kind == "PodDisruptionBudget":
        validate_pdb(e, obj)
    return e


# ---------------------------------------------------------------------------------------------------------------
# Pods and disruption budgets


def pod_ready(pod: JSON) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def qos_class(pod: JSON) -> str:
    containers = ((pod.get("spec") or {}).get("containers") or []) + (
        (pod.get("spec") or {}).get("initContainers") or []
    )
    requests = [(c.get("resources") or {}).get("requests") or {} for c in containers]
    limits = [(c.get("resources") or {}).get("limits") or {} for c in containers]
    if not any(requests) and not any(limits):
        return "BestEffort"
    for req, lim in zip(requests, limits):
        for name in ("cpu", "memory"):
            if name not in lim or _q(req.get(name, lim[name])) != _q(lim[name]):
                return "Burstable"
    return "Guaranteed"


def _scaled(v: Any, total: int, round_up: bool) -> int:
    if isinstance(v, int):
        return v
    percent = Fraction(int(str(v).rstrip("%")), 100) * total
    return math.ceil(percent) if round_up else math.floor(percent)


# ---------------------------------------------------------------------------------------------------------------
# The server

CONTINUE_EXPIRED = (
    "The provided continue parameter is too old to display a consistent list result. You can start a new list "
    "without the continue parameter, or use the continue token in this response to retrieve the remainder of the "
    "results. Continuing with the provided token results in an inconsistent list - objects that were created, "
    "modified, or deleted between the time the first chunk was returned and now may show up in the list."
)
UNKNOWN_FORMAT = (
    "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, "
    "application/merge-patch+json, application/strategic-merge-patch+json"
)
EVICTION = ResourceType("policy", "v1", "pods/eviction", "Eviction", True)
LIST_OPTIONS = ResourceType("meta.k8s.io", "v1", "listoptions", "ListOptions", False)
NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery/pkg/util/rand: no vowels, no look-alikes


@dataclass
class Event:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    obj: JSON
    prev: JSON | None


@dataclass
class RequestRecord:
    """One request as the server saw it: ``verb`` is get, list, watch, create, update, patch, delete or
    deletecollection (or ``discovery``), ``resource`` the plural with its subresource (``resourceclaims/status``)."""

    method: str
    path: str
    query: dict[str, str]
    verb: str = ""
    resource: str = ""
    namespace: str | None = None
    name: str | None = None
    code: int = 0


@dataclass
class _Injection:
    verb: str
    resource: str
    code: int
    message: str | None
    reason: str | None
    retry_after: int
    times: int


@dataclass
class _Ctx:
    query: Any
    dry: bool = False
    warnings: list[str] = field(default_factory=list)


class _Watch:
    def __init__(self, t: ResourceType, flt: Filter, bookmarks: bool) -> None:
        self.t, self.filter, self.bookmarks = t, flt, bookmarks
        self.queue: asyncio.Queue[tuple[str, JSON] | None] = asyncio.Queue()

    def translate(self, ev: Event) -> tuple[str, JSON] | None:
        """An event as this watch sees it through its selectors: an object that stops matching is DELETED for it,
        one that starts matching ADDED (as the watch cache does)."""
        if ev.type == "DELETED":
            return ("DELETED", ev.obj) if self.filter.matches(ev.obj) else None
        now_ = self.filter.matches(ev.obj)
        before = ev.prev is not None and ev.type == "MODIFIED" and self.filter.matches(ev.prev)
        if now_:
            return ("MODIFIED" if before else "ADDED", ev.obj)
        if before:
            gone = copy.deepcopy(ev.prev)
            assert gone is not None
            gone["metadata"]["resourceVersion"] = str(ev.rv)
            return ("DELETED", gone)
        return None

    def offer(self, ev: Event) -> None:
        seen = self.translate(ev)
        if seen is not None:
            self.queue.put_nowait(seen)


class FakeApiServer:
    """kube-apiserver's behaviour for the objects gpud-k8s uses, on ``http://127.0.0.1:<port>``.

    ``version``: the Kubernetes version whose schemas validate every write (the newest kubernetes-validate has
    that is not newer; ``schema_version`` says which). ``kubelet``: a graceful pod deletion (a pod on a node, a
    grace period) sets deletionTimestamp and, on the next turn of the event loop, the fake kubelet removes the pod
    (False: it stays until ``remove``). ``history_limit``: watch events kept per resource; a watch from before the
    oldest kept is answered 410 Expired (``compact()`` drops them all). ``reject_unknown_fields``: an unknown field
    is 422 Invalid unless the request says fieldValidation=Ignore (Strict: 400, as the real server); False
    behaves as the real server by default (dropped, with a Warning header).

    Python-side (call from the server's event loop, or use ``ThreadedFakeApiServer``): ``put``, ``get``,
    ``objects``, ``remove``, ``compact``, ``send_bookmarks``, ``history``, ``count``/``counts``, ``requests``,
    ``hooks``, ``fail_next``, ``watches``, ``wait_for``.
    """

    def __init__(
        self,
        version: str = "1.37",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        kubelet: bool = True,
        history_limit: int = 1000,
        reject_unknown_fields: bool = True,
    ) -> None:
        self.schemas = Schemas.of(version)
        self.schema_version: str = self.schemas.version
        self.host, self.port = host, port
        self.kubelet = kubelet
        self.history_limit = history_limit
        self.reject_unknown_fields = reject_unknown_fields
        self.counts: Counter[tuple[str, str]] = Counter()
        self.requests: list[RequestRecord] = []
        self.hooks: list[Callable[[RequestRecord], None]] = []
        self._objects: dict[str, dict[str, JSON]] = {t.plural: {} for t in TYPES}
        self._history: dict[str, deque[Event]] = {t.plural: deque() for t in TYPES}
        self._floor: dict[str, int] = {t.plural: 0 for t in TYPES}
        self._watches: dict[str, set[_Watch]] = {t.plural: set() for t in TYPES}
        self._snapshots: dict[tuple[str, int], list[tuple[str, JSON]]] = {}
        self._injections: list[_Injection] = []
        self._waiters: list[asyncio.Future[None]] = []
        self._handles: dict[object, asyncio.Handle] = {}
        self._rv = 100
        self._runner: web.AppRunner | None = None

    # -- life ---------------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def resource_version(self) -> str:
        return str(self._rv)

    def configuration(self) -> Any:
        """A kubernetes_asyncio Configuration pointed at this server."""
        from kubernetes_asyncio.client import Configuration

        return Configuration(host=self.url)

    async def start(self) -> FakeApiServer:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, self.host, self.port).start()
        self._runner = runner
        self.port = runner.addresses[0][1]
        return self

    async def close(self) -> None:
        for handle in self._handles.values():
            handle.cancel()
        self._handles.clear()
        for watches in self._watches.values():
            for w in watches:
                w.queue.put_nowait(None)
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def __aenter__(self) -> FakeApiServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- the Python side --------------------------------------------------------------------------------------

    def put(self, obj: JSON, *, validate_write: bool = True) -> JSON:
        """Store ``obj`` as a controller, the scheduler or the kubelet would have written it (created or replaced,
        status included), validated as any write unless ``validate_write=False``. uid, creationTimestamp and
        resourceVersion are the server's; a namespaced object without a namespace goes to ``default``."""
        obj = strip_nulls(copy.deepcopy(obj))
        t = BY_KIND.get(obj.get("kind", ""))
        if t is None or obj.get("apiVersion") != t.api_version:
            raise ValueError(f"the fake API server does not serve {obj.get('apiVersion')} {obj.get('kind')}")
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ValueError("put: metadata.name (or generateName) is required")
            meta["name"] = meta["generateName"] + "".join(random.choice(NAME_CHARS) for _ in range(5))
        if t.namespaced:
            meta.setdefault("namespace", "default")
        else:
            meta.pop("namespace", None)
        key = self._key(t, meta.get("namespace"), meta["name"])
        old = self._objects[t.plural].get(key)
        omega = (old or {}).get("metadata") or {}
        meta["uid"] = meta.get("uid") or omega.get("uid") or str(uuid.uuid4())
        meta.setdefault("creationTimestamp", omega.get("creationTimestamp") or now())
        meta.pop("resourceVersion", None)
        if validate_write:
            schema, _ = schema_errors(self.schemas, obj)
            if schema:
                raise schema.error(t, meta["name"])
        apply_defaults(t, obj)
        e = FieldErrors()
        obj = canonicalize(self.schemas, obj, e)
        meta = obj["metadata"]
        if t.generation:
            if old is None:
                meta.setdefault("generation", 1)
            else:
                meta["generation"] = omega.get("generation", 1) + (obj.get("spec") != old.get("spec"))
        if validate_write:
            if e:
                raise e.error(t, meta["name"])
            v = validate(t, obj, None)
            if v:
                raise v.error(t, meta["name"])
        if old is not None and {**obj, "metadata": {**meta, "resourceVersion": omega["resourceVersion"]}} == old:
            return copy.deepcopy(old)  # nothing changed: no new resourceVersion, no event
        return copy.deepcopy(self._commit(t, "MODIFIED" if old else "ADDED", obj, old))

    def get(self, resource: str, namespace: str | None, name: str) -> JSON | None:
        """A copy of the stored object, or None. ``resource``: plural or Kind."""
        t = resource_type(resource)
        obj = self._objects[t.plural].get(self._key(t, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def objects(self, resource: str, namespace: str | None = None) -> list[JSON]:
        """Copies of every stored object of a resource (in one namespace if given), in key order."""
        t = resource_type(resource)
        return [
            copy.deepcopy(o)
            for _, o in sorted(self._objects[t.plural].items())
            if namespace is None or o["metadata"].get("namespace") == namespace
        ]

    def remove(self, resource: str, namespace: str | None, name: str) -> JSON | None:
        """Remove an object at once (finalizers and grace periods disregarded): a DELETED event."""
        t = resource_type(resource)
        obj = self._objects[t.plural].get(self._key(t, namespace, name))
        if obj is None:
            return None
        return copy.deepcopy(self._commit(t, "DELETED", copy.deepcopy(obj), obj))

    def compact(self) -> None:
        """Forget every watch event so far, as an etcd compaction: a watch from an older resourceVersion, or a list
        continued from one, is answered 410 Expired."""
        for t in TYPES:
            self._history[t.plural].clear()
            self._floor[t.plural] = self._rv
        self._snapshots.clear()

    def send_bookmarks(self) -> None:
        """A BOOKMARK (the current resourceVersion) to every open watch that allowed bookmarks."""
        for t in TYPES:
            for w in self._watches[t.plural]:
                if w.bookmarks:
                    w.queue.put_nowait(("BOOKMARK", self._bookmark(t)))

    def history(self, resource: str) -> list[tuple[str, JSON]]:
        """The kept watch events of a resource, oldest first: (type, object)."""
        return [(ev.type, copy.deepcopy(ev.obj)) for ev in self._history[resource_type(resource).plural]]

    def count(self, verb: str = "*", resource: str = "*") -> int:
        """Requests so far with that verb (get, list, watch, create, update, patch, delete, deletecollection) on that
        resource (``resourceslices``, ``resourceclaims/status``, ``pods/eviction``); ``*`` for any."""
        return sum(n for (v, r), n in self.counts.items() if verb in ("*", v) and resource in ("*", r))

    def fail_next(
        self, verb: str, resource: str, code: int = 500, *, times: int = 1, message: str | None = None,
        reason: str | None = None, retry_after: int = 0,
    ) -> None:  # fmt: skip
        """Answer the next ``times`` requests with that verb on that resource (``*`` for any) with a Status error
        of HTTP ``code`` (its usual reason unless ``reason`` is given: 409 Conflict, 410 Expired, 429
        TooManyRequests with ``retry_after`` as Retry-After, 500 InternalError...), before they touch anything."""
        self._injections.append(_Injection(verb, resource, code, message, reason, retry_after, times))

    def watches(self, resource: str = "*") -> int:
        """Open watches on a resource (plural or Kind; ``*`` for all)."""
        if resource == "*":
            return sum(len(w) for w in self._watches.values())
        return len(self._watches[resource_type(resource).plural])

    async def wait_for(self, predicate: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Wait until ``predicate()`` is true, re-evaluated after every write and every request; its value, or
        TimeoutError after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not (result := predicate()):
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"the fake API server did not see the condition within {timeout}s")
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, remaining)
            except TimeoutError:
                pass
        return result

    # -- storage ------------------------------------------------------------------------------------------------

    @staticmethod
    def _key(t: ResourceType, namespace: str | None, name: str) -> str:
        return f"{namespace or ''}/{name}" if t.namespaced else name

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def _commit(self, t: ResourceType, kind: str, obj: JSON, prev: JSON | None, *, sync: bool = True) -> JSON:
        """The one place the store changes: a new resourceVersion, a watch event, the disruption controller."""
        self._rv += 1
        meta = obj["metadata"]
        meta["resourceVersion"] = str(self._rv)
        key = self._key(t, meta.get("namespace"), meta["name"])
        if kind == "DELETED":
            self._objects[t.plural].pop(key, None)
        else:
            self._objects[t.plural][key] = obj
        ev = Event(self._rv, kind, copy.deepcopy(obj), copy.deepcopy(prev) if prev is not None else None)
        history = self._history[t.plural]
        history.append(ev)
        while len(history) > self.history_limit:
            self._floor[t.plural] = history.popleft().rv
        for w in list(self._watches[t.plural]):
            w.offer(ev)
        if sync and t.plural in ("pods", "poddisruptionbudgets"):
            self._sync_budgets(meta.get("namespace"))
        self._notify()
        return obj

    def _bookmark(self, t: ResourceType, initial_end: bool = False) -> JSON:
        meta: JSON = {"resourceVersion": str(self._rv), "creationTimestamp": None}
        if initial_end:
            meta["annotations"] = {"k8s.io/initial-events-end": "true"}
        return {"kind": t.kind, "apiVersion": t.api_version, "metadata": meta}

    # -- the disruption controller --------------------------------------------------------------------------

    def _budget_pods(self, pdb: JSON) -> list[JSON]:
        selector = label_selector_object((pdb.get("spec") or {}).get("selector"))
        if selector is None:
            return []
        ns = pdb["metadata"].get("namespace")
        return [
            p
            for p in self._objects["pods"].values()
            if p["metadata"].get("namespace") == ns
            and all(r.matches(p["metadata"].get("labels") or {}) for r in selector)
        ]

    def _budget_status(self, pdb: JSON) -> JSON:
        spec, old = pdb.get("spec") or {}, pdb.get("status") or {}
        pods = self._budget_pods(pdb)
        live = {p["metadata"]["name"]: p for p in pods if not p["metadata"].get("deletionTimestamp")}
        disrupted = {k: v for k, v in (old.get("disruptedPods") or {}).items() if k in live}
        expected = len(pods)
        if "maxUnavailable" in spec:
            desired = max(0, expected - _scaled(spec["maxUnavailable"], expected, True))
        elif "minAvailable" in spec:
            desired = _scaled(spec["minAvailable"], expected, True)
        else:
            desired = 0
        healthy = sum(1 for name, p in live.items() if pod_ready(p) and name not in disrupted)
        allowed = healthy - desired
        if expected <= 0 or allowed < 0:
            allowed = 0
        generation = pdb["metadata"].get("generation", 1)
        ok = "True" if allowed > 0 else "False"
        before = next((c for c in old.get("conditions") or [] if c.get("type") == "DisruptionAllowed"), None)
        status: JSON = {}
        if disrupted:
            status["disruptedPods"] = disrupted
        status.update(
            observedGeneration=generation,
            disruptionsAllowed=allowed,
            currentHealthy=healthy,
            desiredHealthy=desired,
            expectedPods=expected,
            conditions=[{
                "type": "DisruptionAllowed",
                "status": ok,
                "observedGeneration": generation,
                "lastTransitionTime": before["lastTransitionTime"] if before and before.get("status") == ok else now(),
                "reason": "SufficientPods" if allowed > 0 else "InsufficientPods",
                "message": "",
            }],
        )  # fmt: skip
        return status

    def _sync_budgets(self, namespace: str | None) -> None:
        t = BY_PLURAL["poddisruptionbudgets"]
        for pdb in list(self._objects[t.plural].values()):
            if pdb["metadata"].get("namespace") != namespace:
                continue
            status = self._budget_status(pdb)
            if status != pdb.get("status"):
                new = copy.deepcopy(pdb)
                new["status"] = status
                self._commit(t, "MODIFIED", new, pdb, sync=False)

    # -- HTTP ---------------------------------------------------------------------------------------------------

    @staticmethod
    def _respond(
        body: JSON, code: int = 200, headers: dict[str, str] | None = None, warnings: Iterable[str] = ()
    ) -> web.Response:
        resp = web.Response(
            text=json.dumps(body, separators=(",", ":")), status=code, content_type="application/json",
            headers=headers or {},
        )  # fmt: skip
        for w in warnings:
            resp.headers.add("Warning", f"299 - {json.dumps(w)}")
        return resp

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        record = RequestRecord(request.method, request.path, dict(request.query))
        self.requests.append(record)
        try:
            resp = await self._dispatch(request, record)
        except ApiError as err:
            resp = self._respond(err.status, err.code, err.headers)
        record.code = resp.status
        self._notify()
        return resp

    def _discovery(self, parts: list[str]) -> web.StreamResponse | None:
        if parts and parts[0] in ("healthz", "readyz", "livez") and len(parts) == 1:
            return web.Response(text="ok")
        if parts == ["version"]:
            major, minor = _version_key(self.schema_version)[:2]
            return self._respond({"major": str(major), "minor": str(minor), "gitVersion": f"v{self.schema_version}",
                                  "platform": "linux/amd64"})  # fmt: skip
        if parts == ["api"]:
            address = [{"clientCIDR": "0.0.0.0/0", "serverAddress": f"{self.host}:{self.port}"}]
            return self._respond({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": address})
        groups = sorted({t.group for t in TYPES if t.group})

        def group(g: str) -> JSON:
            gv = {"groupVersion": f"{g}/v1", "version": "v1"}
            return {"name": g, "versions": [gv], "preferredVersion": gv}

        if parts == ["apis"]:
            return self._respond({"kind": "APIGroupList", "apiVersion": "v1", "groups": [group(g) for g in groups]})
        if len(parts) == 2 and parts[0] == "apis" and parts[1] in groups:
            return self._respond({"kind": "APIGroup", "apiVersion": "v1", **group(parts[1])})
        gv = (
            ("", parts[1])
            if parts[:1] == ["api"] and len(parts) == 2
            else (tuple(parts[1:3]) if len(parts) == 3 and parts[0] == "apis" else None)
        )
        if gv is None or not any((t.group, t.version) == gv for t in TYPES):
            return None
        verbs = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
        resources: list[JSON] = []
        for t in TYPES:
            if (t.group, t.version) != gv:
                continue
            resources.append({"name": t.plural, "singularName": t.kind.lower(), "namespaced": t.namespaced,
                              "kind": t.kind, "verbs": verbs})  # fmt: skip
            for sub in t.subresources:
                if sub == "eviction":
                    resources.append({"name": f"{t.plural}/eviction", "singularName": "", "namespaced": True,
                                      "group": "policy", "version": "v1", "kind": "Eviction", "verbs": ["create"]})  # fmt: skip
                else:
                    resources.append({"name": f"{t.plural}/{sub}", "singularName": "", "namespaced": t.namespaced,
                                      "kind": t.kind, "verbs": ["get", "patch", "update"]})  # fmt: skip
        group_version = f"{gv[0]}/{gv[1]}" if gv[0] else gv[1]
        return self._respond({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version,
                              "resources": resources})  # fmt: skip

    async def _dispatch(self, request: web.Request, record: RequestRecord) -> web.StreamResponse:
        parts = [p for p in request.path.split("/") if p]
        found = self._discovery(parts)
        if found is not None:
            record.verb = "discovery"
            return found
        if len(parts) >= 2 and parts[0] == "api":
            group, version, rest = "", parts[1], parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise no_such_resource()
        ns = None
        if rest[:1] == ["namespaces"]:
            if len(rest) < 3:
                raise no_such_resource()  # namespaces themselves are not served
            ns, rest = rest[1], rest[2:]
        t = next((x for x in TYPES if (x.group, x.version, x.plural) == (group, version, rest[0])), None)
        if t is None or len(rest) > 3 or (ns is not None and not t.namespaced):
            raise no_such_resource()
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else ""
        if (sub and sub not in t.subresources) or (t.namespaced and name is not None and ns is None):
            raise no_such_resource()
        m, q = request.method, request.query
        if name is None:
            verb = {"GET": "list", "POST": "create", "DELETE": "deletecollection"}.get(m)
            if verb == "list" and parse_bool(q.get("watch"), "watch"):
                verb = "watch"
            if verb in ("create", "deletecollection") and t.namespaced and ns is None:
                verb = None
        elif sub == "eviction":
            verb = "create" if m == "POST" else None
        else:
            verb = {"GET": "get", "PUT": "update", "PATCH": "patch", "DELETE": None if sub else "delete"}.get(m)
        if verb is None:
            raise method_not_allowed(m)
        resource = f"{t.plural}/{sub}" if sub else t.plural
        record.verb, record.resource, record.namespace, record.name = verb, resource, ns, name
        self.counts[(verb, resource)] += 1
        for hook in list(self.hooks):
            hook(record)
        for inj in self._injections:
            if inj.verb in ("*", verb) and inj.resource in ("*", resource):
                inj.times -= 1
                if inj.times <= 0:
                    self._injections.remove(inj)
                err = injected(inj.code, inj.message, inj.retry_after)
                if inj.reason is not None:
                    err.status["reason"] = inj.reason
                raise err
        dry_run = q.getall("dryRun", [])
        if any(d != "All" for d in dry_run):
            raise bad_request(f"Invalid dry run value: {dry_run}")  # fmt: skip
        ctx = _Ctx(q, dry=bool(dry_run))
        flt = Filter(namespace=ns)
        if verb in ("list", "watch", "deletecollection"):
            flt.labels = parse_label_selector(q.get("labelSelector"))
            flt.fields = parse_field_selector(q.get("fieldSelector"), t)
        if verb == "watch":
            return await self._watch(request, t, flt)
        if verb == "list":
            if "sendInitialEvents" in q:
                e = FieldErrors()
                e.forbidden("sendInitialEvents", "sendInitialEvents is forbidden for list")
                raise e.error(LIST_OPTIONS, "")
            return self._respond(self._list(t, flt, q))
        if verb == "get":
            obj = self._objects[t.plural].get(self._key(t, ns, name or ""))
            if obj is None:
                raise not_found(t, name or "")
            return self._respond(obj)
        body = await self._body(request)
        if verb == "create" and sub == "eviction":
            code, result = self._evict(ns or "", name or "", body, ctx)
            return self._respond(result, code)
        if verb == "create":
            return self._respond(self._create(t, ns, body, ctx), 201, warnings=ctx.warnings)
        if verb == "update":
            return self._respond(self._update(t, ns, name or "", body, sub, ctx), warnings=ctx.warnings)
        if verb == "patch":
            patched = self._patch(t, ns, name or "", request.content_type, body)
            return self._respond(self._update(t, ns, name or "", patched, sub, ctx), warnings=ctx.warnings)
        options = self._delete_options(body, q)
        if verb == "delete":
            obj, gone = self._delete(t, ns, name or "", options, ctx)
            if gone and not t.return_deleted:
                details = {**_details(t, obj["metadata"]["name"]), "uid": obj["metadata"]["uid"]}
                return self._respond({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                      "details": details})  # fmt: skip
            return self._respond(obj)
        deleted = []
        for _, obj in sorted(self._objects[t.plural].items()):
            if flt.matches(obj):
                deleted.append(
                    self._delete(t, obj["metadata"].get("namespace"), obj["metadata"]["name"], options, ctx)[0]
                )
        items = [{k: v for k, v in o.items() if k not in ("kind", "apiVersion")} for o in deleted]
        return self._respond({"kind": f"{t.kind}List", "apiVersion": t.api_version,
                              "metadata": {"resourceVersion": str(self._rv)}, "items": items})  # fmt: skip

    @staticmethod
    async def _body(request: web.Request) -> Any:
        raw = await request.read()
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError as err:
            raise bad_request(f"couldn't get version/kind; json parse error: {err}") from None

    # -- reads ------------------------------------------------------------------------------------------------

    def _list(self, t: ResourceType, flt: Filter, q: Any) -> JSON:
        try:
            limit = int(q.get("limit") or 0)
        except ValueError:
            raise bad_request(f'invalid limit "{q.get("limit")}"') from None
        token = q.get("continue")
        start = ""
        if token:
            try:
                state = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
                rv, start = int(state["rv"]), str(state["start"])
            except (ValueError, KeyError, TypeError, binascii.Error) as err:
                raise bad_request(f"continue key is not valid: {err}") from None
            snapshot = self._snapshots.get((t.plural, rv))
            if snapshot is None:
                raise expired(CONTINUE_EXPIRED)
            entries = snapshot
        else:
            rv, entries = self._rv, sorted(self._objects[t.plural].items())
        matched = [(k, o) for k, o in entries if k >= start and flt.matches(o)]
        meta: JSON = {"resourceVersion": str(rv)}
        if limit > 0 and len(matched) > limit:
            matched, rest = matched[:limit], matched[limit:]
            state = {"v": "meta.k8s.io/v1", "rv": rv, "start": matched[-1][0] + "\x00"}
            meta["continue"] = base64.urlsafe_b64encode(json.dumps(state).encode()).decode().rstrip("=")
            if not flt.selects:
                meta["remainingItemCount"] = len(rest)
            self._snapshots[(t.plural, rv)] = entries
            while len(self._snapshots) > 64:
                self._snapshots.pop(next(iter(self._snapshots)))
        items = [{k: v for k, v in o.items() if k not in ("kind", "apiVersion")} for _, o in matched]
        return {"kind": f"{t.kind}List", "apiVersion": t.api_version, "metadata": meta, "items": items}

    async def _watch(self, request: web.Request, t: ResourceType, flt: Filter) -> web.StreamResponse:
        q = request.query
        bookmarks = parse_bool(q.get("allowWatchBookmarks"), "allowWatchBookmarks")
        initial = parse_bool(q.get("sendInitialEvents"), "sendInitialEvents") if "sendInitialEvents" in q else None
        try:
            timeout = int(q["timeoutSeconds"]) if q.get("timeoutSeconds") else None
        except ValueError:
            raise bad_request(f'invalid timeoutSeconds "{q["timeoutSeconds"]}"') from None
        if initial is not None:
            e = FieldErrors()
            if q.get("resourceVersionMatch") != "NotOlderThan":
                e.forbidden(
                    "resourceVersionMatch", "sendInitialEvents requires setting resourceVersionMatch to NotOlderThan"
                )
            if not bookmarks:
                e.forbidden("allowWatchBookmarks", "sendInitialEvents requires setting allowWatchBookmarks to true")
            if e:
                raise e.error(LIST_OPTIONS, "")
        rv_raw = q.get("resourceVersion", "")
        w = _Watch(t, flt, bookmarks)
        first: list[tuple[str, JSON]] = []
        failure: ApiError | None = None
        current = [("ADDED", o) for _, o in sorted(self._objects[t.plural].items()) if flt.matches(o)]
        if initial:
            first = current + ([("BOOKMARK", self._bookmark(t, initial_end=True))] if bookmarks else [])
        elif rv_raw in ("", "0"):
            first = current if initial is None else []
        else:
            try:
                since = int(rv_raw)
            except ValueError:
                raise bad_request(f'invalid resource version "{rv_raw}"') from None
            if since < self._floor[t.plural]:
                failure = expired(f"too old resource version: {since} ({self._floor[t.plural]})")
            else:
                first = [seen for ev in self._history[t.plural] if ev.rv > since and (seen := w.translate(ev))]
        if failure is None:
            self._watches[t.plural].add(w)  # before any await: no event can fall between the replay and the watch
            self._notify()
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        try:
            await resp.prepare(request)
            if failure is not None:  # the watch cache's answer: 200, then one ERROR event
                await resp.write(_line({"type": "ERROR", "object": failure.status}))
                await resp.write_eof()
                return resp
            for kind, obj in first:
                await resp.write(_line({"type": kind, "object": obj}))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout if timeout else None
            while True:
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    if bookmarks:
                        await resp.write(_line({"type": "BOOKMARK", "object": self._bookmark(t)}))
                    break
                try:
                    item = await asyncio.wait_for(w.queue.get(), remaining)
                except TimeoutError:
                    continue
                if item is None:
                    break
                await resp.write(_line({"type": item[0], "object": item[1]}))
            await resp.write_eof()
        except ConnectionError:  # the client went away (aiohttp's ClientConnectionResetError is one)
            pass
        finally:
            self._watches[t.plural].discard(w)
            self._notify()
        return resp

    # -- writes -----------------------------------------------------------------------------------------------

    def _decode(self, t: ResourceType, body: Any, ctx: _Ctx) -> JSON:
        """The body as decoding and the schema see it: kind and apiVersion, unknown fields, types."""
        if not isinstance(body, dict):
            raise bad_request(f"the body of the request was not a JSON object: {_value(body)[:200]}")
        body = dict(strip_nulls(copy.deepcopy(body)))
        av, kind = body.get("apiVersion"), body.get("kind")
        if av is not None and av != t.api_version:
            raise bad_request(f"the API version in the data ({av}) does not match the expected API version "
                              f"({t.api_version})")  # fmt: skip
        if kind is not None and kind != t.kind:
            raise bad_request(f"the kind in the data ({kind}) does not match the expected kind ({t.kind})")
        obj: JSON = {
            "kind": t.kind,
            "apiVersion": t.api_version,
            **{k: v for k, v in body.items() if k not in ("kind", "apiVersion")},
        }
        mode = ctx.query.get("fieldValidation", "")
        if mode not in ("", "Ignore", "Warn", "Strict"):
            raise bad_request(f'fieldValidation: Invalid value: "{mode}": fieldValidation must be one of "Ignore", '
                              '"Warn", or "Strict"')  # fmt: skip
        e, unknown = schema_errors(self.schemas, obj, ignore_unknown=True)
        name = (obj.get("metadata") or {}).get("name", "")
        if unknown:
            if mode == "Strict":
                raise bad_request("strict decoding error: " + ", ".join(f'unknown field "{u}"' for u in unknown))
            if mode == "Ignore" or not self.reject_unknown_fields:  # Warn, or unset: the real server's default
                drop_fields(obj, self.schemas, unknown)
                if mode != "Ignore":
                    ctx.warnings.extend(f'unknown field "{u}"' for u in unknown)
            else:
                for u in unknown:
                    e.invalid(u, re.split(r"[.\[\]]", u.rstrip("]"))[-1], "field not declared in schema")
        if e:
            raise e.error(t, name)
        return obj

    def _finish(self, t: ResourceType, obj: JSON, old: JSON | None, sub: str = "") -> JSON:
        """Defaults, canonical quantities, validation."""
        apply_defaults(t, obj)
        e = FieldErrors()
        obj = canonicalize(self.schemas, obj, e)
        name = obj["metadata"].get("name", "")
        if e:
            raise e.error(t, name)
        errors = validate(t, obj, old, sub)
        if errors:
            raise errors.error(t, name)
        return obj

    def _create(self, t: ResourceType, ns: str | None, body: Any, ctx: _Ctx) -> JSON:
        obj = self._decode(t, body, ctx)
        meta = obj.setdefault("metadata", {})
        if t.namespaced:
            if meta.get("namespace") and meta["namespace"] != ns:
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
        if meta.get("resourceVersion"):
            raise internal_error("resourceVersion should not be set on objects to be created")
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(random.choice(NAME_CHARS) for _ in range(5))
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now()
        for key in ("deletionTimestamp", "deletionGracePeriodSeconds", "generation"):
            meta.pop(key, None)
        if t.generation:
            meta["generation"] = 1
        if t.kind == "ResourceClaim":
            obj["status"] = {}
        elif t.kind == "PodDisruptionBudget":
            obj.pop("status", None)
        obj = self._finish(t, obj, None)
        if t.kind == "Pod":
            obj["status"] = {"phase": "Pending", "qosClass": qos_class(obj)}
        if self._key(t, ns, meta["name"]) in self._objects[t.plural]:
            raise already_exists(t, meta["name"])
        if ctx.dry:
            return obj
        return self._commit(t, "ADDED", obj, None)

    def _update(self, t: ResourceType, ns: str | None, name: str, body: Any, sub: str, ctx: _Ctx) -> JSON:
        old = self._objects[t.plural].get(self._key(t, ns, name))
        if old is None:
            raise not_found(t, name)
        new = self._decode(t, body, ctx)
        meta = new.setdefault("metadata", {})
        if meta.get("name", name) != name:
            raise bad_request(f"the name of the object ({meta['name']}) does not match the name on the URL ({name})")
        if t.namespaced and meta.get("namespace", ns) != ns:
            raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
        omega = old["metadata"]
        if meta.get("resourceVersion") and meta["resourceVersion"] != omega["resourceVersion"]:
            raise conflict(t, name)
        if sub == "status":
            result = copy.deepcopy(old)
            if "status" in new:
                result["status"] = new["status"]
            else:
                result.pop("status", None)
            if meta.get("uid"):
                result["metadata"]["uid"] = meta["uid"]
        else:
            result = new
            rmeta = result["metadata"]
            rmeta["name"] = name
            if t.namespaced:
                rmeta["namespace"] = ns
            else:
                rmeta.pop("namespace", None)
            if "status" in t.subresources:
                if "status" in old:
                    result["status"] = copy.deepcopy(old["status"])
                else:
                    result.pop("status", None)
            rmeta["uid"] = rmeta.get("uid") or omega["uid"]
            for key in ("creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation"):
                if key in omega:
                    rmeta[key] = omega[key]
                else:
                    rmeta.pop(key, None)
        result["metadata"]["resourceVersion"] = omega["resourceVersion"]
        result = self._finish(t, result, old, sub)
        if t.generation and result.get("spec") != old.get("spec"):
            result["metadata"]["generation"] = omega.get("generation", 1) + 1
        if result == old:
            return old  # nothing changed: no new resourceVersion, no event
        if ctx.dry:
            return result
        rmeta = result["metadata"]
        if (
            rmeta.get("deletionTimestamp")
            and not rmeta.get("finalizers")
            and omega.get("finalizers")
            and not rmeta.get("deletionGracePeriodSeconds")
        ):
            return self._commit(t, "DELETED", result, old)  # the last finalizer gone: the object goes
        return self._commit(t, "MODIFIED", result, old)

    def _patch(self, t: ResourceType, ns: str | None, name: str, content_type: str, patch: Any) -> JSON:
        old = self._objects[t.plural].get(self._key(t, ns, name))
        if old is None:
            raise not_found(t, name)
        base = copy.deepcopy(old)
        try:
            if content_type == "application/json-patch+json":
                return json_patch(base, patch)  # type: ignore[no-any-return]
            if content_type in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
                if not isinstance(patch, dict):
                    raise ValueError(
                        f"json: cannot unmarshal {type(patch).__name__} into Go value of type map[string]interface {{}}"
                    )
                if content_type == "application/merge-patch+json":
                    return merge_patch(base, patch)  # type: ignore[no-any-return]
                return strategic_merge(self.schemas, base, patch, self.schemas.root(t.api_version, t.kind))  # type: ignore[no-any-return]
        except ValueError as err:
            raise bad_request(str(err)) from None
        except PatchError as err:
            raise ApiError(status_object(422, "Invalid", str(err))) from None
        if content_type.startswith("application/apply-patch"):
            raise ApiError(status_object(415, "UnsupportedMediaType", "the fake API server does not implement "
                                         f"server-side apply ({content_type}); " + UNKNOWN_FORMAT))  # fmt: skip
        raise ApiError(status_object(415, "UnsupportedMediaType", UNKNOWN_FORMAT))

    @staticmethod
    def _delete_options(body: Any, q: Any) -> JSON:
        if isinstance(body, dict) and body:
            return strip_nulls(body)  # type: ignore[no-any-return]
        options: JSON = {}
        if q.get("gracePeriodSeconds"):
            try:
                options["gracePeriodSeconds"] = int(q["gracePeriodSeconds"])
            except ValueError:
                raise bad_request(f'invalid gracePeriodSeconds "{q["gracePeriodSeconds"]}"') from None
        if q.get("propagationPolicy"):
            options["propagationPolicy"] = q["propagationPolicy"]
        return options

    def _delete(self, t: ResourceType, ns: str | None, name: str, options: JSON, ctx: _Ctx) -> tuple[JSON, bool]:
        """The object as the answer has it, and whether it is gone (else it waits for finalizers or a kubelet)."""
        old = self._objects[t.plural].get(self._key(t, ns, name))
        if old is None:
            raise not_found(t, name)
        omega = old["metadata"]
        pre = options.get("preconditions") or {}
        if pre.get("uid") and pre["uid"] != omega["uid"]:
            raise conflict(t, name, f"Precondition failed: UID in precondition: {pre['uid']}, UID in object meta: "
                           f"{omega['uid']}")  # fmt: skip
        if pre.get("resourceVersion") and pre["resourceVersion"] != omega["resourceVersion"]:
            raise conflict(t, name, f"Precondition failed: ResourceVersion in precondition: {pre['resourceVersion']}, "
                           f"ResourceVersion in object meta: {omega['resourceVersion']}")  # fmt: skip
        policy = options.get("propagationPolicy")
        if policy is not None and policy not in ("Orphan", "Background", "Foreground"):
            e = FieldErrors()
            e.not_supported("propagationPolicy", policy, ["Foreground", "Background", "Orphan"])
            raise e.error(ResourceType("", "v1", "deleteoptions", "DeleteOptions", False), "")
        grace = 0
        if t.kind == "Pod":
            spec, phase = old.get("spec") or {}, (old.get("status") or {}).get("phase")
            grace = options.get("gracePeriodSeconds", spec.get("terminationGracePeriodSeconds", 30))
            if grace < 0:
                grace = 1
            if not spec.get("nodeName") or phase in ("Succeeded", "Failed"):
                grace = 0
        obj = copy.deepcopy(old)
        meta = obj["metadata"]
        if omega.get("deletionTimestamp"):
            pending = omega.get("deletionGracePeriodSeconds") or 0
            if t.kind != "Pod" or grace >= pending:
                return old, False  # already being deleted
            meta["deletionGracePeriodSeconds"] = grace
            meta["deletionTimestamp"] = later(grace) if grace else now()
            if grace == 0 and not meta.get("finalizers"):
                return (obj, True) if ctx.dry else (self._commit(t, "DELETED", obj, old), True)
            return (obj, False) if ctx.dry else (self._commit(t, "MODIFIED", obj, old), False)
        if grace > 0 or meta.get("finalizers"):
            meta["deletionTimestamp"] = later(grace) if grace else now()
            meta["deletionGracePeriodSeconds"] = grace
            if ctx.dry:
                return obj, False
            done = self._commit(t, "MODIFIED", obj, old)
            if t.kind == "Pod" and grace > 0 and self.kubelet:
                token = object()
                loop = asyncio.get_running_loop()
                self._handles[token] = loop.call_soon(self._kubelet_removes, token, done["metadata"]["uid"], ns, name)
            return done, False
        return (obj, True) if ctx.dry else (self._commit(t, "DELETED", obj, old), True)

    def _kubelet_removes(self, token: object, uid: str, ns: str | None, name: str) -> None:
        """The kubelet's last word on a pod it has stopped: delete with grace 0 (the pod stays for finalizers)."""
        self._handles.pop(token, None)
        t = BY_PLURAL["pods"]
        pod = self._objects["pods"].get(self._key(t, ns, name))
        if pod is None or pod["metadata"]["uid"] != uid or not pod["metadata"].get("deletionTimestamp"):
            return
        gone = copy.deepcopy(pod)
        gone["metadata"]["deletionGracePeriodSeconds"] = 0
        self._commit(t, "MODIFIED" if gone["metadata"].get("finalizers") else "DELETED", gone, pod)

    def _evict(self, ns: str, name: str, body: Any, ctx: _Ctx) -> tuple[int, JSON]:
        """pkg/registry/core/pod/storage/eviction.go: a pod that can ignore its budget (Pending, Succeeded,
        Failed, being deleted) is deleted; else the one budget that selects it must allow a disruption."""
        if not isinstance(body, dict):
            raise bad_request("not a Eviction object")
        body = strip_nulls(copy.deepcopy(body))
        av, kind = body.get("apiVersion", "policy/v1"), body.get("kind", "Eviction")
        if kind != "Eviction" or av not in ("policy/v1", "policy/v1beta1"):
            raise bad_request(f"not a Eviction object: {av} {kind}")
        checked = {**body, "apiVersion": "policy/v1", "kind": "Eviction"}
        e, _ = schema_errors(self.schemas, checked)
        if e:
            raise e.error(EVICTION, (body.get("metadata") or {}).get("name", ""))
        meta = body.get("metadata") or {}
        if meta.get("name") != name:
            raise bad_request("name in URL does not match name in Eviction object")
        if meta.get("namespace") and meta["namespace"] != ns:
            raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
        pods = BY_PLURAL["pods"]
        pod = self._objects["pods"].get(self._key(pods, ns, name))
        if pod is None:
            raise not_found(pods, name)
        options = dict(body.get("deleteOptions") or {})
        success: JSON = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed", "Pending") or pod["metadata"].get("deletionTimestamp"):
            self._delete(pods, ns, name, options, ctx)
            return 201, success
        budgets = [
            b
            for b in self._objects["poddisruptionbudgets"].values()
            if b["metadata"].get("namespace") == ns and pod in self._budget_pods(b)
        ]
        if len(budgets) > 1:
            return 500, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "code": 500,
                         "message": "This pod has more than one PodDisruptionBudget, which the eviction subresource "
                         "does not support."}  # fmt: skip
        if budgets:
            pdb = budgets[0]
            st = pdb.get("status") or self._budget_status(pdb)
            ready = pod_ready(pod)
            if ready or not (st["currentHealthy"] >= st["desiredHealthy"] and st["desiredHealthy"] > 0):
                if st.get("observedGeneration", 0) < pdb["metadata"].get("generation", 1):
                    cause = f"The disruption budget {pdb['metadata']['name']} is still being processed by the server."
                    raise too_many_requests("Cannot evict pod as it would violate the pod's disruption budget.", 10,
                                            [{"reason": "DisruptionBudget", "message": cause}])  # fmt: skip
                if st["disruptionsAllowed"] <= 0:
                    cause = (f"The disruption budget {pdb['metadata']['name']} needs {st['desiredHealthy']} healthy "
                             f"pods and has {st['currentHealthy']} currently")  # fmt: skip
                    raise too_many_requests("Cannot evict pod as it would violate the pod's disruption budget.", 0,
                                            [{"reason": "DisruptionBudget", "message": cause}])  # fmt: skip
                if not ctx.dry:
                    new = copy.deepcopy(pdb)
                    new["status"] = copy.deepcopy(st)
                    new["status"]["disruptionsAllowed"] -= 1
                    new["status"].setdefault("disruptedPods", {})[name] = now()
                    self._commit(BY_PLURAL["poddisruptionbudgets"], "MODIFIED", new, pdb, sync=False)
            elif "preconditions" not in options:
                options["preconditions"] = {"resourceVersion": pod["metadata"]["resourceVersion"]}
        self._delete(pods, ns, name, options, ctx)
        return 201, success


def _line(event: JSON) -> bytes:
    return (json.dumps(event, separators=(",", ":")) + "\n").encode()


# ---------------------------------------------------------------------------------------------------------------
# The fake in a thread of its own


class ThreadedFakeApiServer:
    """A FakeApiServer on an event loop in a thread of its own, for tests whose own loops come and go (one
    ``asyncio.run`` per test, trio): the same Python-side API, each call run on the server's loop (a predicate
    given to ``wait_for`` runs there too, and may call this object's methods)."""

    def __init__(self, version: str = "1.37", **options: Any) -> None:
        self._version, self._options = version, options
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.server: FakeApiServer | None = None

    def start(self) -> ThreadedFakeApiServer:
        started: concurrent.futures.Future[None] = concurrent.futures.Future()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self.server = FakeApiServer(self._version, **self._options)
                loop.run_until_complete(self.server.start())
            except BaseException as err:  # noqa: BLE001 - handed to the starting thread
                started.set_exception(err)
                loop.close()
                return
            started.set_result(None)
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=run, name="fake-apiserver", daemon=True)
        self._thread.start()
        started.result(timeout=60)
        return self

    def close(self) -> None:
        if self._thread is None or self._loop is None or self.server is None:
            return
        asyncio.run_coroutine_threadsafe(self.server.close(), self._loop).result(timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=60)
        self._thread = None

    def __enter__(self) -> ThreadedFakeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the server's loop, its result here."""
        assert self._loop is not None
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)

        async def run() -> Any:
            return fn(*args, **kwargs)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=60)

    @property
    def _s(self) -> FakeApiServer:
        assert self.server is not None, "not started"
        return self.server

    @property
    def url(self) -> str:
        return self._s.url

    @property
    def host(self) -> str:
        return self._s.host

    @property
    def port(self) -> int:
        return self._s.port

    @property
    def schema_version(self) -> str:
        return self._s.schema_version

    @property
    def resource_version(self) -> str:
        return self.call(lambda: self._s.resource_version)  # type: ignore[no-any-return]

    @property
    def counts(self) -> Counter[tuple[str, str]]:
        return self.call(lambda: Counter(self._s.counts))  # type: ignore[no-any-return]

    @property
    def requests(self) -> list[RequestRecord]:
        return self.call(lambda: list(self._s.requests))  # type: ignore[no-any-return]

    def configuration(self) -> Any:
        return self._s.configuration()

    def put(self, obj: JSON, *, validate_write: bool = True) -> JSON:
        return self.call(self._s.put, obj, validate_write=validate_write)  # type: ignore[no-any-return]

    def get(self, resource: str, namespace: str | None, name: str) -> JSON | None:
        return self.call(self._s.get, resource, namespace, name)  # type: ignore[no-any-return]

    def objects(self, resource: str, namespace: str | None = None) -> list[JSON]:
        return self.call(self._s.objects, resource, namespace)  # type: ignore[no-any-return]

    def remove(self, resource: str, namespace: str | None, name: str) -> JSON | None:
        return self.call(self._s.remove, resource, namespace, name)  # type: ignore[no-any-return]

    def compact(self) -> None:
        self.call(self._s.compact)

    def send_bookmarks(self) -> None:
        self.call(self._s.send_bookmarks)

    def history(self, resource: str) -> list[tuple[str, JSON]]:
        return self.call(self._s.history, resource)  # type: ignore[no-any-return]

    def count(self, verb: str = "*", resource: str = "*") -> int:
        return self.call(self._s.count, verb, resource)  # type: ignore[no-any-return]

    def fail_next(self, verb: str, resource: str, code: int = 500, **options: Any) -> None:
        self.call(self._s.fail_next, verb, resource, code, **options)

    def watches(self, resource: str = "*") -> int:
        return self.call(self._s.watches, resource)  # type: ignore[no-any-return]

    def add_hook(self, hook: Callable[[RequestRecord], None]) -> None:
        """``hook(record)`` on every request, on the server's thread, before it is answered."""
        self.call(self._s.hooks.append, hook)

    async def wait_for(self, predicate: Callable[[], Any], timeout: float = 30.0) -> Any:
        """From an asyncio loop: as FakeApiServer.wait_for (the predicate runs on the server's thread)."""
        assert self._loop is not None
        done = asyncio.run_coroutine_threadsafe(self._s.wait_for(predicate, timeout), self._loop)
        return await asyncio.wrap_future(done)

    def wait_for_blocking(self, predicate: Callable[[], Any], timeout: float = 30.0) -> Any:
        """From a thread (``trio.to_thread.run_sync``): blocks until the predicate holds or TimeoutError."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(self._s.wait_for(predicate, timeout), self._loop).result(timeout + 30)
