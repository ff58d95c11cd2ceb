"""The AWS provider as a real process against moto: restart durability, interruption, metrics, secrets, mTLS."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from bigfleet.provider.conformance.harness import CONFIGURED, IDLE, Harness, S, ShardSession, Token
from bigfleet.testing import ManagedProcess, free_port, wait_until
from bigfleet.v1alpha1 import provider_pb2 as pb

from .conftest import EXAMPLES, MOTO_YAML, Moto

SECRET_BLOB = b"#!/bin/sh\nkubeadm join --token TOPSECRET-abcdef.0123456789abcdef\n"
SECRET_KEY = "wJalrXUtnFEMI-not-a-real-secret-key"


def write_config(tmp: Path, moto: Moto, **interruption: Any) -> Path:
    raw = yaml.safe_load(MOTO_YAML.read_text())
    raw["provider_name"] = f"aws-{tmp.name[-12:].lower().replace('_', '-')}".rstrip("-")
    raw["endpoint_url"] = moto.url
    raw["pricing"]["on_demand_file"] = str(EXAMPLES / "prices-on-demand.yaml")
    raw["interruption"].update(interruption)
    path = tmp / "aws.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def start(cfg: Path, tmp: Path, *extra: str, name: str = "aws-provider") -> tuple[ManagedProcess, str]:
    addr = f"127.0.0.1:{free_port()}"
    proc = ManagedProcess([sys.executable, "-m", "bigfleet_provider_aws", "--config", str(cfg), "--listen", addr,
                           "--log-format", "console", *extra], name, log_dir=tmp,
                          env={"AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEYID", "AWS_SECRET_ACCESS_KEY": SECRET_KEY})
    proc.start()
    proc.wait_healthy(addr, timeout=60)
    return proc, addr


@pytest.mark.slow
def test_restart_interruption_metrics_and_no_secrets_in_logs(moto_server: Moto, tmp_path: Path) -> None:
    sqs = moto_server.client("sqs")
    queue = sqs.create_queue(QueueName="bigfleet-spot-interruptions")["QueueUrl"]
    cfg = write_config(tmp_path, moto_server, sqs_queue_url=queue)
    state = tmp_path / "state.json"
    metrics_addr = f"127.0.0.1:{free_port()}"
    args = ("--state-file", str(state), "--metrics-listen", metrics_addr, "--reconcile-interval", "0.3",
            "--log-level", "debug")
    proc, addr = start(cfg, tmp_path, *args)
    h = Harness(addr, settle_timeout=30)
    try:
        spot = [m for m in h.list([S]).machines if m.capacity_type == pb.CAPACITY_TYPE_SPOT]
        mid = spot[0].id
        shard = ShardSession("aws")
        h.create(mid, shard.next())
        idle = h.must_reach(mid, IDLE)
        assert idle.host.ref.startswith("i-") and idle.allocatable.resources["cpu"].endswith("m")
        md = {"bigfleet.lucy.sh/owner-shard": "shard-0"}
        h.configure(mid, "cluster-a", md, tok=shard.next(), blob=SECRET_BLOB)
        h.must_reach(mid, CONFIGURED)
        last = shard.next()
        assert h.code(h.configure, mid, "cluster-a", md, tok=last, blob=SECRET_BLOB) == grpc.StatusCode.OK
        # EventBridge -> SQS: the 2-minute warning raises the machine's interruption probability and labels it.
        sqs.send_message(QueueUrl=queue, MessageBody=json.dumps({
            "detail-type": "EC2 Spot Instance Interruption Warning", "source": "aws.ec2",
            "detail": {"instance-id": idle.host.ref, "instance-action": "terminate"}}))
        warned = wait_until(lambda: (m := h.get(mid)).interruption_probability == 0.99 and m, 30,
                            what="the interruption notice to reach the machine")
        assert warned.labels["bigfleet.aws/interruption"] == "warning"
        metrics = urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=5).read().decode()
        assert 'bigfleet_aws_api_calls_total{operation="RunInstances",outcome="ok",service="ec2"} 1.0' in metrics
        assert 'bigfleet_aws_spot_interruptions_total{kind="warning"} 1.0' in metrics
        assert 'bigfleet_aws_api_calls_total{operation="SendCommand",outcome="ok",service="ssm"}' in metrics
        assert "bigfleet_provider_rpcs_total" in metrics
        rev = h.revision()
    finally:
        h.close()
    proc.kill()  # SIGKILL: state survives through the kit's state file
    proc2, addr2 = start(cfg, tmp_path, *args, name="aws-provider-restarted")
    h = Harness(addr2, settle_timeout=30)
    try:
        m = h.get(mid)
        assert m.state == CONFIGURED and m.cluster == "cluster-a" and dict(m.shard_metadata) == md
        assert m.host.ref == idle.host.ref and m.interruption_probability == 0.99
        # Fence marks survived: the last token is not newer than itself.
        assert h.code(h.drain, mid, 0, last) == grpc.StatusCode.FAILED_PRECONDITION
        stale = Token(last.shard, last.epoch, last.seq - 1)
        assert h.code(h.drain, mid, 0, stale) == grpc.StatusCode.FAILED_PRECONDITION
        # The revision cursor survived: nothing changed since the cursor taken before the kill.
        assert int(h.revision()) >= int(rev)
        assert not h.list(since=rev).machines
        h.drain(mid, 0, shard.next())
        h.must_reach(mid, IDLE)
        h.delete(mid, shard.next())
        back = h.must_reach(mid, S)
        assert not back.host.ref
        forecast = 0.08 if back.instance_type == "c5.large" else 0.05  # moto.yaml's interruption model
        wait_until(lambda: h.get(mid).interruption_probability == forecast, 30,
                   what="the released slot to return to its forecast probability")
        inst = moto_server.client("ec2").describe_instances(InstanceIds=[idle.host.ref])
        assert inst["Reservations"][0]["Instances"][0]["State"]["Name"] in ("shutting-down", "terminated")
    finally:
        h.close()
        proc2.stop()
    logs = proc.logs() + proc2.logs()
    assert "debug" in logs.lower()
    for secret in ("TOPSECRET", SECRET_KEY):
        assert secret not in logs, f"{secret!r} reached the provider log"


def test_serves_mtls_with_the_shared_tls_flags(moto_server: Moto, tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    made = subprocess.run([sys.executable, "-m", "bigfleet.security.certs", "--out", str(pki), "--shard",
                           "conformance"], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    cfg = write_config(tmp_path, moto_server)
    addr = f"127.0.0.1:{free_port()}"
    proc = ManagedProcess([sys.executable, "-m", "bigfleet_provider_aws", "--config", str(cfg), "--listen", addr,
                           "--tls-cert", str(pki / "readonly.crt"), "--tls-key", str(pki / "readonly.key"),
                           "--tls-ca", str(pki / "ca.crt"), "--log-format", "console"], "aws-tls", log_dir=tmp_path)
    proc.start()
    try:
        shard_tls = ["--tls-cert", str(pki / "shard-conformance.crt"), "--tls-key", str(pki / "shard-conformance.key"),
                     "--tls-ca", str(pki / "ca.crt"), "--tls-ca-key", str(pki / "ca.key")]
        wait_until(lambda: "provider serving" in proc.logs() or not proc.alive(), 60, what="the provider")
        assert proc.alive(), proc.logs()
        run = subprocess.run([sys.executable, "-m", "bigfleet.cli.main", "conformance", "--target", addr, *shard_tls,
                              "--only", "C101,C201,C301", "--strict", "--quiet"],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "3 passed, 0 failed, 0 skipped" in run.stdout
        # Without a certificate the provider refuses the connection.
        with grpc.insecure_channel(addr) as ch, pytest.raises(grpc.RpcError):
            ch.unary_unary("/bigfleet.v1alpha1.CapacityProvider/List")(b"", timeout=5)
    finally:
        proc.stop()


def test_an_unknown_instance_type_stops_the_start_with_one_clear_line(moto_server: Moto, tmp_path: Path) -> None:
    raw = yaml.safe_load(MOTO_YAML.read_text())
    raw["endpoint_url"] = moto_server.url
    raw["pricing"]["on_demand_file"] = str(EXAMPLES / "prices-on-demand.yaml")
    raw["pricing"]["on_demand"] = {"m5.huge": 1.0}
    raw["supply"]["pools"][0]["instance_types"] = ["m5.huge"]
    cfg = tmp_path / "aws.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    p = subprocess.run([sys.executable, "-m", "bigfleet_provider_aws", "--config", str(cfg), "--listen",
                        "127.0.0.1:0"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert "cannot start" in p.stderr and "m5.huge" in p.stderr and "Traceback" not in p.stderr
    bad = subprocess.run([sys.executable, "-m", "bigfleet_provider_aws", "--config", str(MOTO_YAML), "--region",
                          "eu-central-1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no prices for region 'eu-central-1'" in bad.stderr
