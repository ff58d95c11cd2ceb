from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes.aio import config

sys.path.insert(0, str(Path(__file__).parent))

from fakeshard import FakeShard

from bigfleet.k8stest import KubeTestServer


def cr(name: str, resources: dict[str, str], priority: int = 100, ns: str = "default", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "bigfleet.lucy.sh/v1alpha1",
        "kind": "CapacityRequest",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"priority": priority, "resources": resources, **spec},
    }


@pytest.fixture
async def kube(tmp_path: Path) -> AsyncIterator[KubeTestServer]:
    srv = await KubeTestServer(bookmark_interval=0.5).start()
    srv.kubeconfig(tmp_path / "kubeconfig")
    yield srv
    await srv.stop()


@pytest.fixture
async def api(kube: KubeTestServer, tmp_path: Path) -> AsyncIterator[Any]:
    client = await config.new_client_from_config(config_file=str(tmp_path / "kubeconfig"))
    yield client
    await client.close()


@pytest.fixture
async def shard() -> AsyncIterator[FakeShard]:
    s = await FakeShard().start()
    yield s
    await s.stop()
