"""A Kubernetes API server for tests: the real REST and watch wire protocol over loopback HTTP.

No kube-apiserver binary can be installed on the machines this project is
built on, so the operator, the pod controller and the end-to-end tests run
their *real* client code (the official ``kubernetes`` package) against this
server. It serves the paths and verbs those clients use: discovery, CRUD,
merge / strategic-merge / JSON patch, the ``status`` subresource, list and
chunked watch with ``resourceVersion``, bookmarks and ``timeoutSeconds``,
``410 Gone`` for compacted versions, the ``policy/v1`` Eviction subresource
(``429`` when a PodDisruptionBudget forbids it) and Leases. It does no
authentication, admission or schema validation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from bigfleet.k8stest.store import ApiError, ResourceType, Store, WatchEvent

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _status_response(err: ApiError) -> web.Response:
    return web.json_response(err.status(), status=err.code)


class KubeTestServer:
    """An aiohttp app over a :class:`Store`; run it in the current loop or on its own thread."""

    def __init__(self, store: Store | None = None, *, bookmark_interval: float = 1.0, token: str | None = None) -> None:
        self.store = store or Store()
        self.bookmark_interval = bookmark_interval
        self.token = token
        self._runner: web.AppRunner | None = None
        self._site_port = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # fault injection for tests: number of upcoming requests (matching a path substring) to fail with a code
        self._faults: list[tuple[str, str, int]] = []
        self._faults_lock = threading.Lock()

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        return self._site_port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._site_port}"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 << 20)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        return app

    async def start(self, port: int = 0) -> KubeTestServer:
        self._runner = web.AppRunner(self.app(), handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        server = site._server
        assert server is not None
        sockets = getattr(server, "sockets", None) or []
        self._site_port = int(sockets[0].getsockname()[1])
        self._loop = asyncio.get_running_loop()
        return self

    async def stop(self) -> None:
        self.store.expire_watches()  # end open watch streams so shutdown does not wait on them
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def start_in_thread(self, port: int = 0) -> KubeTestServer:
        """Serve from a private event loop on a daemon thread (for sync tests and subprocess clients)."""
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self.start(port))
            except BaseException as exc:  # reported to the starting thread
                errors.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self.stop())
            loop.close()

        self._thread = threading.Thread(target=run, name="k8stest-apiserver", daemon=True)
        self._thread.start()
        ready.wait(30)
        if errors:
            raise errors[0]
        return self

    def stop_thread(self) -> None:
        if self._thread is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._thread = None

    def kubeconfig(self, path: Path | str, namespace: str = "default") -> Path:
        """Write a kubeconfig that points a client at this server."""
        user: dict[str, Any] = {"token": self.token or "k8stest"}
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "k8stest", "cluster": {"server": self.url}}],
            "users": [{"name": "k8stest", "user": user}],
            "contexts": [{"name": "k8stest", "context": {"cluster": "k8stest", "user": "k8stest", "namespace": namespace}}],
            "current-context": "k8stest",
        }
        p = Path(path)
        p.write_text(yaml.safe_dump(cfg))
        return p

    def fail_next(self, method: str, path_contains: str, code: int, times: int = 1) -> None:
        """Answer the next ``times`` requests of ``method`` whose path contains the text with ``code``."""
        with self._faults_lock:
            self._faults.extend([(method.upper(), path_contains, code)] * times)

    def _take_fault(self, method: str, path: str) -> int | None:
        with self._faults_lock:
            for i, (m, sub, code) in enumerate(self._faults):
                if m == method and sub in path:
                    del self._faults[i]
                    return code
        return None

    # -- routing --------------------------------------------------------------------------------
    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.path.rstrip("/")
        method = request.method
        self.store.count(f"{method} {path}")
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            return _status_response(ApiError(401, "Unauthorized", "Unauthorized"))
        fault = self._take_fault(method, path)
        if fault is not None:
            return _status_response(ApiError(fault, "InternalError" if fault >= 500 else "Injected", "injected fault"))
        try:
            if path in ("/version",):
                return web.json_response({"major": "1", "minor": "31", "gitVersion": "v1.31.0-k8stest",
                                          "platform": "linux/amd64"})
            if path in ("/healthz", "/readyz", "/livez"):
                return web.Response(text="ok")
            if path == "/api":
                return web.json_response({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})
            if path == "/apis":
                return web.json_response(self._group_list())
            parts = [p for p in path.split("/") if p]
            if parts[:2] == ["api", "v1"]:
                group, version, rest = "", "v1", parts[2:]
            elif parts and parts[0] == "apis" and len(parts) >= 3:
                group, version, rest = parts[1], parts[2], parts[3:]
            else:
                raise ApiError(404, "NotFound", f"the server could not find the requested resource {path}")
            if not rest:
                return web.json_response(self._resource_list(group, version))
            return await self._resource(request, group, version, rest)
        except ApiError as err:
            return _status_response(err)

    def _group_list(self) -> dict[str, Any]:
        groups: dict[str, list[str]] = {}
        for r in self.store.resources:
            if r.group:
                groups.setdefault(r.group, [])
                if r.version not in groups[r.group]:
                    groups[r.group].append(r.version)
        return {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [
                {
                    "name": g,
                    "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
                    "preferredVersion": {"groupVersion": f"{g}/{vs[0]}", "version": vs[0]},
                }
                for g, vs in sorted(groups.items())
            ],
        }

    def _resource_list(self, group: str, version: str) -> dict[str, Any]:
        res = []
        for r in self.store.resources:
            if (r.group, r.version) != (group, version):
                continue
            res.append({"name": r.plural, "singularName": r.kind.lower(), "namespaced": r.namespaced, "kind": r.kind,
                        "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"]})
            if r.status_subresource:
                res.append({"name": f"{r.plural}/status", "singularName": "", "namespaced": r.namespaced,
                            "kind": r.kind, "verbs": ["get", "patch", "update"]})
            if r.plural == "pods":
                res.append({"name": "pods/eviction", "singularName": "", "namespaced": True, "kind": "Eviction",
                            "group": "policy", "version": "v1", "verbs": ["create"]})
        if not res:
            raise ApiError(404, "NotFound", f"no API group {group}/{version}")
        gv = f"{group}/{version}" if group else version
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": res}

    async def _resource(self, request: web.Request, group: str, version: str, rest: list[str]) -> web.StreamResponse:
        namespace: str | None = None
        if rest[0] == "namespaces" and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        rtype = self.store.resource(group, version, rest[0])
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if len(rest) > 3:
            raise ApiError(404, "NotFound", "unknown path")
        if rtype.namespaced is False and namespace is not None:
            raise ApiError(404, "NotFound", f"{rtype.plural} is not namespaced")
        q = request.query
        method = request.method
        if name is None:
            if method == "GET":
                if q.get("watch") in ("1", "true", "True"):
                    return await self._watch(request, rtype, namespace)
                items, rv = self.store.list(rtype, namespace, q.get("labelSelector"), q.get("fieldSelector"))
                return web.json_response({
                    "kind": f"{rtype.kind}List", "apiVersion": rtype.api_version,
                    "metadata": {"resourceVersion": str(rv)}, "items": items,
                })
            if method == "POST":
                if rtype.namespaced and namespace is None:
                    raise ApiError(405, "MethodNotAllowed", "create needs a namespace")
                body = await self._json(request)
                return web.json_response(self.store.create(rtype, namespace, body), status=201)
            raise ApiError(405, "MethodNotAllowed", f"{method} not allowed on a collection")
        if sub == "eviction":
            if rtype.plural != "pods" or method != "POST":
                raise ApiError(405, "MethodNotAllowed", "eviction is POST on pods only")
            body = await self._json(request)
            if (body.get("metadata") or {}).get("name") not in (None, name):
                raise ApiError(400, "BadRequest", "eviction name does not match the pod")
            assert namespace is not None
            self.store.evict(namespace, name)
            return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201},
                                     status=201)
        if sub not in (None, "status"):
            raise ApiError(404, "NotFound", f"unknown subresource {sub}")
        if sub == "status" and not rtype.status_subresource:
            raise ApiError(404, "NotFound", f"{rtype.plural} has no status subresource")
        if method == "GET":
            return web.json_response(self.store.get(rtype, namespace, name))
        if method == "PUT":
            body = await self._json(request)
            if (body.get("metadata") or {}).get("name") not in (None, name):
                raise ApiError(400, "BadRequest", "the name of the object does not match the request")
            return web.json_response(self.store.replace(rtype, namespace, name, body, subresource=sub))
        if method == "PATCH":
            body = await self._json(request, allow_list=True)
            ct = request.headers.get("Content-Type", "application/json")
            return web.json_response(self.store.patch(rtype, namespace, name, body, ct, subresource=sub))
        if method == "DELETE" and sub is None:
            return web.json_response(self.store.delete(rtype, namespace, name))
        raise ApiError(405, "MethodNotAllowed", f"{method} not allowed")

    @staticmethod
    async def _json(request: web.Request, allow_list: bool = False) -> Any:
        raw = await request.read()
        if not raw:
            return {}
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise ApiError(400, "BadRequest", f"request body is not JSON: {exc}") from exc
        if not isinstance(body, dict) and not (allow_list and isinstance(body, list)):
            raise ApiError(400, "BadRequest", "request body must be a JSON object")
        return body

    async def _watch(self, request: web.Request, rtype: ResourceType, namespace: str | None) -> web.StreamResponse:
        q = request.query
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[WatchEvent | None] = asyncio.Queue()

        def push(ev: WatchEvent | None) -> None:
            # Called under the store lock, possibly from another thread (tests writing directly);
            # call_soon_threadsafe keeps the order of events either way.
            loop.call_soon_threadsafe(queue.put_nowait, ev)

        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        try:
            watcher = self.store.watch(rtype, namespace, q.get("resourceVersion"), q.get("labelSelector"),
                                       q.get("fieldSelector"), push)
        except ApiError as err:
            if err.code != 410:
                raise
            # Like kube-apiserver: the stream opens with 200 and carries a single ERROR event.
            await resp.prepare(request)
            await resp.write(json.dumps({"type": "ERROR", "object": err.status()}).encode() + b"\n")
            await resp.write_eof()
            return resp
        timeout = float(q.get("timeoutSeconds") or 1800)
        bookmarks = q.get("allowWatchBookmarks") in ("1", "true", "True")
        deadline = loop.time() + timeout
        await resp.prepare(request)
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                wait = min(remaining, self.bookmark_interval) if bookmarks else remaining
                try:
                    ev = await asyncio.wait_for(queue.get(), timeout=wait)
                except TimeoutError:
                    if bookmarks and loop.time() < deadline:
                        bm = {"type": "BOOKMARK", "object": {
                            "kind": rtype.kind, "apiVersion": rtype.api_version,
                            "metadata": {"resourceVersion": str(self.store.resource_version)}}}
                        await resp.write(json.dumps(bm).encode() + b"\n")
                    continue
                if ev is None:
                    break
                await resp.write(json.dumps({"type": ev.type, "object": ev.obj}).encode() + b"\n")
        except ConnectionResetError:
            return resp  # the client went away (aiohttp's ClientConnectionResetError is one of these)
        finally:
            self.store.unwatch(watcher)
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp
