"""A Kubernetes API server for tests (real REST + watch protocol on loopback) and its object store."""

from bigfleet.k8stest.server import KubeTestServer
from bigfleet.k8stest.store import ApiError, ResourceType, Store, merge_patch

__all__ = ["ApiError", "KubeTestServer", "ResourceType", "Store", "merge_patch"]
