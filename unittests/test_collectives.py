"""The dispatcher's path choice in every state, the policy, and buffer registration bookkeeping.

``ListBackend`` is a framework half over Python lists (one rank, or a scripted peer for the
registration exchange); the dispatcher and registry under test are the real ones.
"""

import gc

import pytest

from paddle_graphpp.core import collectives as C
from paddle_graphpp.core.errors import CaptureError


class Graph:
    """Stands in for a framework graph object: weak-referenceable, freed by the GC."""


class ListBackend(C.AllReduceBackend):
    name = "lists"

    def __init__(self, *, world_size=2, peer_sees=None, reason=None, arena=4096):
        self._world, self.peer_sees, self.reason, self._arena_size = world_size, peer_sees, reason, arena
        self.capturing = False
        self.calls = []
        self.closed = False

    world_size = property(lambda self: self._world)

    def custom_unavailable_reason(self):
        return self.reason

    def facts(self, t):
        return C.TensorFacts(nbytes=4 * len(t), dtype="float32", contiguous=True, address_mod16=0)

    def is_capturing(self):
        return self.capturing

    def empty_like(self, t):
        self.calls.append("empty")
        return [None] * len(t)

    def fallback(self, t):
        self.calls.append("fallback")
        t[:] = [v * self._world for v in t]
        return t

    def reduce_staged(self, t):
        self.calls.append("staged")
        return [v * self._world for v in t]

    def reduce_registered(self, t, offset):
        self.calls.append(("registered", offset))
        return [v * self._world for v in t]

    def arena_bytes(self):
        return self._arena_size

    def exchange(self, obj):
        peer = obj if self.peer_sees is None else self.peer_sees(obj)
        return [obj, peer]

    def close(self):
        self.closed = True


def test_choose_path_table():
    P = C.AllReducePath
    assert C.choose_path(True, True) is P.REGISTERED
    assert C.choose_path(True, False) is P.ALLOCATION_MIMIC
    assert C.choose_path(False, False) is P.COPY_IN
    assert C.choose_path(False, True) is P.COPY_IN


@pytest.mark.parametrize("phase,capturing,expected,call", [
    (False, False, "copy_in", "staged"),
    (False, True, "copy_in", "staged"),
    (True, False, "allocation_mimic", "empty"),
    (True, True, "registered", ("registered", 0)),
])
def test_dispatcher_paths_in_every_state(phase, capturing, expected, call):
    backend = ListBackend()
    d = C.AllReduceDispatcher(backend)
    backend.capturing = capturing
    g = Graph()
    if phase:
        with C.capture_custom_allreduce(), C.capturing_graph(g):
            assert d.path_for([1.0] * 4).value == expected
            out = d.all_reduce([1.0] * 4)
    else:
        with C.capturing_graph(g):
            assert d.path_for([1.0] * 4).value == expected
            out = d.all_reduce([1.0] * 4)
    assert backend.calls == [call]
    assert d.counts[C.AllReducePath(expected)] == 1
    if expected == "allocation_mimic":
        assert out == [None] * 4       # shape-alike, no communication
    else:
        assert out == [2.0] * 4
    d.close()


def test_unavailable_kernel_and_policy_rejections_fall_back():
    backend = ListBackend(reason="no peer access")
    d = C.AllReduceDispatcher(backend)
    with C.capture_custom_allreduce():
        backend.capturing = True
        assert d.why_not_custom([1.0] * 4) == "no peer access"
        assert d.all_reduce([1.0] * 4) == [2.0] * 4
    assert backend.calls == ["fallback"]
    policy = C.CustomAllReducePolicy(max_bytes=64)
    facts = C.TensorFacts(nbytes=64, dtype="float32", contiguous=True, address_mod16=0)
    assert policy.reject_reason(facts, 2) is None
    assert "max_bytes" in policy.reject_reason(C.TensorFacts(128, "float32", True, 0), 2)
    assert "dtype" in policy.reject_reason(C.TensorFacts(64, "int64", True, 0), 2)
    assert "multiple of 16" in policy.reject_reason(C.TensorFacts(36, "float32", True, 0), 2)
    assert "aligned" in policy.reject_reason(C.TensorFacts(64, "float32", True, 8), 2)
    assert "contiguous" in policy.reject_reason(C.TensorFacts(64, "float32", False, 0), 2)
    assert "world size" in policy.reject_reason(facts, 3)
    assert "empty" in policy.reject_reason(C.TensorFacts(0, "float32", True, 0), 2)
    d2 = C.AllReduceDispatcher(ListBackend(world_size=3))
    assert not d2.should_use_custom([1.0] * 4)
    assert d2.all_reduce([1.0] * 4) == [3.0] * 4


