"""The join-token Secret at operator start-up: a missing Secret or key, or an API server that stays
unreachable, ends the start with one clear line (it was a traceback); an API server that answers
5xx or is not reachable yet is retried for a while (a pod starting with its node)."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from kubernetes.aio import client

from bigfleet.k8stest import KubeTestServer
from bigfleet.operator.cli import JoinTokenError, _join_token
from bigfleet.testing import free_port

TOKEN = "abcdef.0123456789abcdef"


async def _secret(api: Any, name: str, data: dict[str, str]) -> None:
    body = {"metadata": {"name": name, "namespace": "default"},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}
    await client.CoreV1Api(api).create_namespaced_secret("default", body)


async def test_a_missing_secret_or_key_is_one_clear_error(api: Any) -> None:
    with pytest.raises(JoinTokenError, match=r"Secret default/nope: HTTP 404"):
        await _join_token(api, "default", "nope", wait=5)
    await _secret(api, "join", {"other": TOKEN})
    with pytest.raises(JoinTokenError, match=r"default/join has no key 'token'"):
        await _join_token(api, "default", "join", wait=5)
    assert await _join_token(api, "default", "join/other", wait=5) == TOKEN


async def test_an_api_server_answering_5xx_is_retried(api: Any, kube: KubeTestServer) -> None:
    await _secret(api, "join", {"token": TOKEN})
    kube.fail_next("GET", "secrets/join", 503, times=2)
    assert await _join_token(api, "default", "join", wait=10) == TOKEN


async def test_an_unreachable_api_server_ends_the_start_after_the_wait(api: Any) -> None:
    api.configuration.host = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(JoinTokenError, match=r"did not answer within 1\.5s"):
        await _join_token(api, "default", "join", wait=1.5)
