"""gRPC plumbing shared by every server and client: size limits, health, addresses."""

from bigfleet.rpc.options import (
    MAX_MESSAGE_BYTES,
    channel_options,
    insecure_channel,
    new_server,
    server_options,
)

__all__ = ["MAX_MESSAGE_BYTES", "channel_options", "insecure_channel", "new_server", "server_options"]
