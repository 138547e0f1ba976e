"""PyTorch adapter for the graph engine (see :mod:`paddle_graphpp.core.runtime` for each
member's contract)."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
from typing import Any, Optional, Sequence

import torch
from torch.autograd.function import once_differentiable

from ..core.engine import node_backward, node_forward
from ..core.runtime import GraphRuntime, TensorSpec
from .. import support as _support
from ..allocator import env_flag_value
from ..core.state import module_state_slots
from . import compile as _compile
from . import pool_segments as _pool_segments
from . import split_backward as _split
from .allocator import async_allocator_active as _async_allocator_active

__all__ = ["TorchRuntime", "RUNTIME"]

_ALIGN = 512  # bytes between buffers carved from one block (the caching allocator's own rounding)


class _GraphedFunction(torch.autograd.Function):
    """Autograd node of one graphed call (the logic is the core's)."""

    @staticmethod
    def forward(ctx, call, *tensors_and_params):
        return node_forward(ctx, call)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        # Zero-bubble schedules ask for the inputs' gradients first (torch.autograd.grad
        # w.r.t. the stage inputs) and for the parameters' later: the engine splits the backward
        # when autograd wants no parameter gradient from this node.
        stashed = getattr(ctx, "stashed_grads", None)
        if stashed is not None:  # see _weight_pass_hooks: it stashes in input passes only
            # the hook saw the gradients before autograd filled the missing ones with zeros
            grads, ctx.stashed_grads = tuple(s if s is not None else g for s, g in zip(stashed, grads)), None
            wanted = False
        else:
            wanted = _split.weights_wanted(ctx, len(ctx.call.shape.specs))
        return (None, *node_backward(ctx, grads, weights_wanted=wanted))


def _weight_pass_sums_output_grads() -> bool:
    """Does this torch's ``stage_backward_weight`` (torch.distributed.pipelining) sum the
    gradients a multi-output node received and send the sum to its first output? Torch up to
    2.11 does (pytorch/pytorch#170277): the sum fails when the outputs' shapes differ."""
    global _SUMS_OUTPUT_GRADS
    if _SUMS_OUTPUT_GRADS is None:
        try:
            import inspect

            from torch.distributed.pipelining import _backward

            _SUMS_OUTPUT_GRADS = "sum(non_none_grads)" in inspect.getsource(_backward.stage_backward_weight)
        except Exception:  # noqa: BLE001 - no pipelining, or no source: nothing to work around
            _SUMS_OUTPUT_GRADS = False
    return _SUMS_OUTPUT_GRADS


_SUMS_OUTPUT_GRADS = None


class _SumsToItself(torch.Tensor):
    """A gradient that adding zero leaves as it is. Torch 2.11's weight pass sums the gradients
    each node saw (``sum([g])``, that is ``0 + g``), which copies a gradient that comes alone: for
    an output head, the logits' gradient (196.5 MiB at GPT-3 1.3B, sequence 2048), allocated in
    the default cache beside the graphs' pool at every weight pass. A graphed layer's weight half
    never reads what that pass sends it, so the copy is memory for nothing."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __radd__(self, other):
        if isinstance(other, (int, float)) and not isinstance(other, bool) and other == 0:
            return self
        return super().__radd__(other)


def _weight_pass_hooks(outputs) -> None:
    """For a graphed call with parameters (a node without any is never a weight pass's
    junction), on a torch whose weight pass sums a node's output gradients: hand autograd's pre-hooks
    (the pipelining input pass saves what they see) only the first output's gradient, as an
    alias whose sum with zero is itself (:class:`_SumsToItself`), and the node the gradients it
    really received (stashed on its context). The node's weight half reads the gradients it
    kept from its input half, so what the weight pass sends it is never used: the sum must
    neither fail (outputs of different shapes, pytorch/pytorch#170277) nor copy.

    Only in an input pass (no parameter gradient wanted); a whole backward runs as it is. The
    node gets the very tensors autograd gave it, not the alias: the engine knows a
    gradient one graph hands another by the tensor object (a link, read in place); handing
    the node a new object would make every such gradient a buffer of its own."""
    tensors = outputs if isinstance(outputs, tuple) else (outputs,)
    node = next((o.grad_fn for o in tensors if isinstance(o, torch.Tensor) and o.grad_fn is not None), None)
    if node is None:
        return

    def hide(grad_outputs):
        present = [i for i, g in enumerate(grad_outputs) if g is not None]
        if not present or (len(present) == 1 and isinstance(grad_outputs[present[0]], _SumsToItself)):
            return None  # nothing, or the weight pass handing back what this hook gave
        if _split.weights_wanted(node, len(node.call.shape.specs)):
            return None  # a whole backward: no input pass saves these for a weight pass
        node.stashed_grads = tuple(grad_outputs)  # the node is the custom function's ctx
        alias = torch.Tensor._make_subclass(_SumsToItself, grad_outputs[present[0]], False)
        return tuple(alias if i == present[0] else None for i in range(len(grad_outputs)))

    node.register_prehook(hide)


class TorchRuntime(GraphRuntime):
    name = "torch"

    def __init__(self):
        self._capture_streams: dict[int, torch.cuda.Stream] = {}
        self._lender = None  # pool_lending.PoolLender, once a pool is lent
        self._pools: list = []  # every MemPool handed out (see new_pool)
        self._anchors: dict = {}  # id(pool) -> its empty anchor graph (see new_pool)
        from .pool_lending import watch_optimizers

        watch_optimizers()  # prepare_pool sizes a pool by the parameters of the optimizers that step

    # tensors
    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor)

    def spec(self, tensor) -> TensorSpec:
        return TensorSpec(tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""), str(tensor.device),
                          bool(tensor.requires_grad))

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
        pairs = [(d, s) for d, s in zip(dsts, srcs) if d.data_ptr() != s.data_ptr()]
        if pairs:
            with torch.no_grad():
                torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])

    def detach(self, tensor, requires_grad: bool = False):
        out = tensor.detach()
        if requires_grad:
            out.requires_grad_(True)
        return out

    def clone_many(self, tensors) -> list:
        outs = [torch.empty_like(t) for t in tensors]
        self.copy_many(outs, tensors)
        return outs

    def release_to_pool(self, tensor) -> None:
        # The tensor object is re-pointed at a storage over the same address that owns nothing
        # (as PyTorch's CUDA graph trees alias graph outputs); when the last owning storage goes,
        # the block returns to the graphs' pool. Only graph memory: a CPU tensor (a test's fake
        # capture) would be freed to the host allocator under the alias.
        if not tensor.is_cuda:
            return
        with torch.no_grad():
            tensor.set_(_unowned_storage(tensor), tensor.storage_offset(), tensor.shape, tensor.stride())

    def memory_watches(self, tensors, others):
        if not tensors or not all(t.is_cuda for t in tensors):
            return None  # graph memory only (see release_to_pool)
        return storage_watches(tensors, others)

    def weak_alias(self, tensor):
        if not tensor.is_cuda:
            return None
        out = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        with torch.no_grad():
            out.set_(_unowned_storage(tensor), tensor.storage_offset(), tensor.shape, tensor.stride())
        return out

    def move_to_copies(self, tensors) -> bool:
        # ``.data`` swaps the tensor's storage for the copy's, keeping the object (and the
        # references others hold to it); autograd is unaffected: the call's backward is over.
        for t, copy in zip(tensors, self.clone_many([t.detach() for t in tensors])):
            t.data = copy
        return True

    # framework state
    def graphs_unavailable_reason(self, tensors: Sequence[Any]) -> Optional[str]:
        if not torch.cuda.is_available():
            return "PyTorch sees no CUDA device"
        for t in tensors:
            if not t.is_cuda:
                return f"an input is on {t.device}"
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
        slots = _parameter_slots(fn)
        missing = [i for i, p in enumerate(params) if id(p) not in slots]
        if missing:
            raise RuntimeError(
                f"{len(missing)} of the parameters the graphed layer was warmed up with are no longer its "
                f"module's (parameter {missing[0]}, shape {tuple(params[missing[0]].shape)}): parameters were "
                f"replaced after warmup. Replace parameters before the first call, or call "
                f"paddle_graphpp.reset_graphs(model) after replacing them.")
        aliases = [p.detach().requires_grad_(True) for p in params]
        mapping = {name: a for p, a in zip(params, aliases) for name in slots[id(p)]}
        # Every place a parameter is held gets its alias, each place once: functional_call's
        # own tying would swap a module held under two names twice, and its restore then leaves
        # new parameter objects in the module (torch 2.11, 2.13).
        return torch.func.functional_call(fn, mapping, args, kwargs, strict=False, tie_weights=False), aliases

    def autograd_grad(self, outputs, grad_outputs, inputs, retain_graph: bool = False) -> list:
        if not inputs:
            return []
        return list(torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=retain_graph,
                                        allow_unused=True))

    def backward_to_grads(self, outputs, grad_outputs, inputs, aliases, params) -> list:
        # As autograd's accumulation into .grad, one alias at a time: its gradient is adopted
        # by the parameter (none yet) or added into it, and dropped.
        def moved(i, alias):
            grad, alias.grad = alias.grad, None
            param = params[i]
            if param.grad is None:
                param.grad = grad
            else:
                with torch.no_grad():
                    param.grad.add_(grad)

        return _backward_hooked(outputs, grad_outputs, inputs, aliases, moved)

    def backward_into(self, outputs, grad_outputs, inputs, params, buffers, *, accumulate, retain_graph=False):
        # Each parameter alias accumulates its gradient as soon as autograd produces it: into
        # its buffer, preset as the alias's .grad (accumulate), or through a hook that copies
        # it over and drops it. Either way one parameter gradient is alive at a time.
        used = [False] * len(params)

        def moved(i, alias):
            used[i] = True
            if not accumulate:
                buffers[i].copy_(alias.grad)
                alias.grad = None

        grads = _backward_hooked(outputs, grad_outputs, inputs, params, moved,
                                 preset=list(buffers) if accumulate else None, retain_graph=retain_graph)
        return grads, used

    splits_backward = True

    def backward_input(self, outputs, grad_outputs, inputs, params):
        input_grads, state = _split.backward_input(outputs, grad_outputs, inputs, params)
        return input_grads, [None] * len(params), state  # the weight half yields every parameter

    def backward_weight(self, state, params):
        return _split.backward_weight(state, params)

    def weight_pass_refills_grad(self) -> bool:
        return _split.in_pipelining_weight_pass()

    refilling_weight_pass = "torch.distributed.pipelining's stage_backward_weight"

    # AccumulateGrad adopts a gradient only when no other reference to it exists; the engine
    # hands back buffers it keeps referencing, so autograd copies them where it must.
    adopts_held_gradients = False
    accumulates_grads_in_graph = True

    def add_many(self, dsts, srcs) -> None:
        with torch.no_grad():
            torch._foreach_add_(list(dsts), list(srcs))

    def zero_many(self, tensors) -> None:
        if tensors:
            with torch.no_grad():
                torch._foreach_zero_(list(tensors))

    def grad_of(self, param):
        return param.grad

    def set_grad(self, param, grad) -> None:
        param.grad = grad

    def params_with_grad_hooks(self, params) -> list:
        # DistributedDataParallel's reducer hooks each parameter's gradient accumulator in C++,
        # invisible from Python: inside its forward, every parameter counts as hooked.
        if _inside_ddp_forward():
            return list(range(len(params)))
        # Megatron-Core's DistributedDataParallel hooks the accumulator node from Python
        # (``grad_fn.next_functions[0][0].register_hook``), which no attribute of the parameter
        # shows; the ``main_grad`` buffer it gives each parameter does.
        return [i for i, p in enumerate(params)
                if getattr(p, "_post_accumulate_grad_hooks", None) or getattr(p, "_backward_hooks", None)
                or hasattr(p, "main_grad")]

    def leaves_without_grad(self, tensors) -> list:
        return [i for i, t in enumerate(tensors) if t.grad is None and t.requires_grad and t.is_leaf]

    def apply_graphed_function(self, call, tensors, params) -> tuple:
        if self._lender is not None:
            self._lender.abandon_step()  # an optimizer step that raised left the borrowed pool active
        outputs = _GraphedFunction.apply(call, *tensors, *params)
        if params:
            if _weight_pass_sums_output_grads():
                _weight_pass_hooks(outputs)
            # A zero-bubble input pass (torch.distributed.pipelining's stage_backward_input)
            # detaches the stage's outputs and keeps only Python handles of the nodes its weight
            # pass restarts at; a custom function's handle does not keep its node alive, so the
            # weight pass would find it freed (torch 2.11: "_input_metadata is invalid"). The node
            # of a view of an output (a C++ node, whose handle owns it) holds this node until the
            # engine ends the call's backward; the view itself is dropped, so the output's memory
            # is not held with it.
            first = next((o for o in (outputs if isinstance(outputs, tuple) else (outputs,))
                          if isinstance(o, torch.Tensor) and o.requires_grad), None)
            if first is not None:
                call.anchor = first.view_as(first).grad_fn
        return outputs

    # graph operations
    def create_graph(self):
        return torch.cuda.CUDAGraph()

    def new_pool(self):
        # A MemPool (not a bare handle): eager work can then be routed into it (lend_pool). Its
        # destructor empties its cache, which the allocator refuses (aborting the process) while
        # any capture is underway: the runtime keeps each pool until it is released between
        # captures (release_pool) or the process ends. Each pool gets an empty anchor graph
        # captured into it: the host (pinned-memory) allocator counts a pool's users only by its
        # graphs, and refuses a capture into a pool whose graphs are all gone (torch 2.11:
        # "use_count > 0" asserted in capture_begin), as they are after reset_graphs() or a
        # failed capture.
        pool = torch.cuda.MemPool()
        self._pools.append(pool)
        self._anchors[id(pool)] = _anchor_graph(pool, self.capture_stream())
        return pool

    def release_pool(self, pool) -> None:
        # Dropping the runtime's references lets the caller's be the last: the pool's destructor
        # then gives its reference on the allocator's pool back and frees its cached segments,
        # between captures. A pool someone else still holds is kept for the process instead:
        # destroyed later, during a capture, it would trip the allocator's assertion.
        if pool not in self._pools:
            return
        self._pools.remove(pool)
        if sys.getrefcount(pool) > 3:  # this argument, getrefcount's, the caller's
            self._pools.append(pool)
            return
        anchor = self._anchors.pop(id(pool), None)
        if anchor is not None:
            anchor.reset()

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
        for gen in _registered_generators(generators):
            graph.register_generator_state(gen)
        # compiled code runs only what it compiled in the warmup (see .compile)
        with torch.cuda.stream(stream), _pool_segments.pool_allocations(), _compile.no_compile_in_capture():
            try:
                graph.capture_begin(pool=_pool_id(pool), capture_error_mode="thread_local")
                yield graph
                graph.capture_end()
            except BaseException:
                _end_failed_capture(graph, _pool_id(pool))
                self._reset_capture_state(stream)
                raise
        current.wait_stream(stream)

    @staticmethod
    def _reset_capture_state(stream) -> None:
        """After a failed capture, wait for the device, then run one empty capture so
        per-capture state (the RNG generators' capture bookkeeping) is closed the normal way."""
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
            empty = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                try:
                    empty.capture_begin(capture_error_mode="thread_local")
                    empty.capture_end()
                except Exception:  # noqa: BLE001 - best effort; what it began is ended below
                    _end_failed_capture(empty, None)
            del empty

    def capture_failure_hint(self, error, generators):
        if "stance is 'fail_on_recompile'" in str(error):
            return ("Compiled code (torch.compile) would have compiled anew inside the capture, for the reason "
                    "above; a capture runs only what the warmup compiled. Give every call the inputs' shapes, "
                    "dtypes, strides and requires_grad, the attributes and global state the compiled code reads, "
                    "and the autocast and train/eval mode it had in the warmup.")
        if "generator not in capture mode" not in str(error):
            return None
        tracker, unsafe = _megatron_tracker_states()
        if unsafe:
            return (f"The layer draws random numbers from Megatron-Core's RNG tracker (states {sorted(unsafe)}), "
                    f"whose states are not graph-safe. Seed it with "
                    f"model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=True).")
        known = ["the default CUDA generator"]
        if tracker:
            known.append(f"Megatron-Core's RNG tracker states {sorted(tracker)}")
        if generators:
            known.append(f"{len(generators)} generator(s) passed as generators=")
        return (f"The layer draws random numbers from a CUDA generator this capture did not register "
                f"(registered: {', '.join(known)}); a torch.Generator(device='cuda') the layer creates or "
                f"is given must be passed to the graphed layer as generators=[...] (or a callable "
                f"returning them).")

    def replay_graph(self, graph) -> None:
        graph.replay()

    def is_capturing(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    # memory
    def memory_stats(self, pools=None) -> dict:
        if not torch.cuda.is_available():
            return {"reserved_bytes": 0, "allocated_bytes": 0}
        if pools is None:
            return {"reserved_bytes": torch.cuda.memory_reserved(),
                    "allocated_bytes": torch.cuda.memory_allocated()}
        if torch.cuda.get_allocator_backend() == "cudaMallocAsync":
            # No snapshot and no private pools under cudaMallocAsync: all graph memory is the
            # driver's, reported as a whole whatever the pools.
            from ..core.driver_memory import GraphMemory

            gm = GraphMemory(torch.cuda.current_device())
            return {"reserved_bytes": gm.get(GraphMemory.RESERVED_CURRENT) or 0,
                    "allocated_bytes": gm.get(GraphMemory.USED_CURRENT) or 0}
        wanted = {tuple(_pool_id(p)) for p in pools if p is not None}
        reserved = allocated = 0
        for seg in torch.cuda.memory_snapshot():
            if tuple(seg.get("segment_pool_id", ())) in wanted:
                reserved += seg["total_size"]
                allocated += seg["allocated_size"]
        return {"reserved_bytes": reserved, "allocated_bytes": allocated}

    def async_allocator_active(self) -> bool:
        return _async_allocator_active()

    def lending_report(self) -> Optional[dict]:
        """What optimizer steps borrowing graph pools did in this process
        (:meth:`PoolLender.report`); ``None`` before any pool was lent or reserved."""
        return None if self._lender is None else self._lender.report()

    def _pool_lender(self):
        if self._lender is None:
            from .pool_lending import PoolLender

            self._lender = PoolLender(self.capture_stream)
        return self._lender

    def defer_capture(self) -> Optional[str]:
        # An optimizer that has not stepped creates its state in its first step, beside a pool
        # captured before it (the last stage of a 1F1B pipeline, whose episodes are single
        # micro-batches, would otherwise capture within the first training step). Whether or not
        # the pool gets a reserved block: the state and that step's temporaries beside a captured
        # pool cost memory either way (measured with the block off, 1F1B's last stage at GPT-3
        # 1.3B, sequence 2048: +960 MiB on the capture step).
        if not torch.cuda.is_available():
            return None
        from .pool_lending import optimizer_pending

        return "an optimizer has not stepped yet" if optimizer_pending() else None

    def prepare_pool(self, pool) -> int:
        layout = _reserve_pool()
        return self._pool_lender().reserve(pool, layout) if layout else 0

    def lend_pool(self, pool, is_idle, on_leak) -> None:
        self._pool_lender().lend(pool, is_idle, on_leak)

    def release_cached_memory(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


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


def _anchor_graph(pool, stream):
    """An empty graph captured into ``pool``: a user of the pool for as long as it lives."""
    import warnings

    graph = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with warnings.catch_warnings(), torch.cuda.stream(stream):
        warnings.simplefilter("ignore")  # "the CUDA Graph is empty"
        try:
            graph.capture_begin(pool=pool.id, capture_error_mode="thread_local")
            graph.capture_end()
        except BaseException:
            _end_failed_capture(graph, pool.id)
            raise
    return graph


def _end_failed_capture(graph, pool_id) -> None:
    """Undo what a capture that did not complete left in the caching allocator.

    ``CUDAGraph.capture_begin`` routes the device's allocations into the pool and takes a
    reference on it before the stream starts capturing; ``capture_end`` ends the routing only
    after the stream's capture ended well, and a graph gives its reference back (on reset or
    destruction) only if its capture ended. A capture that failed in between (a begin the stream
    refused, a body that raised, an end the driver rejected) would leave the routing on, so that
    the next ``empty_cache()`` (and the pool's destructor at exit) trips the allocator's "no capture
    underway" assertion, and the reference taken, so that the pool's memory could never be freed.
    Here the capture is ended if it still runs, then the routing and the reference are given
    back, each only if still held."""
    device = torch.cuda.current_device()
    try:
        graph.capture_end()  # a body that raised in Python leaves a capture the driver can end
        ended = True
    except Exception:  # noqa: BLE001 - invalidated, or never begun
        ended = False
    if not ended:
        with contextlib.suppress(Exception):
            pool_id = tuple(pool_id or graph.pool())
        try:
            torch._C._cuda_endAllocateToPool(device, pool_id)
        except Exception:  # noqa: BLE001 - not routed: capture_begin failed before it routed
            pool_id = None
        if pool_id is not None:
            with contextlib.suppress(Exception):
                torch._C._cuda_releasePool(device, pool_id)
    with contextlib.suppress(Exception):
        graph.reset()  # an ended capture gives its reference back here


def _unowned_storage(tensor):
    """A storage over ``tensor``'s whole storage that does not own the memory."""
    storage = tensor.untyped_storage()
    return torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device, storage.nbytes())


def storage_watches(tensors, others) -> Optional[list]:
    """Per tensor, whether its storage is still alive (a weak reference to the storage: a tensor
    object may die while autograd keeps its storage saved); ``None`` when two of ``tensors`` share
    a storage, or one shares a storage with ``others``."""
    from torch.multiprocessing.reductions import StorageWeakRef

    try:
        storages = [t.untyped_storage() for t in tensors]
        keys = [(s.device, s.data_ptr()) for s in storages]
        taken = {(o.untyped_storage().device, o.untyped_storage().data_ptr()) for o in others
                 if isinstance(o, torch.Tensor) and o.layout is torch.strided}
    except (NotImplementedError, RuntimeError):  # no plain storage to watch (sparse, DTensor, nested)
        return None
    if len(set(keys)) != len(keys) or taken.intersection(keys) or any(p == 0 for _, p in keys):
        return None
    refs = [StorageWeakRef(s) for s in storages]
    return [lambda ref=ref: not ref.expired() for ref in refs]


def _backward_hooked(outputs, grad_outputs, inputs, aliases, on_grad, *, preset=None, retain_graph=False) -> list:
    """``torch.autograd.backward`` of ``outputs`` into ``inputs`` and ``aliases``, calling
    ``on_grad(i, alias)`` as autograd accumulates each alias's gradient (``preset``: the
    ``.grad`` each alias starts with, else none). Returns the inputs' gradients; leaves no
    ``.grad`` on inputs or aliases."""
    handles = []
    for i, alias in enumerate(aliases):
        alias.grad = None if preset is None else preset[i]
        handles.append(alias.register_post_accumulate_grad_hook(functools.partial(on_grad, i)))
    for x in inputs:
        x.grad = None
    try:
        torch.autograd.backward(list(outputs), list(grad_outputs), retain_graph=retain_graph,
                                inputs=[*inputs, *aliases])
    finally:
        for h in handles:
            h.remove()
        for alias in aliases:
            alias.grad = None
    grads = [x.grad for x in inputs]
    for x in inputs:
        x.grad = None
    return grads


_RESERVE_FLAG = "FLAGS_graphpp_reserve_pool"


def _reserve_pool() -> Optional[str]:
    """``FLAGS_graphpp_reserve_pool``: the memory a shared pool gets before its first capture,
    for the stepping optimizers' temporaries between episodes (see pool_lending): unset or
    true, one block of the parameters' bytes (``"block"``); ``segments``, the segments one list
    of temporaries makes; false, none. Captures wait for an optimizer's first step either way
    (``defer_capture``). In a pool of expandable segments (the default, see pool_segments) the
    two layouts come to the same free range."""
    from .pool_lending import BLOCK, SEGMENTS

    raw = os.environ.get(_RESERVE_FLAG)
    if raw is None:
        return BLOCK
    if (layout := raw.strip().lower()) in (BLOCK, SEGMENTS):
        return layout
    try:
        return BLOCK if env_flag_value(raw, _RESERVE_FLAG) else None
    except ValueError:
        raise ValueError(f"{_RESERVE_FLAG}={raw!r}: use 1 or 'block' (one block of the optimizer's parameter "
                         f"bytes, the default), 'segments' (the segments its temporaries make) or 0 (none)") from None


def _inside_ddp_forward() -> bool:
    """True inside the forward of a ``DistributedDataParallel`` module (C++ reducer)."""
    active = getattr(torch.nn.parallel.DistributedDataParallel, "_get_active_ddp_module", None)
    return active is not None and active() is not None


def _megatron_tracker_states() -> tuple:
    """The states of Megatron-Core's CUDA RNG tracker when Megatron is imported and the tracker
    set up: ``({name: generator} of graph-safe states, [names of states that are not])``."""
    random = sys.modules.get("megatron.core.tensor_parallel.random")
    tracker = getattr(random, "_CUDA_RNG_STATE_TRACKER", None) if random is not None else None
    states = getattr(tracker, "states_", None)
    if not isinstance(states, dict):
        return {}, []
    safe = {name: s for name, s in states.items() if isinstance(s, torch.Generator)}
    return safe, [name for name in states if name not in safe]


def _registered_generators(extra) -> list:
    """The generators a capture registers besides the default one: ``extra`` and the graph-safe
    states of recognised RNG trackers, each once, on CUDA."""
    found, seen = [], set()
    for gen in [*extra, *_megatron_tracker_states()[0].values()]:
        if not isinstance(gen, torch.Generator):
            raise TypeError(f"generators: expected torch.Generator objects, got {type(gen).__name__}")
        if gen.device.type != "cuda":
            raise ValueError(f"generators: {gen!r} is a {gen.device.type} generator; graphs draw only from "
                             f"CUDA generators (torch.Generator(device='cuda'))")
        if id(gen) not in seen:
            seen.add(id(gen))
            found.append(gen)
    return found


def _pool_id(pool):
    return pool.id if isinstance(pool, torch.cuda.MemPool) else pool


_support.require("torch", torch.__version__)
RUNTIME = TorchRuntime()
