"""PyTorch adapter for the graph engine (see :mod:`paddle_graphpp.core.runtime` for each
member's contract).

:class:`TorchRuntime` implements the required protocol (tensors, framework state, autograd,
graph operations) and declares every optional capability: the state check, autocast modes,
capture hints and model walking here; gradient operations, split backward and accumulation inside graphs in :mod:`.autograd`; output
release, pool lending, the stream-ordered allocator and memory figures in
:mod:`.memory.capabilities`; replay events for the watchdog in :mod:`.collectives.watch`.
"""

from __future__ import annotations

import contextlib
import math
from types import MappingProxyType
from typing import Any, Optional, Sequence

import torch

from .. import support as _support
from ..core.process import current_process
from ..core.runtime import (AutocastModes, CaptureHints, GraphRuntime, ModelTree, Recompute, StateSlots, TensorSpec,
                            get_runtime)
from ..core.state import module_state_slots
from . import autograd as _autograd
from . import compile as _compile
from . import integrations
from . import recompute as _recompute
from .memory import pool_segments as _pool_segments
from .collectives.watch import TorchReplayEvents, noting_collectives
from .graphs import capturing, empty_capture
from .memory.capabilities import TorchMemory, _pool_id

__all__ = ["TorchRuntime", "RUNTIME", "active_runtime", "registered_generators"]

_ALIGN = 512  # bytes between buffers carved from one block (the caching allocator's own rounding)
# names in TensorSpec, looked up rather than formatted: every graphed call makes specs of its inputs
_DTYPE_NAMES = MappingProxyType({d: str(d).replace("torch.", "") for d in vars(torch).values()
                                  if isinstance(d, torch.dtype)})
_SPECS_KEPT = 4096  # input specs a runtime remembers (forgotten all at once past that: shapes that keep changing)


