"""PyTorch side of :mod:`paddle_graphpp.optim`: graph-safe clipping, zeroing, master weights,
and :class:`TorchGraphedOptimizer`.

No function here reads a device value on the host, so each can run inside a CUDA graph.
"""

from __future__ import annotations

import logging
import weakref
from typing import Iterable, Optional, Sequence

import torch

from ..core.errors import StateReplacedError
from ..core.process import current_process
from ..graph_api import graph_process
from ..core.capture import capture_for
from ..core.state import StateWatch
from ..optim import GraphedOptimizer
from .memory import pool_lending as _pool_lending
from .moe import UNCHECKED, checked_experts
from .runtime import active_runtime

__all__ = ["global_grad_norm", "clip_by_global_norm", "zero_grads_", "MasterWeights", "TorchGraphedOptimizer",
           "make_capturable", "undo_capturable", "frozen_hyperparameters", "optimizer_state_slots"]

logger = logging.getLogger(__name__)

#: eps of ``torch.nn.utils.clip_grad_norm_``: with it, clipping here is bit-identical to torch's.
TORCH_CLIP_EPS = 1e-6


def _present(tensors: Iterable[Optional[torch.Tensor]]) -> list:
    return [t for t in tensors if t is not None]


def _by_device_and_dtype(tensors: Sequence[torch.Tensor]) -> list:
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def global_grad_norm(grads: Sequence[Optional[torch.Tensor]], norm_type: float = 2.0) -> torch.Tensor:
    """Global ``norm_type``-norm of ``grads`` as a 0-d device tensor; as ``torch.nn.utils.get_total_norm``."""
    with torch.no_grad():
        return torch.nn.utils.get_total_norm(_present(grads), norm_type, error_if_nonfinite=False)


def clip_by_global_norm(grads: Sequence[Optional[torch.Tensor]], max_norm: float, *, eps: Optional[float] = None,
                        norm_type: float = 2.0) -> torch.Tensor:
    """Scale ``grads`` in place by ``min(1, max_norm / (norm + eps))``; return the norm.

    With the default ``eps`` (``1e-6``) the result is bit-identical to
    ``torch.nn.utils.clip_grad_norm_``. The coefficient never leaves the device.
    """
    grads = _present(grads)
    eps = TORCH_CLIP_EPS if eps is None else float(eps)
    with torch.no_grad():
        norm = global_grad_norm(grads, norm_type)
        coef = torch.clamp(float(max_norm) / (norm + eps), max=1.0)
        for group in _by_device_and_dtype(grads):
            torch._foreach_mul_(group, coef.to(group[0].device))
    return norm


def zero_grads_(grads: Sequence[Optional[torch.Tensor]]) -> None:
    """Zero ``grads`` in place (one launch per device and dtype); their addresses stay fixed."""
    with torch.no_grad():
        for group in _by_device_and_dtype(_present(grads)):
            torch._foreach_zero_(group)


class MasterWeights:
    """fp32 master copies of low-precision (bf16/fp16) parameters, for graph-safe updates.

    Build the optimizer over :attr:`master` and pass this object to
    :class:`TorchGraphedOptimizer` as ``master_weights``; each step then copies the model's
    gradients into the masters' preallocated fp32 ``.grad``, clips and steps in fp32, and
    copies the masters back into the model parameters. Every buffer is allocated here, once.

    Args:
        params: the model parameters (any floating dtype; typically bf16).

    Warnings:
        Assigning new tensors to the model parameters (``p.data = ...``) after this is built
        detaches them from their masters; build a new ``MasterWeights`` then.
    """

    def __init__(self, params: Iterable[torch.Tensor]):
        self.params = [p for p in params]
        if not self.params:
            raise ValueError("MasterWeights: no parameters given")
        with torch.no_grad():
            self.master = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
            for m in self.master:
                m.grad = torch.zeros_like(m)

    def grads_to_master_(self) -> None:
        """Copy (and upcast) the model gradients into the masters' ``.grad``; absent ones become zero."""
        with torch.no_grad():
            dst, src, missing = [], [], []
            for p, m in zip(self.params, self.master):
                if p.grad is None:
                    missing.append(m.grad)
                else:
                    dst.append(m.grad)
                    src.append(p.grad)
            if dst:
                torch._foreach_copy_(dst, src)
            zero_grads_(missing)

    def master_to_params_(self) -> None:
        """Copy (and downcast) the masters into the model parameters."""
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.master)


