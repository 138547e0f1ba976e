"""``torch.compile`` inside CUDA graphs (``compile=``): compile in the warmup, capture what was
compiled, never compile inside a capture.

:class:`CompiledModule` is what a graphed layer's engine runs (:func:`compiled_module`; blocks of
one class share one compiled entry while dynamo's guards hold for all of them). While a graph
captures, :func:`no_compile_in_capture` makes a failing guard raise with dynamo's reason (reported
as :class:`~paddle_graphpp.CaptureError` naming the layer) instead of compiling in the capture.
Inductor's own CUDA graphs (``mode="reduce-overhead"`` and the like) are refused with the fix
(:func:`compile_options`, :func:`refuse_inner_graphs`), and :func:`opaque` makes the graphed call a
boundary for dynamo (a graph break), whichever of the two was applied first. The rules and the
measurements: docs/compile.md.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..core.options import compiler_options

__all__ = ["compile_options", "refuse_inner_graphs", "options_for", "compiled_module", "CompiledModule", "RunsInPlaceOf", "opaque",
           "no_compile_in_capture"]

# torch.compile's keyword arguments that a graphed layer passes through.
_KEYS = ("fullgraph", "dynamic", "backend", "mode", "options", "disable")
_GRAPHING_MODES = ("reduce-overhead", "max-autotune")


def _inner_graphs_error(owner: str, what: str) -> ValueError:
    return ValueError(
        f"{owner}: {what} records Inductor's own CUDA graphs, which cannot run inside this layer's "
        f"graphs. Use compile=True (the default mode) or mode='max-autotune-no-cudagraphs': the graphed "
        f"layer already removes the launch overhead that reduce-overhead targets.")


def compile_options(compile: Any, owner: str) -> Optional[dict]:
    """The ``torch.compile`` keyword arguments a graphed layer's ``compile=`` option stands for:
    ``None`` for ``False``/``None``, ``{}`` for ``True``, a copy of a dict.

    Raises:
        TypeError: ``compile`` is neither a bool nor a dict.
        ValueError: an unknown key, or a setting that records Inductor's own CUDA graphs.
    """
    compile = compiler_options(compile, owner, "compile", "torch.compile", _KEYS)
    if compile is None:
        return None
    mode, options, backend = compile.get("mode"), compile.get("options") or {}, compile.get("backend")
    if mode in _GRAPHING_MODES:
        raise _inner_graphs_error(owner, f"compile={{'mode': {mode!r}}}")
    if not isinstance(options, dict):
        raise TypeError(f"{owner}: compile['options'] must be a dict of Inductor options, got "
                        f"{type(options).__name__}")
    if options.get("triton.cudagraphs"):
        raise _inner_graphs_error(owner, "compile={'options': {'triton.cudagraphs': True}}")
    if backend == "cudagraphs":
        raise _inner_graphs_error(owner, "compile={'backend': 'cudagraphs'}")
    return compile


def _compiled_by_user(obj: Any) -> Any:
    """The ``torch.compile`` wrapper of ``obj`` when the user compiled it: an ``OptimizedModule``,
    a module after ``module.compile()``, or a compiled function; else ``None``."""
    if isinstance(obj, torch._dynamo.eval_frame.OptimizedModule):
        return obj
    compiled = getattr(obj, "_compiled_call_impl", None) if isinstance(obj, nn.Module) else None
    if compiled is not None:
        return compiled
    return obj if callable(getattr(obj, "get_compiler_config", None)) else None


def refuse_inner_graphs(obj: Any, owner: str) -> Any:
    """Refuse a module or function the user compiled with Inductor's CUDA graphs on
    (``mode="reduce-overhead"``); returns its ``torch.compile`` wrapper, or ``None`` when the
    user did not compile it."""
    compiled = _compiled_by_user(obj)
    if compiled is None:
        return None
    getter = getattr(compiled, "get_compiler_config", None)
    config = getter() if callable(getter) else None  # Inductor's settings; None for other backends
    if isinstance(config, dict) and config.get("triton.cudagraphs"):
        raise _inner_graphs_error(owner, "the module was compiled with mode='reduce-overhead' (or "
                                         "triton.cudagraphs), which")
    return compiled


def options_for(obj: Any, compile: Any, owner: str) -> Optional[dict]:
    """``compile=`` for ``obj`` (a module or function a graphed layer will run): its options as
    :func:`compile_options` gives them, after :func:`refuse_inner_graphs` checked what the user
    compiled. Raises ``ValueError`` for an ``obj`` compiled already that ``compile=`` would
    compile again."""
    options = compile_options(compile, owner)
    if refuse_inner_graphs(obj, owner) is not None and options is not None:
        what = "module" if isinstance(obj, nn.Module) else "function"
        raise ValueError(f"{owner}: the {what} is compiled already (torch.compile or module.compile()) and "
                         f"compile= asks to compile it again; pass the plain {what} with compile=..., or the "
                         f"compiled one without it")
    return options


def compiled_module(module: nn.Module, options: dict) -> Callable:
    """``torch.compile(module, **options)``: the module's forward code is compiled, shared by
    every module of its class while dynamo's guards hold."""
    return torch.compile(module, **options)


class RunsInPlaceOf(nn.Module):
    """A module a graphed layer's engine runs in place of another (the attribute named by
    ``_wrapped``): its train/eval mode is the other module's, whatever is set on it."""

    _wrapped = "module"

    @property
    def training(self) -> bool:  # the engine keys signatures by the wrapped module's mode
        return getattr(self, self._wrapped).training

    @training.setter
    def training(self, mode: bool) -> None:  # nn.Module.__init__ and train() set it; the wrapped one's wins
        pass


class CompiledModule(RunsInPlaceOf):
    """The module a graphed layer's engine runs when ``compile=`` is given: ``module`` called
    through ``torch.compile``. Its parameters are ``module``'s (under ``module.``); it is never
    a submodule of the model."""

    def __init__(self, module: nn.Module, options: dict):
        super().__init__()
        self.module = module
        self.__dict__["_compiled"] = compiled_module(module, options)

    def forward(self, *args, **kwargs):
        return self._compiled(*args, **kwargs)


def opaque(fn: Callable) -> Callable:
    """``fn`` as a boundary for dynamo: ``torch.compile`` around a caller graph-breaks at it and
    runs it as Python (compiled code that ``fn`` calls itself still runs compiled)."""
    return torch.compiler.disable(fn, recursive=True)


def no_compile_in_capture():
    """Inside a capture, compiled code may only run what it compiled before: a guard miss
    raises with dynamo's reason instead of tracing, compiling and autotuning in the capture."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        return contextlib.nullcontext()
    return set_stance("fail_on_recompile")
