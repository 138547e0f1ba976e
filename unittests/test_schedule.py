"""FIFO pairing and episode positions of InFlightQueue (pure bookkeeping)."""
import pytest

from paddle_graphpp.core.errors import GraphScheduleError
from paddle_graphpp.core.schedule import InFlightQueue


def run(order, max_in_flight=8):
    """Run an order like 'f1 f2 b1' and return the positions each forward got."""
    q = InFlightQueue("layer", max_in_flight)
    recs, pos = {}, {}
    for tok in order.split():
        n = int(tok[1:])
        if tok[0] == "f":
            recs[n] = object()
            pos[n] = q.push(recs[n], "sig")
        else:
            q.pop(recs[n])
    return q, pos


def test_interleaved_order_positions_and_episodes():
    q, pos = run("f1 f2 f3 b1 f4 b2 b3 b4 f5 b5")
    assert pos == {1: 0, 2: 1, 3: 2, 4: 3, 5: 0}
    assert q.episodes == 2 and len(q) == 0 and q.at_episode_start


def test_positions_are_per_signature():
    q = InFlightQueue("layer", 8)
    a, b, c = object(), object(), object()
    assert q.push(a, "s1") == 0 and q.push(b, "s2") == 0 and q.push(c, "s1") == 1


def test_backward_out_of_fifo_order_raises():
    with pytest.raises(GraphScheduleError, match="order of their forwards"):
        run("f1 f2 b2")


def test_backward_without_forward_raises():
    with pytest.raises(GraphScheduleError, match="no forward in flight"):
        run("f1 b1 b1")


def test_second_backward_of_a_consumed_forward_raises():
    with pytest.raises(GraphScheduleError, match="already back-propagated"):
        run("f1 f2 b1 b1")


def test_pile_up_past_bound_raises():
    with pytest.raises(GraphScheduleError, match="max_in_flight=2"):
        run("f1 f2 f3", max_in_flight=2)


def test_bad_bound_rejected():
    with pytest.raises(ValueError, match="max_in_flight"):
        InFlightQueue("layer", 0)