class TorchGraphedOptimizer(GraphedOptimizer):
    """Clip + ``optimizer.step()`` + in-place zero-grad, captured once and replayed.

    Args:
        optimizer: a ``torch.optim`` optimizer with a ``capturable`` mode (``Adam``,
            ``AdamW``, ``NAdam``, ``RAdam``, ...), with ``foreach`` on or off, or ``fused``.
        clip_grad_norm: clip the gradients to this global 2-norm before the step; ``None``
            does not clip.
        eps: added to the norm when clipping (default ``1e-6``, as ``clip_grad_norm_``).
        master_weights: a :class:`MasterWeights` whose :attr:`~MasterWeights.master` are
            the optimizer's parameters; gradients are taken from, and updated weights
            written to, its low-precision model parameters.
        compile: run the captured sequence (master-weight copy, clip, step, zero) through
            ``torch.compile`` (Inductor, default mode) before it is captured; see below.
            Default ``False``.

    With CUDA tensors, construction switches every param group to ``capturable=True`` and
    turns a float ``lr`` into a 0-d fp32 tensor on the parameters' device (which
    ``torch.optim.lr_scheduler`` schedulers update in place). Without CUDA nothing is
    changed and each step runs eagerly, bit-identical to clip_grad_norm_ + step + zero_grad.

    ``compile=True`` applies to the captured GPU step. The sequence is wrapped once, at
    construction, with ``torch.compile(fullgraph=False, dynamic=False)`` in the default mode
    (never ``"reduce-overhead"``: the graph is captured here). Inductor then fuses the
    ``foreach`` optimizer's element-wise passes into a few kernels, and likewise the norm and
    the clip multiply, so the replayed graph makes fewer passes over memory; it helps
    ``foreach=True`` most (``fused=True`` is a single kernel already). torch.optim breaks
    the compiled region around ``step()`` on purpose, so clip, step and zeroing compile as
    separate pieces, all captured in the one graph. The compile happens in the eager warmup
    run that precedes the capture, inside the first :meth:`step`, which therefore takes a
    while (tens of seconds for hundreds of tensors, less with a warm Inductor cache); the
    capture runs the code compiled then, and a recompile inside it is refused
    (``torch.compiler.set_stance("fail_on_recompile")``, reported as a ``CaptureError``).
    Results differ from the eager optimizer by rounding (fused arithmetic); the GPU test
    checks them against eager AdamW to 1e-6 in fp32. The sparse-gradient check runs outside
    the compiled region. Without CUDA, ``compile=True`` is accepted, logged once at INFO,
    and the step runs eagerly and uncompiled, exactly as without it.

    Use it in place of the optimizer in the loop; give schedulers the wrapped optimizer::

        opt = GraphedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), clip_grad_norm=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt.optimizer, lr_lambda)
        for batch in data:
            loss(model, batch).backward()
            norm = opt.step()   # clip + AdamW + zero grads; norm: 0-d device tensor or None
            sched.step()
            opt.zero_grad()     # free: grads are already zero, unless a backward ran since

    Raises:
        TypeError: not a torch optimizer, or one without a capturable mode (it would read
            device values on the host, e.g. ``.item()``); ``compile`` not a bool.
        ValueError: ``differentiable=True``, a non-positive ``clip_grad_norm``, a master
            weights object that does not match the optimizer, ``zero_grad(set_to_none=True)``.
        RuntimeError: a sparse gradient at step time.

    Warnings:
        * Gradients must stay where the graph saw them: accumulate into ``.grad`` and zero in
          place. A changed gradient or parameter address re-captures (logged), it is never
          replayed stale; setting gradients to ``None`` every step therefore defeats the graph.
        * Change hyperparameters other than ``lr`` (betas, weight decay) and they are picked
          up by a re-capture on the next step (logged).
        * Load optimizer state through :meth:`load_state_dict` of this object, which
          re-captures: loading into the wrapped optimizer directly replaces its state
          tensors behind the graph's back.
        * The returned norm is the graph's output buffer: the next step overwrites it.
        * With ``compile=True``: every re-capture (new addresses, a changed hyperparameter,
          :meth:`load_state_dict`) warms up again and may recompile, and each instance is
          one more compiled entry of the same code; past
          ``torch._dynamo.config.recompile_limit`` (8 by default) torch warns and the step
          runs uncompiled (still graphed). The first
          :meth:`step` must not run inside a capture of your own: compiling there is refused
          with torch's ``fail_on_recompile`` error.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, clip_grad_norm: Optional[float] = None, *,
                 eps: float = TORCH_CLIP_EPS, master_weights: Optional[MasterWeights] = None,
                 compile: bool = False):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"GraphedOptimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        name = type(optimizer).__name__
        if "capturable" not in optimizer.defaults:
            raise TypeError(
                f"GraphedOptimizer: torch.optim.{name} has no capturable mode, so its step reads device "
                "values on the host (or keeps step counts on the CPU) and cannot be captured in a CUDA "
                "graph. Use Adam/AdamW (or another optimizer with a `capturable` option), or step it eagerly.")
        if any(group.get("differentiable") for group in optimizer.param_groups):
            raise ValueError(f"GraphedOptimizer: {name}(differentiable=True) builds autograd graphs through "
                             "the step and cannot be captured; construct it with differentiable=False.")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(f"GraphedOptimizer: clip_grad_norm must be > 0 or None, got {clip_grad_norm!r}")
        if not isinstance(compile, bool):
            raise TypeError(f"GraphedOptimizer: compile must be a bool, got {type(compile).__name__} {compile!r}")
        self.optimizer = optimizer
        _pool_lending.register_optimizer(optimizer)  # layer captures wait for its first step (its state)
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.eps = float(eps)
        self.master_weights = master_weights
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        if master_weights is not None and [id(m) for m in master_weights.master] != [id(p) for p in self._params]:
            raise ValueError("GraphedOptimizer: master_weights.master must be exactly the optimizer's parameters, "
                             "in order; build the optimizer over MasterWeights(params).master.")
        # whose .grad the step reads and zeroes: the model's parameters
        self._grad_owners = master_weights.params if master_weights is not None else self._params
        runtime = self._runtime = active_runtime()
        self.unavailable_reason = runtime.graphs_unavailable_reason(self._params)
        self.graphed = self.unavailable_reason is None
        self._lrs: list = []
        self._generation = 0
        self._clean: Optional[list] = None
        if self.graphed:
            self._make_capturable()
        else:
            logger.info("GraphedOptimizer(%s): running eagerly (%s)", name, self.unavailable_reason)
        self.compile = compile
        # Built once, here: the warmup (which compiles) and the capture (which must only run what
        # was compiled) call this same object; graph_process keys on the bound _sequence, which
        # stays stable. The plain function is compiled, not a bound method, so that this object
        # holds no reference back to self (graph_process frees the graph when self dies).
        self._compiled_core = None
        if compile and self.graphed:
            self._compiled_core = torch.compile(type(self)._step_core, fullgraph=False, dynamic=False)
        elif compile:
            logger.info("GraphedOptimizer(%s): compile=True applies to the captured GPU step; without it "
                        "(%s) the step runs eagerly and uncompiled", name, self.unavailable_reason)
        self._hyper = self._hyperparameters()
        # What the captured step reads besides its arguments (optimizer state, the model
        # parameters master weights write to): checked before every replay (core.state).
        self._watch: Optional[StateWatch] = None
        self._watch_stale = True  # rebuild after the next step (state is created lazily by the first)
        if self.graphed:
            self._watch = self._state_watch()

    # ------------------------------------------------------------------ public
    @property
    def param_groups(self) -> list:
        """The wrapped optimizer's param groups."""
        return self.optimizer.param_groups

    def step(self) -> Optional[torch.Tensor]:
        """Clip, step and zero the gradients (one graph replay after the first call).

        Returns:
            The global gradient norm before clipping, as a 0-d device tensor, or ``None``
            without ``clip_grad_norm``. A graph output: read it before the next step.

        Raises:
            StateReplacedError: the optimizer's state (or, with master weights, a model
                parameter's storage) was replaced since the step was captured.
            RuntimeError: graphed, while a model is in a capacity mode whose drop counters each
                optimizer step must read (``on_overflow="raise"`` or ``"rerun"``, docs/moe.md).
        """
        self._refuse_undone()
        if self.graphed:
            refusal = checked_experts()
            if refusal is not None:
                raise RuntimeError(f"GraphedOptimizer: {refusal}; {UNCHECKED} Nothing was stepped.")
        if self.graphed and self._watch is not None:
            self._check_state()
        self._sync_hyperparameters()
        grads = [p.grad for p in self._grad_owners]
        if self.graphed:
            norm = graph_process(self._sequence, self._params, grads, self._generation)
            if self._watch_stale:
                self._watch, self._watch_stale = self._state_watch(), False
        else:
            norm = self._sequence(self._params, grads, self._generation)
        self._clean = [(g, g._version) for g in grads if g is not None]
        self._clean_writes = capture_for(self._runtime).grad_writes
        return norm

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradients in place; skipped when nothing wrote them since :meth:`step`.

        Raises:
            ValueError: ``set_to_none=True`` (new gradient tensors every step would force a
                re-capture every step).
        """
        if set_to_none:
            raise ValueError("GraphedOptimizer.zero_grad(set_to_none=True): gradients must keep their addresses "
                             "for the captured step; they are zeroed in place (step() already leaves them zero).")
        grads = [p.grad for p in self._grad_owners]
        if self._clean is not None and self._untouched(grads):
            return
        zero_grads_(grads)

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load into the wrapped optimizer and re-capture on the next step."""
        self.optimizer.load_state_dict(state_dict)
        if self.graphed:
            self._make_capturable()
            self._watch, self._watch_stale = self._state_watch(), True
        self._generation += 1
        self._hyper = self._hyperparameters()

    def _give_back(self) -> None:
        # GraphedOptimizer.undo: the capturable mode, lr and step counts as before construction.
        if self.graphed:
            undo_capturable(self.optimizer)
        self._compiled_core = None

    # ------------------------------------------------------------- the sequence
    def _sequence(self, params, grads, generation) -> Optional[torch.Tensor]:
        # params and generation are arguments only so that they join the graph's signature.
        # This part is never compiled: a raise inside a compiled region would break its graph.
        for g in grads:
            if g is not None and g.is_sparse:
                raise RuntimeError(
                    f"GraphedOptimizer({type(self.optimizer).__name__}): a gradient is sparse; sparse "
                    "gradients change their nonzero count every step and cannot be graphed. Use dense "
                    "gradients (e.g. nn.Embedding(sparse=False)) or step this optimizer eagerly.")
        if self._compiled_core is None:
            return self._step_core(grads)
        return self._compiled_core(self, grads)  # a capture refuses recompiles (TorchRuntime.capture_to_graph)

    def _step_core(self, grads) -> Optional[torch.Tensor]:
        # master-weight copy, clip, step, zero: what compile=True hands to torch.compile.
        if self.master_weights is not None:
            self.master_weights.grads_to_master_()
            step_grads = [m.grad for m in self.master_weights.master]
        else:
            step_grads = grads
        norm = None
        if self.clip_grad_norm is not None:
            norm = clip_by_global_norm(step_grads, self.clip_grad_norm, eps=self.eps)
        self.optimizer.step()
        if self.master_weights is not None:
            self.master_weights.master_to_params_()
        zero_grads_(grads)
        return norm

    # -------------------------------------------------------- hyperparameters
    def _make_capturable(self) -> None:
        self._lrs = make_capturable(self.optimizer)

    def _hyperparameters(self) -> list:
        # Values the capture freezes into the graph. lr is a device tensor read at replay;
        # initial_lr is the schedulers' bookkeeping. Tensors compare by identity (no host sync).
        return frozen_hyperparameters(self.optimizer)

    def _sync_hyperparameters(self) -> None:
        if self.graphed:
            for group, lr in zip(self.optimizer.param_groups, self._lrs):
                value = group["lr"]
                if value is not lr:  # a schedule or the user assigned a new value: move it into the tensor
                    lr.fill_(value)
                    group["lr"] = lr
        hyper = self._hyperparameters()
        if hyper != self._hyper:
            self._hyper = hyper
            self._generation += 1
            self._watch_stale = True

    def _state_watch(self) -> StateWatch:
        slots = optimizer_state_slots(self.optimizer, self._params)
        if self.master_weights is not None:
            held = dict(enumerate(self.master_weights.params))
            slots += [(held, i, f"model parameter {i} of master_weights") for i in held]
        return StateWatch(self._runtime, slots)

    def _check_state(self) -> None:
        what = self._watch.changed()
        if what is None:
            return
        fix = ("build a new MasterWeights and GraphedOptimizer for the new parameters"
               if what.startswith("model parameter") else
               "load optimizer state through GraphedOptimizer.load_state_dict (it re-captures), or change "
               "state tensors in place (copy_)")
        raise StateReplacedError(
            f"GraphedOptimizer({type(self.optimizer).__name__}): {what} since the step was captured; replaying "
            f"it would update the old memory, so the step is refused. To fix it, {fix}; loading into the "
            f"wrapped optimizer (opt.optimizer.load_state_dict) replaces its state behind the graph's back.")

    def _untouched(self, grads) -> bool:
        # Backward graphs that accumulate in-graph write .grad without bumping its version.
        if capture_for(self._runtime).grad_writes != self._clean_writes:
            return False
        present = [g for g in grads if g is not None]
        if len(present) != len(self._clean):
            return False
        return all(g is c and g._version == v for g, (c, v) in zip(present, self._clean))


