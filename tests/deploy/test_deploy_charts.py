"""Helm charts: lint, render, Kubernetes schemas, cross-references, and what the pods would run."""

from __future__ import annotations

import copy
import functools
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
import chartcheck as cc

_missing = cc.tools_missing()
pytestmark = pytest.mark.skipif(_missing is not None, reason=_missing or "")

CASES = [(chart, label) for chart in cc.CHARTS for label, _ in cc.value_sets(chart)]


def values_for(chart: str, label: str) -> dict[str, Any]:
    return copy.deepcopy(dict(cc.value_sets(chart))[label])


@functools.cache
def _rendered(chart: str, label: str) -> list[cc.Doc]:
    return cc.render(chart, values_for(chart, label))


def rendered(chart: str, label: str) -> list[cc.Doc]:
    return copy.deepcopy(_rendered(chart, label))


def find(docs: list[cc.Doc], kind: str, name: str) -> cc.Doc:
    for d in docs:
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d
    raise AssertionError(f"{kind}/{name} not rendered; have {[cc.name_of(d) for d in docs]}")


def render_error(chart: str, values: dict[str, Any]) -> str:
    import helm_python as helm

    with pytest.raises(helm.HelmError) as info:
        cc.render(chart, values)
    return str(info.value)


# --- the CI gate ----------------------------------------------------------------------------


@pytest.mark.parametrize(("chart", "label"), CASES)
def test_chart_lints_renders_and_validates(chart: str, label: str) -> None:
    result = cc.check(chart, label, values_for(chart, label), cc.kube_versions())
    assert result.objects > 0
    assert result.problems == []


def test_every_chart_has_non_default_values_under_test() -> None:
    for chart in cc.CHARTS:
        assert any(label != "defaults" for label, _ in cc.value_sets(chart)), chart


# --- the checker itself can fail ------------------------------------------------------------


def test_schema_check_rejects_unknown_and_mistyped_fields() -> None:
    docs = rendered("bigfleet", "minimal-values.yaml")
    sts = find(docs, "StatefulSet", "bigfleet-coordinator")
    assert cc.schema_errors(sts, cc.MIN_KUBE) == []
    typo = copy.deepcopy(sts)
    typo["spec"]["replicaz"] = 3
    assert cc.schema_errors(typo, cc.MIN_KUBE)
    wrong_type = copy.deepcopy(sts)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "grpc"
    assert cc.schema_errors(wrong_type, cc.MIN_KUBE)
    unknown_kind = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    assert any("no schema" in e for e in cc.schema_errors(unknown_kind, cc.MIN_KUBE))


def test_schema_check_covers_prometheus_operator_kinds() -> None:
    docs = rendered("bigfleet", "full-values.yaml")
    sm = find(docs, "ServiceMonitor", "fleet")
    assert cc.schema_errors(sm, cc.MIN_KUBE) == []
    bad = copy.deepcopy(sm)
    bad["spec"]["endpoints"][0]["intervall"] = "30s"
    assert cc.schema_errors(bad, cc.MIN_KUBE)
    rule = find(docs, "PrometheusRule", "fleet")
    bad_rule = copy.deepcopy(rule)
    bad_rule["spec"]["groups"][0]["rules"][0]["for"] = "five minutes"
    assert cc.schema_errors(bad_rule, cc.MIN_KUBE)


def test_reference_check_catches_dangling_selectors_and_ports() -> None:
    docs = rendered("bigfleet", "minimal-values.yaml")
    assert cc.reference_errors(docs) == []
    broken = copy.deepcopy(docs)
    find(broken, "Service", "bigfleet-shard-0")["spec"]["selector"]["bigfleet.lucy.sh/shard-id"] = "shard-9"
    find(broken, "Service", "bigfleet-coordinator")["spec"]["ports"][0]["targetPort"] = "grcp"
    errors = cc.reference_errors(broken)
    assert any("matches no pod template" in e for e in errors)
    assert any("targetPort grcp" in e for e in errors)
    no_governor = [d for d in copy.deepcopy(docs) if d["metadata"]["name"] != "bigfleet-coordinator-headless"]
    assert any("governing Service" in e for e in cc.reference_errors(no_governor))


