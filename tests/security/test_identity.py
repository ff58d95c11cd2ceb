"""Pure identity parsing and the role decision table."""

from __future__ import annotations

import pytest

from bigfleet.security import certs
from bigfleet.security.identity import (
    ADMIN,
    READONLY,
    Identity,
    IdentityError,
    Role,
    cluster,
    identity_from_auth_context,
    identity_from_certificate,
    identity_from_uris,
    shard,
)
from bigfleet.security.roles import (
    ADMIN_ONLY,
    COORDINATOR_POLICY,
    PROVIDER_POLICY,
    READ,
    SHARD_POLICY,
    Access,
    PermissionDenied,
    authorize,
    check_transport,
    lookup,
)


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("bigfleet://admin", ADMIN),
        ("bigfleet://readonly", READONLY),
        ("bigfleet://cluster/prod-eu-1", cluster("prod-eu-1")),
        ("bigfleet://shard/shard-0", shard("shard-0")),
    ],
)
def test_parse_valid(uri: str, expected: Identity) -> None:
    assert Identity.parse(uri) == expected
    assert expected.uri == uri


@pytest.mark.parametrize(
    "uri",
    [
        "bigfleet://",
        "bigfleet://root",
        "bigfleet://cluster",
        "bigfleet://cluster/",
        "bigfleet://cluster/a/b",
        "bigfleet://shard/with space",
        "bigfleet://admin/x",
        "bigfleet://readonly/",
        "https://admin",
        "bigfleet://cluster/" + "x" * 300,
    ],
)
def test_parse_invalid(uri: str) -> None:
    with pytest.raises(IdentityError):
        Identity.parse(uri)


def test_exactly_one_bigfleet_san() -> None:
    assert identity_from_uris(["spiffe://x/y", "bigfleet://admin"]) == ADMIN
    with pytest.raises(IdentityError, match="no bigfleet"):
        identity_from_uris(["spiffe://x/y"])
    with pytest.raises(IdentityError, match="exactly one"):
        identity_from_uris(["bigfleet://admin", "bigfleet://readonly"])


