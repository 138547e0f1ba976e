"""``install()``: fleet's own ``use_cudagraph`` flag builds this project's graphed runs.

Paddle 3.x's ``PipelineLayer(use_cudagraph=True)`` wraps each flushed group of layers in
Paddle's ``paddle.device.cuda.cuda_graphed_layer.CUDAGraphedLayer``: one graph pair and one
memory pool per in-flight micro-batch. After :func:`install`, fleet's
``PipelineLayer.__init__`` builds such a model with ``use_cudagraph=False`` and hands it to
:func:`paddle_graphpp.graph_pipeline`, so the flag gives this project's runs instead (one
shared pool, shared layers eager, names and checkpoints unchanged). Upstream's
``CUDAGraphedLayer`` is then never built by fleet.

With ``default_use_cudagraph=True`` every fleet pipeline model built afterwards is graphed
unless its constructor call passes ``use_cudagraph=False``: the switch for model classes that
never pass the flag (PaddleFormers' ``...Pipe`` models call ``PipelineLayer.__init__``
without it).

The hook is the ``use_cudagraph`` argument of fleet's ``PipelineLayer.__init__`` (Paddle
3.x); :func:`install` refuses a Paddle without it, naming the version.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Optional

import paddle
from paddle.distributed.fleet.meta_parallel import PipelineLayer as _FleetPipelineLayer

from paddle_graphpp.core.options import EngineOptions
from paddle_graphpp.core.process import current_process
from paddle_graphpp.paddle.graphed import paddle_engine_options
from paddle_graphpp.paddle.integrations.fleet import check_graphable
from paddle_graphpp.paddle.pipeline import graph_pipeline

__all__ = ["install", "uninstall", "Installed"]


@dataclass(frozen=True, slots=True)
class _Settings:
    default_use_cudagraph: bool
    options: EngineOptions


class InstallState:
    """What :func:`install` did in this process (a part of its paddle section)."""

    def __init__(self) -> None:
        self.settings: Optional[_Settings] = None
        self.original_init = None  # fleet's own PipelineLayer.__init__ while installed
        self.wrapper = None  # what install() put in its place


def _installed() -> InstallState:
    return current_process().section("paddle").part(InstallState)


class Installed:
    """What :func:`install` returns: ``undo()`` is :func:`uninstall`."""

    def undo(self) -> None:
        """:func:`uninstall`: fleet's own ``PipelineLayer.__init__`` again. Models graphed through
        the hook stay graphed: ``GraphedPipeline.of(model).undo()`` ungraphs each.

        Raises:
            RuntimeError: not installed (undone already, or :func:`uninstall` was called), or
                something else replaced ``PipelineLayer.__init__`` after :func:`install`.
        """
        if _installed().wrapper is None:
            raise RuntimeError("paddle_graphpp.install(...).undo(): not installed (undone already, or uninstall() "
                               "was called); nothing to undo")
        uninstall()


def install(*, default_use_cudagraph: bool = False, options: Optional[EngineOptions] = None,
            **engine_kwargs) -> Installed:
    """Make fleet's ``PipelineLayer(..., use_cudagraph=True)`` graph with this project's engine.

    Affects pipeline models built after the call, of fleet's class and every subclass; call
    it on every rank (models must be graphed alike everywhere). Calling it again changes the
    settings.

    Args:
        default_use_cudagraph: graph models whose constructor call does not pass
            ``use_cudagraph`` (model libraries such as PaddleFormers never do); an explicit
            ``use_cudagraph=False`` still builds an eager model.
        options, **engine_kwargs: the engine options of the graphed runs (an
            :class:`paddle_graphpp.EngineOptions`, or its fields by keyword, as
            :class:`paddle_graphpp.CUDAGraphedLayer` takes them).

    Returns:
        An :class:`Installed`, whose ``undo()`` is :func:`uninstall` (fleet's own
        ``PipelineLayer.__init__`` again; models graphed meanwhile are ungraphed each with
        ``GraphedPipeline.of(model).undo()``).

    Raises:
        RuntimeError: this Paddle's fleet ``PipelineLayer`` has no ``use_cudagraph`` argument
            (the message names the version); build the model as usual and call
            :func:`paddle_graphpp.graph_pipeline` on it instead.

    A model graphed this way fails its constructor (before building anything) with the errors
    of :func:`paddle_graphpp.graph_pipeline`: recomputation it cannot take over, dynamic shapes.
    ``paddle_graphpp.GraphedPipeline.of(model)`` returns its graphs and segmentation report.
    """
    installed = _installed()
    if "use_cudagraph" not in inspect.signature(_FleetPipelineLayer.__init__).parameters:
        raise RuntimeError(
            f"paddle_graphpp.install(): fleet's PipelineLayer in Paddle {paddle.__version__} has no "
            "use_cudagraph argument, so there is no flag to redirect. Build the model as usual and call "
            "paddle_graphpp.graph_pipeline(model) on it, on every rank")
    chosen = paddle_engine_options("paddle_graphpp.install()", install, (), engine_kwargs, options)
    installed.settings = _Settings(bool(default_use_cudagraph), chosen)
    if installed.wrapper is None:
        installed.original_init = _FleetPipelineLayer.__init__
        installed.wrapper = _FleetPipelineLayer.__init__ = _graphing_init(installed.original_init)
    return Installed()


def uninstall() -> None:
    """Undo :func:`install`: fleet's ``use_cudagraph`` builds upstream's graphs again.

    Models graphed already stay graphed (``GraphedPipeline.of(model).undo()`` ungraphs each).
    A no-op when not installed.

    Raises:
        RuntimeError: something else replaced ``PipelineLayer.__init__`` after :func:`install`
            (restoring the original would drop that); undo that first.
    """
    installed = _installed()
    if installed.wrapper is None:
        return
    if _FleetPipelineLayer.__dict__.get("__init__") is not installed.wrapper:
        raise RuntimeError(
            "paddle_graphpp.uninstall(): fleet's PipelineLayer.__init__ was replaced after "
            "paddle_graphpp.install(); undo that replacement first")
    _FleetPipelineLayer.__init__ = installed.original_init
    installed.settings = installed.original_init = installed.wrapper = None


def _graphing_init(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        settings = _installed().settings
        bound = signature.bind(self, *args, **kwargs)
        requested = bound.arguments.get("use_cudagraph")  # None: the call did not pass it
        use_graphs = settings is not None and (
            settings.default_use_cudagraph if requested is None else bool(requested))
        if not use_graphs:
            return original(self, *args, **kwargs)
        given = bound.arguments
        check_graphable(f"{type(self).__name__}(use_cudagraph=True)",
                        recompute_interval=given.get("recompute_interval", 0),
                        recompute_ctx=given.get("recompute_ctx"), use_dualpipev=given.get("use_dualpipev", False))
        bound.arguments["use_cudagraph"] = False
        original(*bound.args, **bound.kwargs)
        graph_pipeline(self, options=settings.options)

    return __init__
