"""Helm chart validation without the helm binary: lint, render, schema-check, cross-check.

Neither ``helm`` nor ``kubeconform`` can be installed from the registries CI reaches, so this uses
what can: ``helm-python-sdk`` (Helm v4's own Go SDK behind a C ABI: the real template engine and
the real linter) and ``kubernetes-validate`` (the Kubernetes OpenAPI schemas as JSON Schema, the
same source kubeconform uses). Kinds that come from other projects' CRDs (Prometheus Operator)
are checked against the small schemas below, covering exactly the fields our charts write.

On top of the schemas it checks what a schema cannot see but a cluster would trip over:
selectors that match no pod, named ports that do not exist, a StatefulSet whose governing Service
is missing, references to ServiceAccounts/ConfigMaps the render does not create.

Run ``python tests/deploy/chartcheck.py`` for a table over every chart and every ``ci/*.yaml``.
"""

from __future__ import annotations

import functools
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
HELM_DIR = REPO / "deploy" / "helm"
CHARTS = ("bigfleet", "bigfleet-operator", "bigfleet-unschedulable-pod-controller")
NAMESPACE = "bigfleet-system"
# The oldest Kubernetes the charts admit (kubeVersion >=1.31) and the newest with shipped schemas.
MIN_KUBE = "1.31.0"

Doc = dict[str, Any]


def tools_missing() -> str | None:
    """Why the validation tools cannot run here, or None when they can."""
    try:
        import helm_python  # noqa: F401
        import kubernetes_validate  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        return f"{exc.name} is not installed (make install adds helm-python-sdk and kubernetes-validate)"
    return None


def value_sets(chart: str) -> list[tuple[str, dict[str, Any]]]:
    """(label, values) pairs to check a chart with: its defaults and every ci/*.yaml."""
    sets: list[tuple[str, dict[str, Any]]] = []
    ci = sorted((HELM_DIR / chart / "ci").glob("*.yaml"))
    if not ci or chart == "bigfleet-unschedulable-pod-controller":
        sets.append(("defaults", {}))
    for path in ci:
        sets.append((path.name, yaml.safe_load(path.read_text()) or {}))
    return sets


def lint(chart: str, values: dict[str, Any]) -> list[str]:
    """``helm lint --strict`` findings at warning level or above, as text."""
    import helm_python as helm

    report = helm.lint(HELM_DIR / chart, values, strict=True, namespace=NAMESPACE, kube_version=f"v{MIN_KUBE}")
    problems = [f"{m['path']}: {m['error']}" for m in report.get("messages", []) if int(m["severity"]) >= 2]
    problems += [str(e) for e in report.get("errors", []) or []]
    return problems


def render(chart: str, values: dict[str, Any], *, with_crds: bool = True) -> list[Doc]:
    """``helm template`` of one chart: every rendered object (plus its crds/ when asked)."""
    import helm_python as helm

    docs: list[Doc] = []
    with helm.Chart.load(HELM_DIR / chart) as loaded:
        loaded.validate_schema(values)
        manifests = loaded.render(values, name=chart, namespace=NAMESPACE, is_install=True)
        sources = [(path, text) for path, text in sorted(manifests.items()) if not path.endswith("NOTES.txt")]
        if with_crds:
            sources += [(c["name"], c["data"]) for c in loaded.crds]
    for path, text in sources:
        for doc in yaml.safe_load_all(text):
            if doc is None:
                continue
            if not isinstance(doc, dict) or "kind" not in doc:
                raise ValueError(f"{path}: rendered a document that is not a Kubernetes object: {doc!r}")
            doc.setdefault("metadata", {})
            doc["metadata"].setdefault("annotations", {})
            doc["metadata"]["annotations"]["chartcheck/source"] = path
            docs.append(doc)
    return docs


def render_notes(chart: str, values: dict[str, Any]) -> str:
    import helm_python as helm

    with helm.Chart.load(HELM_DIR / chart) as loaded:
        manifests = loaded.render(values, name=chart, namespace=NAMESPACE, is_install=True)
    return "".join(text for path, text in manifests.items() if path.endswith("NOTES.txt"))


# --- schemas for kinds Kubernetes itself does not define -------------------------------------

_STR = {"type": "string"}
_STRMAP = {"type": "object", "additionalProperties": _STR}
_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": _STRMAP,
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["key", "operator"],
                "additionalProperties": False,
                "properties": {"key": _STR, "operator": _STR, "values": {"type": "array", "items": _STR}},
            },
        },
    },
}
_OBJECT_META = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": _STR, "namespace": _STR, "labels": _STRMAP, "annotations": _STRMAP},
}
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}

