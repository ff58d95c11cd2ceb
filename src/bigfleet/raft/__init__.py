"""The one pysyncobj <-> asyncio bridge shared by the coordinator and shard replica groups.

Both keep a replicated state machine in a pysyncobj ``SyncObjConsumer`` and write to it from an
asyncio daemon. The measured pitfalls (spec decision 15, python-ecosystem §1) apply to both alike,
so the settings, the callback-to-awaitable bridge and the role/status queries live here once; each
user keeps only its state machine and its replicated commands.
"""

from bigfleet.raft.bridge import RaftBridge
from bigfleet.raft.consumer import LockedConsumer
from bigfleet.raft.errors import RaftError, fail_reason
from bigfleet.raft.group import GroupCommit
from bigfleet.raft.settings import RaftSettings, RaftSettingsError, sync_obj_conf, timing_problems

__all__ = [
    "GroupCommit",
    "LockedConsumer",
    "RaftBridge",
    "RaftError",
    "RaftSettings",
    "RaftSettingsError",
    "fail_reason",
    "sync_obj_conf",
    "timing_problems",
]
