"""tools.memtrace on a hand-made allocator history: the peaks, where in the steps they fall,
what the step inherited, block sizes per site."""

from tools.diagnostics import memtrace

MIB = 2**20


def _alloc(addr, mib, t, line, pool=(0, 0)):
    return {"action": "alloc", "addr": addr, "size": mib * MIB, "time_us": t, "pool_id": pool,
            "frames": [{"filename": "/x/tools/train_gpt.py", "line": line, "name": "run_torch"}]}


def _free(addr, mib, t):
    return {"action": "free_completed", "addr": addr, "size": mib * MIB, "time_us": t}


def test_peak_moments_say_their_step_and_what_the_step_inherited():
    events = [
        {"action": "segment_alloc", "addr": 0, "size": 1024 * MIB, "time_us": 0, "pool_id": (0, 0)},
        _alloc(0, 100, 5, 10),  # a buffer kept for the whole run
        _alloc(100 * MIB, 8, 110, 20),  # step 1: two 8 MiB activations and a 24 MiB one
        _alloc(108 * MIB, 8, 120, 20),
        _alloc(116 * MIB, 24, 130, 21),
        _free(116 * MIB, 24, 150),
        _free(108 * MIB, 8, 160),
        _free(100 * MIB, 8, 170),
        _alloc(100 * MIB, 8, 215, 20),  # step 2: less
        _free(100 * MIB, 8, 230),
    ]
    out = memtrace.analyze({"device_traces": [events]}, device=0, step_starts_us=[100, 200])
    peak = out["peak_allocated"]
    assert peak["allocated_mib"] == 140
    assert peak["step"] == 0 and peak["step_fraction"] == 0.3
    assert peak["allocated_before_step_by_pool_mib"] == {"default": 100}
    site = "default tools/train_gpt.py:20:run_torch"
    assert peak["top_sites_mib"][site] == 16
    assert peak["top_site_sizes"][site] == {8.0: 2}
    assert out["end"]["step"] == 1 and out["end"]["allocated_mib"] == 100
    assert peak["segments"] == {"default": 1}
    assert peak["segments_most_free_mib"] == {"default": [(1024.0, 140.0)]}
    text = memtrace.describe(out)
    assert "at step 0 +0.3" in text and "{8.0: 2}" in text


def test_without_step_marks_moments_carry_no_step():
    events = [{"action": "segment_alloc", "addr": 0, "size": 64 * MIB, "time_us": 0, "pool_id": (0, 0)},
              _alloc(0, 10, 1, 5)]
    out = memtrace.analyze({"device_traces": [events]}, device=0)
    assert "step" not in out["peak_allocated"] and out["peak_allocated"]["allocated_mib"] == 10


def test_a_graph_pool_growing_beside_a_hole_too_small_is_listed():
    pool = (1, 2)
    events = [
        {"action": "segment_alloc", "addr": 0, "size": 100 * MIB, "time_us": 0, "pool_id": pool},
        _alloc(0, 30, 1, 5, pool),
        _alloc(30 * MIB, 20, 2, 5, pool),
        _alloc(50 * MIB, 30, 3, 5, pool),
        _free(30 * MIB, 20, 4),  # holes of 20 MiB and 20 MiB (at the end): 40 free, none of 40
        {"action": "segment_alloc", "addr": 200 * MIB, "size": 40 * MIB, "time_us": 5, "pool_id": pool},
        _alloc(200 * MIB, 40, 6, 7, pool),
    ]
    out = memtrace.analyze({"device_traces": [events]}, device=0)
    assert out["growth"] == [[100.0, 30.0, 0.0, 0.0, "tools/train_gpt.py:5:run_torch"],
                             [40.0, 40.0, 20.0, 40.0, "tools/train_gpt.py:7:run_torch"]]
    assert "2 segments; 2 of them for a request larger than the largest hole" in memtrace.describe(out)


def test_the_raw_history_is_written_only_where_a_folder_is_given(tmp_path, monkeypatch):
    import gzip
    import json

    from tools.diagnostics import pool_model

    events = [{"action": "alloc", "addr": 0, "size": 1024, "stream": 0, "time_us": 5, "frames": []},
              {"action": "free_completed", "addr": 0, "size": 1024, "stream": 0, "time_us": 6, "frames": []}]
    monkeypatch.delenv("GRAPHPP_MEMTRACE_RAW", raising=False)
    monkeypatch.setattr(memtrace, "raw_events", lambda snapshot: [[e["action"], e["addr"], e["size"], 0, "default",
                                                                  e["time_us"], "", ""] for e in snapshot["events"]])
    assert memtrace.write_raw({"events": events}, "ours-rank1", [1, 2]) is None
    monkeypatch.setenv("GRAPHPP_MEMTRACE_RAW", str(tmp_path))
    path = memtrace.write_raw({"events": events}, "ours-rank1", [1, 2])
    assert path == str(tmp_path / "ours-rank1.json.gz")
    with gzip.open(path, "rt") as f:
        assert json.load(f)["step_starts_us"] == [1, 2]
    assert [row[0] for row in pool_model._rows(path)] == ["alloc", "free_completed"]


def test_a_history_whose_start_the_ring_dropped_is_not_complete():
    whole = [{"action": "segment_alloc", "addr": 0, "size": 64 * MIB, "time_us": 0, "pool_id": (0, 0)},
             _alloc(0, 8, 1, 10), _alloc(8 * MIB, 8, 2, 11), _free(8 * MIB, 8, 3), _free(0, 8, 4)]
    assert memtrace.analyze({"device_traces": [whole]}, device=0)["complete"]
    # the ring kept the last events only: its first is an allocation, but a block it never saw is freed
    tail = whole[2:]
    assert not memtrace.analyze({"device_traces": [tail]}, device=0)["complete"]
