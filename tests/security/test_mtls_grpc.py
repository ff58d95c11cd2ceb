"""Real grpc.aio servers on loopback under mTLS: identities, roles and handshakes."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from bigfleet.security import TLSConfig, dial
from bigfleet.v1alpha1 import capacity_pb2 as capb
from bigfleet.v1alpha1 import coordinator_pb2 as cpb
from bigfleet.v1alpha1 import coordinator_pb2_grpc as cgrpc
from bigfleet.v1alpha1 import shard_pb2 as spb
from bigfleet.v1alpha1 import shard_pb2_grpc as sgrpc

from .conftest import Pki
from .servers import start

PD = grpc.StatusCode.PERMISSION_DENIED


def cfg(pki: Pki, name: str, ca: Path | None = None) -> TLSConfig:
    return TLSConfig.from_paths(pki.root / f"{name}.crt", pki.root / f"{name}.key", ca or pki.ca_file)


@pytest.fixture
async def server(pki: Pki) -> AsyncIterator[int]:
    srv, port, _ = await start(cfg(pki, "shard-0"))
    yield port
    await srv.stop(None)


async def call_code(pki: Pki, port: int, who: str, fn: str, req: object) -> grpc.StatusCode:
    async with dial(f"127.0.0.1:{port}", cfg(pki, who)) as ch:
        stub = cgrpc.CoordinatorStub(ch)
        try:
            await getattr(stub, fn)(req, timeout=30)
        except grpc.aio.AioRpcError as e:
            return e.code()
        return grpc.StatusCode.OK


async def session_code(pki: Pki, port: int, who: str, cluster_id: str) -> grpc.StatusCode:
    async with dial(f"127.0.0.1:{port}", cfg(pki, who)) as ch:
        call = sgrpc.ShardStub(ch).Session(timeout=30)
        try:
            await call.write(spb.OperatorMessage(hello=spb.Hello(cluster_id=cluster_id, protocol_version="v1alpha1")))
            reply = await call.read()
            assert reply.ack.echo == "hello"
            await call.write(spb.OperatorMessage(rollup=capb.ClusterCapacityNeeds(cluster_id=cluster_id)))
            assert (await call.read()).ack.echo == "rollup"
            await call.done_writing()
        except grpc.aio.AioRpcError as e:
            return e.code()
        return grpc.StatusCode.OK


async def test_admin_mutates_readonly_cannot(pki: Pki, server: int) -> None:
    req = cpb.AssignDomainRequest(topology_key="zone", topology_value="a", shard_id="shard-0")
    assert await call_code(pki, server, "admin", "AssignDomain", req) == grpc.StatusCode.OK
    assert await call_code(pki, server, "readonly", "AssignDomain", req) == PD
    assert await call_code(pki, server, "cluster-a", "AssignDomain", req) == PD
    assert await call_code(pki, server, "shard-0", "AssignDomain", req) == PD


async def test_reads_accept_readonly_and_admin_only(pki: Pki, server: int) -> None:
    req = cpb.ListShardsRequest()
    assert await call_code(pki, server, "readonly", "ListShards", req) == grpc.StatusCode.OK
    assert await call_code(pki, server, "admin", "ListShards", req) == grpc.StatusCode.OK
    assert await call_code(pki, server, "cluster-a", "ListShards", req) == PD
    assert await call_code(pki, server, "shard-0", "ListShards", req) == PD


async def test_server_streaming_admin_gate(pki: Pki, server: int) -> None:
    for who, want in [("admin", grpc.StatusCode.OK), ("readonly", PD)]:
        async with dial(f"127.0.0.1:{server}", cfg(pki, who)) as ch:
            code = grpc.StatusCode.OK
            try:
                chunks = [c async for c in cgrpc.CoordinatorStub(ch).SnapshotSave(cpb.SnapshotSaveRequest(), timeout=10)]
                assert chunks[0].meta_json == b"{}"
            except grpc.aio.AioRpcError as e:
                code = e.code()
            assert code == want, who


async def test_report_shard_only_for_itself(pki: Pki, server: int) -> None:
    assert await call_code(pki, server, "shard-0", "ReportShard", cpb.ShardReport(shard_id="shard-0")) == grpc.StatusCode.OK
    assert await call_code(pki, server, "shard-0", "ReportShard", cpb.ShardReport(shard_id="shard-1")) == PD
    assert await call_code(pki, server, "admin", "ReportShard", cpb.ShardReport(shard_id="shard-0")) == PD
    # validation still answers for a missing id
    assert (
        await call_code(pki, server, "shard-0", "ReportShard", cpb.ShardReport())
        == grpc.StatusCode.INVALID_ARGUMENT
    )


async def test_session_only_for_own_cluster(pki: Pki, server: int) -> None:
    assert await session_code(pki, server, "cluster-a", "cluster-a") == grpc.StatusCode.OK
    assert await session_code(pki, server, "cluster-a", "cluster-b") == PD
    assert await session_code(pki, server, "cluster-b", "cluster-a") == PD
    assert await session_code(pki, server, "admin", "cluster-a") == PD
    assert await session_code(pki, server, "shard-0", "cluster-a") == PD


@pytest.mark.parametrize("who", ["no-identity", "two-identities"])
async def test_bad_identity_certificates_denied(pki: Pki, server: int, who: str) -> None:
    assert await call_code(pki, server, who, "ListShards", cpb.ListShardsRequest()) == PD


async def test_foreign_scheme_sans_are_ignored(pki: Pki, server: int) -> None:
    assert await call_code(pki, server, "foreign-scheme", "ListShards", cpb.ListShardsRequest()) == grpc.StatusCode.OK


@pytest.mark.parametrize("who", ["expired-admin", "foreign-ca-admin"])
async def test_untrusted_client_certificates_fail_the_handshake(pki: Pki, server: int, who: str) -> None:
    assert await call_code(pki, server, who, "ListShards", cpb.ListShardsRequest()) == grpc.StatusCode.UNAVAILABLE


async def test_no_client_certificate_fails_the_handshake(pki: Pki, server: int) -> None:
    creds = grpc.ssl_channel_credentials(root_certificates=pki.ca_file.read_bytes())
    async with grpc.aio.secure_channel(f"127.0.0.1:{server}", creds) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await cgrpc.CoordinatorStub(ch).ListShards(cpb.ListShardsRequest(), timeout=10)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_plaintext_client_cannot_talk_to_tls_server(pki: Pki, server: int) -> None:
    async with dial(f"127.0.0.1:{server}", None) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await cgrpc.CoordinatorStub(ch).ListShards(cpb.ListShardsRequest(), timeout=10)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_client_rejects_server_from_foreign_ca(pki: Pki) -> None:
    srv, port, _ = await start(cfg(pki, "foreign-ca-admin", ca=pki.ca_file))
    try:
        assert await call_code(pki, port, "admin", "ListShards", cpb.ListShardsRequest()) == grpc.StatusCode.UNAVAILABLE
    finally:
        await srv.stop(None)


async def test_plaintext_server_skips_checks(pki: Pki) -> None:
    srv, port, coord = await start(None)
    try:
        async with dial(f"127.0.0.1:{port}", None) as ch:
            await cgrpc.CoordinatorStub(ch).AssignDomain(
                cpb.AssignDomainRequest(topology_key="k", topology_value="v", shard_id="s"), timeout=10
            )
            call = sgrpc.ShardStub(ch).Session(timeout=10)
            await call.write(spb.OperatorMessage(hello=spb.Hello(cluster_id="any")))
            assert (await call.read()).ack.echo == "hello"
            await call.done_writing()
        assert coord.domains == [("k", "v", "s")]
    finally:
        await srv.stop(None)


def _bump(path: Path, ns: int) -> None:
    os.utime(path, ns=(ns, ns))


async def test_rotation_is_picked_up_and_half_written_pair_is_ignored(pki: Pki, tmp_path: Path) -> None:
    """Server leaf rotates from CA1 to CA2; clients trusting only one CA show which one serves."""
    from bigfleet.security import certs
    from bigfleet.security.identity import shard

    ca2 = pki.foreign_ca
    both = tmp_path / "client-ca.pem"
    crt, key = tmp_path / "srv.crt", tmp_path / "srv.key"
    certs.write_pair(certs.issue_certificate(pki.ca, shard("shard-0")), crt, key)
    _bump(crt, 1_000_000_000_000_000_000)
    _bump(key, 1_000_000_000_000_000_000)
    server_cfg = TLSConfig.from_paths(crt, key, pki.ca_file)  # verifies clients against CA1 only
    reloader = server_cfg.reloader()
    from bigfleet.rpc import new_server
    from bigfleet.security import COORDINATOR_POLICY, RoleInterceptor

    from .servers import Coordinator

    srv, _ = new_server(interceptors=[RoleInterceptor(COORDINATOR_POLICY)])
    cgrpc.add_CoordinatorServicer_to_server(Coordinator(), srv)  # type: ignore[abstract]
    port = srv.add_secure_port("127.0.0.1:0", server_cfg.server_credentials(reloader))
    await srv.start()
    ca2_file = tmp_path / "ca2.pem"
    ca2_file.write_bytes(ca2.cert_pem)
    both.write_bytes(pki.ca.cert_pem + ca2.cert_pem)

    async def ok_with(server_ca: Path) -> bool:
        client = TLSConfig.from_paths(pki.root / "readonly.crt", pki.root / "readonly.key", server_ca)
        async with dial(f"127.0.0.1:{port}", client) as ch:
            try:
                await cgrpc.CoordinatorStub(ch).ListShards(cpb.ListShardsRequest(), timeout=10)
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE
                return False
            return True

    try:
        assert await ok_with(pki.ca_file) and not await ok_with(ca2_file)
        new = certs.issue_certificate(ca2, shard("shard-0"))
        # Half-written rotation: the new certificate lands first, the key is still the old one.
        crt.write_bytes(new.cert_pem)
        _bump(crt, 1_000_000_000_000_000_001)
        assert await ok_with(pki.ca_file), "a mismatched pair must keep the old one serving"
        assert reloader.reloads == 0 and reloader.failures == 1
        # The key follows: now the CA2 leaf serves.
        certs.write_pair(new, crt, key)
        _bump(crt, 1_000_000_000_000_000_002)
        _bump(key, 1_000_000_000_000_000_002)
        assert await ok_with(ca2_file) and not await ok_with(pki.ca_file)
        assert reloader.reloads == 1
        assert await ok_with(both)
        # A vanished file (failed stat) keeps the cached pair serving.
        key.unlink()
        assert await ok_with(ca2_file)
    finally:
        await srv.stop(None)


async def test_denied_call_never_reaches_the_handler_and_is_counted(pki: Pki) -> None:
    from prometheus_client import CollectorRegistry

    from bigfleet.rpc import new_server
    from bigfleet.security import COORDINATOR_POLICY, RoleInterceptor, add_port

    from .servers import Coordinator

    registry = CollectorRegistry()
    srv, _ = new_server(interceptors=[RoleInterceptor(COORDINATOR_POLICY, registry=registry, component="coordinator")])
    coord = Coordinator()  # type: ignore[abstract]
    cgrpc.add_CoordinatorServicer_to_server(coord, srv)
    port = add_port(srv, "127.0.0.1:0", cfg(pki, "shard-0"))
    await srv.start()
    try:
        req = cpb.AssignDomainRequest(topology_key="zone", topology_value="a", shard_id="shard-0")
        assert await call_code(pki, port, "readonly", "AssignDomain", req) == PD
        assert coord.domains == []
        value = registry.get_sample_value(
            "bigfleet_coordinator_permission_denied_total",
            {"method": "/bigfleet.v1alpha1.Coordinator/AssignDomain"},
        )
        assert value == 1.0
        assert await call_code(pki, port, "admin", "AssignDomain", req) == grpc.StatusCode.OK
        assert coord.domains == [("zone", "a", "shard-0")]
    finally:
        await srv.stop(None)


class _FakeContext:
    def __init__(self, auth: dict[str, list[bytes]]) -> None:
        self._auth = auth

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"


def test_tls12_session_is_refused_by_the_policy(pki: Pki) -> None:
    from bigfleet.security.roles import READ, _decide

    pem = (pki.root / "admin.crt").read_bytes()
    base = {"transport_security_type": [b"ssl"], "x509_pem_cert": [pem]}
    assert _decide(_FakeContext({**base, "ssl_tls_version": [b"TLSv1.3"]}), READ, None) is None
    reason = _decide(_FakeContext({**base, "ssl_tls_version": [b"TLSv1.2"]}), READ, None)
    assert reason is not None and "TLSv1.2" in reason


@pytest.mark.parametrize("secure", [False, True])
async def test_malformed_frames_end_only_their_call_with_invalid_argument(pki: Pki, secure: bool) -> None:
    tls = cfg(pki, "shard-0") if secure else None
    srv, port, _ = await start(tls)
    try:
        async with dial(f"127.0.0.1:{port}", cfg(pki, "cluster-a") if secure else None) as ch:
            good = sgrpc.ShardStub(ch).Session(timeout=10)
            await good.write(spb.OperatorMessage(hello=spb.Hello(cluster_id="cluster-a")))
            assert (await good.read()).ack.echo == "hello"

            raw = ch.stream_stream(
                "/bigfleet.v1alpha1.Shard/Session",
                request_serializer=lambda b: b,
                response_deserializer=spb.ShardMessage.FromString,
            )(timeout=10)
            await raw.write(spb.OperatorMessage(hello=spb.Hello(cluster_id="cluster-a")).SerializeToString())
            assert (await raw.read()).ack.echo == "hello"
            await raw.write(b"\x12\xff\xff")  # a length-delimited field whose length runs off the end
            assert await raw.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "malformed" in (await raw.details() or "")

            unary = ch.unary_unary(
                "/bigfleet.v1alpha1.Coordinator/ListShards",
                request_serializer=lambda b: b,
                response_deserializer=cpb.ListShardsResponse.FromString,
            )
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await unary(b"\xff", timeout=10)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            # The well-formed session on the same connection is untouched.
            await good.write(spb.OperatorMessage(rollup=capb.ClusterCapacityNeeds(cluster_id="cluster-a")))
            assert (await good.read()).ack.echo == "rollup"
            await good.done_writing()
    finally:
        await srv.stop(None)


async def test_rotating_channel_presents_the_rotated_client_certificate(pki: Pki, tmp_path: Path) -> None:
    import shutil

    from bigfleet.security import RotatingChannel

    srv, port, _ = await start(cfg(pki, "shard-0"))
    crt, key = tmp_path / "me.crt", tmp_path / "me.key"
    shutil.copy(pki.root / "readonly.crt", crt)
    shutil.copy(pki.root / "readonly.key", key)
    me = TLSConfig.from_paths(crt, key, pki.ca_file)
    rotating = RotatingChannel(f"127.0.0.1:{port}", me, grace=0.1)
    static = dial(f"127.0.0.1:{port}", me)
    req = cpb.AssignDomainRequest(topology_key="zone", topology_value="r", shard_id="shard-0")

    async def code(ch: grpc.aio.Channel) -> grpc.StatusCode:
        try:
            await cgrpc.CoordinatorStub(ch).AssignDomain(req, timeout=10)
        except grpc.aio.AioRpcError as e:
            return e.code()
        return grpc.StatusCode.OK

    try:
        assert await code(rotating.get()) == PD and await code(static) == PD
        assert rotating.get() is rotating.get()  # nothing changed: same channel
        # Rotate to the admin identity: key first (a half-written pair must not be used) ...
        shutil.copy(pki.root / "admin.key", key)
        _bump(key, 2_000_000_000_000_000_000)
        assert await code(rotating.get()) == PD and rotating.redials == 0
        # ... then the certificate.
        shutil.copy(pki.root / "admin.crt", crt)
        _bump(crt, 2_000_000_000_000_000_001)
        assert await code(rotating.get()) == grpc.StatusCode.OK and rotating.redials == 1
        assert await code(static) == PD  # a plain channel keeps its old certificate
    finally:
        await rotating.close()
        await static.close()
        await srv.stop(None)


def test_self_field_checks_fail_closed_on_undecoded_requests(pki: Pki) -> None:
    from bigfleet.security import PROVIDER_POLICY
    from bigfleet.security.identity import Role
    from bigfleet.security.roles import Access, _decide
    from bigfleet.v1alpha1 import provider_pb2 as ppb

    pem = (pki.root / "shard-1.crt").read_bytes()
    ctx = _FakeContext({"transport_security_type": [b"ssl"], "x509_pem_cert": [pem], "ssl_tls_version": [b"TLSv1.3"]})
    create = PROVIDER_POLICY["/bigfleet.v1alpha1.CapacityProvider/Create"]
    own = ppb.CreateRequest(machine_id="m", shard_id="shard-1").SerializeToString()
    other = ppb.CreateRequest(machine_id="m", shard_id="shard-0").SerializeToString()
    assert _decide(ctx, create, own) is None  # raw bytes (the provider kit's lazy decoding) are parsed
    assert _decide(ctx, create, other) is not None
    no_parser = Access.of(Role.SHARD, self_field="shard_id", allow_empty_self=True)
    reason = _decide(ctx, no_parser, own)
    assert reason is not None and "undecoded" in reason  # cannot check -> refuse, never pass
    reason = _decide(ctx, no_parser, object())
    assert reason is not None and "no shard_id" in reason
