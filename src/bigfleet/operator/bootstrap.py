"""Bootstrap blobs: render the kubelet join payload a shard asks for in a ``BootstrapRequest``.

The template is Jinja2 (from ``--bootstrap-template-file``, the Helm value
``bootstrapTemplate`` mounted from a ConfigMap). It sees ``ClusterID``,
``Requirements`` (each with ``Key``, ``Operator`` as ``In``/``NotIn``/...,
``Values``), ``JoinToken`` (from a Secret, if configured), ``APIServerEndpoint``,
``CACertHash`` and ``RequestID``, and may call ``fail("why")`` to answer that this
cluster cannot satisfy the requirements — which the shard records as a shortfall,
not a transport error.

Without a template file but with a join token, the built-in :data:`KUBEADM_TEMPLATE`
is used: a cloud-config that writes a kubeadm ``JoinConfiguration`` (bootstrap token
discovery, pinned to the cluster CA's public-key hash) and runs ``kubeadm join``, so the
machine's kubelet registers a Node. With neither, a stub cloud-config that joins nothing
is returned (development only: nodes never register).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2.sandbox import SandboxedEnvironment

from bigfleet.operator.rollup import OPERATOR_NAME
from bigfleet.v1alpha1 import shard_pb2

STUB_TTL_SECONDS = 600

# The default join: kubeadm's bootstrap-token flow (k8s >= 1.31, kubeadm.k8s.io/v1beta4). The token is
# a kubeadm bootstrap token ("abcdef.0123456789abcdef", `kubeadm token create`) read from the Secret
# named by --join-token-secret; the CA hash pins the API server's certificate authority
# ("sha256:<hex of the CA's SubjectPublicKeyInfo>"), so the new node trusts only this cluster.
KUBEADM_TEMPLATE = """\
#cloud-config
# BigFleet: join {{ ClusterID }} with kubeadm (request {{ RequestID }}).
{%- if not APIServerEndpoint %}{{ fail("no API server endpoint for the kubeadm join: set --api-server-endpoint") }}{% endif %}
{%- if not CACertHash %}{{ fail("no CA certificate hash for the kubeadm join: set --ca-cert-hash") }}{% endif %}
write_files:
  - path: /etc/kubernetes/bigfleet-join.yaml
    permissions: "0600"
    content: |
      apiVersion: kubeadm.k8s.io/v1beta4
      kind: JoinConfiguration
      discovery:
        bootstrapToken:
          apiServerEndpoint: "{{ APIServerEndpoint }}"
          token: "{{ JoinToken }}"
          caCertHashes: ["{{ CACertHash }}"]
      nodeRegistration:
        kubeletExtraArgs:
          - name: node-labels
            value: "bigfleet.lucy.sh/cluster={{ ClusterID }}"
runcmd:
  - [kubeadm, join, --config, /etc/kubernetes/bigfleet-join.yaml]
"""


def ca_cert_hash(pem: bytes) -> str:
    """kubeadm's ``--discovery-token-ca-cert-hash`` of a CA certificate: ``sha256:`` + the hex SHA-256
    of its DER SubjectPublicKeyInfo."""
    import hashlib

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate(pem)
    spki = cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return "sha256:" + hashlib.sha256(spki).hexdigest()


class Unsatisfiable(Exception):
    """Raised by the template's ``fail()``."""


def _fail(message: str = "requirements cannot be satisfied by this cluster") -> None:
    raise Unsatisfiable(message)


@dataclass
class BootstrapRenderer:
    template_text: str | None = None
    join_token: str = ""
    ttl_seconds: int = 0
    api_server_endpoint: str = ""
    ca_cert_hash: str = ""

    def __post_init__(self) -> None:
        self._template: jinja2.Template | None = None
        if self.template_text is None and self.join_token:
            self.template_text = KUBEADM_TEMPLATE
        if self.template_text is not None:
            env = SandboxedEnvironment(undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True)
            env.globals["fail"] = _fail
            self._template = env.from_string(self.template_text)  # syntax errors surface at start-up

    def context(self, req: shard_pb2.BootstrapRequest, cluster_id: str) -> dict[str, Any]:
        reqs = [
            {"Key": r.key, "Operator": OPERATOR_NAME.get(r.operator, "Unspecified"), "Values": list(r.values)}
            for r in req.requirements
        ]
        return {"ClusterID": cluster_id, "Requirements": reqs, "JoinToken": self.join_token, "RequestID": req.request_id,
                "APIServerEndpoint": self.api_server_endpoint, "CACertHash": self.ca_cert_hash}

    @property
    def joins(self) -> bool:
        """Whether the blobs can make a kubelet join (False for the development stub)."""
        return self._template is not None

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