class TorchRuntime(TorchMemory, _autograd.TorchGradients, TorchReplayEvents, GraphRuntime, StateSlots, AutocastModes,
                   CaptureHints, ModelTree, Recompute):
    name = "torch"
    # AccumulateGrad adopts a gradient only when no other reference to it exists; the engine
    # hands back buffers it keeps referencing, so autograd copies them where it must.
    adopts_held_gradients = False

    def __init__(self):
        super().__init__()
        self._capture_streams: dict[int, torch.cuda.Stream] = {}
        self._specs: dict = {}  # (shape, dtype, device, requires_grad) -> its TensorSpec (spec)

    # tensors
    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor)

    def spec(self, tensor) -> TensorSpec:
        # every graphed call asks this of each input tensor: the specs seen are kept, by what they read
        seen = (tensor.shape, tensor.dtype, tensor.device, tensor.requires_grad)
        found = self._specs.get(seen)
        if found is None:
            if len(self._specs) >= _SPECS_KEPT:
                self._specs.clear()
            dtype = _DTYPE_NAMES.get(tensor.dtype) or str(tensor.dtype).replace("torch.", "")
            found = self._specs[seen] = TensorSpec(tuple(tensor.shape), dtype, str(tensor.device), tensor.requires_grad)
        return found

    def static_like(self, tensor):
        return torch.empty_like(tensor, requires_grad=False).detach()

    def alias_key(self, tensor):
        return (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)

    def static_buffers(self, specs) -> list:
        out: list = [None] * len(specs)
        by_device: dict = {}
        for i, s in enumerate(specs):
            by_device.setdefault(s.device, []).append(i)
        for device, index in by_device.items():
            dtypes = [getattr(torch, specs[i].dtype) for i in index]
            sizes = [math.prod(specs[i].shape) * d.itemsize for i, d in zip(index, dtypes)]
            offsets, total = [], 0
            for n in sizes:
                offsets.append(total)
                total += -(-n // _ALIGN) * _ALIGN
            block = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
            for i, d, start, n in zip(index, dtypes, offsets, sizes):
                out[i] = block[start:start + n].view(d).view(specs[i].shape)
        return out

    def copy_many(self, dsts, srcs) -> None:
        to, of = [], []
        for d, s in zip(dsts, srcs):
            if d.data_ptr() != s.data_ptr():
                to.append(d)
                of.append(s)
        if not to:
            return
        if torch.is_grad_enabled():
            with torch.no_grad():
                torch._foreach_copy_(to, of)
        else:  # inside the graphed function's forward and backward
            torch._foreach_copy_(to, of)

    def detach(self, tensor, requires_grad: bool = False):
        out = tensor.detach()
        if requires_grad:
            out.requires_grad_(True)
        return out

    def graphs_unavailable_reason(self, tensors: Sequence[Any]) -> Optional[str]:
        for t in tensors:
            if not t.is_cuda:
                return "PyTorch sees no CUDA device" if not torch.cuda.is_available() else f"an input is on {t.device}"
        if not tensors and not torch.cuda.is_available():  # a CUDA input answers it (asked on every call)
            return "PyTorch sees no CUDA device"
        return None

    def mode_key(self):
        if torch.is_autocast_enabled("cuda"):
            return ("autocast", torch.get_autocast_dtype("cuda"))
        return None

    def mode_context(self, key):
        if key == self.mode_key():
            return contextlib.nullcontext()
        if key is None:
            return torch.autocast("cuda", enabled=False)
        _, dtype = key
        # No autocast cache: casts made inside a capture must not be handed to code outside it.
        return torch.autocast("cuda", dtype=dtype, cache_enabled=False)

    def state_slots(self, layer) -> list:
        if not isinstance(layer, torch.nn.Module):
            return []
        return module_state_slots(layer.named_modules())

    def storage_addresses(self, tensors) -> list:
        return list(map(torch.Tensor.data_ptr, tensors))

    def submodules(self, model) -> list:
        return list(model.modules()) if isinstance(model, torch.nn.Module) else [model]

    # autograd
    def grad_enabled(self) -> bool:
        return torch.is_grad_enabled()

    def enable_grad(self):
        return torch.enable_grad()

    def call_with_param_aliases(self, fn, params, args, kwargs):
        if not params:
            return fn(*args, **kwargs), []
        aliases, mapping = _aliases(fn, params)
        # Every place a parameter is held gets its alias, each place once: functional_call's
        # own tying would swap a module held under two names twice, and its restore then leaves
        # new parameter objects in the module (torch 2.11, 2.13).
        return torch.func.functional_call(fn, mapping, args, kwargs, strict=False, tie_weights=False), aliases

    # recompute (activation checkpointing, see .recompute)
    def no_grad(self):
        return torch.no_grad()

    def call_checkpointed(self, fn, params, args, kwargs):
        aliases, mapping = _aliases(fn, params) if params else ([], {})
        return _recompute.checkpointed(fn, mapping, args, kwargs), aliases

    def rng_mirror(self, generators):
        # Eager recomputation (torch.utils.checkpoint) repeats the default generators' draws only,
        # so a layer drawing from others would recompute other masks there: refused for now.
        extra = list(generators)
        tracked = [t.name for t in integrations.rng_trackers() if any(t.states())]
        if extra or tracked:
            what = f"generators= ({len(extra)})" if extra else tracked[0]
            raise ValueError(f"recompute (activation checkpointing) in graphs repeats the default CUDA generator's "
                             f"draws only; this layer's captures also register {what}, whose draws it would not "
                             f"repeat. Turn recompute (checkpointing) off for this layer.")
        return _recompute.Mirrors()

    def autograd_grad(self, outputs, grad_outputs, inputs, retain_graph: bool = False) -> list:
        if not inputs:
            return []
        return list(torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=retain_graph,
                                        allow_unused=True))

    def apply_graphed_function(self, call, tensors, params) -> tuple:
        return _autograd.apply_graphed_function(call, tensors, params)

    def add_many(self, dsts, srcs) -> None:
        with torch.no_grad():
            torch._foreach_add_(list(dsts), list(srcs))

    def leaves_without_grad(self, tensors) -> list:
        return [i for i, t in enumerate(tensors) if t.grad is None and t.requires_grad and t.is_leaf]

    # graph operations
    def create_graph(self):
        return torch.cuda.CUDAGraph()

    def capture_stream(self) -> "torch.cuda.Stream":
        device = torch.cuda.current_device()
        stream = self._capture_streams.get(device)
        if stream is None:
            stream = self._capture_streams[device] = torch.cuda.Stream(device)
        return stream

    @contextlib.contextmanager
    def capture_to_graph(self, graph, pool=None, stream=None, generators=()):
        stream = stream if stream is not None else self.capture_stream()
        current = torch.cuda.current_stream()
        stream.wait_stream(current)
        for gen in registered_generators(generators):
            graph.register_generator_state(gen)
        before, after = self.blas_workspace_frees(pool)
        # compiled code runs only what it compiled in the warmup (see .compile)
        with torch.cuda.stream(stream), _pool_segments.pool_allocations(), \
                _compile.no_compile_in_capture(), noting_collectives():
            try:
                with capturing(graph, _pool_id(pool), free_before=before, free_after=after):
                    yield graph
            except BaseException:
                self._reset_capture_state(stream)
                raise
        current.wait_stream(stream)

    @staticmethod
    def _reset_capture_state(stream) -> None:
        """After a failed capture, wait for the device, then run one empty capture so
        per-capture state (the RNG generators' capture bookkeeping) is closed the normal way."""
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        with contextlib.suppress(Exception):  # best effort; a failed one was ended
            empty_capture(stream)

    def capture_failure_hint(self, error, generators):
        if "stance is 'fail_on_recompile'" in str(error):
            return ("Compiled code (torch.compile) would have compiled anew inside the capture, for the reason "
                    "above; a capture runs only what the warmup compiled. Give every call the inputs' shapes, "
                    "dtypes, strides and requires_grad, the attributes and global state the compiled code reads, "
                    "and the autocast and train/eval mode it had in the warmup.")
        if "generator not in capture mode" not in str(error):
            return None
        known = ["the default CUDA generator"]
        for tracker in integrations.rng_trackers():
            safe, unsafe = tracker.states()
            if unsafe:
                return (f"The layer draws random numbers from {tracker.name} (states {sorted(unsafe)}), whose states "
                        f"are not graph-safe. Seed it with {tracker.fix}.")
            if safe:
                known.append(f"{tracker.name} states {sorted(safe)}")
        if generators:
            known.append(f"{len(generators)} generator(s) passed as generators=")
        return (f"The layer draws random numbers from a CUDA generator this capture did not register "
                f"(registered: {', '.join(known)}); a torch.Generator(device='cuda') the layer creates or "
                f"is given must be passed to the graphed layer as generators=[...] (or a callable "
                f"returning them).")

    def replay_graph(self, graph) -> None:
        graph.replay()

    def is_capturing(self) -> bool:
        # asked on every graphed call: nothing captures before CUDA is initialised (a cheap test)
        return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()