def test_lint_reports_a_broken_template(tmp_path: Path) -> None:
    chart = tmp_path / "broken"
    shutil.copytree(cc.HELM_DIR / "bigfleet-unschedulable-pod-controller", chart)
    (chart / "templates" / "broken.yaml").write_text("value: {{ .Values.missing.deeper }}\n")
    import helm_python as helm

    report = helm.lint(chart, {}, strict=True, kube_version=f"v{cc.MIN_KUBE}")
    assert any(int(m["severity"]) >= 3 for m in report["messages"])


# --- values that must fail the install --------------------------------------------------------


def test_operator_requires_cluster_and_destination() -> None:
    assert "clusterID is required" in render_error("bigfleet-operator", {"shardAddress": "s:7780"})
    assert "shardAddress or coordinatorAddress" in render_error("bigfleet-operator", {"clusterID": "a"})
    both = {"clusterID": "a", "shardAddress": "s:1", "coordinatorAddress": "c:2"}
    assert "only one of" in render_error("bigfleet-operator", both)
    assert "lower-case" in render_error("bigfleet-operator", {"clusterID": "Bad_ID", "shardAddress": "s:1"})
    no_election = {"clusterID": "a", "shardAddress": "s:1", "leaderElection": {"enabled": False}}
    assert "leaderElection" in render_error("bigfleet-operator", no_election)


def test_control_plane_rejects_unsafe_shapes() -> None:
    assert "shard.provider.address is required" in render_error("bigfleet", {})
    base = values_for("bigfleet", "minimal-values.yaml")
    assert "must be odd" in render_error("bigfleet", {**base, "coordinator": {"replicas": 4}})
    assert "replicasPerShard must be 1 or odd" in render_error(
        "bigfleet", {"shard": {**base["shard"], "replicasPerShard": 2}}
    )
    assert "/shard/count" in render_error("bigfleet", {"shard": {**base["shard"], "count": 0}})


def test_pod_controller_rejects_unknown_penalty_keys_and_second_writer() -> None:
    bad = {"priorityClassDefaults": {"high": {"interuptionPenalty": "5"}}}
    # values.schema.json answers first; the templates' own checks back it up when schema
    # validation is skipped (helm --skip-schema-validation).
    assert "interuptionPenalty" in render_error("bigfleet-unschedulable-pod-controller", bad)
    assert "needs leaderElection.enabled" in render_error(
        "bigfleet-unschedulable-pod-controller", {"replicas": 2, "leaderElection": {"enabled": False}})
    assert "leaseDuration > renewDeadline" in render_error(
        "bigfleet-unschedulable-pod-controller", {"leaderElection": {"enabled": True, "leaseDuration": 5}})


# --- what the control plane runs --------------------------------------------------------------


def _run_launcher(script: str, pod_name: str, tmp_path: Path) -> list[str]:
    """Run a rendered launcher script with a stand-in `bigfleet` that records its argv."""
    fake = tmp_path / "bigfleet"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "POD_NAME": pod_name}
    out = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, check=True, timeout=30)
    return out.stdout.splitlines()


