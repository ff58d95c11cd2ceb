"""Pure parts of the AWS provider: state mapping, capacity types, tokens, shapes, supply, bootstrap scripts."""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
from bigfleet_provider_aws import states
from bigfleet_provider_aws.aws import metadata_tags, parse_event
from bigfleet_provider_aws.backend import bootstrap_scripts, build_slots
from bigfleet_provider_aws.config import ConfigError, SystemReserve, load_config, parse_config

from bigfleet.provider.kit import CapacityType
from bigfleet.provider.kit.model import validate_instance

from .conftest import MOTO_YAML

# ---- EC2 state -> contract state --------------------------------------------------------------------


@pytest.mark.parametrize(("state", "outcome"), [
    ("pending", states.Outcome.WAIT),
    ("running", states.Outcome.READY),
    ("shutting-down", states.Outcome.FAILED),
    ("terminated", states.Outcome.FAILED),
    ("stopping", states.Outcome.FAILED),
    ("stopped", states.Outcome.FAILED),
    ("rebooting-in-space", states.Outcome.FAILED),
])
def test_create_outcome_maps_every_ec2_state(state: str, outcome: states.Outcome) -> None:
    got, why = states.create_outcome(state, "Server.InsufficientInstanceCapacity")
    assert got == outcome
    assert bool(why) == (outcome == states.Outcome.FAILED)
    if outcome == states.Outcome.FAILED:
        assert state in why and "InsufficientInstanceCapacity" in why


def test_metal_is_bare_metal_only_on_demand() -> None:
    assert states.capacity_type(CapacityType.ON_DEMAND, "m5.metal") == CapacityType.BARE_METAL
    assert states.capacity_type(CapacityType.ON_DEMAND, "c6i.metal") == CapacityType.BARE_METAL
    assert states.capacity_type(CapacityType.ON_DEMAND, "m7i.metal-24xl") == CapacityType.BARE_METAL
    assert states.capacity_type(CapacityType.SPOT, "m5.metal") == CapacityType.SPOT
    assert states.capacity_type(CapacityType.ON_DEMAND, "m5.large") == CapacityType.ON_DEMAND


def test_client_token_is_derived_from_the_operation() -> None:
    t = states.client_token("aws", "aws-od-m5.large-us-east-1a-000", "op-7")
    assert t == states.client_token("aws", "aws-od-m5.large-us-east-1a-000", "op-7")  # retries: same token
    assert t != states.client_token("aws", "aws-od-m5.large-us-east-1a-000", "op-8")  # next transition
    assert t != states.client_token("aws", "aws-od-m5.large-us-east-1a-001", "op-7")  # other machine
    assert t != states.client_token("aws-2", "aws-od-m5.large-us-east-1a-000", "op-7")  # other provider
    assert len(t) <= 64 and t.isascii()


def test_allocatable_subtracts_the_system_reserve() -> None:
    info = {"VCpuInfo": {"DefaultVCpus": 2}, "MemoryInfo": {"SizeInMiB": 8192},
            "NetworkInfo": {"MaximumNetworkInterfaces": 3, "Ipv4AddressesPerInterface": 10}}
    res, alloc = states.allocatable(info, SystemReserve(cpu_millis=100, memory_mib=512))
    assert res == {"cpu": "2", "memory": "8192Mi", "pods": "29"}  # ENI formula: 3 x (10 - 1) + 2
    assert alloc == {"cpu": "1900m", "memory": "7680Mi", "pods": "29"}
    _, alloc = states.allocatable(info, SystemReserve(cpu_millis=0, memory_mib=0, cpu_percent=10,
                                                      memory_percent=25, max_pods=110))
    assert alloc == {"cpu": "1800m", "memory": "6144Mi", "pods": "110"}
    gpu = {**info, "GpuInfo": {"Gpus": [{"Manufacturer": "NVIDIA", "Count": 4}]}}
    res, alloc = states.allocatable(gpu, SystemReserve())
    assert res["nvidia.com/gpu"] == alloc["nvidia.com/gpu"] == "4"


def test_interruption_marks() -> None:
    m = states.interruption_mark
    assert m("running", "", "", 0.99, 0.5) is None
    assert m("running", "", "warning", 0.99, 0.5) == states.Mark("warning", 0.99)
    assert m("running", "", "rebalance", 0.99, 0.5) == states.Mark("rebalance", 0.5)
    assert m("terminated", states.REASON_SPOT, "", 0.99, 0.5) == states.Mark("interrupted", 1.0)
    assert m("shutting-down", "", "warning", 0.99, 0.5) == states.Mark("interrupted", 1.0)
    assert m("terminated", states.REASON_USER, "warning", 0.99, 0.5) is None  # someone terminated it
    assert m("terminated", states.REASON_SPOT, "warning", 0.99, 0.5, released=True) is None  # our own Delete


def test_eventbridge_events_parse() -> None:
    warning = {"detail-type": "EC2 Spot Instance Interruption Warning", "source": "aws.ec2",
               "detail": {"instance-id": "i-0abc", "instance-action": "terminate"}}
    assert parse_event(json.dumps(warning)) == ("i-0abc", "EC2 Spot Instance Interruption Warning")
    rebalance = {"detail-type": "EC2 Instance Rebalance Recommendation",
                 "resources": ["arn:aws:ec2:us-east-1:123456789012:instance/i-0def"], "detail": {}}
    assert parse_event(json.dumps(rebalance)) == ("i-0def", "EC2 Instance Rebalance Recommendation")
    assert parse_event("not json") == ("", "")
    assert parse_event("[1]") == ("", "")