class BeforeCapturable(weakref.WeakKeyDictionary):
    """Per optimizer :func:`make_capturable` changed: each param group's ("capturable" given, its
    value, lr) before, for :func:`undo_capturable` (a part of the process's torch section)."""


def _before_capturable() -> BeforeCapturable:
    return current_process().section("torch").part(BeforeCapturable)


def make_capturable(optimizer: torch.optim.Optimizer) -> list:
    """Switch every param group of ``optimizer`` to ``capturable=True`` and make its ``lr`` a 0-d
    fp32 tensor on the parameters' device (``torch.optim.lr_scheduler`` fills such a tensor in
    place, so a captured step reads each new value); move step counts kept on the CPU to the
    device. Returns the lr tensors, one per param group. Idempotent; :func:`undo_capturable`
    undoes it."""
    before = _before_capturable()
    if optimizer not in before:
        before[optimizer] = [("capturable" in g, g.get("capturable"), g["lr"]) for g in optimizer.param_groups]
    lrs = []
    for group in optimizer.param_groups:
        device = group["params"][0].device
        group["capturable"] = True
        lr = group["lr"]
        if not (isinstance(lr, torch.Tensor) and lr.device == device and lr.dtype == torch.float32):
            lr = torch.tensor(float(lr), dtype=torch.float32, device=device)
            group["lr"] = lr
        lrs.append(lr)
        for p in group["params"]:  # step counts taken eagerly before wrapping live on the CPU
            state = optimizer.state.get(p, {})
            step = state.get("step")
            if isinstance(step, torch.Tensor) and step.device != p.device:
                state["step"] = step.to(device=p.device, dtype=torch.float32)
    return lrs


