"""Optimizer steps borrow the graph pool's free memory between episodes.

Eagerly, a training step's activations and its optimizer's temporaries (``foreach`` AdamW
makes several parameter-sized lists) take turns in one cache. With graphs, activations live
in the graph pool, and the temporaries would need memory of their own: measured on a GPT-3
1.3B pipeline stage, 1.36 GB on top of eager's peak. Between episodes (no micro-batch in
flight in any graphed layer) every activation of the pool is dead, so an optimizer step
run then may allocate its temporaries from the pool's free blocks, as long as it frees them
before the next replay; it then runs on the capture stream (the pool's blocks belong to
that stream) and the current stream waits for it.

Borrowing pays only where the temporaries fit into what the pool already has free: a pool
that must grow for them keeps that memory for good (a pool with live graphs is never
trimmed), while the default cache would have shared it with the eager work outside the
graphs. Measured on the last stage of a GPT-3 1.3B pipeline at sequence 512, whose pool holds
one micro-batch's activations (~0.5 GB) and grew to 1.75 GB for AdamW's 1.15 GB of
temporaries. So each optimizer borrows a pool only when the pool's free bytes are at least the
bytes of the parameters it updates (``foreach`` AdamW's temporaries are about that much), decided
once per pool and optimizer.

A step that leaves memory allocated in the pool (optimizer state created lazily, a tensor
kept from the step) would be overwritten by the next replays. That is checked after every
borrowed step: the pool's allocated bytes must be what they were before. If not, the
pool's graphs are dropped (the core records and captures them anew into a new pool) and
lending stops for this process, with a warning.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import warnings
from typing import Any, Callable, Optional

import torch

__all__ = ["PoolLender"]

logger = logging.getLogger("paddle_graphpp")


class PoolLender:
    """Lends one graph pool at a time to optimizer steps (installed once per process)."""

    def __init__(self, capture_stream: Callable[[], Any]):
        self._capture_stream = capture_stream
        self._pool: Optional[torch.cuda.MemPool] = None
        self._is_idle: Callable[[], bool] = lambda: False
        self._on_leak: Callable[[], None] = lambda: None
        self._handles: list = []
        self._active: Optional[tuple] = None  # (exit stack, stream, caller stream, bytes before)
        self._fresh = False  # the default cache has yet to be emptied for the pool lent last
        self.disabled = False
        self.steps = 0
        self.declined = 0  # steps that did not borrow because the pool had too little free
        self._fits: dict = {}  # (id(pool), id(optimizer)) -> does the pool have room for its temporaries

    def lend(self, pool: Any, is_idle: Callable[[], bool], on_leak: Callable[[], None]) -> None:
        """From now on, optimizer steps run while ``is_idle()`` borrow ``pool``."""
        if self.disabled or not isinstance(pool, torch.cuda.MemPool):
            return
        self._pool, self._is_idle, self._on_leak = pool, is_idle, on_leak
        self._fresh = True
        if not self._handles:
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

            self._handles = [register_optimizer_step_pre_hook(self._pre), register_optimizer_step_post_hook(self._post)]
            # A step that raised and was never followed by another graphed call or step would
            # leave the allocator routed into the pool; the allocator refuses to shut down so.
            atexit.register(self.abandon_step)

    def _pre(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling():
            return  # traced by torch.compile: the hooks' effects would not be balanced at run time
        self.abandon_step()  # a previous step that raised never reached _post
        pool = self._pool
        if (pool is None or self.disabled or not self._is_idle()
                or torch.cuda.is_current_stream_capturing() or not _state_complete(optimizer)):
            return
        room = self._fits.get((id(pool), id(optimizer)))
        if room is None:
            room = self._fits[(id(pool), id(optimizer))] = _free(pool) >= _param_bytes(optimizer)
        if not room:
            self.declined += 1
            return
        if self._fresh:
            # Steps before this one kept their temporaries in the default cache; from now on
            # they come from the pool, so that cache would only add to the peak. (Once per
            # pool: here or after the first step that could not borrow.)
            self._fresh = False
            torch.cuda.empty_cache()
        stream, caller = self._capture_stream(), torch.cuda.current_stream()
        before = _allocated(pool)
        stack = contextlib.ExitStack()
        stream.wait_stream(caller)
        stack.enter_context(torch.cuda.stream(stream))
        stack.enter_context(torch.cuda.use_mem_pool(pool))
        self._active = (stack, stream, caller, before)

    def _post(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling():
            return
        if self._active is None:
            if self._fresh and self._pool is not None:
                # A step that could not borrow (its optimizer state was being created): its
                # temporaries are cached by now; later ones come from the pool.
                self._fresh = False
                torch.cuda.empty_cache()
            return
        stack, stream, caller, before = self._active
        self._active = None
        stack.close()
        caller.wait_stream(stream)
        self.steps += 1
        after = _allocated(self._pool)
        if after != before:
            self.disabled = True
            self._pool = None
            warnings.warn(
                f"paddle_graphpp: an optimizer step ({type(optimizer).__name__}) run between episodes left "
                f"{after - before} bytes allocated in the graph pool; its graphs are captured anew and optimizer "
                f"steps no longer borrow graph memory in this process (memory above eager's by their "
                f"temporaries).", RuntimeWarning, stacklevel=3)
            self._on_leak()

    def abandon_step(self) -> None:
        """A step raised between the hooks: leave the pool and the capture stream."""
        if self._active is not None:
            stack, stream, caller, _ = self._active
            self._active = None
            stack.close()
            caller.wait_stream(stream)


def _state_complete(optimizer: torch.optim.Optimizer) -> bool:
    """Every parameter with a gradient has its state: the step creates nothing lasting."""
    state = optimizer.state
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and not state.get(p):
                return False
    return True


def _allocated(pool: torch.cuda.MemPool) -> int:
    return sum(seg["allocated_size"] for seg in pool.snapshot())


def _free(pool: torch.cuda.MemPool) -> int:
    return sum(seg["total_size"] - seg["allocated_size"] for seg in pool.snapshot())


def _param_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(p.numel() * p.element_size() for group in optimizer.param_groups for p in group["params"]
               if p.grad is not None)
