"""The push all-reduce kernel's bounded wait on one GPU (issue 37): both "ranks" of a 2-rank
group live on this GPU (their symmetric buffers are two local buffers), so one process can play
a peer that never comes.

* Both ranks launched on two streams: each gets the sum, neither reports a peer.
* Rank 0 alone: the kernel gives up after its timeout, names rank 1 through the pinned status
  word, and returns; a call after it, eager or replayed from a graph, does not wait again.
  Stated margin: 1 s over the timeout for the launch and the host's wait.
* A peer that comes about 1 s late, within a 30 s timeout, is waited for.

Run on the GPU machine: ``python -m pytest unittests/gpu/test_allreduce_timeout_gpu.py -q``.
"""
import time

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="requires a CUDA device"),
              pytest.mark.timeout(180)]
pytest.importorskip("triton")

from paddle_graphpp.torch.collectives.push_allreduce import PushAllReduce, flags_bytes, region_bytes  # noqa: E402

N = 8192  # bf16 elements: 4 blocks
TIMEOUT, MARGIN = 0.5, 1.0


class LocalHandle:
    """A symmetric-memory handle whose peers' buffers are local ones."""

    def __init__(self, buffers):
        self.buffers = buffers

    def get_buffer(self, rank, shape, dtype, offset):
        assert offset == 0 and tuple(shape) == tuple(self.buffers[rank].shape) and dtype == torch.uint8
        return self.buffers[rank]


def _group(timeout):
    total = flags_bytes(2) + region_bytes(N * 2, 2)
    buffers = [torch.zeros(total, dtype=torch.uint8, device="cuda") for _ in range(2)]
    handle = LocalHandle(buffers)
    ranks = [PushAllReduce(handle, buffers[r], r, 2, timeout=timeout) for r in range(2)]
    torch.cuda.synchronize()
    return ranks


def _both(ranks, xs):
    """One call of both ranks, each on its own stream, concurrently."""
    streams = [torch.cuda.Stream() for _ in ranks]
    outs = []
    for push, x, s in zip(reversed(ranks), reversed(xs), reversed(streams)):  # rank 1 first: it waits
        s.wait_stream(torch.cuda.current_stream())  # the inputs were made there
        with torch.cuda.stream(s):
            outs.append(push(x, flags_bytes(2)))
    torch.cuda.synchronize()
    return outs[::-1]


def _timed(fn):
    torch.cuda.synchronize()
    start = time.monotonic()
    out = fn()
    torch.cuda.synchronize()
    return out, time.monotonic() - start


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Each rank's kernel compiled and loaded alone, on a group of its own with a 1 ms timeout
    (one kernel serves every timeout): loading a kernel while another one spins on the device
    could wait for that one (lazy module loading), and a compile must not eat a peer's timeout."""
    for rank in range(2):
        alone = _group(timeout=0.001)[rank]
        alone(torch.ones(N, device="cuda", dtype=torch.bfloat16), flags_bytes(2))
        torch.cuda.synchronize()
        assert alone.peer_waited_for() == 1 - rank


def test_two_ranks_get_the_sum_and_report_no_peer():
    ranks = _group(timeout=5.0)
    for _ in range(3):
        xs = [torch.randn(N, device="cuda").to(torch.bfloat16) for _ in ranks]
        expected = (xs[0].float() + xs[1].float()).to(torch.bfloat16)
        for out in _both(ranks, xs):
            assert torch.equal(out, expected)
    assert [r.peer_waited_for() for r in ranks] == [None, None]


def test_a_rank_whose_peer_never_comes_gives_up_names_it_and_does_not_wait_again():
    ranks = _group(timeout=TIMEOUT)
    xs = [torch.randn(N, device="cuda").to(torch.bfloat16) for _ in ranks]
    _both(ranks, xs)  # compiled and in step
    alone = ranks[0]
    _, waited = _timed(lambda: alone(xs[0], flags_bytes(2)))
    assert alone.peer_waited_for() == 1
    assert TIMEOUT <= waited < TIMEOUT + MARGIN, waited
    _, again = _timed(lambda: alone(xs[0], flags_bytes(2)))
    assert again < 0.1 + MARGIN / 2 and alone.peer_waited_for() == 1, again
    # replayed from a graph: the same kernel, the same status word
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        alone(xs[0], flags_bytes(2))
    _, replayed = _timed(graph.replay)
    assert replayed < 0.1 + MARGIN / 2, replayed


def test_a_peer_that_comes_within_the_timeout_is_waited_for():
    ranks = _group(timeout=30.0)  # finite: a wrong kernel fails the test instead of hanging it
    xs = [torch.randn(N, device="cuda").to(torch.bfloat16) for _ in ranks]
    _both(ranks, xs)
    s0, s1 = torch.cuda.Stream(), torch.cuda.Stream()
    s0.wait_stream(torch.cuda.current_stream())
    s1.wait_stream(torch.cuda.current_stream())
    # Rank 1 is queued first, behind ~1 s of sleep (well past TIMEOUT), then rank 0: the host
    # makes no allocation while rank 0's kernel waits. (Queued the other way round, rank 1's
    # output was allocated on a new stream while rank 0 spun, and rank 1 started only after
    # rank 0 had waited its whole timeout: the test took 30 s and rank 0 gave up.)
    with torch.cuda.stream(s1):
        torch.cuda._sleep(int(2 * TIMEOUT * 1.5e9))
        out1 = ranks[1](xs[1], flags_bytes(2))
    with torch.cuda.stream(s0):
        start = time.monotonic()
        out0 = ranks[0](xs[0], flags_bytes(2))
    torch.cuda.synchronize()
    waited = time.monotonic() - start
    assert waited < 10.0, f"rank 0 waited {waited:.1f} s for a peer ~1 s late"
    assert ranks[0].peer_waited_for() is None
    assert torch.equal(out0, out1)
