"""The provider kit: implement a small ``Backend``, get the whole provider contract.

    from bigfleet.provider.kit import Backend, Instance, serve
"""

from bigfleet.provider.kit.backend import (
    Backend,
    ConfigureCall,
    CreateCall,
    CreateResult,
    DeleteCall,
    DrainCall,
)
from bigfleet.provider.kit.core import ProviderCore, parse_revision
from bigfleet.provider.kit.model import (
    CapacityType,
    Fence,
    HostRef,
    Instance,
    InvalidRecord,
    Kind,
    KitError,
    MachineRecord,
    State,
)
from bigfleet.provider.kit.server import KitOptions, ProviderServer, RunningProvider, serve
from bigfleet.provider.kit.store import FileStore, MemStore, NullStore, Store

__all__ = [
    "Backend", "CapacityType", "ConfigureCall", "CreateCall", "CreateResult", "DeleteCall", "DrainCall",
    "Fence", "FileStore", "HostRef", "Instance", "InvalidRecord", "Kind", "KitError", "KitOptions",
    "MachineRecord", "MemStore", "NullStore", "ProviderCore", "ProviderServer", "RunningProvider", "State",
    "Store", "parse_revision", "serve",
]
