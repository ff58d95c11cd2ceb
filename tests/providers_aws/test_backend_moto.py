"""The AWS backend against a real moto server process: idempotent Create, SSM delivery, tags, prices, interruption."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from bigfleet_provider_aws import states
from bigfleet_provider_aws.aws import TAG_MACHINE, TAG_OPERATION, TAG_PROVIDER, Api, AwsMetrics, tags_of
from bigfleet_provider_aws.backend import AwsBackend
from bigfleet_provider_aws.config import parse_config
from prometheus_client import CollectorRegistry

from bigfleet.provider.kit import (
    CapacityType,
    ConfigureCall,
    CreateCall,
    DeleteCall,
    DrainCall,
    HostRef,
    MachineRecord,
    State,
)

from .conftest import EXAMPLES, Moto

_names = itertools.count()


def make_backend(moto: Moto, **over: Any) -> tuple[AwsBackend, CollectorRegistry]:
    raw: dict[str, Any] = {
        "provider_name": f"t{next(_names)}", "region": "us-east-1", "endpoint_url": moto.url,
        "emulator_credentials": True, "launch": {"image_id": "ami-1e749f67"},
        "supply": {"pools": [{"instance_types": ["m5.large"], "zones": ["us-east-1a", "us-east-1b"],
                              "capacity_types": ["on-demand", "spot"], "slots": 2}],
                   "reserved": [{"instance_type": "c5.large", "zone": "us-east-1a", "count": 1}]},
        "pricing": {"on_demand_file": "prices-on-demand.yaml"},
        "api": {"poll_seconds": 0.02, "max_attempts": 2},
        "bootstrap": {"chunk_chars": 2048},
    }
    for k, v in over.items():
        raw[k] = {**raw[k], **v} if isinstance(v, dict) and isinstance(raw.get(k), dict) else v
    cfg = parse_config(raw, EXAMPLES)
    reg = CollectorRegistry()
    return AwsBackend(cfg, Api(cfg, AwsMetrics(reg))), reg


def record(backend: AwsBackend, slot_index: int = 0, spot: bool = False, state: State = State.CREATING,
           host: str = "") -> MachineRecord:
    slot = [s for s in backend.slots if s.spot == spot][slot_index]
    return MachineRecord(id=slot.id, state=state, instance_type=slot.instance_type, zone=slot.zone,
                         capacity_type=slot.capacity, host=HostRef(backend.host_provider, host) if host else HostRef())


def instances_of(moto: Moto, provider: str) -> list[dict[str, Any]]:
    ec2 = moto.client("ec2")
    out = ec2.describe_instances(Filters=[{"Name": f"tag:{TAG_PROVIDER}", "Values": [provider]}])
    return [i for r in out["Reservations"] for i in r["Instances"]]


def metric(reg: CollectorRegistry, name: str, **labels: str) -> float:
    return reg.get_sample_value(name, labels) or 0.0


async def test_create_is_idempotent_per_operation(moto_server: Moto) -> None:
    """moto ignores ClientToken (two RunInstances, two instances): the operation-tag lookup prevents a second."""
    b, reg = make_backend(moto_server)
    m = record(b)
    first = await b.create_instance(CreateCall(m, "op-1"))
    again = await b.create_instance(CreateCall(m, "op-1"))
    assert first.host == again.host and first.host.ref.startswith("i-")
    assert first.host.provider == f"{b.cfg.provider_name}-us-east-1"
    assert len(instances_of(moto_server, b.cfg.provider_name)) == 1
    assert metric(reg, "bigfleet_aws_create_adopted_total") == 1
    assert metric(reg, "bigfleet_aws_api_calls_total", service="ec2", operation="RunInstances", outcome="ok") == 1
    inst = instances_of(moto_server, b.cfg.provider_name)[0]
    tags = tags_of(inst)
    assert tags[TAG_MACHINE] == m.id
    assert tags[TAG_OPERATION] == states.client_token(b.cfg.provider_name, m.id, "op-1")
    assert tags["bigfleet:capacity-type"] == "on-demand" and tags["Name"] == m.id
    # The create result carries the shape DescribeInstanceTypes gives (m5.large: 2 vCPU, 8 GiB) minus the reserve.
    assert first.resources == {"cpu": "2", "memory": "8192Mi", "pods": "29"}
    assert first.allocatable == {"cpu": "1900m", "memory": "7680Mi", "pods": "29"}
    # A later transition of the same slot (a new operation) launches a new instance.
    third = await b.create_instance(CreateCall(m, "op-9"))
    assert third.host.ref != first.host.ref


async def test_create_adopts_the_instance_an_earlier_attempt_launched(moto_server: Moto) -> None:
    b, reg = make_backend(moto_server)
    m = record(b, 1)
    token = states.client_token(b.cfg.provider_name, m.id, "op-3")
    ec2 = moto_server.client("ec2")
    pre = ec2.run_instances(ImageId="ami-1e749f67", InstanceType="m5.large", MinCount=1, MaxCount=1,
                            TagSpecifications=[{"ResourceType": "instance", "Tags": [
                                {"Key": TAG_PROVIDER, "Value": b.cfg.provider_name},
                                {"Key": TAG_MACHINE, "Value": m.id}, {"Key": TAG_OPERATION, "Value": token}]}])
    got = await b.create_instance(CreateCall(m, "op-3"))
    assert got.host.ref == pre["Instances"][0]["InstanceId"]
    assert metric(reg, "bigfleet_aws_api_calls_total", service="ec2", operation="RunInstances", outcome="ok") == 0


async def test_spot_create_uses_the_spot_market(moto_server: Moto) -> None:
    b, _ = make_backend(moto_server)
    got = await b.create_instance(CreateCall(record(b, spot=True), "op-1"))
    inst = moto_server.client("ec2").describe_instances(InstanceIds=[got.host.ref])["Reservations"][0]["Instances"][0]
    assert inst["InstanceLifecycle"] == "spot" and inst["Placement"]["AvailabilityZone"] == "us-east-1a"


async def test_failed_launch_names_the_cause(moto_server: Moto) -> None:
    b, _ = make_backend(moto_server, launch={"image_id": "ami-1e749f67", "security_group_ids": ["sg-nope"]})
    with pytest.raises(RuntimeError, match=r"RunInstances m5.large in us-east-1a: InvalidGroup.NotFound: .*sg-nope"):
        await b.create_instance(CreateCall(record(b), "op-1"))


async def test_describe_prices_shapes_and_reserved(moto_server: Moto) -> None:
    b, reg = make_backend(moto_server)
    by_id = {i.id: i for i in await b.describe()}
    assert len(by_id) == len(b.slots) == 9
    od = next(i for i in by_id.values() if i.capacity_type == CapacityType.ON_DEMAND)
    spot = next(i for i in by_id.values() if i.capacity_type == CapacityType.SPOT)
    rsv = next(i for i in by_id.values() if i.capacity_type == CapacityType.RESERVED)
    assert od.price_per_hour == 0.096 and od.interruption_probability == 0.0  # the price table
    assert spot.price_per_hour == pytest.approx(0.00001)  # DescribeSpotPriceHistory (moto's number)
    assert spot.interruption_probability == 0.05  # the configured default
    assert rsv.price_per_hour == 0.0 and rsv.instance_type == "c5.large"
    assert od.allocatable == {"cpu": "1900m", "memory": "7680Mi", "pods": "29"}
    assert od.labels["bigfleet.aws/capacity-type"] == "on-demand" and spot.labels["bigfleet.aws/capacity-type"] == "spot"
    assert all(i.state == State.SPECULATIVE and i.host is None for i in by_id.values())
    assert metric(reg, "bigfleet_aws_spot_price_refresh_total", outcome="ok") == 1
    await b.describe()  # prices are cached for spot_refresh_seconds
    assert metric(reg, "bigfleet_aws_spot_price_refresh_total", outcome="ok") == 1


async def test_a_fresh_start_adopts_running_instances(moto_server: Moto) -> None:
    """Without its state file the provider finds its hosts by tag and reports them IDLE, not SPECULATIVE."""
    b, _ = make_backend(moto_server)
    m = record(b)
    first = await b.create_instance(CreateCall(m, "op-1"))
    await b.delete_instance(DeleteCall(record(b, host=first.host.ref), "op-2"))
    got = await b.create_instance(CreateCall(m, "op-3"))  # the slot's second instance, same second maybe
    b2 = AwsBackend(b.cfg, Api(b.cfg, AwsMetrics(CollectorRegistry())))
    found = {i.id: i for i in await b2.describe()}
    assert found[m.id].state == State.IDLE and found[m.id].host == got.host  # the live one, not the terminated
    assert sum(i.state == State.IDLE for i in found.values()) == 1


async def test_configure_drain_delete(moto_server: Moto) -> None:
    b, _ = make_backend(moto_server)
    m = record(b)
    host = (await b.create_instance(CreateCall(m, "op-1"))).host
    m = record(b, state=State.CONFIGURING, host=host.ref)
    blob = b"#!/bin/sh\necho join\n" * 300  # 6 KiB -> 4 SendCommands of 2048 base64 characters
    md = {"bigfleet.lucy.sh/owner-shard": "shard-0", "weird": "a\x00b"}
    await b.configure_instance(ConfigureCall(m, "cluster-a", blob, "op-2", md))
    ec2, ssm = moto_server.client("ec2"), moto_server.client("ssm")
    inst = ec2.describe_instances(InstanceIds=[host.ref])["Reservations"][0]["Instances"][0]
    tags = tags_of(inst)
    assert tags["bigfleet:cluster"] == "cluster-a"
    assert tags["bigfleet:md:bigfleet.lucy.sh/owner-shard"] == "shard-0"
    assert "bigfleet:md:weird" not in tags  # not a valid tag value: kept by the kit, not tagged
    cmds = ssm.list_commands(InstanceId=host.ref)["Commands"]
    assert len(cmds) == 4 and all(c["DocumentName"] == "AWS-RunShellScript" for c in cmds)
    m.cluster, m.shard_metadata, m.state = "cluster-a", md, State.DRAINING
    await b.drain_instance(DrainCall(m, 30, "op-3"))
    inst = ec2.describe_instances(InstanceIds=[host.ref])["Reservations"][0]["Instances"][0]
    assert not any(k.startswith(("bigfleet:cluster", "bigfleet:md:")) for k in tags_of(inst))
    assert len(ssm.list_commands(InstanceId=host.ref)["Commands"]) == 5
    await b.delete_instance(DeleteCall(m, "op-4"))
    inst = ec2.describe_instances(InstanceIds=[host.ref])["Reservations"][0]["Instances"][0]
    assert inst["State"]["Name"] in ("shutting-down", "terminated")
    await b.delete_instance(DeleteCall(m, "op-4"))  # terminating a terminated instance is fine


async def test_spot_interruption_notice_from_sqs_is_durable(moto_server: Moto) -> None:
    sqs = moto_server.client("sqs")
    url = sqs.create_queue(QueueName=f"bf-interrupt-{next(_names)}")["QueueUrl"]
    b, reg = make_backend(moto_server, interruption={"sqs_queue_url": url})
    m = record(b, spot=True)
    host = (await b.create_instance(CreateCall(m, "op-1"))).host
    other = (await b.create_instance(CreateCall(record(b, 1, spot=True), "op-2"))).host
    event = {"version": "0", "detail-type": "EC2 Spot Instance Interruption Warning", "source": "aws.ec2",
             "resources": [f"arn:aws:ec2:us-east-1:123456789012:instance/{host.ref}"],
             "detail": {"instance-id": host.ref, "instance-action": "terminate"}}
    rebalance = {"detail-type": "EC2 Instance Rebalance Recommendation", "detail": {"instance-id": other.ref}}
    for body in (event, rebalance, {"detail-type": "x", "detail": {"instance-id": "i-notours"}}):
        sqs.send_message(QueueUrl=url, MessageBody=json.dumps(body))
    by_id = {i.id: i for i in await b.describe()}
    warned, rebalanced = by_id[m.id], by_id[record(b, 1, spot=True).id]
    assert warned.interruption_probability == 0.99 and warned.labels["bigfleet.aws/interruption"] == "warning"
    assert rebalanced.interruption_probability == 0.5
    assert metric(reg, "bigfleet_aws_spot_interruptions_total", kind="warning") == 1
    assert "Messages" not in sqs.receive_message(QueueUrl=url, WaitTimeSeconds=0)  # consumed
    # The mark lives on the instance (a tag), so a restarted provider still reports it.
    b2 = AwsBackend(b.cfg, Api(b.cfg, AwsMetrics(CollectorRegistry())))
    assert {i.id: i for i in await b2.describe()}[m.id].interruption_probability == 0.99
    # Delete clears it: the slot's next instance starts with the forecast again.
    await b.delete_instance(DeleteCall(record(b, spot=True, host=host.ref), "op-3"))
    assert {i.id: i for i in await b.describe()}[m.id].interruption_probability == 0.05


def test_secrets_never_reach_the_logs(moto_server: Moto, tmp_path: Path) -> None:
    """Covered end to end in test_process.py; here: botocore's loggers are capped below DEBUG."""
    import logging

    import bigfleet_provider_aws.aws  # noqa: F401

    assert logging.getLogger("botocore").getEffectiveLevel() >= logging.WARNING
