"""mTLS identities, role checks, input limits and local certificates (issue #11).

Daemons use, in order: :func:`add_tls_arguments` on their parser, :meth:`TLSConfig.from_args`
(or :func:`tls_from_args_or_exit`), :func:`add_port` / :func:`dial` for servers and clients,
:class:`RoleInterceptor` with the matching ``*_POLICY`` on their server, and
:func:`require_cluster` / :func:`require_shard` where the subject is only known in the handler.
"""

from bigfleet.security.identity import (
    ADMIN,
    READONLY,
    Identity,
    IdentityError,
    Role,
    cluster,
    identity_from_auth_context,
    identity_from_certificate,
    peer_identity,
    shard,
)
from bigfleet.security.metadata import MetadataLimitInterceptor
from bigfleet.security.raft import (
    RaftPasswordError,
    add_raft_password_arguments,
    raft_password,
    raft_password_or_exit,
)
from bigfleet.security.roles import (
    ADMIN_ONLY,
    COORDINATOR_POLICY,
    PROVIDER_POLICY,
    READ,
    SHARD_POLICY,
    Access,
    PermissionDenied,
    RoleInterceptor,
    authorize,
    require_cluster,
    require_role,
    require_self,
    require_shard,
    session_denial,
)
from bigfleet.security.tls import (
    KeyPairReloader,
    RotatingChannel,
    TLSConfig,
    TLSConfigError,
    add_port,
    add_tls_arguments,
    dial,
    dial_sync,
    tls_from_args_or_exit,
)

__all__ = [
    "ADMIN",
    "ADMIN_ONLY",
    "COORDINATOR_POLICY",
    "PROVIDER_POLICY",
    "READ",
    "READONLY",
    "SHARD_POLICY",
    "Access",
    "Identity",
    "IdentityError",
    "KeyPairReloader",
    "MetadataLimitInterceptor",
    "PermissionDenied",
    "RaftPasswordError",
    "Role",
    "RoleInterceptor",
    "RotatingChannel",
    "TLSConfig",
    "TLSConfigError",
    "add_port",
    "add_raft_password_arguments",
    "add_tls_arguments",
    "authorize",
    "cluster",
    "dial",
    "dial_sync",
    "identity_from_auth_context",
    "identity_from_certificate",
    "peer_identity",
    "raft_password",
    "raft_password_or_exit",
    "require_cluster",
    "require_role",
    "require_self",
    "require_shard",
    "session_denial",
    "shard",
    "tls_from_args_or_exit",
]
