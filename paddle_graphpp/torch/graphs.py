"""Graph objects beyond one capture: undoing a capture that failed, and the empty anchor graph
that keeps a pool's users counted (see :meth:`~paddle_graphpp.torch.memory.capabilities.TorchMemory.new_pool`)."""

from __future__ import annotations

import contextlib
import gc

import torch

__all__ = ["capturing", "end_failed_capture", "capture_pool_id", "empty_capture", "anchor_graph", "gc_paused",
           "free_blas_workspaces"]


def free_blas_workspaces() -> None:
    """Free torch's cuBLAS workspaces, every (handle, stream) one; each is made again, from
    wherever the allocator then routes, at its handle's next matmul on that stream.

    Torch keeps one workspace per cuBLAS handle (one per thread) and stream. A capture's stream
    has its own, allocated in the graph pool by the first matmul captured on it, and the map
    would keep it allocated there for good: two of them (the thread that captures forwards and
    autograd's device thread, which captures backwards), 32 MiB each on Hopper, that the pool
    could lend to nothing. Freed before a capture, the capture makes the one it uses inside its
    own pool, never using one made elsewhere that a later free would give away. Freed after a
    capture into a pool that later captures share, that memory is the pool's free space like any
    buffer the capture freed (its kernels use it as scratch only while they run, and the pool's
    graphs replay in the order they were captured); the next capture, forward or backward, takes
    it again. Which captures free, and when that stops: ``TorchMemory.blas_workspace_frees``.
    Under the ``cudaMallocAsync`` backend, which has no private pools, nothing is freed."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.get_allocator_backend() == "native":
        clear()


@contextlib.contextmanager
def gc_paused():
    """Python's cycle collector off while allocations route into a graph pool (a capture, a
    borrowed optimizer step). A collection there could destroy an unreachable
    ``torch.cuda.MemPool`` (one the program left in a reference cycle): its destructor empties the
    pool's cache, which the caching allocator refuses while any capture or routing is on, by
    aborting the process (``captures_underway.empty()``). Nested uses leave it off until the
    outermost ends; a collector the program turned off stays off."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def end_failed_capture(graph, pool_id) -> None:
    """Undo what a capture that did not complete left in the caching allocator.

    ``CUDAGraph.capture_begin`` routes the device's allocations into the pool and takes a
    reference on it before the stream starts capturing; ``capture_end`` ends the routing only
    after the stream's capture ended well, and a graph gives its reference back (on reset or
    destruction) only if its capture ended. A capture that failed in between (a begin the stream
    refused, a body that raised, an end the driver rejected) would leave the routing on, so that
    the next ``empty_cache()`` frees nothing and the next ``MemPool`` destroyed (or the process
    exit) trips the allocator's "no capture underway" assertion, and the reference taken, so that
    the pool's memory could never be freed. Here the capture is ended if it still runs, then the
    routing and the reference are given back, each only if still held.

    ``pool_id``: the id the capture began with, never ``None``: a graph without a pool of its own
    cannot tell its id after a failed capture (``CUDAGraph.pool()`` needs a completed one), so
    captures pass :func:`capture_pool_id`'s."""
    device = torch.cuda.current_device()
    try:
        graph.capture_end()  # a body that raised in Python leaves a capture the driver can end
        ended = True
    except Exception:  # noqa: BLE001 - invalidated, or never begun
        ended = False
    if not ended:
        try:
            torch._C._cuda_endAllocateToPool(device, pool_id)
            routed = True
        except Exception:  # noqa: BLE001 - not routed: capture_begin failed before it routed
            routed = False
        if routed:
            with contextlib.suppress(Exception):
                torch._C._cuda_releasePool(device, pool_id)
    with contextlib.suppress(Exception):
        graph.reset()  # an ended capture gives its reference back here


def capture_pool_id(pool_id=None) -> tuple:
    """The pool id a capture begins with: ``pool_id``, or a new one of the graph's own (what
    ``capture_begin`` makes when given none), known before the capture so that a failed capture
    can be ended (:func:`end_failed_capture`)."""
    return tuple(pool_id) if pool_id is not None else tuple(torch.cuda.graph_pool_handle())


@contextlib.contextmanager
def capturing(graph, pool_id=None, free_before=False, free_after=False):
    """Capture the block into ``graph`` on the current stream, into the pool ``pool_id`` (or a
    pool of the graph's own), with the collector paused (:func:`gc_paused`). A block or an end
    that fails has its capture ended (:func:`end_failed_capture`) before the error goes on: every
    capture of the library goes through here. ``free_before`` / ``free_after``: free torch's
    cuBLAS workspaces before the capture begins / after it ends, failed or not
    (:func:`free_blas_workspaces`)."""
    pool_id = capture_pool_id(pool_id)
    with gc_paused():
        if free_before:
            free_blas_workspaces()  # the capture makes the one it uses in its own pool
        try:
            graph.capture_begin(pool=pool_id, capture_error_mode="thread_local")
            yield graph
            graph.capture_end()
        except BaseException:
            end_failed_capture(graph, pool_id)
            raise
        finally:
            if free_after:
                free_blas_workspaces()


def empty_capture(stream, pool_id=None):
    """An empty graph captured on ``stream`` (into the pool ``pool_id``, or a pool of its own);
    a capture that fails is ended (:func:`end_failed_capture`) before its error is raised."""
    import warnings

    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings(), torch.cuda.stream(stream):
        warnings.simplefilter("ignore")  # "the CUDA Graph is empty"
        with capturing(graph, pool_id):
            pass
    return graph


def anchor_graph(pool, stream):
    """An empty graph captured into ``pool``: a user of the pool for as long as it lives."""
    stream.wait_stream(torch.cuda.current_stream())
    return empty_capture(stream, pool.id)
