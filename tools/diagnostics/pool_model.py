"""A model of PyTorch's CUDA caching allocator for the requests of one stream in one pool.

    python tools/diagnostics/pool_model.py RANK.json.gz ... [--reserve-from RANK.json.gz]
        # histories written with GRAPHPP_MEMTRACE_RAW=<folder> by train_gpt.py --memory-trace
        # or bench_peer_megatron.py --memory-trace (memtrace.write_raw)

What it answers: given a sequence of requests (allocate ``n`` bytes, free an earlier
allocation) and the free blocks a pool starts with, which segments the allocator adds, so that
starting layouts can be compared without spending memory on them. The command replays the
graph pool's requests of a recorded run (its captures and the optimizer steps that borrowed
it) from each layout the pool could have been given before its first capture (the reserve as
the optimizer temporaries' segments, as one block, none) and prints the pool's size in each
beside the size the run reached. It follows the native
allocator's rules (PyTorch 2.x, ``expandable_segments`` off, ``max_split_size_mb`` unset):

* a request is rounded up to a multiple of 512 bytes; up to 1 MiB it is served from the small
  blocks (2 MiB segments), above from the large ones;
* the free block chosen is the smallest at least as large, the lowest address among equals;
* a block is split when what is left is more than 1 MiB (large) or at least 512 bytes
  (small); the request takes the front, the rest stays free after it;
* with no block large enough a segment is added: 2 MiB for small requests, 20 MiB for
  requests under 10 MiB, else the request rounded up to 2 MiB;
* a freed block merges with free neighbours of its segment; segments are never released
  (a graph pool with live graphs is not trimmed).

Requests are matched to frees by a key of the caller's choice (an address in a recorded
history, a counter in a plan). Measured against 12 recorded runs (GPT-3 1.3B ``zbv`` and
``dualpipev`` stages, three layouts, 2026-11-26; the record and the notes of the fifth
session are in git history, ``git show 32ce9ec:benchmarks/NOTES.md``): with
its segments at the run's addresses the model gives each run's pool exactly; from another
layout's run it gives the runs with a reserve (block or segments) within 4 MiB, while without
a reserve the outcome depends on the order of the addresses the driver hands out (between free
blocks of one size the lowest address wins), which the model cannot know beforehand.

:class:`ExpandablePoolModel` models the same requests on a pool in expandable segments (how
``paddle_graphpp`` maps graph pools by default, ``FLAGS_graphpp_pool_expandable``); the command
prints it as ``expandable``. Its figures from the fifth session's histories were the
prediction for that change: ``zbv`` rank 0 4986 MiB (5552 with the block), rank 1 4366; the
pools of the run with it were 4986 and 4366 MiB. Those histories (the run with expandable
pools, both ranks, and the block layout's rank 0) are kept in
``tools/diagnostics/allocator-histories/`` for the tests.
"""

from __future__ import annotations

import bisect
import sys
from typing import Hashable, Iterable, Optional

__all__ = ["ExpandablePoolModel", "PoolModel", "compare", "layouts", "main", "pool_requests", "pool_rows", "replay",
           "replay_expandable", "round_size", "segment_size"]

_MIN_BLOCK = 512
_SMALL = 1 << 20
_SMALL_BUFFER = 2 << 20
_LARGE_BUFFER = 20 << 20
_MIN_LARGE_ALLOC = 10 << 20
_ROUND_LARGE = 2 << 20