def test_identity_from_generated_certificates() -> None:
    ca = certs.generate_ca()
    leaf = certs.issue_certificate(ca, cluster("c1"), extra_uris=["urn:other"])
    assert identity_from_certificate(leaf.cert_pem) == cluster("c1")
    none = certs.issue_certificate(ca, None)
    with pytest.raises(IdentityError):
        identity_from_certificate(none.cert_pem)
    with pytest.raises(IdentityError, match="unparseable"):
        identity_from_certificate(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")


def test_auth_context_plaintext_is_none() -> None:
    assert identity_from_auth_context({}) is None
    assert identity_from_auth_context({"transport_security_type": [b"insecure"]}) is None


def test_auth_context_tls_without_certificate_is_an_error() -> None:
    with pytest.raises(IdentityError):
        identity_from_auth_context({"transport_security_type": [b"ssl"]})


def test_tls_version_gate() -> None:
    check_transport({"ssl_tls_version": [b"TLSv1.3"]})
    check_transport({})  # plaintext: nothing to check
    with pytest.raises(PermissionDenied, match=r"TLSv1\.2"):
        check_transport({"ssl_tls_version": [b"TLSv1.2"]})


C = "/bigfleet.v1alpha1.Coordinator/"
IDS = {
    "admin": ADMIN,
    "readonly": READONLY,
    "shard-0": shard("shard-0"),
    "cluster-a": cluster("cluster-a"),
}


@pytest.mark.parametrize(
    ("method", "allowed"),
    [
        (C + "AssignDomain", {"admin"}),
        (C + "UnassignDomain", {"admin"}),
        (C + "RemoveShard", {"admin"}),
        (C + "JoinRaftCluster", {"admin"}),
        (C + "SnapshotSave", {"admin"}),
        (C + "ListShards", {"admin", "readonly"}),
        (C + "ListDomainAssignments", {"admin", "readonly"}),
        (C + "ListShardReports", {"admin", "readonly"}),
        ("/bigfleet.v1alpha1.ShardRead/InspectNeeds", {"admin", "readonly"}),
        ("/bigfleet.v1alpha1.Shard/Session", {"cluster-a"}),
        ("/bigfleet.v1alpha1.CapacityProvider/Create", {"shard-0"}),
        ("/bigfleet.v1alpha1.CapacityProvider/List", {"shard-0", "admin", "readonly"}),
        ("/bigfleet.v1alpha1.Coordinator/SomeFutureRpc", {"admin"}),
        (C + "LookupCluster", {"admin", "readonly", "cluster-a"}),
        (C + "ApplyRebalance", {"admin"}),
        (C + "PlanRebalance", {"admin", "readonly"}),
        ("/bigfleet.v1alpha1.ShardAdmin/SetActuation", {"admin"}),
        ("/bigfleet.v1alpha1.ShardAdmin/GetActuation", {"admin", "readonly"}),
        ("/bigfleet.v1alpha1.ShardRead/WhatIf", {"admin", "readonly", "cluster-a"}),
        ("/bigfleet.v1alpha1.ShardRead/PlanConsolidation", {"admin", "readonly"}),
        ("/grpc.health.v1.Health/Check", set(IDS)),
    ],
)
def test_policy_matrix(method: str, allowed: set[str]) -> None:
    policy = {**COORDINATOR_POLICY, **SHARD_POLICY, **PROVIDER_POLICY}
    access = lookup(policy, method)
    for name, ident in IDS.items():
        if name in allowed:
            authorize(ident, access)
        else:
            with pytest.raises(PermissionDenied):
                authorize(ident, access)
        authorize(None, access)  # plaintext skips every check


def test_report_shard_only_for_itself() -> None:
    access = COORDINATOR_POLICY[C + "ReportShard"]
    authorize(shard("shard-0"), access, "shard-0")
    with pytest.raises(PermissionDenied, match="shard-1"):
        authorize(shard("shard-0"), access, "shard-1")
    with pytest.raises(PermissionDenied):
        authorize(ADMIN, access, "shard-0")  # admin does not pass ReportShard


def test_lookup_cluster_only_for_itself() -> None:
    access = COORDINATOR_POLICY[C + "LookupCluster"]
    authorize(cluster("cluster-a"), access, "cluster-a")
    authorize(ADMIN, access, "cluster-b")
    with pytest.raises(PermissionDenied):
        authorize(cluster("cluster-a"), access, "cluster-b")


def test_whatif_only_for_its_own_cluster() -> None:
    access = SHARD_POLICY["/bigfleet.v1alpha1.ShardRead/WhatIf"]
    authorize(cluster("cluster-a"), access, "cluster-a")
    authorize(READONLY, access, "cluster-b")
    with pytest.raises(PermissionDenied):
        authorize(cluster("cluster-a"), access, "cluster-b")


def test_empty_subject_left_to_handler_validation() -> None:
    access = Access.of(Role.SHARD, self_field="shard_id", allow_empty_self=True)
    authorize(shard("s"), access, "")
    strict = Access.of(Role.SHARD, self_field="shard_id")
    with pytest.raises(PermissionDenied):
        authorize(shard("s"), strict, "")


def test_constants() -> None:
    assert Role.ADMIN in ADMIN_ONLY.roles and len(ADMIN_ONLY.roles) == 1
    assert READ.roles == {Role.ADMIN, Role.READONLY}


def test_only_an_admin_peer_relays_its_callers_role() -> None:
    from bigfleet.security.roles import acting_role

    admin = Identity(Role.ADMIN, "")
    ro = Identity(Role.READONLY, "")
    cluster = Identity(Role.CLUSTER, "a")
    assert acting_role(None, "readonly") is None  # plaintext: no roles at all
    assert acting_role(admin, None) is Role.ADMIN
    assert acting_role(admin, "readonly") is Role.READONLY  # a replica forwarding a readonly call
    assert acting_role(admin, "cluster") is Role.CLUSTER
    assert acting_role(admin, "bogus") is Role.READONLY  # unknown: the least
    assert acting_role(ro, "admin") is Role.READONLY  # a non-admin's claim is ignored
    assert acting_role(cluster, "admin") is Role.CLUSTER