# Subsets of the Prometheus Operator's monitoring.coreos.com/v1 CRDs: the fields we write, each
# typed as upstream types it; anything else is rejected so a typo cannot pass.
EXTRA_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": _STR,
            "kind": _STR,
            "metadata": _OBJECT_META,
            "spec": {
                "type": "object",
                "required": ["selector", "endpoints"],
                "additionalProperties": False,
                "properties": {
                    "jobLabel": _STR,
                    "selector": _LABEL_SELECTOR,
                    "namespaceSelector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": _STR}},
                    },
                    "endpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "port": _STR,
                                "path": _STR,
                                "scheme": {"enum": ["http", "https"]},
                                "interval": _DURATION,
                                "scrapeTimeout": _DURATION,
                            },
                        },
                    },
                },
            },
        },
    },
    ("monitoring.coreos.com/v1", "PrometheusRule"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": _STR,
            "kind": _STR,
            "metadata": _OBJECT_META,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "groups": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["name", "rules"],
                            "additionalProperties": False,
                            "properties": {
                                "name": _STR,
                                "interval": _DURATION,
                                "rules": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "required": ["expr"],
                                        "additionalProperties": False,
                                        "properties": {
                                            "alert": _STR,
                                            "record": _STR,
                                            "expr": {"type": "string", "minLength": 1},
                                            "for": _DURATION,
                                            "labels": _STRMAP,
                                            "annotations": _STRMAP,
                                        },
                                    },
                                },
                            },
                        },
                    }
                },
            },
        },
    },
}


def _strip_checker_annotations(doc: Doc) -> Doc:
    clean = dict(doc)
    meta = dict(clean.get("metadata") or {})
    ann = {k: v for k, v in (meta.get("annotations") or {}).items() if not k.startswith("chartcheck/")}
    if ann:
        meta["annotations"] = ann
    else:
        meta.pop("annotations", None)
    clean["metadata"] = meta
    return clean


@functools.cache
def _k8s_validator(kube_version: str, api_version: str, kind: str) -> Any:
    """A strict validator for one kind, built once.

    Same schema files and resolution as ``kubernetes_validate.validate`` (the newest shipped
    version not newer than ``kube_version``; ``<group>-<version>`` file naming), but cached:
    that function re-reads and re-parses the large definitions file on every call.
    """
    import re

    import jsonschema
    import kubernetes_validate.utils as kv
    from referencing import Registry, Resource

    wanted = kv.major_minor(kube_version)
    shipped = [v for v in kv.all_versions() if kv.major_minor(v) <= wanted]
    if not shipped:
        raise kv.VersionNotSupportedError(version=wanted)
    folder = f"kubernetes-json-schema/v{shipped[-1]}-local-strict"
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    try:
        schema = kv.schema_contents(f"{folder}/{kind.lower()}-{group_version}.json", kube_version)
    except FileNotFoundError:
        raise kv.SchemaNotFoundError(version=wanted, kind=kind, api_version=api_version) from None
    definitions = kv.schema_contents(f"{folder}/_definitions.json", kube_version)
    registry: Registry = Resource.from_contents(schema) @ Registry()
    registry = Resource.from_contents(definitions) @ registry
    return jsonschema.Draft202012Validator(schema, registry=registry)


def schema_errors(doc: Doc, kube_version: str) -> list[str]:
    """Problems with one object against its OpenAPI schema (strict: unknown fields are errors)."""
    import jsonschema
    import kubernetes_validate.utils as kv

    obj = _strip_checker_annotations(doc)
    key = (obj.get("apiVersion", ""), obj.get("kind", ""))
    if key in EXTRA_SCHEMAS:
        validator = jsonschema.Draft202012Validator(EXTRA_SCHEMAS[key])
    else:
        try:
            validator = _k8s_validator(kube_version, key[0], key[1])
        except kv.SchemaNotFoundError as exc:
            return [f"no schema: {exc.message}"]
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


# --- cross-object checks ----------------------------------------------------------------------


def name_of(doc: Doc) -> str:
    return f"{doc['kind']}/{doc['metadata'].get('name')}"