def round_size(nbytes: int) -> int:
    """The bytes the allocator sets aside for a request of ``nbytes``."""
    return _MIN_BLOCK if nbytes < _MIN_BLOCK else -(-nbytes // _MIN_BLOCK) * _MIN_BLOCK


def segment_size(rounded: int) -> int:
    """The segment the allocator adds for a rounded request no free block fits."""
    if rounded <= _SMALL:
        return _SMALL_BUFFER
    if rounded < _MIN_LARGE_ALLOC:
        return _LARGE_BUFFER
    return -(-rounded // _ROUND_LARGE) * _ROUND_LARGE


class _Block:
    __slots__ = ("addr", "size", "free", "prev", "next", "small")

    def __init__(self, addr: int, size: int, small: bool):
        self.addr, self.size, self.free, self.small = addr, size, True, small
        self.prev: Optional[_Block] = None
        self.next: Optional[_Block] = None


class _Blocks:
    """Blocks linked by address within their segment (or range), a free list per kind sorted by
    size then address, and the counters; subclasses say where a request's block comes from and
    when a rest is split off."""

    def __init__(self):
        self._free = {False: [], True: []}  # small? -> sorted [(size, addr, id, block)]
        self._live: dict = {}  # key -> block
        self._sizes: dict = {}  # key -> rounded request
        self.reserved = self.allocated = self.peak_allocated = 0
        self.requested = self.peak_requested = 0  # the requests' own bytes (rounded), without unsplit rests

    def _insert(self, block: _Block) -> None:
        bisect.insort(self._free[block.small], (block.size, block.addr, id(block), block))

    def _remove(self, block: _Block) -> None:
        lst = self._free[block.small]
        i = bisect.bisect_left(lst, (block.size, block.addr, id(block)))
        assert lst[i][3] is block
        del lst[i]

    def _block_for(self, size: int, small: bool) -> _Block:
        """A free block of at least ``size`` bytes, out of the free list."""
        raise NotImplementedError

    def _splits(self, rest: int, small: bool) -> bool:
        raise NotImplementedError

    def _split(self, block: _Block, size: int) -> _Block:
        """Cut ``block`` to ``size``; the rest becomes a free block linked after it."""
        tail = _Block(block.addr + size, block.size - size, block.small)
        tail.prev, tail.next = block, block.next
        if block.next is not None:
            block.next.prev = tail
        block.next = tail
        block.size = size
        return tail

    def _merged(self, lower: _Block, upper: _Block) -> None:
        """``upper`` was merged into ``lower``."""

    def alloc(self, key: Hashable, nbytes: int) -> None:
        """Allocate ``nbytes`` for ``key`` (which must not be live)."""
        size = round_size(nbytes)
        small = size <= _SMALL
        block = self._block_for(size, small)
        if self._splits(block.size - size, small):
            self._insert(self._split(block, size))
        block.free = False
        self._live[key] = block
        self._sizes[key] = size
        self.allocated += block.size
        self.requested += size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_requested = max(self.peak_requested, self.requested)

    def free(self, key: Hashable) -> bool:
        """Free ``key``'s block; False when ``key`` is not live here (nothing happens)."""
        block = self._live.pop(key, None)
        if block is None:
            return False
        self.allocated -= block.size
        self.requested -= self._sizes.pop(key)
        block.free = True
        for other in (block.prev, block.next):
            if other is not None and other.free:
                self._remove(other)
                lower, upper = (other, block) if other is block.prev else (block, other)
                lower.size += upper.size
                lower.next = upper.next
                if upper.next is not None:
                    upper.next.prev = lower
                self._merged(lower, upper)
                block = lower
        self._insert(block)
        return True

    def live(self, key: Hashable) -> bool:
        return key in self._live

    def replay(self, requests: Iterable[tuple]) -> "_Blocks":
        """Apply ``requests`` (``("alloc", key, nbytes)`` or ``("free", key, _)``) in order; returns
        this model."""
        for action, key, size in requests:
            if action == "alloc":
                self.alloc(key, size)
            else:
                self.free(key)
        return self


class PoolModel(_Blocks):
    """The blocks of one pool on one stream, as the caching allocator would hold them.

    ``reserved`` (bytes in segments), ``peak_allocated`` (blocks handed out, a rest too small to
    split off included), ``peak_requested`` (the requests' rounded bytes alone) and ``segments``
    (the sizes added, in order) describe what happened; :meth:`alloc` and :meth:`free` replay
    requests. Segments a pool starts with are large-block segments."""

    def __init__(self, segments: Iterable[int] = (), addresses: Optional[Iterable[int]] = None):
        """``segments``: free segments the pool starts with. ``addresses``: where the segments
        go, in the order they are made (a recorded history's, or random ones); by default each
        above the last. Between free blocks of one size the allocator takes the lowest address,
        so the order of the addresses the driver hands out can decide where a request goes."""
        super().__init__()
        self._addresses = iter(addresses) if addresses is not None else None
        self._next_addr = 1 << 40
        self.segments: list = []
        for size in segments:  # free segments the pool starts with (a reserve)
            self._add_segment(size, small=False)

    def _add_segment(self, size: int, small: bool) -> _Block:
        given = next(self._addresses, None) if self._addresses is not None else None
        block = _Block(self._next_addr if given is None else given, size, small)
        self._next_addr = block.addr + size + (1 << 30)  # segments are never adjacent
        self.reserved += size
        self.segments.append(size)
        self._insert(block)
        return block

    def _block_for(self, size: int, small: bool) -> _Block:
        lst = self._free[small]
        i = bisect.bisect_left(lst, (size,))
        if i < len(lst):
            return lst.pop(i)[3]
        block = self._add_segment(segment_size(size), small)
        self._remove(block)
        return block

    def _splits(self, rest: int, small: bool) -> bool:
        return rest >= _MIN_BLOCK if small else rest > _SMALL


class ExpandablePoolModel(_Blocks):
    """The blocks of one pool whose memory is the caching allocator's expandable segments
    (``expandable_segments:True``, as ``paddle_graphpp`` maps graph pools by default): large and
    small requests each get one range of addresses, mapped in pages (20 MiB, 2 MiB) from its
    start. The free block chosen is the smallest at least as large, the lowest address among
    equals; the free block at the end of a range is taken last (the allocator counts it as large
    as the unmapped space after it). With no other block large enough, that end block, extended
    by the pages still missing, serves the request. A block is split whenever 512 bytes or more
    are left; freed blocks merge with free neighbours; nothing is unmapped (``max_split_size_mb``
    unset: with it, free blocks at least that large serve only requests as large). Same interface and
    figures as :class:`PoolModel`, ``maps`` instead of ``segments``. ``reserve``: sizes
    allocated together and freed before the requests (the pool's reserve)."""

    _PAGE = {False: _LARGE_BUFFER, True: _SMALL_BUFFER}

    def __init__(self, reserve: Iterable[int] = ()):
        super().__init__()
        self._end: dict = {False: None, True: None}  # the last block of each range (out of the free list)
        self._mapped = {False: 0, True: 0}
        self.maps: list = []  # bytes mapped, in order
        reserve = list(reserve)
        for i, n in enumerate(reserve):
            self.alloc(("reserve", i), n)
        for i in range(len(reserve)):
            self.free(("reserve", i))
        self.peak_allocated, self.peak_requested = self.allocated, self.requested

    def _insert(self, block: _Block) -> None:
        if block is not self._end[block.small]:
            super()._insert(block)

    def _remove(self, block: _Block) -> None:
        if block is not self._end[block.small]:
            super()._remove(block)

    def _block_for(self, size: int, small: bool) -> _Block:
        lst = self._free[small]
        i = bisect.bisect_left(lst, (size,))
        if i < len(lst):
            return lst.pop(i)[3]
        end = self._end[small]
        free_end = end.size if end is not None and end.free else 0
        if free_end >= size:
            return end
        page = self._PAGE[small]
        grow = -(-(size - free_end) // page) * page
        self.reserved += grow
        self.maps.append(grow)
        if free_end:
            end.size += grow
        else:
            block = _Block(((1 << 50) if small else (1 << 40)) + self._mapped[small], grow, small)
            block.prev = end
            if end is not None:
                end.next = block
            self._end[small] = end = block
        self._mapped[small] += grow
        return end

    def _splits(self, rest: int, small: bool) -> bool:
        return rest >= _MIN_BLOCK

    def _split(self, block: _Block, size: int) -> _Block:
        tail = super()._split(block, size)
        if self._end[block.small] is block:
            self._end[block.small] = tail
        return tail

    def _merged(self, lower: _Block, upper: _Block) -> None:
        if self._end[upper.small] is upper:
            self._end[upper.small] = lower


def _capture_state(where: str, ours: str) -> bool:
    """A row of what a capture allocates for itself before it begins (its random-number state,
    in the default pool on the capture stream) in a history whose events name no pool: the
    stream then stands for the pool, and these rows are not the pool's."""
    return where.startswith("stream") and ours.endswith("runtime.py:capture_to_graph")


def pool_rows(rows: list) -> tuple:
    """The graph pool of a raw history (``tools/diagnostics/memtrace.py`` ``raw_events`` rows) and its rows:
    the pool the reserve was made in, else the one with the most events (histories of torch
    2.11 name pools by their stream: one pool per capture stream)."""
    from collections import Counter

    reserved = [r[4] for r in rows if "pool_lending.py" in r[6] and "reserve" in r[6] and r[0] == "alloc"]
    counts = Counter(r[4] for r in rows if r[4] not in ("default", "stream0"))
    if not counts:
        raise ValueError("no graph pool in this history: was it recorded from a run with --cudagraph?")
    pool = reserved[0] if reserved else counts.most_common(1)[0][0]
    return pool, [r for r in rows if r[4] == pool and not _capture_state(r[4], r[6])]


def pool_requests(rows: list) -> tuple:
    """From a raw history: the graph pool (:func:`pool_rows`), the sizes the pool's reserve
    allocated before its first capture, and every other request of that pool in order,
    ``("alloc" | "free", addr, size)``; a block's free is when it is back in the pool
    (``free_completed``), not when it was asked for."""
    pool, mine = pool_rows(rows)
    return (pool, *_split_reserve(mine))


def _split_reserve(mine: list) -> tuple:
    """A pool's rows as (the reserve's allocation sizes, the other requests in order)."""
    reserve, requests = [], []
    for action, addr, size, _stream, _where, _t, ours, _site in mine:
        if "pool_lending.py" in ours and "reserve" in ours:
            if action == "alloc":
                reserve.append(size)
        elif action == "alloc":
            requests.append(("alloc", addr, size))
        elif action == "free_completed":
            requests.append(("free", addr, 0))
    return reserve, requests


def layouts(reserve: list) -> dict:
    """The free segments a pool starts with under each reserve layout, for a reserve whose
    allocations were ``reserve`` (one per parameter, or one block)."""
    shaped = PoolModel()
    for i, n in enumerate(reserve):
        shaped.alloc(i, n)
    total = sum(round_size(n) for n in reserve)
    return {"segments": list(shaped.segments), "block": [segment_size(total)] if total else [], "none": []}


def replay(requests: list, initial: Iterable[int] = (), addresses: Optional[Iterable[int]] = None) -> PoolModel:
    """``requests`` (as :func:`pool_requests` gives them) on a pool that starts with the free
    segments ``initial`` (``addresses``: see :class:`PoolModel`)."""
    return PoolModel(initial, addresses).replay(requests)


def replay_expandable(requests: list, reserve: Iterable[int] = ()) -> ExpandablePoolModel:
    """``requests`` (as :func:`pool_requests` gives them) on a pool in expandable segments that
    first allocated and freed ``reserve``."""
    return ExpandablePoolModel(reserve).replay(requests)


def _rows(path: str) -> list:
    import gzip
    import json

    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f)["events"]


def compare(path: str, reserve_from: Optional[str] = None, orders: int = 0, extra: Iterable[int] = ()) -> dict:
    """The pool of the run recorded in ``path``: MiB it grew to (``run_mib``); MiB the model
    gives the run's own requests, the reserve's included, with its segments at the run's
    addresses (``model_at_run_addresses_mib``); the most the requests (the reserve's left out)
    hold at once, each rounded as the allocator rounds it, which no placement can go below
    (``requested_peak_mib``); and MiB the model gives the requests from each
    layout (``<layout>_mib``; with ``orders``, ``<layout>_range_mib``: least and most over that
    many random address orders). A run that reserved one block holds no parameter sizes: the
    segments layout then needs ``reserve_from``, a history of a run that reserved segments.
    The ``none`` layout keeps the recorded optimizer steps in the pool, as where they borrow it.
    ``extra``: free segments (bytes) added to every layout, to see how much the outcome depends
    on the layout's details."""
    import random

    mine = pool_rows(_rows(path))[1]
    reserve, requests = _split_reserve(mine)
    grown = [r for r in mine if r[0] == "segment_alloc"]
    mapped = [r for r in mine if r[0] == "segment_map"]  # a pool in expandable segments
    own = [(("alloc" if r[0] == "alloc" else "free"), r[1], r[2]) for r in mine if r[0] in ("alloc", "free_completed")]
    # one range for a pool in expandable segments: no addresses to follow
    at_run = replay_expandable(own) if mapped else replay(own, (), [r[1] for r in grown])
    out = {"run_mib": sum(r[2] for r in grown + mapped) / 2**20, "model_at_run_addresses_mib": at_run.reserved / 2**20,
           "requested_peak_mib": replay(requests).peak_requested / 2**20}
    if reserve_from is not None:
        reserve = pool_requests(_rows(reserve_from))[1]
    out["expandable_mib"] = replay_expandable(requests, reserve).reserved / 2**20
    for name, initial in layouts(reserve).items():
        if name == "segments" and len(reserve) == 1:
            continue  # one block reserved: not the parameters' sizes
        initial = [*initial, *extra]
        out[f"{name}_mib"] = replay(requests, initial).reserved / 2**20
        if orders:
            sizes = []
            for seed in range(orders):
                rng = random.Random(seed)
                sizes.append(replay(requests, initial, iter(lambda: rng.randrange(1, 1 << 20) << 30, None)).reserved)
            out[f"{name}_range_mib"] = [min(sizes) / 2**20, max(sizes) / 2**20]
    return out


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("histories", nargs="+", help="*.json.gz histories (memtrace.write_raw, GRAPHPP_MEMTRACE_RAW)")
    parser.add_argument("--reserve-from", help="take the reserve's allocations from this history")
    parser.add_argument("--orders", type=int, default=0, help="also replay over this many random address orders")
    parser.add_argument("--add-segment", type=float, action="append", default=[], metavar="MIB",
                        help="a free segment of this many MiB added to every layout (repeatable)")
    opts = parser.parse_args(argv)
    extra = [int(m * 2**20) for m in opts.add_segment]
    for path in opts.histories:
        sizes = compare(path, opts.reserve_from, opts.orders, extra)
        print(f"{path}: " + ", ".join(f"{k[:-4]} {v if isinstance(v, list) else round(v)} MiB" for k, v in sizes.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