def _flag(argv: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    assert len(values) == 1, (name, argv)
    return values[0]


def test_coordinator_replicas_get_the_other_members_as_peers(tmp_path: Path) -> None:
    docs = rendered("bigfleet", "minimal-values.yaml")
    (cmd,) = [c for c in cc.commands(docs) if c.subcommand == "coordinator"]
    assert cmd.script is not None
    suffix = "bigfleet-coordinator-headless.bigfleet-system.svc.cluster.local:7791"
    for ordinal in range(3):
        pod = f"bigfleet-coordinator-{ordinal}"
        argv = _run_launcher(cmd.script, pod, tmp_path)
        assert argv[0] == "coordinator"
        assert _flag(argv, "node-id") == pod
        assert _flag(argv, "raft-bind") == "0.0.0.0:7791"
        assert _flag(argv, "raft-advertise") == f"{pod}.{suffix}"
        peers = _flag(argv, "raft-peers").split(",")
        assert sorted(peers) == [f"bigfleet-coordinator-{i}.{suffix}" for i in range(3) if i != ordinal]
        assert _flag(argv, "listen") == "0.0.0.0:7790"
        assert _flag(argv, "data-dir") == "/var/lib/bigfleet"


def test_shard_replica_groups_are_separate_raft_groups(tmp_path: Path) -> None:
    docs = rendered("bigfleet", "full-values.yaml")
    shards = [c for c in cc.commands(docs) if c.subcommand == "shard"]
    assert [c.workload for c in shards] == [f"StatefulSet/fleet-shard-{i}" for i in range(3)]
    for i, cmd in enumerate(shards):
        assert cmd.script is not None
        pod = f"fleet-shard-{i}-4"
        argv = _run_launcher(cmd.script, pod, tmp_path)
        assert _flag(argv, "shard-id") == f"shard-{i}"
        assert _flag(argv, "replica-id") == pod
        peers = _flag(argv, "raft-peers").split(",")
        assert len(peers) == 4
        assert all(p.startswith(f"fleet-shard-{i}-") and f".fleet-shard-{i}-raft." in p for p in peers)
        assert pod not in {p.split(".")[0] for p in peers}
        assert _flag(argv, "provider") == "capacity-provider.providers.svc.cluster.local:7700"
        assert _flag(argv, "coordinator") == "fleet-coordinator.bigfleet-system.svc.k8s.internal:7790"
        assert "--dry-run" in argv and "--paused" in argv
        assert "--consolidation" in argv and _flag(argv, "consolidation-margin") == "0.2"
        assert _flag(argv, "consolidation-payback-hours") == "168" and _flag(argv, "consolidation-max-moves") == "2"
        assert _flag(argv, "cycle-interval") == "5"
        assert _flag(argv, "reclaim-cap-fraction") == "0.1"
        assert "--no-empty-rollup-guard" in argv
        assert _flag(argv, "tls-cert") == "/etc/bigfleet/tls/tls.crt"
        sts = find(docs, "StatefulSet", f"fleet-shard-{i}")
        secret = next(v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
        assert secret["secret"]["secretName"] == f"bigfleet-shard-tls-{i}"


def test_coordinator_address_given_to_shards_is_a_rendered_service() -> None:
    docs = rendered("bigfleet", "minimal-values.yaml")
    (shard,) = [c for c in cc.commands(docs) if c.subcommand == "shard"]
    assert shard.script is not None
    host, port = next(a for a in shard.script.split() if "--coordinator=" in a).split("=", 1)[1].strip("'").split(":")
    svc = find(docs, "Service", host.split(".")[0])
    assert svc["spec"]["type"] == "ClusterIP"
    assert int(port) in [p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc"]


def test_single_replica_shard_runs_without_raft_and_defaults_stay_quiet() -> None:
    docs = rendered("bigfleet", "demo-values.yaml")
    by_sub = {c.subcommand: c for c in cc.commands(docs)}
    shard = by_sub["shard"]
    assert shard.script is None
    assert not any(f.startswith("--raft") or f == "--replica-id" for f in shard.flags())
    assert "--dry-run" not in shard.args and "--paused" not in shard.args
    assert not any(a.startswith("--consolidation") for a in shard.args)  # off by default
    assert not any(a.startswith(("--cycle-interval", "--bootstrap-timeout", "--reclaim-cap")) for a in shard.args)
    assert "--no-empty-rollup-guard" not in shard.args
    assert _flag(shard.args, "provider") == "bigfleet-fake-provider.bigfleet-system.svc.cluster.local:7800"
    assert "fake-provider" in by_sub
    assert not [d for d in docs if d["kind"] == "PodDisruptionBudget" and "shard" in d["metadata"]["name"]]


@pytest.mark.parametrize(("replicas", "quorum"), [(3, 2), (5, 3), (7, 4)])
def test_coordinator_pdb_keeps_a_quorum(replicas: int, quorum: int) -> None:
    vals = values_for("bigfleet", "minimal-values.yaml")
    vals["coordinator"] = {"replicas": replicas}
    pdb = find(cc.render("bigfleet", vals), "PodDisruptionBudget", "bigfleet-coordinator")
    assert pdb["spec"]["minAvailable"] == quorum


def test_probes_use_grpc_health_and_fall_back_under_mtls() -> None:
    plain = find(rendered("bigfleet", "minimal-values.yaml"), "StatefulSet", "bigfleet-coordinator")
    c = plain["spec"]["template"]["spec"]["containers"][0]
    assert c["readinessProbe"]["grpc"] == {"port": 7790, "service": "bigfleet.v1alpha1.Coordinator"}
    shard = find(rendered("bigfleet", "minimal-values.yaml"), "StatefulSet", "bigfleet-shard-0")
    assert shard["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["service"] == (
        "bigfleet.v1alpha1.Shard"
    )
    tls = find(rendered("bigfleet", "full-values.yaml"), "StatefulSet", "fleet-coordinator")
    c = tls["spec"]["template"]["spec"]["containers"][0]
    assert "tcpSocket" in c["readinessProbe"] and "grpc" not in c["readinessProbe"]


def test_raft_services_publish_unready_pods_and_client_services_do_not() -> None:
    docs = rendered("bigfleet", "minimal-values.yaml")
    for name in ("bigfleet-coordinator-headless", "bigfleet-shard-0-raft"):
        assert find(docs, "Service", name)["spec"]["publishNotReadyAddresses"] is True
    for name in ("bigfleet-coordinator", "bigfleet-shard-0"):
        assert not find(docs, "Service", name)["spec"].get("publishNotReadyAddresses")


def test_alert_runbook_links_point_at_operator_guide_sections() -> None:
    guide = (cc.REPO / "docs" / "operator-guide.md").read_text()
    anchors = {_anchor(line) for line in guide.splitlines() if line.startswith("#")}
    explicit = {line.split('id="')[1].split('"')[0] for line in guide.splitlines() if 'id="' in line}
    rule = find(rendered("bigfleet", "full-values.yaml"), "PrometheusRule", "fleet")
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert len(alerts) >= 10
    for r in alerts:
        target = r["annotations"]["runbook"]
        assert target.startswith("docs/operator-guide.md#"), target
        assert target.split("#", 1)[1] in anchors | explicit, target
        assert r["alert"] in guide, f"{r['alert']} is not documented in the operator guide"


@pytest.mark.parametrize(("replicas", "quorum"), [(1, 1), (3, 2), (5, 3)])
def test_shard_quorum_alert_fires_with_every_replica_down(replicas: int, quorum: int) -> None:
    """`count(up == 1) < n` has no series to compare once every replica is down (the filter drops
    them all), so it never fired then. The rule sums `up` per group instead (0 while the down
    targets are still scraped) and falls back to absent() when no shard target is left at all."""
    values = values_for("bigfleet", "full-values.yaml")
    values["shard"]["replicasPerShard"] = replicas
    rule = find(cc.render("bigfleet", values), "PrometheusRule", "fleet")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    expr = " ".join(alerts["BigFleetShardGroupWithoutQuorum"]["expr"].split())
    ns = rule["metadata"]["namespace"]
    up = f'up{{job="shard", namespace="{ns}"}}'
    assert expr == (f'sum by (bigfleet_shard) (label_replace({up}, "bigfleet_shard", "$1", "pod", "(.*)-[0-9]+"))'
                    f" < {quorum} or absent({up})")
    # Any rule counting only the targets that are up must say what happens when none is.
    for name, r in alerts.items():
        if re.search(r"count[^(]*\(.*== 1", r["expr"]):
            assert "absent(" in r["expr"], f"{name}: counts up == 1 without an absent() fallback"


def _anchor(heading: str) -> str:
    text = heading.lstrip("#").strip().lower()
    out = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return out.replace(" ", "-")


# --- operator and pod controller ------------------------------------------------------------------

# protocols.md §11.6 plus the Lease and the release's own configuration.
REQUIRED_RULES = [
    ("ClusterRole", "bigfleet.lucy.sh", "capacityrequests", {"get", "list", "watch"}),
    ("ClusterRole", "bigfleet.lucy.sh", "capacityrequests/status", {"update", "patch"}),
    ("ClusterRole", "bigfleet.lucy.sh", "upcomingnodes", {"get", "list", "watch", "create", "update", "patch", "delete"}),
    ("ClusterRole", "bigfleet.lucy.sh", "availablecapacities", {"get", "list", "watch", "create", "update", "patch", "delete"}),
    ("ClusterRole", "bigfleet.lucy.sh", "upcomingnodes/status", {"update", "patch"}),
    ("ClusterRole", "", "nodes", {"get", "list", "watch", "patch", "update"}),
    ("ClusterRole", "", "pods", {"get", "list", "watch"}),
    ("ClusterRole", "", "pods/eviction", {"create"}),
    ("Role", "coordination.k8s.io", "leases", {"get", "create", "update"}),
    ("Role", "", "configmaps", {"get", "list", "watch", "create", "update"}),
    ("Role", "", "secrets", {"get"}),
]


def _granted(role: cc.Doc, group: str, resource: str) -> set[str]:
    verbs: set[str] = set()
    for rule in role["rules"]:
        if group in rule["apiGroups"] and resource in rule["resources"]:
            verbs |= set(rule["verbs"])
    return verbs


def test_operator_rbac_grants_what_the_operator_does() -> None:
    docs = rendered("bigfleet-operator", "minimal-values.yaml")
    roles = {d["kind"]: d for d in docs if d["kind"] in ("ClusterRole", "Role")}
    for kind, group, resource, verbs in REQUIRED_RULES:
        missing = verbs - _granted(roles[kind], group, resource)
        assert not missing, f"{kind} lacks {missing} on {group}/{resource}"
    # Read-only where the operator only reads: no writes to pods or secrets.
    assert _granted(roles["ClusterRole"], "", "pods") == {"get", "list", "watch"}
    assert _granted(roles["Role"], "", "secrets") <= {"get", "list", "watch"}
    assert not [d for d in rendered("bigfleet-operator", "single-no-rbac-values.yaml") if "Role" in d["kind"]]


def test_operator_deployment_is_two_replicas_with_lease_election() -> None:
    docs = rendered("bigfleet-operator", "minimal-values.yaml")
    dep = find(docs, "Deployment", "bigfleet-operator")
    assert dep["spec"]["replicas"] == 2
    (cmd,) = cc.commands(docs)
    assert cmd.subcommand == "operator"
    assert _flag(cmd.args, "cluster-id") == "cluster-a"
    assert _flag(cmd.args, "lease-name") == "bigfleet-operator-leader"
    assert _flag(cmd.args, "namespace") == "$(POD_NAMESPACE)"
    assert _flag(cmd.args, "identity") == "$(POD_NAME)"
    assert "--leader-elect" in cmd.args
    env = {e["name"] for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert {"POD_NAME", "POD_NAMESPACE"} <= env
    assert find(docs, "PodDisruptionBudget", "bigfleet-operator")["spec"]["minAvailable"] == 1


def test_operator_bootstrap_template_is_mounted_where_the_flag_points() -> None:
    docs = rendered("bigfleet-operator", "full-values.yaml")
    (cmd,) = cc.commands(docs)
    path = _flag(cmd.args, "bootstrap-template-file")
    dep = find(docs, "Deployment", "bigfleet-operator")
    mounts = dep["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    (mount,) = [m for m in mounts if m["mountPath"] == path]
    cm = find(docs, "ConfigMap", "bigfleet-operator-bootstrap-template")
    assert mount["subPath"] in cm["data"]
    assert "{{ ClusterID }}" in cm["data"][mount["subPath"]]
    assert _flag(cmd.args, "join-token-secret") == "kubeadm-join/token"
    assert _flag(cmd.args, "coordinator") == "bigfleet.fleet.example.com:7790"
    assert not any(a.startswith("--shard-addr") for a in cmd.args)


def test_pod_controller_defaults_file_round_trips() -> None:
    docs = rendered("bigfleet-unschedulable-pod-controller", "full-values.yaml")
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    parsed = yaml.safe_load(cm["data"]["priority-class-defaults.yaml"])
    assert parsed == {
        "system-cluster-critical": {"interruptionPenalty": "10000", "reclamationPenalty": "10000"},
        "batch-low": {"interruptionPenalty": "0.5"},
    }
    (cmd,) = cc.commands(docs)
    assert _flag(cmd.args, "priority-class-defaults") == "/etc/bigfleet/priority-class-defaults.yaml"
    assert not [d for d in rendered("bigfleet-unschedulable-pod-controller", "defaults") if d["kind"] == "ConfigMap"]


# --- flags the charts pass vs flags the daemons accept -------------------------------------------


@functools.cache
def _help(subcommand: str) -> tuple[int, str]:
    return cc.run_cli([subcommand, "--help"])


def _all_commands() -> list[cc.Command]:
    found: list[cc.Command] = []
    for chart, label in CASES:
        found += cc.commands(rendered(chart, label))
    return found


# Flags of features a daemon may not have grown yet. A group is checked only once the daemon
# accepts any flag of it; then it must accept all of them.
FEATURE_FLAGS = {
    "tls": {"--tls-cert", "--tls-key", "--tls-ca"},
    "shard-ha": {"--replica-id", "--raft-bind", "--raft-peers"},
}


@pytest.mark.slow
@pytest.mark.parametrize("subcommand", ["coordinator", "shard", "operator", "pod-controller", "fake-provider"])
@pytest.mark.parametrize("group", ["core", *FEATURE_FLAGS])
def test_rendered_flags_are_accepted_by_the_daemon(subcommand: str, group: str) -> None:
    user_extra = {"--snapshot-export-dir", "--kubeconfig"}  # set through extraArgs in ci/ values
    flags = {f for c in _all_commands() if c.subcommand == subcommand for f in c.flags()} - user_extra
    if group == "core":
        flags -= set().union(*FEATURE_FLAGS.values()) if subcommand == "shard" else FEATURE_FLAGS["tls"]
    elif group == "shard-ha" and subcommand != "shard":
        pytest.skip("replica-group flags are the shard's")
    else:
        flags &= FEATURE_FLAGS[group]
    if not flags:
        pytest.skip(f"the charts pass no {group} flags to `bigfleet {subcommand}`")
    code, text = _help(subcommand)
    if "not available in this build yet" in text:
        pytest.skip(f"`bigfleet {subcommand}` is not in this build yet; its flags cannot be checked")
    assert code == 0, text
    accepted = {f for f in flags if re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)}
    if group != "core" and not accepted:
        pytest.skip(f"`bigfleet {subcommand}` has no {group} flags yet ({sorted(flags)} pending)")
    unknown = sorted(flags - accepted)
    assert not unknown, f"`bigfleet {subcommand}` does not accept {unknown}"


# --- values.schema.json -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chart", "bad"),
    [
        ("bigfleet", {"shard": {"replicaPerShard": 3}}),  # typo
        ("bigfleet", {"coordinator": {"replicas": "3"}}),  # wrong type
        ("bigfleet", {"shard": {"cycleInterval": "5s"}}),  # the daemon takes seconds
        ("bigfleet", {"shard": {"reclaimCapFraction": 5}}),  # a fraction, not a percentage
        ("bigfleet", {"sharding": {}}),  # unknown top-level key
        ("bigfleet", {"image": {"pullPolicy": "Sometimes"}}),
        ("bigfleet-operator", {"clusterID": "a", "shardAddress": "s:1", "leaderElection": {"enable": True}}),
        ("bigfleet-operator", {"clusterID": "a", "shardAddress": "s:1", "metricsPort": 70000}),
        ("bigfleet-unschedulable-pod-controller", {"priorityClassDefaults": {"high": {"interruption": "1"}}}),
        ("bigfleet-unschedulable-pod-controller", {"logFormat": "xml"}),
    ],
)
def test_values_schema_rejects_mistakes(chart: str, bad: dict[str, Any]) -> None:
    import helm_python as helm

    with helm.Chart.load(cc.HELM_DIR / chart) as loaded:
        assert loaded.schema is not None
        with pytest.raises(helm.HelmError):
            loaded.validate_schema(bad)
        for _, good in cc.value_sets(chart):
            loaded.validate_schema(good)


def test_notes_tell_operators_where_to_connect() -> None:
    notes = cc.render_notes("bigfleet", values_for("bigfleet", "full-values.yaml"))
    for i in range(3):
        assert f"shard-{i}: fleet-shard-{i}.bigfleet-system.svc.k8s.internal:7780" in notes
    assert "act on nothing" in notes  # paused wins over dry-run in the warning
    op = cc.render_notes("bigfleet-operator", values_for("bigfleet-operator", "minimal-values.yaml"))
    assert 'cluster "cluster-a"' in op and "lease bigfleet-operator-leader" in op


def _final_argv(cmd: cc.Command, tmp_path: Path) -> list[str]:
    """The argv the daemon would see in the pod: launcher run, Kubernetes $(VAR) references expanded."""
    pod = cmd.workload.split("/", 1)[1] + "-0"
    argv = _run_launcher(cmd.script, pod, tmp_path) if cmd.script else [cmd.subcommand, *cmd.args]
    env = {"$(POD_NAME)": pod, "$(POD_NAMESPACE)": cc.NAMESPACE}
    out = []
    for a in argv:
        for ref, value in env.items():
            a = a.replace(ref, value)
        out.append(a)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("chart", "label", "subcommand"),
    [
        ("bigfleet", "full-values.yaml", "coordinator"),
        ("bigfleet", "full-values.yaml", "shard"),
        ("bigfleet", "demo-values.yaml", "shard"),
        ("bigfleet", "demo-values.yaml", "fake-provider"),
        ("bigfleet-operator", "full-values.yaml", "operator"),
        ("bigfleet-operator", "minimal-values.yaml", "operator"),
        ("bigfleet-unschedulable-pod-controller", "full-values.yaml", "pod-controller"),
    ],
)
def test_rendered_argv_parses_in_the_daemon(chart: str, label: str, subcommand: str, tmp_path: Path) -> None:
    """Values, not only flag names, must parse: argparse converts each one before `--help` exits."""
    code, text = _help(subcommand)
    if "not available in this build yet" in text:
        pytest.skip(f"`bigfleet {subcommand}` is not in this build yet")
    cmd = next(c for c in cc.commands(rendered(chart, label)) if c.subcommand == subcommand)
    argv = _final_argv(cmd, tmp_path)
    pending = {f for group in FEATURE_FLAGS.values() for f in group if not re.search(rf"(?<![\w-]){f}(?![\w-])", text)}
    argv = [a for a in argv if a.split("=", 1)[0] not in pending]
    assert argv[0] == subcommand
    code, out = cc.run_cli([*argv, "--help"])
    assert code == 0, f"{argv}\n{out}"


def test_network_policies_fence_raft_ports_to_group_members() -> None:
    docs = rendered("bigfleet", "full-values.yaml")
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    assert set(policies) == {"fleet-coordinator", "fleet-shard-0", "fleet-shard-1", "fleet-shard-2"}
    for i in range(3):
        spec = policies[f"fleet-shard-{i}"]["spec"]
        raft_rule = next(r for r in spec["ingress"] if any(p["port"] == 7781 for p in r["ports"]))
        (peer,) = raft_rule["from"]
        assert peer["podSelector"]["matchLabels"]["bigfleet.lucy.sh/shard-id"] == f"shard-{i}"
        open_rule = next(r for r in spec["ingress"] if "from" not in r)
        assert {p["port"] for p in open_rule["ports"]} == {7780, 8780}
    assert not [d for d in rendered("bigfleet", "minimal-values.yaml") if d["kind"] == "NetworkPolicy"]
    broken = copy.deepcopy(docs)
    find(broken, "NetworkPolicy", "fleet-shard-0")["spec"]["ingress"][0]["ports"][0]["port"] = 9999
    assert any("9999" in e for e in cc.reference_errors(broken))