def pod_templates(docs: list[Doc]) -> Iterator[tuple[Doc, Doc]]:
    """(workload, pod template) for every Deployment and StatefulSet."""
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            yield d, d["spec"]["template"]


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def reference_errors(docs: list[Doc]) -> list[str]:
    errors: list[str] = []
    by_kind: dict[str, dict[str, Doc]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    seen: set[str] = set()
    for d in docs:
        if name_of(d) in seen:
            errors.append(f"{name_of(d)} is rendered twice")
        seen.add(name_of(d))
    templates = list(pod_templates(docs))

    for workload, tmpl in templates:
        labels = tmpl["metadata"].get("labels", {})
        if not _matches(workload["spec"]["selector"]["matchLabels"], labels):
            errors.append(f"{name_of(workload)}: selector does not match its own pod template")
        spec = tmpl["spec"]
        sa = spec.get("serviceAccountName")
        if sa and sa not in by_kind.get("ServiceAccount", {}) and sa != "default" and not _sa_external(docs):
            errors.append(f"{name_of(workload)}: ServiceAccount {sa} is not rendered")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        claim_names = {c["metadata"]["name"] for c in workload["spec"].get("volumeClaimTemplates", [])}
        for v in volumes.values():
            cm = v.get("configMap", {}).get("name")
            if cm and cm not in by_kind.get("ConfigMap", {}):
                errors.append(f"{name_of(workload)}: volume {v['name']} uses ConfigMap {cm}, which is not rendered")
        for c in spec["containers"]:
            port_names = {p.get("name") for p in c.get("ports", [])}
            for mount in c.get("volumeMounts", []):
                if mount["name"] not in volumes and mount["name"] not in claim_names:
                    errors.append(f"{name_of(workload)}/{c['name']}: mount {mount['name']} has no volume")
            for probe_name in ("livenessProbe", "readinessProbe", "startupProbe"):
                probe = c.get(probe_name) or {}
                for kind in ("httpGet", "tcpSocket"):
                    port = (probe.get(kind) or {}).get("port")
                    if isinstance(port, str) and port not in port_names:
                        errors.append(f"{name_of(workload)}/{c['name']}: {probe_name} uses unknown port {port}")
        if workload["kind"] == "StatefulSet":
            svc = by_kind.get("Service", {}).get(workload["spec"]["serviceName"])
            if svc is None:
                errors.append(f"{name_of(workload)}: governing Service {workload['spec']['serviceName']} is missing")
            elif svc["spec"].get("clusterIP") != "None":
                errors.append(f"{name_of(workload)}: governing Service must be headless")

    for svc in by_kind.get("Service", {}).values():
        selector = svc["spec"].get("selector") or {}
        targets = [(w, t) for w, t in templates if _matches(selector, t["metadata"].get("labels", {}))]
        if not targets:
            errors.append(f"{name_of(svc)}: selector {selector} matches no pod template")
        for port in svc["spec"].get("ports", []):
            tp = port.get("targetPort")
            if isinstance(tp, str):
                for w, t in targets:
                    names = {p.get("name") for c in t["spec"]["containers"] for p in c.get("ports", [])}
                    if tp not in names:
                        errors.append(f"{name_of(svc)}: targetPort {tp} is not a port of {name_of(w)}")

    for pdb in by_kind.get("PodDisruptionBudget", {}).values():
        sel = pdb["spec"]["selector"]["matchLabels"]
        if not any(_matches(sel, t["metadata"].get("labels", {})) for _, t in templates):
            errors.append(f"{name_of(pdb)}: selector matches no pod template")

    for np in by_kind.get("NetworkPolicy", {}).values():
        sel = np["spec"]["podSelector"].get("matchLabels", {})
        selected = [t for _, t in templates if _matches(sel, t["metadata"].get("labels", {}))]
        if not selected:
            errors.append(f"{name_of(np)}: podSelector matches no pod template")
        open_ports = {p["containerPort"] for t in selected for c in t["spec"]["containers"] for p in c.get("ports", [])}
        for rule in np["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                if port["port"] not in open_ports:
                    errors.append(f"{name_of(np)}: admits port {port['port']}, which its pods do not listen on")

    for binding_kind, role_kind in (("ClusterRoleBinding", "ClusterRole"), ("RoleBinding", "Role")):
        for b in by_kind.get(binding_kind, {}).values():
            if b["roleRef"]["name"] not in by_kind.get(role_kind, {}):
                errors.append(f"{name_of(b)}: {role_kind} {b['roleRef']['name']} is not rendered")
            for s in b.get("subjects", []):
                sa_missing = s["kind"] == "ServiceAccount" and s["name"] not in by_kind.get("ServiceAccount", {})
                if sa_missing and not _sa_external(docs):
                    errors.append(f"{name_of(b)}: ServiceAccount {s['name']} is not rendered")

    for sm in by_kind.get("ServiceMonitor", {}).values():
        sel = sm["spec"]["selector"]["matchLabels"]
        svcs = [s for s in by_kind.get("Service", {}).values() if _matches(sel, s["metadata"].get("labels", {}))]
        if not svcs:
            errors.append(f"{name_of(sm)}: selects no Service")
        for ep in sm["spec"]["endpoints"]:
            for s in svcs:
                if ep["port"] not in {p.get("name") for p in s["spec"]["ports"]}:
                    errors.append(f"{name_of(sm)}: {name_of(s)} has no port named {ep['port']}")
    return errors


def _sa_external(docs: list[Doc]) -> bool:
    """True when the chart was told to use a pre-existing ServiceAccount (serviceAccount.create=false)."""
    return not any(d["kind"] == "ServiceAccount" for d in docs)


# --- container command lines --------------------------------------------------------------------


@dataclass
class Command:
    """A container's `bigfleet` invocation as the daemon would receive it."""

    workload: str
    container: str
    subcommand: str
    args: list[str] = field(default_factory=list)
    script: str | None = None  # the launcher script, when a shell builds the command

    def flags(self) -> list[str]:
        return sorted({a.split("=", 1)[0] for a in self.args if a.startswith("--")})


def commands(docs: list[Doc]) -> list[Command]:
    """The daemon command line of every container (launcher scripts parsed up to their exec)."""
    found: list[Command] = []
    for workload, tmpl in pod_templates(docs):
        for c in tmpl["spec"]["containers"]:
            command = c.get("command") or []
            args = [str(a) for a in c.get("args") or []]
            if command and command[-2:] == ["/bin/sh", "-c"]:
                script = args[0]
                exec_lines = [ln.strip() for ln in script.splitlines() if ln.strip().startswith("exec ")]
                if len(exec_lines) != 1:
                    raise ValueError(f"{name_of(workload)}: launcher script must exec exactly once")
                argv = shlex.split(exec_lines[0])[1:]
                if argv[0] != "bigfleet":
                    raise ValueError(f"{name_of(workload)}: launcher does not exec bigfleet: {argv[0]}")
                found.append(Command(name_of(workload), c["name"], argv[1], argv[2:], script))
            elif command:
                raise ValueError(f"{name_of(workload)}: unexpected command {command}")
            else:
                found.append(Command(name_of(workload), c["name"], args[0], args[1:]))
    return found


def run_cli(argv: list[str]) -> tuple[int, str]:
    """`bigfleet <argv>` in this process, output captured; argparse's exit on --help is caught."""
    import contextlib
    import io

    from bigfleet.cli.main import main as bigfleet_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = bigfleet_main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue() + err.getvalue()


@dataclass
class Result:
    chart: str
    values: str
    objects: int = 0
    problems: list[str] = field(default_factory=list)


def check(chart: str, label: str, values: dict[str, Any], kube_versions: tuple[str, ...]) -> Result:
    """Everything CI checks for one chart with one set of values."""
    result = Result(chart, label)
    result.problems += [f"lint: {p}" for p in lint(chart, values)]
    docs = render(chart, values)
    result.objects = len(docs)
    for doc in docs:
        for version in kube_versions:
            for err in schema_errors(doc, version):
                result.problems.append(f"schema {version}: {name_of(doc)}: {err}")
    result.problems += [f"refs: {e}" for e in reference_errors(docs)]
    for cmd in commands(docs):
        if cmd.subcommand not in ("shard", "coordinator", "operator", "pod-controller", "fake-provider"):
            result.problems.append(f"command: {cmd.workload}: unknown subcommand {cmd.subcommand}")
    return result


def kube_versions() -> tuple[str, ...]:
    import kubernetes_validate.utils as kv

    return (MIN_KUBE, kv.latest_version())


def main() -> int:
    reason = tools_missing()
    if reason:
        print(f"chartcheck: {reason}", file=sys.stderr)
        return 2
    versions = kube_versions()
    results = [check(chart, label, vals, versions) for chart in CHARTS for label, vals in value_sets(chart)]
    width = max(len(f"{r.chart} [{r.values}]") for r in results)
    print(f"helm lint --strict + template + Kubernetes schemas {', '.join(versions)} (strict) + cross-references")
    for r in results:
        status = "ok" if not r.problems else f"{len(r.problems)} problem(s)"
        print(f"  {f'{r.chart} [{r.values}]'.ljust(width)}  {r.objects:3d} objects  {status}")
        for p in r.problems:
            print(f"      {p}")
    failed = sum(1 for r in results if r.problems)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