def _aliases(fn, params) -> tuple:
    """Aliases of ``params`` that require grad, and ``{name: alias}`` for every place ``fn`` holds each."""
    slots = _parameter_slots(fn)  # the engine checked that every one is still fn's (core.layer_capture)
    aliases = [p.detach().requires_grad_(True) for p in params]
    return aliases, {name: a for p, a in zip(params, aliases) for name in slots[id(p)]}


def _parameter_slots(module) -> dict:
    """``{id(parameter): [name, ...]}``: one name per place the parameter is held (a module and
    attribute), so a parameter tied into two modules has two names and a module reachable
    under two names (a submodule also held by a ``torch.compile`` wrapper) counts once."""
    places: dict = {}
    seen: set = set()
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for attr, p in sub._parameters.items():
            if p is None or (id(sub), attr) in seen:
                continue
            seen.add((id(sub), attr))
            places.setdefault(id(p), []).append(f"{prefix}.{attr}" if prefix else attr)
    return places


def registered_generators(extra) -> list:
    """The generators a capture registers besides the default one: ``extra`` and the graph-safe
    states of the libraries' RNG trackers (:func:`~paddle_graphpp.torch.integrations.rng_trackers`),
    each once, on CUDA.

    Raises:
        TypeError, ValueError: an entry of ``extra`` is not a CUDA ``torch.Generator``.
    """
    tracked = [gen for tracker in integrations.rng_trackers() for gen in tracker.states()[0].values()]
    found, seen = [], set()
    for gen in [*extra, *tracked]:
        if not isinstance(gen, torch.Generator):
            raise TypeError(f"generators: expected torch.Generator objects, got {type(gen).__name__}")
        if gen.device.type != "cuda":
            raise ValueError(f"generators: {gen!r} is a {gen.device.type} generator; graphs draw only from "
                             f"CUDA generators (torch.Generator(device='cuda'))")
        if id(gen) not in seen:
            seen.add(id(gen))
            found.append(gen)
    return found


_support.require("torch", torch.__version__)
# Made on import: optimizers' steps are watched from then on (pool lending sizes pools by them).
current_process().section(TorchRuntime.name).part(TorchRuntime)


def __getattr__(name: str) -> Any:
    # RUNTIME: the process's TorchRuntime, a part of its torch section (it holds the capture
    # streams, the graph pools and the pool lender).
    if name == "RUNTIME":
        return current_process().section(TorchRuntime.name).part(TorchRuntime)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def active_runtime() -> GraphRuntime:
    """The runtime torch's adapters use: :data:`RUNTIME`, or one registered in its place under
    the name ``"torch"`` (tests plug fake graph runtimes in with ``core.runtime.register_runtime``)."""
    return get_runtime(TorchRuntime.name)