def test_metadata_tags_keep_only_what_ec2_accepts() -> None:
    md = {"bigfleet.lucy.sh/owner-shard": "shard-0", "nul": "a\x00b", "long": "x" * 300, "k" * 200: "v"}
    assert metadata_tags(md) == {"bigfleet:md:bigfleet.lucy.sh/owner-shard": "shard-0"}
    many = {f"k{i:02d}": "v" for i in range(60)}
    assert len(metadata_tags(many)) == 30


# ---- configuration and supply -----------------------------------------------------------------------


def test_moto_example_loads_and_builds_the_supply() -> None:
    cfg = load_config(MOTO_YAML)
    assert cfg.region == "us-east-1" and cfg.endpoint_url == "http://127.0.0.1:5000"
    assert load_config(MOTO_YAML, region="us-west-2", endpoint_url="http://x:1").endpoint_url == "http://x:1"
    slots = build_slots(cfg)
    by_cap: dict[CapacityType, int] = {}
    for s in slots:
        by_cap[s.capacity] = by_cap.get(s.capacity, 0) + 1
    assert by_cap == {CapacityType.ON_DEMAND: 32, CapacityType.SPOT: 32, CapacityType.BARE_METAL: 2,
                      CapacityType.RESERVED: 4}
    assert len({s.id for s in slots}) == len(slots)
    assert slots == build_slots(cfg)  # deterministic ids
    assert "aws-moto-metal-m5.metal-us-east-1a-000" in {s.id for s in slots}
    spread = build_slots(cfg, seed_count=100)
    assert len(spread) == 100 + 4  # the seed count replaces pool slots; reservations stay
    assert cfg.interruption.forecast("c5.large", "us-east-1a") == 0.08
    assert cfg.interruption.forecast("m5.large", "us-east-1a") == 0.05


def _base() -> dict[str, object]:
    return {"region": "us-east-1", "launch": {"image_id": "ami-1"},
            "supply": {"pools": [{"instance_types": ["m5.large"], "zones": ["us-east-1a"],
                                  "capacity_types": ["on-demand", "spot"], "slots": 1}]},
            "pricing": {"on_demand": {"m5.large": 0.096}}}


@pytest.mark.parametrize(("patch", "message"), [
    ({"surprise": 1}, "unknown key"),
    ({"region": ""}, "region: required"),
    ({"launch": {}}, "launch.image_id: required"),
    ({"pricing": {}}, "no on-demand price"),
    ({"interruption": {"default_probability": 0}}, "probability 0"),
    ({"interruption": {"default_probability": 1.5}}, "outside"),
    ({"supply": {"pools": [{"instance_types": ["m5.large"], "zones": ["a"], "capacity_types": ["reserved"]}]}},
     "unknown capacity type"),
    ({"emulator_credentials": True}, "only with an endpoint_url"),
    ({"launch": {"image_id": "ami-1", "tags": {"bigfleet:x": "y"}}}, "reserved"),
    ({"supply": {}}, "at least one"),
    ({"system_reserve": {"cpu": "lots"}}, "system_reserve.cpu"),
])
def test_config_errors_name_the_key(patch: dict[str, object], message: str) -> None:
    raw = {**_base(), **patch}
    with pytest.raises(ConfigError, match=message):
        parse_config(raw, Path("."))


def test_every_slot_is_a_valid_kit_record() -> None:
    """Records built from the example config pass the kit's own validation (spot p > 0, no forbidden labels)."""
    from bigfleet.provider.kit import Instance

    cfg = load_config(MOTO_YAML)
    for s in build_slots(cfg):
        p = cfg.interruption.forecast(s.instance_type, s.zone) if s.spot else 0.0
        validate_instance(Instance(s.id, s.instance_type, s.zone, s.capacity, 0.1, p, labels=s.labels),
                          require_zone=True)


# ---- the bootstrap delivery, run for real in a shell ------------------------------------------------


@pytest.mark.parametrize("size", [0, 14, 100_000])
def test_bootstrap_scripts_deliver_the_blob_byte_for_byte(tmp_path: Path, size: int) -> None:
    blob = os.urandom(size)
    hook = tmp_path / "hook"
    out = tmp_path / "received"
    hook.write_text(f"#!/bin/sh\nprintf %s \"$1\" > {out}.cluster\ncp \"$2\" {out}\n")
    hook.chmod(hook.stat().st_mode | stat.S_IXUSR)
    cluster = "prod-'eu' $(rm -rf /)"
    scripts = bootstrap_scripts(blob, cluster, "op-1", str(hook), chunk_chars=4096, state_dir=str(tmp_path / "st"))
    assert len(scripts) == max(1, -(-len(base64.b64encode(blob)) // 4096))
    for sc in scripts:
        subprocess.run(["sh", "-c", sc], check=True, timeout=30)
    assert out.read_bytes() == blob
    assert (tmp_path / f"{out.name}.cluster").read_text() == cluster
    assert (tmp_path / "st" / "bootstrap.blob").stat().st_mode & 0o077 == 0  # root-only
    assert not list((tmp_path / "st").glob("*.b64"))  # the staging file is gone


def test_bootstrap_scripts_refuse_a_corrupted_blob(tmp_path: Path) -> None:
    hook = tmp_path / "hook"
    hook.write_text("#!/bin/sh\nexit 0\n")
    hook.chmod(0o755)
    scripts = bootstrap_scripts(b"x" * 10_000, "c", "op-2", str(hook), chunk_chars=4096,
                                state_dir=str(tmp_path))
    scripts[1] = scripts[1].replace("printf %s '", "printf %s 'AAAA", 1)  # a chunk arrives altered
    for sc in scripts[:-1]:
        subprocess.run(["sh", "-c", sc], check=True, timeout=30)
    assert subprocess.run(["sh", "-c", scripts[-1]], timeout=30).returncode != 0
