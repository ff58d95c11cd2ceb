"""Bootstrap blobs: render the kubelet join payload a shard asks for in a ``BootstrapRequest``.

The template is Jinja2 (from ``--bootstrap-template-file``, the Helm value
``bootstrapTemplate`` mounted from a ConfigMap). It sees ``ClusterID``,
``Requirements`` (each with ``Key``, ``Operator`` as ``In``/``NotIn``/...,
``Values``), ``JoinToken`` (from a Secret, if configured) and ``RequestID``,
and may call ``fail("why")`` to answer that this cluster cannot satisfy the
requirements — which the shard records as a shortfall, not a transport error.
Without a template a stub cloud-config is returned (development only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2.sandbox import SandboxedEnvironment

from bigfleet.operator.rollup import OPERATOR_NAME
from bigfleet.v1alpha1 import shard_pb2

STUB_TTL_SECONDS = 600


class Unsatisfiable(Exception):
    """Raised by the template's ``fail()``."""


def _fail(message: str = "requirements cannot be satisfied by this cluster") -> None:
    raise Unsatisfiable(message)


@dataclass
class BootstrapRenderer:
    template_text: str | None = None
    join_token: str = ""
    ttl_seconds: int = 0

    def __post_init__(self) -> None:
        self._template: jinja2.Template | None = None
        if self.template_text is not None:
            env = SandboxedEnvironment(undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True)
            env.globals["fail"] = _fail
            self._template = env.from_string(self.template_text)  # syntax errors surface at start-up

    def context(self, req: shard_pb2.BootstrapRequest, cluster_id: str) -> dict[str, Any]:
        reqs = [
            {"Key": r.key, "Operator": OPERATOR_NAME.get(r.operator, "Unspecified"), "Values": list(r.values)}
            for r in req.requirements
        ]
        return {"ClusterID": cluster_id, "Requirements": reqs, "JoinToken": self.join_token, "RequestID": req.request_id}

    def render(self, req: shard_pb2.BootstrapRequest, cluster_id: str) -> shard_pb2.BootstrapBlobResponse:
        resp = shard_pb2.BootstrapBlobResponse(request_id=req.request_id)
        if req.cluster_id and req.cluster_id != cluster_id:
            resp.error = f"bootstrap request for cluster {req.cluster_id!r} reached cluster {cluster_id!r}"
            return resp
        if self._template is None:
            resp.user_data = f"#cloud-config\n# bigfleet stub bootstrap for {cluster_id}\n".encode()
            resp.ttl_seconds = STUB_TTL_SECONDS
            return resp
        try:
            resp.user_data = self._template.render(**self.context(req, cluster_id)).encode()
            resp.ttl_seconds = self.ttl_seconds
        except Unsatisfiable as exc:
            resp.error = str(exc) or "unsatisfiable"
        except Exception as exc:  # a template bug must become an answer, never a dead stream
            resp.error = f"bootstrap template failed: {type(exc).__name__}: {exc}"
        return resp
