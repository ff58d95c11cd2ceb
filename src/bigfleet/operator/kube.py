"""Kubernetes access for the operator and the pod controller, on the official ``kubernetes.aio`` client.

Three pieces: building an ``ApiClient`` (explicit kubeconfig, ``$KUBECONFIG``,
``~/.kube/config`` or in-cluster service account); an :class:`Informer` that
lists, then watches from the list's resourceVersion with bookmarks, resumes
after a watch ends, re-lists on ``410 Gone`` and keeps an in-memory cache of
raw objects; and :func:`with_retries`, exponential backoff for transient API
failures (429, 5xx, connection errors).
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from kubernetes.aio import client, config, watch
from kubernetes.aio.client.exceptions import ApiException

from bigfleet.observability import get_logger

T = TypeVar("T")
MERGE_PATCH = "application/merge-patch+json"
log = get_logger("bigfleet.kube")


async def api_client(kubeconfig: str | None = None, qps: float = 50.0, burst: int = 100) -> client.ApiClient:
    """An ApiClient from ``kubeconfig``, else ``$KUBECONFIG``/``~/.kube/config``, else in-cluster config."""
    path = kubeconfig or os.environ.get("KUBECONFIG") or ""
    if not path and Path("~/.kube/config").expanduser().exists():
        path = str(Path("~/.kube/config").expanduser())
    if path:
        api: client.ApiClient = await config.new_client_from_config(config_file=path)  # type: ignore[no-untyped-call]
    else:
        cfg = client.Configuration()
        config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        api = client.ApiClient(configuration=cfg)
    api.configuration.connection_pool_maxsize = max(1, int(burst))
    rate_limit(api, qps, burst)
    return api


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` saved. Pure: time is passed in."""

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = max(rate, 1e-9)
        self.burst = max(1, int(burst))
        self.tokens = float(self.burst)
        self.last = now

    def take(self, now: float) -> float:
        """Take one token; returns how long to wait before using it (0 = now)."""
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        self.tokens -= 1.0
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


def rate_limit(api: client.ApiClient, qps: float, burst: int) -> None:
    """Client-side request rate limit (client-go's --qps/--burst); the Python client has none."""
    if qps <= 0:
        return
    loop_time = asyncio.get_running_loop().time
    bucket = TokenBucket(qps, burst, loop_time())
    inner = api.call_api

    async def call_api(*args: Any, **kwargs: Any) -> Any:
        wait = bucket.take(loop_time())
        if wait > 0:
            await asyncio.sleep(wait)
        return await inner(*args, **kwargs)

    api.call_api = call_api  # type: ignore[method-assign]


def status_code(exc: BaseException) -> int | None:
    if isinstance(exc, ApiException):
        return int(exc.status) if exc.status is not None else None
    return None


def is_transient(exc: BaseException) -> bool:
    code = status_code(exc)
    if code is not None:
        return code == 429 or code >= 500 or code == 0
    return isinstance(exc, aiohttp.ClientError | asyncio.TimeoutError | ConnectionError | OSError)


async def with_retries(
    fn: Callable[[], Awaitable[T]],
    *,
    attempts: int = 5,
    base: float = 0.1,
    cap: float = 5.0,
    retry_on: Callable[[BaseException], bool] = is_transient,
    what: str = "kubernetes call",
) -> T:
    """Run ``fn`` until it succeeds, retrying transient failures with jittered exponential backoff."""
    delay = base
    for attempt in range(1, attempts + 1):
        try:
            return await fn()
        except Exception as exc:
            if attempt == attempts or not retry_on(exc):
                raise
            log.debug("retrying", what=what, attempt=attempt, error=str(exc)[:200])
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(cap, delay * 2)
    raise AssertionError("unreachable")


def obj_key(obj: dict[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))


ListCall = Callable[..., Awaitable[Any]]


class Informer:
    """List-then-watch one resource into a cache of raw dicts; calls ``on_change`` after every change.

    ``list_call`` is an official client list method (``CustomObjectsApi.list_cluster_custom_object``,
    ``CoreV1Api.list_pod_for_all_namespaces``, ...), ``args``/``kwargs`` its arguments.
    """

    def __init__(
        self,
        name: str,
        api: client.ApiClient,
        list_call: ListCall,
        *args: Any,
        on_change: Callable[[str, dict[str, Any]], None] | None = None,
        watch_timeout: int = 240,
        **kwargs: Any,
    ) -> None:
        self.name = name
        self.api = api
        self.list_call = list_call
        self.args = args
        self.kwargs = kwargs
        self.on_change = on_change
        self.watch_timeout = watch_timeout
        self.cache: dict[tuple[str, str], dict[str, Any]] = {}
        self.synced = asyncio.Event()
        self.resource_version = ""
        self.relists = 0  # how many times a LIST rebuilt the cache (1 at start, +1 per 410 or failure)
        self.log = get_logger("bigfleet.kube.informer", informer=name)

    def items(self) -> list[dict[str, Any]]:
        return list(self.cache.values())

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.cache.get((namespace, name))

    def _emit(self, kind: str, obj: dict[str, Any]) -> None:
        if self.on_change is not None:
            self.on_change(kind, obj)

    async def _list(self) -> None:
        resp = await with_retries(lambda: self.list_call(*self.args, **self.kwargs), what=f"list {self.name}")
        raw = resp if isinstance(resp, dict) else self.api.sanitize_for_serialization(resp)  # type: ignore[no-untyped-call]
        items = raw.get("items") or []
        fresh: dict[tuple[str, str], dict[str, Any]] = {}
        for it in items:
            fresh[obj_key(it)] = it
        old = self.cache
        self.cache = fresh
        self.resource_version = str((raw.get("metadata") or {}).get("resourceVersion") or "")
        self.relists += 1
        self.synced.set()
        for k, obj in fresh.items():
            if old.get(k) != obj:
                self._emit("ADDED" if k not in old else "MODIFIED", obj)
        for k, obj in old.items():
            if k not in fresh:
                self._emit("DELETED", obj)
        if not fresh and not old:
            self._emit("SYNCED", {})

    async def _watch_once(self) -> None:
        w: Any = watch.Watch()  # type: ignore[no-untyped-call]
        try:
            stream = w.stream(
                self.list_call, *self.args,
                resource_version=self.resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=self.watch_timeout,
                _request_timeout=self.watch_timeout + 30,
                **self.kwargs,
            )
            async for ev in stream:
                etype = ev["type"]
                obj = ev["raw_object"]
                rv = str(((obj or {}).get("metadata") or {}).get("resourceVersion") or "")
                if etype == "BOOKMARK":
                    self.resource_version = rv or self.resource_version
                    continue
                k = obj_key(obj)
                if etype in ("ADDED", "MODIFIED"):
                    self.cache[k] = obj
                elif etype == "DELETED":
                    self.cache.pop(k, None)
                if rv:
                    self.resource_version = rv
                self._emit(etype, obj)
        finally:
            await w.close()

    async def run(self) -> None:
        """Run forever (until cancelled): list, then watch; re-list on 410 Gone or repeated failure."""
        backoff = 0.2
        need_list = True
        while True:
            try:
                if need_list:
                    await self._list()
                    need_list = False
                await self._watch_once()
                backoff = 0.2
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                code = status_code(exc)
                if code == 410:
                    self.log.info("watch expired; re-listing", resource_version=self.resource_version)
                    need_list = True
                    continue
                self.log.warning("watch failed; retrying", error=str(exc)[:300], code=code)
                need_list = True  # events may have been missed while disconnected
                await asyncio.sleep(backoff * (0.5 + random.random()))
                backoff = min(10.0, backoff * 2)
