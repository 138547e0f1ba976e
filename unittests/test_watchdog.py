"""The replay watchdog (``paddle_graphpp.core.watchdog``) on CPU, with events of the test's own:
a replay that never completes raises naming the graph, then the communicators are aborted, then
the process exits; completed replays and a quiet peer raise nothing; bad timeouts are refused.
A stalled replay on a real GPU is ``unittests/gpu/test_watchdog_gpu.py``; a peer's failed capture
over two gloo ranks is ``unittests/test_capture_agreement.py``."""
import threading
import time

import pytest

from paddle_graphpp.core.errors import ReplayTimeoutError
from paddle_graphpp.core.watchdog import EXIT_CODE, ReplayWatchdog, parse_timeout


class Events:
    """Replays the test completes (or not) by hand; abort and exit are recorded."""

    def __init__(self):
        self.done, self.aborted, self.exited = set(), [], threading.Event()
        self.count = 0

    def event_recorder(self):
        def record():
            self.count += 1
            return self.count
        return record

    def event_done(self, event):
        return event in self.done

    def abort_collectives(self, reason):
        self.aborted.append(reason)
        return "the test's communicators"


def wait_for(predicate, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_a_replay_that_never_completes_raises_then_aborts_then_exits():
    events, codes = Events(), []
    dog = ReplayWatchdog(events, 0.2, grace=0.3, min_gap=0, exit=lambda code: (codes.append(code), events.exited.set()))
    start = time.monotonic()
    dog.launched(lambda: "the forward graph of stage[0:4] (micro-batch position 2; captured with "
                         "torch.distributed.all_reduce (2 ranks))")
    assert wait_for(lambda: dog.error is not None, 2.0)
    assert 0.2 <= time.monotonic() - start < 1.0
    with pytest.raises(ReplayTimeoutError, match=r"forward graph of stage\[0:4\].*all_reduce.*has not completed "
                                                 r"0\.2 s after its replay was launched.*FLAGS_graphpp_replay_timeout"):
        dog.raise_pending()
    # raised in the main thread: the process handles it; no abort, no exit
    time.sleep(1.0)
    assert events.aborted == [] and codes == []


def test_a_process_stuck_on_the_device_gets_its_communicators_aborted_then_exits():
    events, codes = Events(), []
    dog = ReplayWatchdog(events, 0.2, grace=0.3, min_gap=0, exit=lambda code: (codes.append(code), events.exited.set()))
    start = time.monotonic()
    dog.launched("the backward graph of blocks.3 (micro-batch position 0; no collective recorded in its capture)")
    assert events.exited.wait(5.0)  # nobody called raise_pending: the main thread is stuck
    assert codes == [EXIT_CODE] and len(events.aborted) == 1 and "blocks.3" in events.aborted[0]
    assert 0.8 <= time.monotonic() - start < 3.0  # timeout + two graces


def test_completed_replays_and_a_quiet_peer_raise_nothing():
    events = Events()
    peer_calls = []
    dog = ReplayWatchdog(events, 0.2, grace=0.3, min_gap=0, peer_failure=lambda: peer_calls.append(1))
    for _ in range(5):
        dog.launched("a graph")
        events.done.add(events.count)
    time.sleep(0.6)
    dog.raise_pending()  # nothing to raise
    assert dog.error is None and len(peer_calls) == 1  # asked at once, then about once a second
    dog.stop()


def test_a_peers_failure_is_raised_here():
    dog = ReplayWatchdog(Events(), float("inf"), grace=5, peer_failure=lambda: "capturing CUDA graphs failed on rank 3: X")
    assert wait_for(lambda: dog.error is not None, 2.0)
    with pytest.raises(ReplayTimeoutError, match="failed on rank 3: X; this rank stops too"):
        dog.raise_pending()
    dog.stop()


def test_replays_are_sampled_at_most_once_per_min_gap():
    events = Events()
    dog = ReplayWatchdog(events, 10, min_gap=60)
    for _ in range(100):
        dog.launched("a graph")
    assert events.count == 1  # launch-bound steps record one event, not one per replay
    dog.stop()


def test_a_last_launch_within_min_gap_is_followed_by_the_thread():
    # The host launches twice in quick succession, then blocks: the second launch is not
    # recorded at once, and must not be lost when nothing launches after it.
    events = Events()
    dog = ReplayWatchdog(events, 0.3, grace=60, min_gap=0.2)
    dog.launched("the first graph")
    events.done.add(events.count)  # the first replay completes
    dog.launched("the last graph before the host blocks")
    assert events.count == 1  # not recorded at launch
    assert wait_for(lambda: dog.error is not None, 3.0)
    with pytest.raises(ReplayTimeoutError, match="the last graph before the host blocks has not completed"):
        dog.raise_pending()
    assert events.count == 2


@pytest.mark.parametrize("raw,want", [(None, None), (0, None), ("0", None), ("600", 600.0), (1.5, 1.5)])
def test_timeouts_parse(raw, want):
    assert parse_timeout(raw, "X") == want


@pytest.mark.parametrize("raw", ["ten", -1, "nan", [1]])
def test_bad_timeouts_name_the_setting_and_the_fix(raw):
    with pytest.raises(ValueError, match=r"FLAGS_graphpp_replay_timeout=.*(seconds|>= 0)"):
        parse_timeout(raw, "FLAGS_graphpp_replay_timeout")


def test_the_flag_configures_the_process_watchdog(rt, monkeypatch):
    from paddle_graphpp.core.capture import capture_for

    proc = capture_for(rt)
    monkeypatch.setenv("FLAGS_graphpp_replay_timeout", "12")
    dog = proc.replay_watch.watch()
    assert dog is not None and dog.timeout == 12.0 and dog.peer_failure is None  # one process: no peers
    monkeypatch.setenv("FLAGS_graphpp_replay_timeout", "0")
    assert proc.replay_watch.watch() is None  # off
    monkeypatch.setenv("FLAGS_graphpp_replay_timeout", "soon")
    with pytest.raises(ValueError, match="FLAGS_graphpp_replay_timeout='soon'"):
        proc.replay_watch.watch()
    monkeypatch.delenv("FLAGS_graphpp_replay_timeout")
    assert proc.replay_watch.watch() is None  # no process group of several ranks: no default timeout


def test_watch_replays_validates_its_arguments():
    pytest.importorskip("torch")
    from paddle_graphpp.torch import watch_replays

    with pytest.raises(ValueError, match="grace must be > 0"):
        watch_replays(10, grace=0)
    with pytest.raises(ValueError, match=r"watch_replays\(timeout\)=-5"):
        watch_replays(-5)


def test_a_collective_that_gave_up_on_a_peer_raises_its_own_error_though_every_replay_completed():
    from paddle_graphpp.core.errors import CollectiveTimeoutError

    events, codes, fault = Events(), [], []
    dog = ReplayWatchdog(events, 60.0, grace=0.3, min_gap=0, faults=lambda: fault[0] if fault else None,
                         exit=lambda code: (codes.append(code), events.exited.set()))
    try:
        dog.launched("the forward graph of stage[0:4]")
        events.done.add(1)  # the replay completed: the kernel gave up and returned
        time.sleep(0.2)
        dog.raise_pending()  # nothing yet
        fault.append("the custom all-reduce of a 2-rank group on rank 0 waited 5 s for rank 1 and gave up")
        assert wait_for(lambda: dog.error is not None, 2.0)
        time.sleep(1.0)  # > 2 x grace: a kernel that gave up returned, nothing is stuck to abort
        assert events.aborted == [] and codes == []
        with pytest.raises(CollectiveTimeoutError, match="waited 5 s for rank 1"):
            dog.raise_pending()
        time.sleep(1.0)  # raised in the main thread: no abort, no exit
        assert events.aborted == [] and codes == []
    finally:
        dog.stop()


def test_a_timeout_names_the_launches_before_it_that_were_not_followed():
    # Replays on one stream complete in order: a forward graph with a collective hangs, and the
    # graphs queued behind it do not complete either. It was launched within min_gap of the
    # previous followed launch, as were the next ones; the thread follows the last one (the host
    # then blocks), whose graph holds no collective: the error names the launches before it.
    events = Events()
    dog = ReplayWatchdog(events, 0.3, grace=60, min_gap=0.2)
    dog.launched("the forward graph of blocks.0 (micro-batch position 0; captured with torch.distributed.all_reduce)")
    events.done.add(events.count)  # position 0 completed
    dog.launched("the forward graph of blocks.0 (micro-batch position 1; captured with torch.distributed.all_reduce)")
    for n in range(5):
        dog.launched(f"the forward graph of blocks.{n + 1} (micro-batch position 1)")
    assert wait_for(lambda: dog.error is not None, 3.0)
    with pytest.raises(ReplayTimeoutError) as err:
        dog.raise_pending()
    text = str(err.value)
    assert text.startswith("paddle_graphpp: the forward graph of blocks.5 (micro-batch position 1) (or one launched "
                           "before it, after the last replay known to have completed: the forward graph of blocks.0 "
                           "(micro-batch position 1; captured with torch.distributed.all_reduce); "), text
    assert "blocks.3 (micro-batch position 1); and 1 more) has not completed 0.3 s" in text  # the first four, a count
    dog.stop()
