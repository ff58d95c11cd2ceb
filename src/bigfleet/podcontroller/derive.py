"""Pure derivation of a CapacityRequest from a Pod (API dict form).

Resources follow kube-scheduler's effective request: the larger of (app
containers + restartable "sidecar" init containers) and the peak init step
(each init container plus the sidecars started before it), plus pod
overhead; a container with limits but no requests counts its limits, as the
API server defaults them. Requirements come from the first required
nodeAffinity term and the nodeSelector; co-location from the first required
podAffinity term; penalties from pod annotations, else the PriorityClass
defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bigfleet.needs import ValidationError, format_quantity, parse_quantity

OWNED_BY_POD_LABEL = "bigfleet.lucy.sh/owned-by-pod"
INTERRUPTION_ANNOTATION = "bigfleet.lucy.sh/interruption-penalty"
RECLAMATION_ANNOTATION = "bigfleet.lucy.sh/reclamation-penalty"
CORE_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
DEFAULT_REQUIREMENT = {"key": "node.kubernetes.io/instance-type", "operator": "Exists"}

PriorityDefaults = Mapping[str, Mapping[str, str]]


def _container_request(c: Mapping[str, Any]) -> dict[str, int]:
    res = c.get("resources") or {}
    merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
    out: dict[str, int] = {}
    for name, q in merged.items():
        milli = parse_quantity(str(q), f"resources[{name}]")
        if milli > 0:
            out[name] = milli
    return out


def _add(a: dict[str, int], b: Mapping[str, int]) -> dict[str, int]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


def _max(a: dict[str, int], b: Mapping[str, int]) -> dict[str, int]:
    out = dict(a)
    for k, v in b.items():
        out[k] = max(out.get(k, 0), v)
    return out


def pod_request(spec: Mapping[str, Any]) -> dict[str, int]:
    """The pod's effective request in milli-units."""
    app: dict[str, int] = {}
    for c in spec.get("containers") or []:
        app = _add(app, _container_request(c))
    sidecars: dict[str, int] = {}
    peak_init: dict[str, int] = {}
    for c in spec.get("initContainers") or []:
        req = _container_request(c)
        if c.get("restartPolicy") == "Always":
            sidecars = _add(sidecars, req)
            peak_init = _max(peak_init, sidecars)
        else:
            peak_init = _max(peak_init, _add(sidecars, req))
    total = _max(_add(app, sidecars), peak_init)
    overhead = {k: parse_quantity(str(v), f"overhead[{k}]") for k, v in (spec.get("overhead") or {}).items()}
    return _add(total, overhead)


def _penalty(pod: Mapping[str, Any], annotation: str, pc_key: str, defaults: PriorityDefaults) -> str | None:
    ann = ((pod.get("metadata") or {}).get("annotations") or {}).get(annotation)
    if ann:
        parse_quantity(ann, annotation)  # reject garbage here rather than at roll-up
        return str(ann)
    pc = (pod.get("spec") or {}).get("priorityClassName") or ""
    val = (defaults.get(pc) or {}).get(pc_key)
    return str(val) if val else None


def capacity_request_spec(pod: Mapping[str, Any], defaults: PriorityDefaults | None = None) -> dict[str, Any]:
    """The ``spec`` of the pod's CapacityRequest; raises ValidationError on an unusable pod."""
    spec = pod.get("spec") or {}
    request = pod_request(spec)
    if not request:
        raise ValidationError("spec.containers", "the pod requests no resources")
    reqs: list[dict[str, Any]] = []
    affinity = spec.get("affinity") or {}
    terms = (((affinity.get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or {})
             .get("nodeSelectorTerms") or [])
    if terms:
        for e in terms[0].get("matchExpressions") or []:
            if e.get("operator") in CORE_OPERATORS:
                item: dict[str, Any] = {"key": e["key"], "operator": e["operator"]}
                if e.get("values"):
                    item["values"] = list(e["values"])
                reqs.append(item)
    for k, v in sorted((spec.get("nodeSelector") or {}).items()):
        reqs.append({"key": k, "operator": "In", "values": [v]})
    if not reqs:
        reqs.append(dict(DEFAULT_REQUIREMENT))
    out: dict[str, Any] = {
        "priority": int(spec.get("priority") or 0),
        "resources": {k: format_quantity(v) for k, v in sorted(request.items())},
        "requirements": reqs,
    }
    pod_aff = ((affinity.get("podAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or [])
    if pod_aff and pod_aff[0].get("topologyKey"):
        co: dict[str, Any] = {"topologyKey": pod_aff[0]["topologyKey"]}
        if pod_aff[0].get("labelSelector"):
            co["labelSelector"] = pod_aff[0]["labelSelector"]
        out["coLocation"] = co
    spread = [
        {"maxSkew": int(t.get("maxSkew") or 1), "topologyKey": t["topologyKey"], "whenUnsatisfiable": "DoNotSchedule"}
        for t in spec.get("topologySpreadConstraints") or []
        if t.get("topologyKey") and t.get("whenUnsatisfiable", "DoNotSchedule") == "DoNotSchedule"
    ]
    if spread:
        out["topologySpread"] = spread
    d = defaults or {}
    ip = _penalty(pod, INTERRUPTION_ANNOTATION, "interruptionPenalty", d)
    rp = _penalty(pod, RECLAMATION_ANNOTATION, "reclamationPenalty", d)
    if ip is not None:
        out["interruptionPenalty"] = ip
    if rp is not None:
        out["reclamationPenalty"] = rp
    return out


def is_terminal(pod: Mapping[str, Any]) -> bool:
    return ((pod.get("status") or {}).get("phase") or "") in ("Succeeded", "Failed")


def is_unschedulable(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if (status.get("phase") or "Pending") != "Pending":
        return False
    return any(c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable"
               for c in status.get("conditions") or [])


def capacity_request_object(pod: Mapping[str, Any], defaults: PriorityDefaults | None = None) -> dict[str, Any]:
    meta = pod.get("metadata") or {}
    name = str(meta.get("name", ""))
    prefix = f"cr-pod-{name}"[:200].rstrip("-.") + "-"
    return {
        "apiVersion": "bigfleet.lucy.sh/v1alpha1",
        "kind": "CapacityRequest",
        "metadata": {
            "generateName": prefix,
            "namespace": meta.get("namespace", "default"),
            "labels": {OWNED_BY_POD_LABEL: str(meta.get("uid", ""))},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": name, "uid": meta.get("uid", ""),
                                 "controller": True, "blockOwnerDeletion": False}],
        },
        "spec": capacity_request_spec(pod, defaults),
    }
