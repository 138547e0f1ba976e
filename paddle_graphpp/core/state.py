"""Replay-time check that the tensors a graph was captured against are still the ones in use.

A graph works on parameters, buffers and optimizer state in place, at fixed addresses. A tensor
given new storage after the capture (``param.data = w``, a dtype round trip, a loader that assigns
new tensors, ``optimizer.load_state_dict`` behind a graphed optimizer) would leave the graph on the
old memory. :class:`StateWatch` notes at capture where each such tensor was held and its storage
address; :meth:`StateWatch.changed` compares both before a replay and says what changed, and its
callers raise :class:`~paddle_graphpp.core.errors.StateReplacedError` (in-place changes pass).
Graphed layers check once per layer and step (:class:`LayerStateCheck`),
:class:`~paddle_graphpp.GraphedOptimizer` once per step; the cost per tensor: docs/failures.md.
"""

from __future__ import annotations

import operator
from typing import Any, Hashable, Optional, Sequence

from .errors import StateReplacedError
from .runtime import capabilities

__all__ = ["StateWatch", "LayerStateCheck", "module_state_slots"]


class StateWatch:
    """Where the tensors (or containers of tensors) a capture read were held, and their
    addresses then.

    Args:
        runtime: the framework's :class:`~paddle_graphpp.core.runtime.GraphRuntime`
            with :class:`~paddle_graphpp.core.runtime.StateSlots`
            (:meth:`~paddle_graphpp.core.runtime.StateSlots.storage_addresses`).
        slots: ``(holder, key, name)`` triples: ``holder[key]`` is the object the graph read,
            ``holder`` a ``dict`` (or a subclass: a module's ``OrderedDict``, an optimizer's
            ``defaultdict``, read without creating entries) and ``name`` describes it in
            messages (``"parameter 'fc.weight'"``). Tensors are checked for identity and
            address, other objects (a state dict) for identity.
    """

    __slots__ = ("_runtime", "_holders", "_keys", "_names", "_objects", "_tensors", "_tensor_index",
                 "_addresses")

    def __init__(self, runtime: Any, slots: Sequence[tuple[dict, Hashable, str]]):
        self._runtime = runtime
        self._holders = tuple(h for h, _, _ in slots)
        self._keys = tuple(k for _, k, _ in slots)
        self._names = tuple(n for _, _, n in slots)
        self._objects = tuple(h.get(k) for h, k, _ in slots)
        self._tensor_index = tuple(i for i, o in enumerate(self._objects) if runtime.is_tensor(o))
        self._tensors = [self._objects[i] for i in self._tensor_index]
        self._addresses = runtime.storage_addresses(self._tensors)

    def __len__(self) -> int:
        return len(self._objects)

    def changed(self) -> Optional[str]:
        """``None`` when every slot still holds its object at its address; else what changed
        (the first slot, in slot order, that did), as a phrase naming it."""
        if not all(map(operator.is_, map(dict.get, self._holders, self._keys), self._objects)) \
                or self._runtime.storage_addresses(self._tensors) != self._addresses:
            return self._describe()
        return None

    def _describe(self) -> str:
        moved = dict(zip(self._tensor_index, zip(self._addresses, self._runtime.storage_addresses(self._tensors))))
        for i, (holder, key, name) in enumerate(zip(self._holders, self._keys, self._names)):
            now = holder.get(key)
            if now is None and self._objects[i] is not None:
                return f"{name} was removed"
            if now is not self._objects[i]:
                return f"{name} was replaced by another object (a new assignment to the attribute or entry)"
            if i in moved and moved[i][0] != moved[i][1]:
                return (f"{name} was given new storage (address {moved[i][0]:#x} -> {moved[i][1]:#x}: an "
                        f"assignment to .data, a dtype or device round trip such as "
                        f"module.to(torch.float64).to(torch.float32), or a loader that rebinds tensors)")
        return "a tensor was replaced"


def module_state_slots(named_modules) -> list:
    """``(holder, key, name)`` of every parameter and buffer of the modules ``named_modules``
    yields as ``(prefix, module)`` pairs. PyTorch modules and Paddle layers both keep them in
    ``_parameters`` and ``_buffers`` dicts, which are the holders: rebinding an attribute
    (``module.weight = new``) replaces the entry there."""
    slots = []
    for prefix, module in named_modules:
        for kind, holder in (("parameter", module._parameters), ("buffer", module._buffers)):
            for key, tensor in holder.items():
                if tensor is not None:
                    slots.append((holder, key, f"{kind} '{prefix}.{key}'" if prefix else f"{kind} '{key}'"))
    return slots


class LayerStateCheck:
    """The replay-time check of one graphed layer: its graphs refuse to replay once a parameter
    or buffer they read was replaced.

    One watch serves every position captured while nothing was replaced, so one check per
    step (episode) covers them all; a capture after a replacement gets a new watch.
    """

    def __init__(self, runtime: Any, layer: Any, name: str):
        self.runtime = runtime
        self.layer = layer  # what StateSlots.state_slots reads (the wrapped module or layer)
        self.name = name
        self._watch: Optional[StateWatch] = None  # parameters and buffers as the newest capture read them
        self._checked: dict = {}  # per kind of replay: (episode, watch) last found unchanged

    def watch(self) -> Optional[StateWatch]:
        """The watch a new capture records: the current one while nothing was replaced, else a new one."""
        watch = self._watch
        if watch is None or watch.changed() is not None:
            state = capabilities(self.runtime).state  # a runtime without StateSlots checks nothing
            slots = state.state_slots(self.layer) if state is not None else []
            watch = self._watch = StateWatch(self.runtime, slots) if slots else None
        return watch

    def check(self, watch: StateWatch, episode: int, kind: str = "forward") -> None:
        """Raise :class:`~paddle_graphpp.StateReplacedError` when ``watch`` saw a replacement.
        Checked once per episode, watch and ``kind`` of replay (``"forward"``, ``"backward"``:
        a hook that swaps parameters between a forward and its backward, as FSDP2 does, must
        put back the same memory): replacing a parameter between the micro-batches of one step
        is not something a training loop does."""
        checked = self._checked.get(kind)
        if checked is not None and checked[0] == episode and checked[1] is watch:
            return
        what = watch.changed()
        if what is not None:
            raise StateReplacedError(
                f"{self.name}: {what} since its CUDA graphs were captured; replaying them would compute with "
                f"the old memory, so the layer refuses to. Change parameters and buffers in place "
                f"(module.load_state_dict(...) without assign=True, param.copy_(...) under no_grad) rather than "
                f"assigning new tensors or storage. If the replacement is meant (a dtype round trip, a checkpoint "
                f"loader that rebinds tensors), call paddle_graphpp.reset_graphs(model) between steps: it makes "
                f"every graphed layer of the model forget its graphs and capture them anew, against the new "
                f"tensors, after warmup.")
        self._checked[kind] = (episode, watch)

    def reset(self) -> None:
        self._watch = None
        self._checked = {}
