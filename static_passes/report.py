"""The report of the send-wait pass: what it removed, inserted, kept and recognised.

Indices: ``send_index``, ``sync_index`` and ``recv_index`` are positions in block 0 *before*
the pass; ``nop_index`` / ``InsertedNop.index`` are positions *after* it. Plain data, no
framework import.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["PeerInfo", "RemovedSync", "InsertedNop", "KeptSend", "ExistingNop", "SendWaitReport"]


@dataclass(frozen=True)
class PeerInfo:
    """The other end of a send or recv.

    ring_id: the communicator ring of the op. ring_rank: its ``peer`` attribute (a rank inside
    that ring). endpoint: the peer's endpoint, when the communicator setup was found.
    global_rank: the peer's index in the widest ring found (the global ring), when known.
    """

    ring_id: int
    ring_rank: int | None
    endpoint: str | None = None
    global_rank: int | None = None

    def __str__(self) -> str:
        if self.endpoint is None:
            return f"ring {self.ring_id} peer {self.ring_rank} (endpoint unknown)"
        rank = "" if self.global_rank is None else f"rank {self.global_rank} "
        return f"{rank}({self.endpoint}) via ring {self.ring_id} peer {self.ring_rank}"


@dataclass(frozen=True)
class RemovedSync:
    """A forward-send ``c_sync_comm_stream`` the pass removed, and why that was safe."""

    sync_index: int
    send_index: int
    var_names: tuple[str, ...]
    ring_id: int
    peer: PeerInfo
    recv_index: int
    nop_index: int
    evidence: str


@dataclass(frozen=True)
class InsertedNop:
    """A ``nop`` the pass inserted right after a backward recv, holding the sent variables."""

    index: int
    recv_index: int
    recv_peer: PeerInfo
    var_names: tuple[str, ...]


@dataclass(frozen=True)
class KeptSend:
    """A send whose sync (if any) the pass left in place, with the reason."""

    send_index: int
    var_names: tuple[str, ...]
    ring_id: int | None
    reason: str


@dataclass(frozen=True)
class ExistingNop:
    """A ``nop`` already in the program (upstream ``_optimize_forward_send_sync`` or a previous run).

    verified: True when every held variable was sent to the stage the preceding recv comes
    from, False when one was sent elsewhere, None when the peers are unknown.
    """

    index: int
    var_names: tuple[str, ...]
    recv_index: int | None
    verified: bool | None
    note: str


@dataclass
class SendWaitReport:
    """What ``optimize_pipeline_send_wait`` did to one section program."""

    removed_syncs: list[RemovedSync] = field(default_factory=list)
    inserted_nops: list[InsertedNop] = field(default_factory=list)
    kept_sends: list[KeptSend] = field(default_factory=list)
    existing_nops: list[ExistingNop] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        """True when the pass rewrote the program."""
        return bool(self.removed_syncs or self.inserted_nops)

    def to_dict(self) -> dict:
        """A JSON-ready copy of the report."""
        return asdict(self) | {"changed": self.changed}

    def __str__(self) -> str:
        what = "rewrote the program" if self.changed else "no change"
        lines = [f"send-wait pass: {what} (op #: index before the pass; nop #: index after it)"]
        for r in self.removed_syncs:
            lines.append(
                f"  removed c_sync_comm_stream #{r.sync_index} of send #{r.send_index} "
                f"{list(r.var_names)} ring {r.ring_id} -> {r.peer}; held after recv #{r.recv_index} "
                f"by nop #{r.nop_index} [{r.evidence}]"
            )
        for n in self.inserted_nops:
            lines.append(
                f"  inserted nop #{n.index} after recv #{n.recv_index} from {n.recv_peer}: "
                f"holds {list(n.var_names)}"
            )
        for k in self.kept_sends:
            lines.append(f"  kept send #{k.send_index} {list(k.var_names)} ring {k.ring_id}: {k.reason}")
        for e in self.existing_nops:
            lines.append(f"  existing nop #{e.index} {list(e.var_names)}: {e.note}")
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)