def test_registered_buffers_live_with_their_graph():
    backend = ListBackend()
    d = C.AllReduceDispatcher(backend)
    g1, g2 = Graph(), Graph()
    with C.capture_custom_allreduce():
        backend.capturing = True
        with C.capturing_graph(g1):
            d.all_reduce([1.0] * 4)
            d.all_reduce([1.0] * 100)
        with C.capturing_graph(g2):
            d.all_reduce([1.0] * 4)
    offsets = [c[1] for c in backend.calls]
    assert offsets == [0, 256, 768]       # distinct, granule-aligned, same on every rank
    assert d.registered_bytes == 1024
    C.check_replay(g1)
    C.check_replay(g2)
    del g1
    gc.collect()
    assert d.registered_bytes == 256      # g1's buffers went back to the arena
    C.release_graph_buffers(g2)
    assert d.registered_bytes == 0
    with pytest.raises(C.ReleasedBufferError, match="release_graph_buffers"):
        C.check_replay(g2)


def test_close_marks_graphs_released_including_captured_copy_in():
    backend = ListBackend()
    d = C.AllReduceDispatcher(backend)
    g_reg, g_copy, g_none = Graph(), Graph(), Graph()
    backend.capturing = True
    with C.capture_custom_allreduce(), C.capturing_graph(g_reg):
        d.all_reduce([1.0] * 4)
    with C.capturing_graph(g_copy):          # captured outside the phase: staging buffer
        d.all_reduce([1.0] * 4)
    with C.capturing_graph(g_none):
        pass
    d.close()
    assert backend.closed
    for g in (g_reg, g_copy):
        with pytest.raises(C.ReleasedBufferError, match="closed"):
            C.check_replay(g)
    C.check_replay(g_none)
    assert d.why_not_custom([1.0] * 4) == "the dispatcher is closed"


def test_ranks_that_captured_differently_raise_and_release():
    backend = ListBackend(peer_sees=lambda mine: mine[:-1])
    d = C.AllReduceDispatcher(backend)
    g = Graph()
    backend.capturing = True
    with pytest.raises(CaptureError, match="rank 1 captured 1 all-reduces"):
        with C.capture_custom_allreduce(), C.capturing_graph(g):
            d.all_reduce([1.0] * 4)
            d.all_reduce([1.0] * 4)
    with pytest.raises(C.ReleasedBufferError, match="ranks captured different"):
        C.check_replay(g)
    assert d.registered_bytes == 0


def test_error_inside_phase_releases_without_exchange():
    backend = ListBackend(peer_sees=lambda mine: pytest.fail("no exchange after an error"))
    d = C.AllReduceDispatcher(backend)
    g = Graph()
    backend.capturing = True
    with pytest.raises(ValueError):
        with C.capture_custom_allreduce(), C.capturing_graph(g):
            d.all_reduce([1.0] * 4)
            raise ValueError("capture failed")
    assert not C.in_capture_phase()
    with pytest.raises(C.ReleasedBufferError):
        C.check_replay(g)


def test_nested_phase_registers_once_on_outer_exit():
    seen = []
    backend = ListBackend(peer_sees=lambda mine: seen.append(list(mine)) or mine)
    d = C.AllReduceDispatcher(backend)
    backend.capturing = True
    with C.capture_custom_allreduce():
        with C.capture_custom_allreduce():
            with C.capturing_graph(Graph()):
                d.all_reduce([1.0] * 4)
        assert seen == [] and C.in_capture_phase()
    assert seen == [[(0, 16, "float32")]]


def test_full_arena_falls_back_with_one_warning():
    backend = ListBackend(arena=256)
    d = C.AllReduceDispatcher(backend)
    backend.capturing = True
    with C.capture_custom_allreduce(), C.capturing_graph(Graph()):
        d.all_reduce([1.0] * 4)
        with pytest.warns(UserWarning, match="arena"):
            d.all_reduce([1.0] * 4)
    assert backend.calls == [("registered", 0), "fallback"]


def test_registered_call_reserves_the_backends_buffer_bytes():
    class SlotBackend(ListBackend):
        def buffer_bytes(self, nbytes):       # e.g. double-buffered receive slots per rank
            return 2 * self._world * nbytes

    backend = SlotBackend(arena=4096)
    d = C.AllReduceDispatcher(backend)
    backend.capturing = True
    graph = Graph()
    with C.capture_custom_allreduce(), C.capturing_graph(graph):
        d.all_reduce([1.0] * 100)          # 400 bytes -> 1600 reserved -> 1792 with granules
        d.all_reduce([1.0] * 4)            # 16 bytes -> 64 -> 256
    assert [c[1] for c in backend.calls] == [0, 1792]
    assert d.registered_bytes == 1792 + 256


