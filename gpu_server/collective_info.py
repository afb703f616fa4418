"""A collective record's place among the ranks, decoded from the wire and validated (docs/collectives.md).

The agent (npu_agent/collectives.py) tags each torch.distributed call with its training (`job`), its process group
(name and member ranks) and its sequence number in that group; the server matches the records of one collective
from every member rank by `CollectiveInfo.key` (gpu_server/checking/collectives.py). Everything here comes from the
wire:
each field is bounded and checked before the record is accepted.
"""
from __future__ import annotations

import dataclasses
import re

from protos import online_check_pb2 as pb
from protos.apis import COLLECTIVES, POINT_TO_POINT, REDUCE_OPS
from protos.limits import RUN_ID, log_text

GROUP_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}\Z", re.ASCII)
MAX_SEQ = 1 << 53
P2P = "p2p"


class CollectiveError(ValueError):
    """A Collective field that cannot be accepted: the message names it."""


@dataclasses.dataclass(frozen=True)
class CollectiveInfo:
    job: str
    group: str
    ranks: tuple[int, ...]
    seq: int
    op: str = ""
    root: int = -1
    async_op: bool = False
    error: str = ""
    unfinished: bool = False

    @property
    def key(self) -> tuple[str, str, tuple[int, ...], int]:
        """What the records of one collective share on every member rank."""
        return (self.job, self.group, self.ranks, self.seq)

    @property
    def p2p(self) -> bool:
        return self.group == P2P


def from_wire(c: pb.Collective, api: str, rank: int, max_ranks: int) -> CollectiveInfo:
    """The validated CollectiveInfo of `Distributed.<api>` sent by global rank `rank`; raises CollectiveError."""
    if api not in COLLECTIVES and api not in POINT_TO_POINT:
        raise CollectiveError(f"Distributed.{log_text(api)} is not a collective the server checks")
    if not RUN_ID.match(c.job):
        raise CollectiveError(f"collective job '{log_text(c.job)}' is not 1-64 letters, digits, '_' or '-'")
    if not GROUP_NAME.match(c.group):
        raise CollectiveError(f"collective group '{log_text(c.group)}' is not 1-64 letters, digits or '_.:-'")
    if (c.group == P2P) != (api in POINT_TO_POINT):
        raise CollectiveError(f"Distributed.{api} in group '{c.group}': point-to-point calls and only they use "
                              f"group '{P2P}'")
    if not 0 < len(c.ranks) <= max_ranks:
        raise CollectiveError(f"collective of {len(c.ranks)} ranks: 1 to {max_ranks} are accepted")
    ranks = tuple(int(r) for r in c.ranks)
    if len(set(ranks)) != len(ranks):
        raise CollectiveError("collective ranks repeat a rank")
    if rank not in ranks:
        raise CollectiveError(f"rank {rank} sent a collective of group ranks {list(ranks[:8])} it is not a member of")
    if c.group == P2P and len(ranks) != 2:
        raise CollectiveError("a point-to-point record names 2 ranks: (source, destination)")
    if c.seq >= MAX_SEQ:
        raise CollectiveError(f"collective sequence number {c.seq} is too large")
    if c.op and c.op not in REDUCE_OPS:
        raise CollectiveError(f"reduce op '{log_text(c.op)}' is not one of {', '.join(sorted(REDUCE_OPS))}")
    if c.root != -1 and c.root not in ranks:
        raise CollectiveError(f"collective root {c.root} is not a member of its group")
    return CollectiveInfo(job=c.job, group=c.group, ranks=ranks, seq=int(c.seq), op=c.op, root=int(c.root),
                          async_op=bool(c.async_op), error=log_text(c.error, 1000) if c.error else "",
                          unfinished=bool(c.unfinished))
