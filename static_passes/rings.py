"""Who is at the other end of a ring: read from a program's communicator setup.

Paddle's static pipeline (fleet ``PipelineOptimizer``) gives every ordered stage pair its own
two-rank ring and writes, into the startup program, one ``c_comm_init`` (with
``endpoints``, ``rank``, ``ring_id``) and on device builds one ``c_gen_*_id`` (with
``endpoint``, ``other_endpoints``, ``rank``, ``ring_id``) per ring. A send's ``peer`` attribute
is a rank inside its ring, so the peer's endpoint is ``endpoints[peer]``. Ops are read at the
desc level, so programs holding ops this Paddle build does not register still parse.
"""

from __future__ import annotations

from dataclasses import dataclass

from .report import PeerInfo

__all__ = ["RingTable"]


@dataclass(frozen=True)
class _Ring:
    rank: int
    endpoints: tuple[str, ...]


def _ring_of(op_desc):
    """(ring_id, _Ring) from one communicator-setup op desc, or None."""
    if not (op_desc.has_attr("ring_id") and op_desc.has_attr("rank")):
        return None
    ring_id, rank = int(op_desc.attr("ring_id")), int(op_desc.attr("rank"))
    endpoints = None
    if op_desc.has_attr("endpoints") and isinstance(op_desc.attr("endpoints"), str):
        endpoints = [e for e in op_desc.attr("endpoints").split(",") if e]
    elif op_desc.has_attr("endpoint") and op_desc.has_attr("other_endpoints"):
        endpoints = list(op_desc.attr("other_endpoints"))
        endpoints.insert(rank, op_desc.attr("endpoint"))
    if not endpoints or not 0 <= rank < len(endpoints):
        return None
    return ring_id, _Ring(rank, tuple(endpoints))


class RingTable:
    """Ring id -> (this process's rank in it, the ring's endpoints), from communicator setup ops."""

    def __init__(self, program_descs=()):
        self._rings: dict[int, _Ring] = {}
        self.conflicts: set[int] = set()
        for desc in program_descs:
            block = desc.block(0)
            for i in range(block.op_size()):
                found = _ring_of(block.op(i))
                if found is None:
                    continue
                ring_id, ring = found
                if self._rings.get(ring_id, ring) != ring:
                    self.conflicts.add(ring_id)
                self._rings[ring_id] = ring
        for ring_id in self.conflicts:
            del self._rings[ring_id]
        # The global ring: the widest one, the lowest id among equals (fleet gives it id 1).
        by_width = sorted(self._rings.items(), key=lambda item: (-len(item[1].endpoints), item[0]))
        self._global = by_width[0][1].endpoints if by_width else ()

    def __bool__(self) -> bool:
        return bool(self._rings)

    def knows(self, ring_id: int) -> bool:
        """True when the setup of ``ring_id`` was found (and is not contradictory)."""
        return ring_id in self._rings

    def peer(self, ring_id: int, ring_rank: int | None) -> PeerInfo:
        """The peer reached through ``ring_id`` at rank ``ring_rank`` of that ring."""
        ring = self._rings.get(ring_id)
        if ring is None or ring_rank is None or not 0 <= ring_rank < len(ring.endpoints):
            return PeerInfo(ring_id, ring_rank)
        endpoint = ring.endpoints[ring_rank]
        global_rank = self._global.index(endpoint) if endpoint in self._global else None
        return PeerInfo(ring_id, ring_rank, endpoint, global_rank)