def undo_capturable(optimizer: torch.optim.Optimizer) -> None:
    """Undo :func:`make_capturable`: each param group's ``capturable`` and ``lr`` as they were (an
    lr a schedule changed since keeps its new value, as a float), and the step counts of groups
    that are neither capturable nor fused back on the CPU, where such an optimizer keeps them.
    A no-op for an optimizer not made capturable."""
    before = _before_capturable().pop(optimizer, None)
    for group, (given, capturable, lr) in zip(optimizer.param_groups, before or ()):
        if given:
            group["capturable"] = capturable
        else:
            group.pop("capturable", None)
        now = group["lr"]
        if isinstance(now, torch.Tensor) and now is not lr:
            if isinstance(lr, torch.Tensor):
                group["lr"] = lr.copy_(now)
            else:  # the float as given while the schedule left it alone (the tensor holds it rounded to fp32)
                value = now.item()
                group["lr"] = lr if value == torch.tensor(float(lr), dtype=torch.float32).item() else value
        if group.get("capturable") or group.get("fused"):
            continue
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            step = state.get("step")
            if isinstance(step, torch.Tensor) and step.device.type != "cpu":
                state["step"] = step.cpu()


def optimizer_state_slots(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list:
    """``(holder, key, name)`` slots of what a captured step of ``optimizer`` reads besides
    its arguments: the state dict itself (``load_state_dict`` replaces it), each parameter's
    state entry and its tensors (:class:`paddle_graphpp.core.state.StateWatch`)."""
    state = optimizer.state
    slots = [(optimizer.__dict__, "state", "the optimizer's state (optimizer.state)")]
    for i, p in enumerate(params):
        entry = state.get(p)
        slots.append((state, p, f"the optimizer state of parameter {i}"))
        if entry is not None:
            slots += [(entry, key, f"optimizer state '{key}' of parameter {i}")
                      for key, value in entry.items() if isinstance(value, torch.Tensor)]
    return slots


def frozen_hyperparameters(optimizer: torch.optim.Optimizer) -> list:
    """Per param group, the values a capture of ``optimizer``'s step freezes into the graph: every
    entry but ``params``, ``lr`` (a device tensor the graph reads) and ``initial_lr`` (the
    schedulers' bookkeeping); tensors by identity (no host sync)."""
    return [{k: _frozen(v) for k, v in group.items() if k not in ("params", "lr", "initial_lr")}
            for group in optimizer.param_groups]


def _frozen(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    if isinstance(value, (tuple, list)):
        return tuple(_frozen(v) for v in value)
    return value


GRAPHED_OPTIMIZER = TorchGraphedOptimizer
