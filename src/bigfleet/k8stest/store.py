"""The object store behind the test API server: resources, resource versions, watch history.

It reproduces the parts of the Kubernetes API semantics BigFleet's clients
depend on, so that the *real* client code can be tested without a cluster:
one global, monotonically increasing resourceVersion; optimistic concurrency
on update (409 on a stale version); the status subresource (writes to the main
resource cannot touch ``.status`` and vice versa); ``generation`` bumps on spec
changes; a bounded watch history whose compaction makes old versions answer
410 Gone; ownerReference garbage collection; and PodDisruptionBudget checks
for the Eviction subresource.

The store is thread-safe (one lock) so tests may read and write it directly
while the HTTP server runs on another thread's event loop.
"""

from __future__ import annotations

import builtins
import copy
import datetime as _dt
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]


class ApiError(Exception):
    """A Kubernetes ``Status`` failure: HTTP code, reason and message."""

    def __init__(self, code: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = dict(details or {})

    def status(self) -> Obj:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "details": self.details,
            "code": self.code,
        }


@dataclass(frozen=True)
class ResourceType:
    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    namespaced: bool
    status_subresource: bool = False

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.group, self.version, self.plural)


BIGFLEET_GROUP = "bigfleet.lucy.sh"

DEFAULT_RESOURCES: tuple[ResourceType, ...] = (
    ResourceType("", "v1", "pods", "Pod", True, True),
    ResourceType("", "v1", "nodes", "Node", False, True),
    ResourceType("", "v1", "namespaces", "Namespace", False, True),
    ResourceType("", "v1", "configmaps", "ConfigMap", True),
    ResourceType("", "v1", "secrets", "Secret", True),
    ResourceType("", "v1", "events", "Event", True),
    ResourceType("coordination.k8s.io", "v1", "leases", "Lease", True),
    ResourceType("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True, True),
    ResourceType("scheduling.k8s.io", "v1", "priorityclasses", "PriorityClass", False),
    ResourceType("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False, True),
    ResourceType(BIGFLEET_GROUP, "v1alpha1", "capacityrequests", "CapacityRequest", True, True),
    ResourceType(BIGFLEET_GROUP, "v1alpha1", "availablecapacities", "AvailableCapacity", False, True),
    ResourceType(BIGFLEET_GROUP, "v1alpha1", "upcomingnodes", "UpcomingNode", False, True),
)


@dataclass
class WatchEvent:
    rv: int
    rtype: ResourceType
    type: str  # ADDED / MODIFIED / DELETED
    obj: Obj


@dataclass
class Watcher:
    rtype: ResourceType
    namespace: str | None
    predicate: Callable[[Obj], bool]
    push: Callable[[WatchEvent | None], None]  # None = the server closes this watch
    closed: bool = False


def now_rfc3339() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            result.pop(k, None)
        else:
            result[k] = merge_patch(result.get(k), v)
    return result


def json_patch(target: Obj, ops: list[Any]) -> Obj:
    """RFC 6902 JSON patch (add / replace / remove / test) on objects and lists."""
    doc = copy.deepcopy(target)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise ApiError(400, "BadRequest", "malformed JSON patch operation")
        parts = [p.replace("~1", "/").replace("~0", "~") for p in str(op["path"]).split("/")[1:]]
        if not parts:
            raise ApiError(422, "Invalid", "JSON patch on the document root is not supported")
        parent: Any = doc
        for p in parts[:-1]:
            try:
                parent = parent[int(p)] if isinstance(parent, list) else parent[p]
            except (KeyError, IndexError, ValueError) as exc:
                raise ApiError(422, "Invalid", f"JSON patch path {op['path']} does not exist") from exc
        last = parts[-1]
        kind = op["op"]
        try:
            if kind == "test":
                cur = parent[int(last)] if isinstance(parent, list) else parent[last]
                if cur != op.get("value"):
                    raise ApiError(422, "Invalid", f"JSON patch test failed at {op['path']}")
            elif kind in ("add", "replace"):
                if isinstance(parent, list):
                    if last == "-":
                        parent.append(op.get("value"))
                    elif kind == "add":
                        parent.insert(int(last), op.get("value"))
                    else:
                        parent[int(last)] = op.get("value")
                else:
                    if kind == "replace" and last not in parent:
                        raise ApiError(422, "Invalid", f"JSON patch replace of missing {op['path']}")
                    parent[last] = op.get("value")
            elif kind == "remove":
                if isinstance(parent, list):
                    del parent[int(last)]
                else:
                    del parent[last]
            else:
                raise ApiError(422, "Invalid", f"unsupported JSON patch op {kind!r}")
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise ApiError(422, "Invalid", f"JSON patch failed at {op['path']}: {exc}") from exc
    return doc


def parse_label_selector(sel: str | None) -> Callable[[Mapping[str, str]], bool]:
    """The equality subset of label selectors: ``a=b``, ``a==b``, ``a!=b``, ``a``, ``!a``."""
    if not sel:
        return lambda labels: True
    terms: list[tuple[str, str, str]] = []  # (op, key, value)
    for raw in sel.split(","):
        t = raw.strip()
        if not t:
            continue
        if "!=" in t:
            k, v = (s.strip() for s in t.split("!=", 1))
            terms.append(("!=", k, v))
        elif "=" in t:
            k, v = (s.strip() for s in t.replace("==", "=").split("=", 1))
            terms.append(("=", k, v))
        elif t.startswith("!"):
            terms.append(("!", t[1:].strip(), ""))
        else:
            terms.append(("exists", t, ""))

    def term(labels: Mapping[str, str], op: str, k: str, v: str) -> bool:
        if op == "!=":
            return labels.get(k) != v
        if op == "=":
            return labels.get(k) == v
        if op == "!":
            return k not in labels
        return k in labels

    return lambda labels: all(term(labels, *t) for t in terms)


def _dig(obj: Any, dotted: str) -> Any:
    cur = obj
    for p in dotted.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(p)
    return cur


def parse_field_selector(sel: str | None) -> Callable[[Obj], bool]:
    """Equality field selectors on any dotted path (``spec.nodeName=n1``, ``status.phase!=Failed``)."""
    if not sel:
        return lambda obj: True
    terms: list[Callable[[Obj], bool]] = []
    for raw in sel.split(","):
        t = raw.strip()
        if not t:
            continue
        neg = "!=" in t
        k, v = (s.strip() for s in t.replace("!=", "=").replace("==", "=").split("=", 1))

        def term(obj: Obj, k: str = k, v: str = v, neg: bool = neg) -> bool:
            cur = _dig(obj, k)
            val = "" if cur is None else str(cur)
            return (val != v) if neg else (val == v)

        terms.append(term)
    return lambda obj: all(f(obj) for f in terms)


def label_selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A metav1.LabelSelector (matchLabels + matchExpressions) against labels; empty selects all."""
    if not selector:
        return True
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


@dataclass
class Store:
    """All objects, by resource type then (namespace, name)."""

    resources: tuple[ResourceType, ...] = DEFAULT_RESOURCES
    history_limit: int = 10_000
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _objects: dict[tuple[str, str, str], dict[tuple[str, str], Obj]] = field(default_factory=dict)
    _rv: int = 1
    _history: list[WatchEvent] = field(default_factory=list)
    _oldest_rv: int = 1  # watches from a version older than this get 410 Gone
    _watchers: list[Watcher] = field(default_factory=list)
    # counters tests can assert on (e.g. that a client re-listed after 410)
    requests: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for r in self.resources:
            self._objects.setdefault(r.key, {})

    # -- lookup ---------------------------------------------------------------------------------
    def resource(self, group: str, version: str, plural: str) -> ResourceType:
        for r in self.resources:
            if r.key == (group, version, plural):
                return r
        raise ApiError(404, "NotFound", f"the server could not find the requested resource ({group}/{version} {plural})")

    def resource_by_kind(self, api_version: str, kind: str) -> ResourceType:
        for r in self.resources:
            if r.api_version == api_version and r.kind == kind:
                return r
        raise ApiError(404, "NotFound", f"no resource for {api_version} {kind}")

    def count(self, name: str) -> None:
        with self._lock:
            self.requests[name] = self.requests.get(name, 0) + 1

    @property
    def resource_version(self) -> int:
        with self._lock:
            return self._rv

    # -- reads ----------------------------------------------------------------------------------
    def get(self, rtype: ResourceType, namespace: str | None, name: str) -> Obj:
        with self._lock:
            obj = self._objects[rtype.key].get((namespace or "", name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{rtype.plural}.{rtype.group or "core"} "{name}" not found',
                               {"name": name, "group": rtype.group, "kind": rtype.plural})
            return copy.deepcopy(obj)

    def list(
        self,
        rtype: ResourceType,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> tuple[builtins.list[Obj], int]:
        pred = self._predicate(label_selector, field_selector)
        with self._lock:
            items = [
                copy.deepcopy(o)
                for (ns, _), o in sorted(self._objects[rtype.key].items())
                if (namespace is None or ns == namespace) and pred(o)
            ]
            return items, self._rv

    @staticmethod
    def _predicate(label_selector: str | None, field_selector: str | None) -> Callable[[Obj], bool]:
        lsel = parse_label_selector(label_selector)
        fsel = parse_field_selector(field_selector)
        return lambda o: lsel((o.get("metadata") or {}).get("labels") or {}) and fsel(o)

    # -- writes ---------------------------------------------------------------------------------
    def _bump(self) -> int:
        self._rv += 1
        return self._rv

    def _record(self, rtype: ResourceType, etype: str, obj: Obj) -> None:
        ev = WatchEvent(self._rv, rtype, etype, copy.deepcopy(obj))
        self._history.append(ev)
        if len(self._history) > self.history_limit:
            drop = len(self._history) - self.history_limit
            self._oldest_rv = self._history[drop - 1].rv + 1
            del self._history[:drop]
        ns = (obj.get("metadata") or {}).get("namespace")
        for w in list(self._watchers):
            if w.closed or w.rtype.key != rtype.key:
                continue
            if w.namespace is not None and w.namespace != ns:
                continue
            if w.predicate(obj):
                w.push(ev)

    def create(self, rtype: ResourceType, namespace: str | None, body: Obj, *, keep_status: bool = False) -> Obj:
        with self._lock:
            obj = copy.deepcopy(body)
            meta = obj.setdefault("metadata", {})
            if rtype.namespaced:
                ns = namespace or meta.get("namespace") or "default"
                if meta.get("namespace") and namespace and meta["namespace"] != namespace:
                    raise ApiError(400, "BadRequest", "the namespace of the object does not match the request")
                meta["namespace"] = ns
            else:
                ns = ""
                meta.pop("namespace", None)
            if not meta.get("name"):
                gen = meta.get("generateName")
                if not gen:
                    raise ApiError(422, "Invalid", "metadata.name or metadata.generateName is required")
                meta["name"] = gen + uuid.uuid4().hex[:5]
            name = meta["name"]
            objs = self._objects[rtype.key]
            if (ns, name) in objs:
                raise ApiError(409, "AlreadyExists", f'{rtype.plural}.{rtype.group or "core"} "{name}" already exists',
                               {"name": name, "group": rtype.group, "kind": rtype.plural})
            obj["apiVersion"] = rtype.api_version
            obj["kind"] = rtype.kind
            if rtype.status_subresource and not keep_status:
                obj.pop("status", None)
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now_rfc3339()
            meta["generation"] = 1
            meta["resourceVersion"] = str(self._bump())
            objs[(ns, name)] = obj
            self._record(rtype, "ADDED", obj)
            return copy.deepcopy(obj)

    def replace(
        self, rtype: ResourceType, namespace: str | None, name: str, body: Obj, *, subresource: str | None = None
    ) -> Obj:
        with self._lock:
            cur = self.get(rtype, namespace, name)
            want_rv = (body.get("metadata") or {}).get("resourceVersion")
            if want_rv and want_rv != cur["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict",
                               f'Operation cannot be fulfilled on {rtype.plural} "{name}": the object has been '
                               "modified; please apply your changes to the latest version and try again",
                               {"name": name, "kind": rtype.plural})
            new = copy.deepcopy(body)
            if subresource == "status":
                merged = copy.deepcopy(cur)
                if "status" in new:
                    merged["status"] = new["status"]
                else:
                    merged.pop("status", None)
                new = merged
            elif rtype.status_subresource:
                if "status" in cur:
                    new["status"] = cur["status"]
                else:
                    new.pop("status", None)
            return self._commit(rtype, cur, new)

    def patch(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str,
        patch: Any,
        content_type: str,
        *,
        subresource: str | None = None,
    ) -> Obj:
        with self._lock:
            cur = self.get(rtype, namespace, name)
            ct = content_type.split(";")[0].strip()
            if ct == "application/json-patch+json":
                if not isinstance(patch, list):
                    raise ApiError(400, "BadRequest", "json patch body must be a list of operations")
                new = json_patch(cur, patch)
            elif ct in ("application/merge-patch+json", "application/strategic-merge-patch+json",
                        "application/apply-patch+yaml", "application/apply-patch+json"):
                if not isinstance(patch, dict):
                    raise ApiError(400, "BadRequest", f"{ct} body must be an object")
                want_rv = (patch.get("metadata") or {}).get("resourceVersion")
                if want_rv and want_rv != cur["metadata"]["resourceVersion"]:
                    raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {rtype.plural} "{name}"')
                new = merge_patch(cur, patch)
            else:
                raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format: {ct}")
            if subresource == "status":
                keep = copy.deepcopy(cur)
                if "status" in new:
                    keep["status"] = new["status"]
                new = keep
            elif rtype.status_subresource:
                if "status" in cur:
                    new["status"] = cur["status"]
                else:
                    new.pop("status", None)
            return self._commit(rtype, cur, new)

    def _commit(self, rtype: ResourceType, cur: Obj, new: Obj) -> Obj:
        meta = new.setdefault("metadata", {})
        old_meta = cur["metadata"]
        # Immutable identity fields come from the stored object.
        for k in ("name", "namespace", "uid", "creationTimestamp"):
            if k in old_meta:
                meta[k] = old_meta[k]
            else:
                meta.pop(k, None)
        meta["generation"] = old_meta.get("generation", 1)
        new["apiVersion"], new["kind"] = rtype.api_version, rtype.kind
        meta["resourceVersion"] = old_meta["resourceVersion"]
        if new == cur:
            return copy.deepcopy(cur)  # a no-op write does not bump the version
        if any(new.get(k) != cur.get(k) for k in set(new) | set(cur) if k not in ("metadata", "status")):
            meta["generation"] = int(old_meta.get("generation", 1)) + 1
        meta["resourceVersion"] = str(self._bump())
        key = (meta.get("namespace", ""), meta["name"])
        self._objects[rtype.key][key] = new
        self._record(rtype, "MODIFIED", new)
        return copy.deepcopy(new)

    def delete(self, rtype: ResourceType, namespace: str | None, name: str) -> Obj:
        with self._lock:
            cur = self.get(rtype, namespace, name)
            del self._objects[rtype.key][(cur["metadata"].get("namespace", ""), name)]
            cur["metadata"]["resourceVersion"] = str(self._bump())
            self._record(rtype, "DELETED", cur)
            self._collect_garbage(cur["metadata"]["uid"])
            return cur

    def _collect_garbage(self, owner_uid: str) -> None:
        """Delete dependents whose ownerReferences name a deleted owner (background propagation)."""
        for rtype in self.resources:
            for (ns, name), obj in list(self._objects[rtype.key].items()):
                refs = (obj.get("metadata") or {}).get("ownerReferences") or []
                if any(r.get("uid") == owner_uid for r in refs):
                    self.delete(rtype, ns or None, name)

    # -- eviction -------------------------------------------------------------------------------
    def evict(self, namespace: str, name: str) -> None:
        """The policy/v1 Eviction subresource: 429 when a PodDisruptionBudget forbids the disruption."""
        pods = self.resource("", "v1", "pods")
        pdbs = self.resource("policy", "v1", "poddisruptionbudgets")
        with self._lock:
            pod = self.get(pods, namespace, name)
            labels = pod["metadata"].get("labels") or {}
            for pdb in self._objects[pdbs.key].values():
                if pdb["metadata"].get("namespace") != namespace:
                    continue
                spec = pdb.get("spec") or {}
                if not label_selector_matches(spec.get("selector"), labels) or not spec.get("selector"):
                    continue
                matching = [
                    o for (ns, _), o in self._objects[pods.key].items()
                    if ns == namespace and label_selector_matches(spec.get("selector"), (o["metadata"].get("labels") or {}))
                ]
                healthy = sum(1 for o in matching if (o.get("status") or {}).get("phase", "Running") == "Running")
                if "minAvailable" in spec:
                    allowed = healthy - int(spec["minAvailable"])
                elif "maxUnavailable" in spec:
                    allowed = int(spec["maxUnavailable"]) - (len(matching) - healthy)
                else:
                    allowed = healthy
                if allowed < 1:
                    raise ApiError(
                        429, "TooManyRequests",
                        "Cannot evict pod as it would violate the pod's disruption budget.",
                        {"causes": [{"reason": "DisruptionBudget",
                                     "message": f"The disruption budget {pdb['metadata']['name']} needs "
                                                f"{spec.get('minAvailable', '?')} healthy pods"}]},
                    )
            self.delete(pods, namespace, name)

    # -- watches --------------------------------------------------------------------------------
    def watch(
        self,
        rtype: ResourceType,
        namespace: str | None,
        resource_version: str | None,
        label_selector: str | None,
        field_selector: str | None,
        push: Callable[[WatchEvent | None], None],
    ) -> Watcher:
        """Register a watcher and replay what it missed; raises 410 when the version was compacted away."""
        pred = self._predicate(label_selector, field_selector)
        with self._lock:
            w = Watcher(rtype, namespace, pred, push)
            if resource_version in (None, "", "0"):
                # No version: synthetic ADDED for everything that exists now, then live events.
                for (ns, _), o in sorted(self._objects[rtype.key].items()):
                    if (namespace is None or ns == namespace) and pred(o):
                        push(WatchEvent(self._rv, rtype, "ADDED", copy.deepcopy(o)))
            else:
                try:
                    since = int(str(resource_version))
                except ValueError as exc:
                    raise ApiError(400, "BadRequest", f"invalid resourceVersion {resource_version!r}") from exc
                if since < self._oldest_rv - 1:
                    raise ApiError(410, "Expired", f"too old resource version: {since} ({self._oldest_rv - 1})")
                for ev in self._history:
                    if ev.rv <= since or ev.rtype.key != rtype.key:
                        continue
                    ev_ns = (ev.obj.get("metadata") or {}).get("namespace")
                    if (namespace is None or ev_ns == namespace) and pred(ev.obj):
                        push(ev)
            self._watchers.append(w)
            return w

    def unwatch(self, w: Watcher) -> None:
        with self._lock:
            w.closed = True
            if w in self._watchers:
                self._watchers.remove(w)

    def watcher_count(self, plural: str | None = None) -> int:
        with self._lock:
            return sum(1 for w in self._watchers if plural is None or w.rtype.plural == plural)

    def compact(self) -> None:
        """Forget all watch history: any watch resuming from an earlier version now gets 410 Gone."""
        with self._lock:
            self._history.clear()
            self._oldest_rv = self._rv + 1

    def expire_watches(self) -> None:
        """Compact, then end every open watch, so clients must resume and will be told 410 Gone."""
        with self._lock:
            self.compact()
            # Bump once so that the versions the clients hold are strictly older than the oldest retained.
            self._bump()
            self._oldest_rv = self._rv + 1
            for w in list(self._watchers):
                w.closed = True
                w.push(None)
            self._watchers.clear()

    # -- convenience for tests ------------------------------------------------------------------
    def objects(self, plural: str, namespace: str | None = None) -> builtins.list[Obj]:
        rtype = next(r for r in self.resources if r.plural == plural)
        return self.list(rtype, namespace)[0]

    def find(self, plural: str, name: str, namespace: str | None = None) -> Obj | None:
        rtype = next(r for r in self.resources if r.plural == plural)
        try:
            return self.get(rtype, namespace, name)
        except ApiError:
            return None

    def put(self, obj: Obj, *, keep_status: bool = True) -> Obj:
        """Create an object from its apiVersion/kind (status kept), for test fixtures."""
        rtype = self.resource_by_kind(obj["apiVersion"], obj["kind"])
        return self.create(rtype, (obj.get("metadata") or {}).get("namespace"), obj, keep_status=keep_status)

    def remove(self, plural: str, name: str, namespace: str | None = None) -> Obj:
        rtype = next(r for r in self.resources if r.plural == plural)
        return self.delete(rtype, namespace, name)

    def update_status(self, plural: str, name: str, status: Obj, namespace: str | None = None) -> Obj:
        rtype = next(r for r in self.resources if r.plural == plural)
        return self.patch(rtype, namespace, name, {"status": status}, "application/merge-patch+json",
                          subresource="status")

    def iter_all(self) -> Iterable[tuple[ResourceType, Obj]]:
        with self._lock:
            return [(r, copy.deepcopy(o)) for r in self.resources for o in self._objects[r.key].values()]
