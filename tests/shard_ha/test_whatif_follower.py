"""ShardRead.WhatIf on a follower replica: UNAVAILABLE with the leader in ``bigfleet-redirect``, the
same as every other ShardRead call (the HA forwarder covers every method of the service)."""

from __future__ import annotations

from typing import NoReturn

import grpc
import pytest

from bigfleet.shard.ha.controller import REDIRECT_METADATA_KEY, HAController, _forwarder
from bigfleet.v1alpha1 import shardread_pb2, shardread_pb2_grpc


class Refused(Exception):
    pass


class Ctx:
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.trailers: tuple[tuple[str, str], ...] = ()

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple[tuple[str, str], ...] = ()
                    ) -> NoReturn:
        self.code, self.trailers = code, trailing_metadata
        raise Refused(details)


class Follower:
    read_servicer = None

    def leader_hint(self) -> str:
        return "10.0.0.9:7700"

    refuse = HAController.refuse


async def test_follower_redirects_whatif() -> None:
    svc = _forwarder(shardread_pb2_grpc.ShardReadServicer, Follower(), "read_servicer")  # type: ignore[arg-type]
    ctx = Ctx()
    with pytest.raises(Refused, match="not the shard leader"):
        await svc.WhatIf(shardread_pb2.WhatIfRequest(cluster_id="c1"), ctx)
    assert ctx.code == grpc.StatusCode.UNAVAILABLE
    assert dict(ctx.trailers) == {REDIRECT_METADATA_KEY: "10.0.0.9:7700"}
