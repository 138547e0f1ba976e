"""The settings of one graphed layer, and the documentation both frameworks' layer classes share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from . import memory as _memory

__all__ = ["EngineOptions", "GRAPHED_LAYER_DOC", "graphed_layer_doc", "compiler_options"]

_FALLBACKS = ("error", "eager")


def compiler_options(value: Any, owner: str, option: str, compiler: str, keys: Sequence[str]) -> Optional[dict]:
    """The keyword arguments a graphed layer's compiler option (``compile=``, ``to_static=``)
    stands for: ``None`` for ``False``/``None``, ``{}`` for ``True``, a copy of a dict whose keys
    are among ``keys``. The framework checks the values.

    Raises:
        TypeError: ``value`` is neither a bool nor a dict.
        ValueError: a key not in ``keys``.
    """
    if value is None or value is False:
        return None
    if value is not True and not isinstance(value, dict):
        raise TypeError(f"{owner}: {option} must be True, False or a dict of {compiler} keyword arguments (some of "
                        f"{list(keys)}), got {type(value).__name__}")
    options = {} if value is True else dict(value)
    unknown = sorted(set(options) - set(keys))
    if unknown:
        raise ValueError(f"{owner}: {option}={{...}} has {unknown}, which a graphed layer does not pass to {compiler}; "
                         f"use some of {list(keys)}")
    return options


@dataclass(kw_only=True, slots=True)
class EngineOptions:
    """Settings of one graphed layer (validated on construction)."""

    num_warmup_steps: int = 3
    """Eager forwards per signature before it is recorded (recording also waits for an
    episode start)."""
    fallback: str = "error"
    """``"error"``: a failed capture raises :class:`CaptureError`. ``"eager"``: warn once and
    keep running this layer eagerly."""
    memory: str = "shared"
    """``"shared"`` or ``"per_graph"``; see :mod:`paddle_graphpp.core.memory`."""
    max_in_flight: int = 64
    """Forwards that may wait for their backward before that is an error."""
    max_signatures: int = 4
    """Input signatures captured per layer; further ones run eagerly with a warning."""
    accumulate_grads: Any = "auto"
    """``True``: the backward graph adds parameter gradients into ``.grad`` itself (one
    in-graph add per parameter; ``.grad`` becomes a buffer the layer owns). ``False``: the
    graph writes them into a buffer of the layer that autograd then adds to ``.grad`` (a
    second set of gradient buffers, and one more pass over them per micro-batch).
    ``"auto"`` (default): ``True`` where the runtime supports it and no parameter's
    gradient accumulation runs hooks (Python accumulation hooks, or a DistributedDataParallel
    forward around the layer); ``False`` there, so the hooks keep seeing every gradient."""
    generators: Any = None
    """Random generators the layer draws from besides the framework's default one (which is
    always registered): a sequence, or a callable returning one at each capture. Runtimes
    also register the generators of RNG trackers they recognise (see each runtime)."""

    def validate(self, owner: str) -> "_memory.MemoryMode":
        if not isinstance(self.num_warmup_steps, int) or self.num_warmup_steps < 0:
            raise ValueError(f"{owner}: num_warmup_steps must be an int >= 0, got {self.num_warmup_steps!r}")
        if self.fallback not in _FALLBACKS:
            raise ValueError(f"{owner}: fallback must be one of {_FALLBACKS}, got {self.fallback!r}")
        if not isinstance(self.max_signatures, int) or self.max_signatures < 1:
            raise ValueError(f"{owner}: max_signatures must be an int >= 1, got {self.max_signatures!r}")
        if not isinstance(self.max_in_flight, int) or self.max_in_flight < 1:
            raise ValueError(f"{owner}: max_in_flight must be an int >= 1, got {self.max_in_flight!r}")
        if not (isinstance(self.accumulate_grads, bool) or self.accumulate_grads == "auto"):
            raise ValueError(f"{owner}: accumulate_grads must be a bool or 'auto', got {self.accumulate_grads!r}")
        if not (self.generators is None or callable(self.generators)
                or isinstance(self.generators, (list, tuple))):
            raise ValueError(f"{owner}: generators must be a list or tuple of generators, or a callable returning "
                             f"one, got {type(self.generators).__name__}")
        return _memory.MemoryMode.parse(self.memory, owner)


_ACCUMULATE_DOC = """        accumulate_grads: ``"auto"`` (default) adds parameter gradients into ``.grad``
            inside the backward graph (``.grad`` becomes a buffer the layer owns), except where
            a parameter's accumulation runs hooks (DistributedDataParallel, Python accumulation
            hooks): there autograd accumulates, and the hooks see every gradient. ``True``
            forces it (an error with such hooks); ``False`` turns it off (the layer then keeps
            a second set of gradient buffers).