def test_kernel_choice_per_group_size_follows_its_record():
    pytest.importorskip("torch")
    import json
    import os

    from paddle_graphpp.torch.collectives.allreduce import MEASURED, policy_for_world

    def facts(n):
        return C.TensorFacts(nbytes=n, dtype="bfloat16", contiguous=True, address_mod16=0)

    two, four, eight = policy_for_world(2), policy_for_world(4), policy_for_world(8)
    assert two.reject_reason(facts(8 << 20), 2) is None            # push up to 8 MiB on 2 ranks
    assert four.reject_reason(facts(1 << 20), 4) is None
    assert "max_bytes" in four.reject_reason(facts(2 << 20), 4)    # NCCL from 2 MiB on 4 ranks
    assert "world size" in eight.reject_reason(facts(4096), 8)     # not measured: NCCL
    # each choice agrees with the benchmark record of its group size: at every size it admits, the
    # kernel it picks (push below two_shot_min_bytes, two-shot from there) gave correct sums and was
    # faster than NCCL
    from tools.bench_allreduce import suggested_choice

    results = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")
    records = {}
    for name in sorted(os.listdir(results)):
        if name.startswith("allreduce") and name.endswith(".json"):
            record = json.load(open(os.path.join(results, name)))
            records[record.get("ranks", 2)] = record  # the first runs had 2 ranks and did not say so
    for world, choice in MEASURED.items():
        rows = records[world]["sections"]["latency"]
        for row in rows:
            if row["bytes"] > choice.custom_max_bytes:
                continue
            picked = "push" if row["bytes"] < choice.two_shot_min_bytes else "two_shot"
            if picked not in row:  # the dispatcher's own pick ran as "custom"
                assert row["custom_kernel"] == picked, (world, row["bytes"])
                picked = "custom"
            assert row["correct"].get(picked, True), (world, row["bytes"], picked)
            us = row[picked]["median_us"]
            assert us < row["nccl"]["median_us"], (world, row["bytes"], us, row["nccl"]["median_us"])
        # and the benchmark reads the same choice off its own record
        assert suggested_choice(rows) == {"custom_max_bytes": choice.custom_max_bytes,
                                          "two_shot_min_bytes": choice.two_shot_min_bytes}, world


def test_the_suggested_choice_never_takes_a_kernel_whose_results_were_wrong():
    from tools.bench_allreduce import suggested_choice

    def row(n, push, two_shot, nccl, wrong=()):
        return {"bytes": n, "custom_kernel": "push", "push": {"median_us": push}, "two_shot": {"median_us": two_shot},
                "nccl": {"median_us": nccl}, "correct": {v: v not in wrong for v in ("push", "two_shot")}}

    rows = [row(1 << 10, 5.0, 9.0, 10.0), row(1 << 20, 15.0, 12.0, 20.0, wrong=("two_shot",)),
            row(2 << 20, 15.0, 12.0, 20.0, wrong=("two_shot", "push"))]
    assert suggested_choice(rows) == {"custom_max_bytes": 1 << 20, "two_shot_min_bytes": 2 << 20}
    # a variant whose calls went to the framework's all-reduce timed NCCL, not a custom kernel
    rows[1]["correct"]["two_shot"] = True
    assert suggested_choice(rows)["two_shot_min_bytes"] == 1 << 20
    rows[1]["fallback_calls"] = {"two_shot": 32}
    assert suggested_choice(rows)["two_shot_min_bytes"] == 2 << 20


def test_after_the_kernel_gave_up_on_a_peer_every_call_raises_naming_it():
    from paddle_graphpp.core.errors import CollectiveTimeoutError, ReplayTimeoutError

    class GivesUp(ListBackend):
        gave_up = None

        def fault(self):
            return self.gave_up

    backend = GivesUp()
    ar = C.AllReduceDispatcher(backend)
    assert ar.all_reduce([1.0]) == [2.0] and C.collective_fault() is None
    backend.gave_up = "the custom all-reduce on rank 0 waited 5 s for rank 1 and gave up"
    calls = len(backend.calls)
    for capturing in (False, True):  # eager or inside a capture: nothing is launched
        backend.capturing = capturing
        with pytest.raises(CollectiveTimeoutError, match="waited 5 s for rank 1") as raised:
            ar.all_reduce([1.0])
        assert isinstance(raised.value, ReplayTimeoutError)
    assert len(backend.calls) == calls
    # the replay watchdog's thread finds it among the live dispatchers, until the group is closed
    assert C.collective_fault() == backend.gave_up
    ar.close()
    assert C.collective_fault() is None
