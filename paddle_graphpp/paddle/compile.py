"""``paddle.jit.to_static`` inside CUDA graphs (``to_static=``): convert in the warmup, capture what
was converted, never convert inside a capture.

:class:`StaticLayer` is what a graphed layer's engine runs: a call that would convert anew while a
graph captures (another shape, dtype or ``stop_gradient``, a sublayer in another train/eval mode)
raises, naming the layer and the reason. :func:`opaque` makes the graphed call a boundary for SOT
(a graph break); the AST converter (``full_graph=True``) has none, so a graphed layer inside its
program raises. Each graphed layer converts on its own, through a code object of its own. A layer
converted already, or (with SOT) one calling a converted sublayer, is refused with the fix. The
Paddle 3.3.1 facts behind these rules: docs/compile.md#paddle-to_static.
"""

from __future__ import annotations

import functools
import itertools
import sys
import types
from typing import Any, Optional

import paddle
from paddle import nn
from paddle.jit.dy2static.program_translator import ASTStaticFunction, StaticFunction
from paddle.jit.dy2static.utils import ENV_ENABLE_SOT, Backend
from paddle.jit.marker import force_dynamic
from paddle.jit.sot import psdb
from paddle.jit.sot.opcode_translator.custom_code import CustomCode
from paddle.jit.sot.opcode_translator.executor.executor_cache import OpcodeExecutorCache
from paddle.jit.sot.translate import symbolic_translate
from paddle.jit.sot.utils import StepInfoManager

from ..core.options import compiler_options
from ..core.process import current_process
from .runtime import active_runtime

__all__ = ["to_static_options", "StaticLayer", "opaque", "is_converted"]

# paddle.jit.to_static's keyword arguments that a graphed layer passes through.
_KEYS = ("full_graph", "backend", "build_strategy", "input_spec")
# The code of the wrapper every call of an SOT-converted function runs in (symbolic_translate's ``impl``).
_SOT_CALL = next((c for c in symbolic_translate.__code__.co_consts
                  if isinstance(c, types.CodeType) and c.co_name == "impl"), None)


def to_static_options(to_static: Any, owner: str) -> Optional[dict]:
    """The ``paddle.jit.to_static`` keyword arguments a graphed layer's ``to_static=`` option
    stands for: ``None`` for ``False``/``None``, ``{}`` for ``True``, a checked copy of a dict.

    Raises:
        TypeError: ``to_static`` is neither a bool nor a dict, or a value has the wrong type.
        ValueError: an unknown key, an unknown backend, ``input_spec`` without
            ``full_graph=True`` (SOT ignores it), or SOT with the PIR API turned off.
    """
    options = compiler_options(to_static, owner, "to_static", "paddle.jit.to_static", _KEYS)
    if options is None:
        return None
    full_graph = options.get("full_graph")
    if full_graph is not None and not isinstance(full_graph, bool):
        raise TypeError(f"{owner}: to_static['full_graph'] must be a bool, got {type(full_graph).__name__}")
    sot = _uses_sot(options)
    if "backend" in options:
        try:
            Backend.from_arg(options["backend"])
        except (ValueError, AttributeError):
            raise ValueError(f"{owner}: to_static['backend']={options['backend']!r} is no backend of "
                             f"paddle.jit.to_static; use 'CINN' (its default: PHI where CINN is unavailable) "
                             f"or None (PHI)") from None
    strategy = options.get("build_strategy")
    if strategy is not None and not isinstance(strategy, paddle.static.BuildStrategy):
        raise TypeError(f"{owner}: to_static['build_strategy'] must be a paddle.static.BuildStrategy, got "
                        f"{type(strategy).__name__}")
    if options.get("input_spec") is not None and sot:
        raise ValueError(f"{owner}: to_static['input_spec'] takes effect with full_graph=True only (SOT ignores "
                         f"it); drop it, or add 'full_graph': True")
    if sot and not paddle.framework.use_pir_api():
        raise ValueError(f"{owner}: to_static with SOT (full_graph=False) needs Paddle's PIR API, which "
                         f"FLAGS_enable_pir_api=0 turns off; unset that flag, or pass to_static={{'full_graph': True}}")
    return options


def is_converted(layer: nn.Layer) -> bool:
    """Whether ``paddle.jit.to_static(layer)`` (or ``@paddle.jit.to_static`` on its class's
    ``forward``) converted ``layer``'s call."""
    return isinstance(getattr(layer, "forward", None), StaticFunction)


def _uses_sot(options: dict) -> bool:
    """Whether ``paddle.jit.to_static(**options)`` converts with SOT (else with the AST converter)."""
    full_graph = options.get("full_graph")
    return (not full_graph) if full_graph is not None else ENV_ENABLE_SOT.get()


def _check_convertible(layer: nn.Layer, options: dict, owner: str) -> None:
    """Refuse a layer converted already, and (SOT) one that calls a converted sublayer: Paddle
    3.3.1's SOT fails on code that calls a layer ``paddle.jit.to_static`` converted (an
    ``InnerError`` with ``KeyError: 'self'`` at the first call; the AST converter handles it)."""
    if is_converted(layer):
        raise ValueError(f"{owner}: the layer is converted already (paddle.jit.to_static(layer)) and to_static= "
                         f"asks to convert it again; pass the plain layer with to_static=..., or the converted one "
                         f"without it")
    converted = [f"{type(sub).__name__} ({name})" for name, sub in layer.named_sublayers() if is_converted(sub)]
    if converted and _uses_sot(options):
        raise ValueError(
            f"{owner}: {', '.join(converted[:4])} converted by paddle.jit.to_static already, and Paddle "
            f"{paddle.__version__}'s SOT cannot convert code that calls a converted layer (InnerError \"KeyError: "
            f"'self'\"). Pass to_static=False (converted layers run converted inside the graphs anyway), or "
            f"to_static={{'full_graph': True}}, or leave those layers unconverted")