"""

_GENERATORS_DOC = """        generators: random generators the layer draws from besides the default CUDA
            generator (always registered), as a list or a callable returning one; each
            capture registers them so every replay draws fresh numbers from them. The
            generators of Megatron-Core's RNG tracker are found and registered without this
            (``model_parallel_cuda_manual_seed(..., use_cudagraphable_rng=True)``).
"""

#: The documentation of both frameworks' graphed layer classes (formatted per framework).
GRAPHED_LAYER_DOC = """Wrap ``{arg}`` so that, after warmup, its forward and backward replay CUDA graphs.

    Calls ``1..num_warmup_steps`` run eagerly. The next step (from a moment no micro-batch is
    in flight) runs eagerly too and is recorded; at the start of the step after it, every
    recorded micro-batch position of every graphed layer is captured in the order the step
    ran them, into one memory pool, and that step replays. Each position of the schedule
    gets its own forward/backward graph pair; backwards pair with forwards in FIFO order, so
    1F1B and interleaved schedules work.

    Args:
        {arg}: the {base} to graph. Its parameters must stay on the GPU at fixed addresses.
        num_warmup_steps: eager calls per input signature before recording.
        fallback: ``"error"`` (default) raises :class:`paddle_graphpp.CaptureError` when capture
            fails; ``"eager"`` warns once and keeps running eagerly.
        memory: ``"shared"`` (default: one pool, static buffers shared by lifetime) or
            ``"per_graph"`` (a pool per graph, upstream Paddle's design).
        max_in_flight: forwards that may await their backward before that is an error.
        max_signatures: input signatures captured; later new ones run eagerly with a warning.
{accumulate}{generators}{extra}        name: the name used in messages (default: the class name of ``{arg}``).

    Without CUDA (or with CPU inputs) it runs eagerly and warns once. Under ``{no_grad}`` it
    always runs eagerly.

    .. warning:: Outputs alias graph memory until the same micro-batch position is replayed
       again, or, for an output the recorded step had freed within the step, until the graphs
       captured after that point run. (PyTorch) An output object still referenced then is first
       moved to memory of its own, so the outputs themselves keep their values when kept (a
       schedule keeping them to return them merged), at the cost of a copy; tensors made from
       them without a copy (``out.detach()``, a slice, a view) are not moved and are
       overwritten: clone those (or keep them in the recorded step too, which keeps the memory).
       (Paddle) outputs are overwritten: clone what you keep.
    .. warning:: Do not modify outputs in place, and do not replace parameters or buffers
       (assigning new tensors or storage to them, ``module.to(dtype)``) after capture: graphs
       read fixed addresses, and the next replay raises
       :class:`paddle_graphpp.StateReplacedError` (call :func:`paddle_graphpp.reset_graphs`
       on the model to capture anew). In-place updates (optimizers, ``load_state_dict``) are fine.
    .. warning:: Code inside must not synchronise with the host (``.item()``, printing tensors,
       data-dependent shapes); capture fails with a :class:`paddle_graphpp.CaptureError`.
       Other exceptions raised by its code during capture keep their type, with the layer named.
    .. warning:: Gradient hooks on tensors inside the wrapped {base} run at capture only; hooks
       on its inputs, outputs and parameters work as usual.
    .. warning:: The schedule must repeat every step: graphs are replayed in capture order, and a
       different order raises :class:`paddle_graphpp.GraphScheduleError` (use ``memory="per_graph"``).
    .. warning:: (PyTorch) A backward that asks for input gradients only (``torch.autograd.grad``
       w.r.t. the inputs, as zero-bubble schedules' input pass does) runs the input half; the
       micro-batch stays in flight until a backward asks for the parameters' gradients (the
       weight pass), which receives them as autograd would (the schedule adds them into ``.grad``).
       With ``accumulate_grads`` (default ``"auto"``) the weight graph adds them into ``.grad``
       itself and ``torch.distributed.pipelining``'s weight pass is handed each parameter's
       whole sum with ``.grad`` unset, which it puts back into ``.grad``; per-micro-batch
       parameter gradients do not exist then, and any other weight pass raises
       :class:`paddle_graphpp.GraphScheduleError` (pass ``accumulate_grads=False`` for it).
    """


def graphed_layer_doc(*, arg: str, base: str, no_grad: str, accumulate_grads: bool, generators: bool,
                      extra_args: str = "") -> str:
    """:data:`GRAPHED_LAYER_DOC` for one framework's class (``accumulate_grads``,
    ``generators``: whether its constructor takes that argument; ``extra_args``: the entries of
    the framework's own arguments, indented as the others)."""
    return GRAPHED_LAYER_DOC.format(arg=arg, base=base, no_grad=no_grad,
                                    accumulate=_ACCUMULATE_DOC if accumulate_grads else "",
                                    generators=_GENERATORS_DOC if generators else "", extra=extra_args)
