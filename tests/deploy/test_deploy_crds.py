"""The operator chart's CRDs: the shape protocols.md §10 fixes, and schemas that accept real objects."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_CRDS = REPO / "deploy" / "helm" / "bigfleet-operator" / "crds"
SOURCE_CRDS = REPO / "deploy" / "crds"

EXPECTED = {
    "capacityrequests": ("CapacityRequest", "Namespaced", {"cr", "crs"}),
    "availablecapacities": ("AvailableCapacity", "Cluster", {"avc"}),
    "upcomingnodes": ("UpcomingNode", "Cluster", {"upn"}),
}


def load(plural: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((CHART_CRDS / f"bigfleet.lucy.sh_{plural}.yaml").read_text())
    return doc


def validator(plural: str) -> jsonschema.Draft202012Validator:
    schema = load(plural)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return jsonschema.Draft202012Validator(schema)


def test_chart_crds_are_the_operator_crds() -> None:
    """deploy/crds/ is the source (the operator's); the chart carries byte-identical copies."""
    if not SOURCE_CRDS.is_dir():
        pytest.skip("deploy/crds/ does not exist in this build; the chart's crds/ are the only copy")
    source = {p.name: p.read_bytes() for p in SOURCE_CRDS.glob("*.yaml")}
    chart = {p.name: p.read_bytes() for p in CHART_CRDS.glob("*.yaml")}
    assert sorted(chart) == sorted(source), "run `make sync-crds`"
    for name, data in source.items():
        assert chart[name] == data, f"{name} differs from deploy/crds/{name}: run `make sync-crds`"


@pytest.mark.parametrize("plural", sorted(EXPECTED))
def test_crd_names_scope_and_versions(plural: str) -> None:
    kind, scope, short = EXPECTED[plural]
    crd = load(plural)
    spec = crd["spec"]
    assert crd["metadata"]["name"] == f"{plural}.bigfleet.lucy.sh"
    assert spec["group"] == "bigfleet.lucy.sh"
    assert spec["scope"] == scope
    assert spec["names"]["kind"] == kind
    assert spec["names"]["plural"] == plural
    assert set(spec["names"]["shortNames"]) == short
    assert spec["names"]["categories"] == ["fleet"]
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}


def test_capacity_request_selects_on_phase() -> None:
    version = load("capacityrequests")["spec"]["versions"][0]
    assert version["selectableFields"] == [{"jsonPath": ".status.phase"}]


def test_capacity_request_schema_accepts_a_real_request_and_rejects_bad_ones() -> None:
    v = validator("capacityrequests")
    good = {
        "apiVersion": "bigfleet.lucy.sh/v1alpha1",
        "kind": "CapacityRequest",
        "metadata": {"name": "cr-pod-web-0-abcde", "namespace": "default"},
        "spec": {
            "priority": 1000,
            "resources": {"cpu": "500m", "memory": "1Gi", "nvidia.com/gpu": 1},
            "requirements": [{"key": "node.kubernetes.io/instance-type", "operator": "Exists"}],
            "interruptionPenalty": "250",
            "reclamationPenalty": 10,
            "topologySpread": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule"}],
            "coLocation": {"topologyKey": "topology.kubernetes.io/zone", "labelSelector": {"matchLabels": {"app": "db"}}},
        },
        "status": {"phase": "Acknowledged", "acknowledgedAt": "2026-11-22T04:00:00Z"},
    }
    assert list(v.iter_errors(good)) == []
    for broken in (
        {"spec": {"resources": {"cpu": "1"}}},  # no priority
        {"spec": {"priority": 1, "resources": {"cpu": "one"}}},  # not a quantity
        {"spec": {"priority": 1, "resources": {}}, "status": {"phase": "Shortfall"}},  # removed phase
        {"spec": {"priority": 1, "resources": {}, "requirements": [{"key": "k"}]}},  # no operator
    ):
        assert list(v.iter_errors({**good, **broken})), broken


def test_available_capacity_and_upcoming_node_schemas() -> None:
    avc = {"spec": {"availability": "High", "availableCount": 3, "cost": "1.25", "resources": {"cpu": "8"}}}
    assert list(validator("availablecapacities").iter_errors(avc)) == []
    assert list(validator("availablecapacities").iter_errors({"spec": {**avc["spec"], "availability": "Lots"}}))
    un = {
        "spec": {"resources": {"cpu": "8"}, "labels": {"a": "b"}, "taints": [{"key": "k", "effect": "NoSchedule"}]},
        "status": {"phase": "Ready", "nodeRef": {"kind": "Node", "name": "n1"}, "providerID": "fake://m-1"},
    }
    assert list(validator("upcomingnodes").iter_errors(un)) == []
    assert list(validator("upcomingnodes").iter_errors({**un, "status": {"phase": "Booting"}}))