def _call_layer(self, args, kwargs):  # paddle.jit.to_static converts no function with *args
    return self.layer(*args, **kwargs)


class CodeSerials:
    """Numbers for the code objects :func:`_own_code` makes (a part of the process's paddle section)."""

    def __init__(self) -> None:
        self.numbers = itertools.count()


def _own_code(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with a code object of its own (equal code objects are one key of SOT's cache,
    whose 20 entries would otherwise be shared by every graphed layer; docs/compile.md#paddle-to_static).
    Its name and source stay ``fn``'s, which the AST converter looks up."""
    serial = next(current_process().section("paddle").part(CodeSerials).numbers)
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{serial}")
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _conversions(static: StaticFunction) -> int:
    """A count that grows whenever ``static`` converts (translates or traces) anew."""
    if isinstance(static, ASTStaticFunction):
        return static.get_traced_count()
    return OpcodeExecutorCache().translate_count


class StaticLayer(nn.Layer):
    """The layer a graphed layer's engine runs when ``to_static=`` is given: ``layer`` called
    (hooks included) through ``paddle.jit.to_static(**options)``; ``layer`` itself is left as
    it is. Its parameters are ``layer``'s (under ``layer.``), its train/eval mode is
    ``layer``'s; it is never a sublayer of the model.

    Raises:
        ValueError: ``layer`` is converted already, or (SOT) holds a converted sublayer; see
            :func:`_check_convertible`.
        RuntimeError: when called, if the call would convert anew while a graph captures (the
            message names ``owner`` and what to keep equal).
    """

    def __init__(self, layer: nn.Layer, options: dict, owner: str):
        super().__init__()
        _check_convertible(layer, options, owner)
        self.layer = layer
        self.__dict__["_owner"] = owner
        self.__dict__["_static"] = paddle.jit.to_static(types.MethodType(_own_code(_call_layer), self), **options)

    @property
    def training(self):  # the engine keys captures by the wrapped layer's mode
        layer = self.__dict__.get("_sub_layers", {}).get("layer")
        return True if layer is None else layer.training

    @training.setter
    def training(self, mode) -> None:  # nn.Layer.__init__ and train() set it; the layer's own wins
        pass

    def forward(self, *args, **kwargs):
        if not active_runtime().is_capturing():
            return self._static(args, kwargs)
        before = _conversions(self._static)
        out = self._static(args, kwargs)
        if _conversions(self._static) != before:
            raise RuntimeError(
                f"{self._owner}: paddle.jit.to_static converted the layer anew inside the capture; a capture runs "
                f"only what the warmup converted. Give every call the inputs' shapes, dtypes and stop_gradient, "
                f"and the sublayers' train/eval mode that the warmup calls had.")
        return out


def _inside_sot() -> bool:
    """Whether a function converted by SOT is running on this thread's stack (cheap when none runs)."""
    if StepInfoManager().current_code is None:
        return False
    frame = sys._getframe(2)
    while frame is not None and frame.f_code is not _SOT_CALL:
        frame = frame.f_back
    return frame is not None


def _run_frame_as_is(frame):
    """An SOT eval-frame callback that translates nothing: every frame runs as it is."""
    return CustomCode(None, False)


def _rearm_enclosing_sot() -> None:
    """Turn the interpreter's eval-frame hook back on for the SOT function around a graphed layer.

    A function SOT converts that runs inside another's graph break (a graphed layer's converted
    layer, or a user's ``paddle.jit.to_static(sublayer)`` in it) turns the hook off when it
    returns, although the outer function's callback stays recorded: the code after the graphed
    layer would then run unconverted (Paddle 3.3.1, measured). A pass-through callback turns the
    hook on; SOT puts the outer callback back when the graphed layer's untraced call returns.
    """
    paddle.framework.core.set_eval_frame(_run_frame_as_is)


def opaque(cls: type) -> type:
    """Make the graphed layer class ``cls`` a boundary for Paddle's converters.

    SOT breaks the graph where a converted caller calls an instance (``force_dynamic``), and the
    instance's ``forward`` then runs untraced, its callees included (``psdb.fallback(recursive=
    True)``, a no-op outside SOT): the engine runs as plain Python, and the layer it wraps runs
    as the graphed layer's own ``to_static=`` says. Under the AST converter, which has no graph
    breaks, ``forward`` is not converted (``not_to_static``) and raises ``RuntimeError`` naming
    the layer, as it does in any static program. The code after the call stays converted
    (:func:`_rearm_enclosing_sot`).
    """
    forward = cls.forward

    @functools.wraps(forward)
    def boundary(self, *args, **kwargs):
        psdb.fallback(recursive=True)  # inside SOT: this call and all it calls run as plain Python
        if not paddle.in_dynamic_mode():
            raise RuntimeError(
                f"{self.engine.name}: a graphed layer runs in dynamic mode only, but it is called while a static "
                f"program is built (paddle.jit.to_static(..., full_graph=True) around it, or paddle.enable_static()). "
                f"Convert the enclosing model with full_graph=False (SOT calls graphed layers as they are), or give "
                f"the graphed layer to_static={{'full_graph': True}} to convert what it wraps.")
        out = forward(self, *args, **kwargs)
        if _inside_sot():
            _rearm_enclosing_sot()
        return out

    cls.forward = paddle.jit.not_to_static(boundary)
    force_dynamic(cls)
    return cls
