"""The test API server speaks the Kubernetes protocol the real client expects (checked through the
official kubernetes.aio client, not by poking the server's internals)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes.aio import client, config, watch
from kubernetes.aio.client.exceptions import ApiException

from bigfleet.k8stest import KubeTestServer

G, V = "bigfleet.lucy.sh", "v1alpha1"
MERGE = "application/merge-patch+json"


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[tuple[KubeTestServer, Any]]:
    srv = await KubeTestServer(bookmark_interval=0.1).start()
    api = await config.new_client_from_config(config_file=str(srv.kubeconfig(tmp_path / "kc")))
    yield srv, api
    await api.close()
    await srv.stop()


def cr(name: str) -> dict[str, Any]:
    return {"apiVersion": f"{G}/{V}", "kind": "CapacityRequest", "metadata": {"name": name},
            "spec": {"priority": 1, "resources": {"cpu": "1"}}, "status": {"phase": "Acknowledged"}}


async def test_crud_conflicts_and_status_subresource(env: tuple[KubeTestServer, Any]) -> None:
    _, api = env
    co = client.CustomObjectsApi(api)
    made = await co.create_namespaced_custom_object(G, V, "ns1", "capacityrequests", cr("a"))
    assert "status" not in made  # status is not writable through the main resource
    assert made["metadata"]["generation"] == 1 and made["metadata"]["uid"]
    with pytest.raises(ApiException) as e:
        await co.create_namespaced_custom_object(G, V, "ns1", "capacityrequests", cr("a"))
    assert e.value.status == 409 and json.loads(e.value.body)["reason"] == "AlreadyExists"
    st = await co.patch_namespaced_custom_object_status(G, V, "ns1", "capacityrequests", "a",
                                                        {"status": {"phase": "Pending"}, "spec": {"priority": 9}},
                                                        _content_type=MERGE)
    assert st["status"] == {"phase": "Pending"} and st["spec"]["priority"] == 1
    assert st["metadata"]["generation"] == 1  # status writes never bump generation
    sp = await co.patch_namespaced_custom_object(G, V, "ns1", "capacityrequests", "a",
                                                 {"spec": {"priority": 5}, "status": {"phase": "Acknowledged"}},
                                                 _content_type=MERGE)
    assert sp["spec"]["priority"] == 5 and sp["status"] == {"phase": "Pending"}
    assert sp["metadata"]["generation"] == 2
    stale = {**sp, "metadata": {**sp["metadata"], "resourceVersion": made["metadata"]["resourceVersion"]}}
    with pytest.raises(ApiException) as e:
        await co.replace_namespaced_custom_object(G, V, "ns1", "capacityrequests", "a", stale)
    assert e.value.status == 409 and json.loads(e.value.body)["reason"] == "Conflict"
    with pytest.raises(ApiException) as e:
        await co.get_namespaced_custom_object(G, V, "ns1", "capacityrequests", "zzz")
    assert e.value.status == 404 and json.loads(e.value.body)["kind"] == "Status"
    await co.delete_namespaced_custom_object(G, V, "ns1", "capacityrequests", "a")
    lst = await co.list_cluster_custom_object(G, V, "capacityrequests")
    assert lst["items"] == []


async def test_list_then_watch_bookmarks_and_410(env: tuple[KubeTestServer, Any]) -> None:
    srv, api = env
    co = client.CustomObjectsApi(api)
    await co.create_namespaced_custom_object(G, V, "ns1", "capacityrequests", cr("a"))
    lst = await co.list_cluster_custom_object(G, V, "capacityrequests")
    rv = lst["metadata"]["resourceVersion"]
    await co.create_namespaced_custom_object(G, V, "ns2", "capacityrequests", cr("b"))
    await co.delete_namespaced_custom_object(G, V, "ns1", "capacityrequests", "a")
    seen = []
    async with watch.Watch() as w:
        async for ev in w.stream(co.list_cluster_custom_object, G, V, "capacityrequests", resource_version=rv,
                                 allow_watch_bookmarks=True, timeout_seconds=1):
            seen.append((ev["type"], ev["raw_object"]["metadata"].get("name")))
    assert seen[:2] == [("ADDED", "b"), ("DELETED", "a")]
    assert ("BOOKMARK", None) in seen[2:]
    srv.store.compact()
    await co.create_namespaced_custom_object(G, V, "ns2", "capacityrequests", cr("c"))
    with pytest.raises(ApiException) as e:
        async with watch.Watch() as w:
            async for _ in w.stream(co.list_cluster_custom_object, G, V, "capacityrequests", resource_version=rv,
                                    timeout_seconds=1):
                pass
    assert e.value.status == 410


async def test_selectors_generate_name_json_patch_gc_and_eviction(env: tuple[KubeTestServer, Any]) -> None:
    srv, api = env
    core = client.CoreV1Api(api)
    co = client.CustomObjectsApi(api)
    s = srv.store
    owner = s.put({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "d", "labels": {"a": "1"}},
                   "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i"}]}})
    s.put({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "q", "namespace": "d", "labels": {"a": "1"}},
           "spec": {"nodeName": "n2", "containers": [{"name": "c", "image": "i"}]}})
    on_n1 = await core.list_pod_for_all_namespaces(field_selector="spec.nodeName=n1")
    assert [p.metadata.name for p in on_n1.items] == ["p"]
    by_label = await core.list_namespaced_pod("d", label_selector="a=1")
    assert len(by_label.items) == 2
    dep = {**cr(""), "metadata": {"generateName": "cr-pod-p-", "labels": {"x": "y"},
                                  "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "p",
                                                       "uid": owner["metadata"]["uid"]}]}}
    made = await co.create_namespaced_custom_object(G, V, "d", "capacityrequests", dep)
    assert made["metadata"]["name"].startswith("cr-pod-p-") and len(made["metadata"]["name"]) > len("cr-pod-p-")
    patched = await co.patch_namespaced_custom_object(
        G, V, "d", "capacityrequests", made["metadata"]["name"],
        [{"op": "replace", "path": "/spec/priority", "value": 7}], _content_type="application/json-patch+json")
    assert patched["spec"]["priority"] == 7
    # policy/v1 Eviction: a PDB that needs both pods refuses with 429; without it the pod goes.
    s.put({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "b", "namespace": "d"},
           "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"a": "1"}}}})
    ev = client.V1Eviction(metadata=client.V1ObjectMeta(name="q", namespace="d"))
    with pytest.raises(ApiException) as e:
        await core.create_namespaced_pod_eviction("q", "d", ev)
    assert e.value.status == 429
    s.remove("poddisruptionbudgets", "b", "d")
    await core.create_namespaced_pod_eviction("q", "d", ev)
    assert s.find("pods", "q", "d") is None
    # Deleting the owner garbage-collects the dependent CR.
    await core.delete_namespaced_pod("p", "d")
    assert s.objects("capacityrequests") == []


async def test_leases_with_optimistic_concurrency(env: tuple[KubeTestServer, Any]) -> None:
    _, api = env
    coord = client.CoordinationV1Api(api)
    body = client.V1Lease(metadata=client.V1ObjectMeta(name="l"), spec=client.V1LeaseSpec(holder_identity="a"))
    made = await coord.create_namespaced_lease("d", body)
    made.spec.holder_identity = "b"
    await coord.replace_namespaced_lease("l", "d", made)
    made.spec.holder_identity = "c"  # same (now stale) resourceVersion
    with pytest.raises(ApiException) as e:
        await coord.replace_namespaced_lease("l", "d", made)
    assert e.value.status == 409
    assert (await coord.read_namespaced_lease("l", "d")).spec.holder_identity == "b"
