"""Fleet's ``recompute_interval`` in a graphed pipeline model: the graphed runs recompute.

:func:`in_groups` rebuilds a chunk's graphed entry list (its graphed runs already cut at fleet's
group boundaries by :func:`paddle_graphpp.core.segment.cut_runs`) so that every entry is called
once per micro-batch forward, in order, and sets fleet's ``_recompute_interval`` to 0
(``GraphedPipeline.eager_view`` shows fleet's value). Each group becomes a :class:`RecomputeGroup`
whose first entry takes fleet's decision on the group's input: a graphed run of a recomputing
group recomputes inside its own backward graph, and each stretch of its eager entries
(:class:`EagerPart`) runs under fleet's ``recompute_hybrid``. The same layers recompute as without
graphs. Why fleet's own grouping cannot run graphed runs: docs/paddle.md#recompute.
"""

from __future__ import annotations

import paddle
from paddle import nn

__all__ = ["RecomputeGroup", "EagerPart", "in_groups"]


def _inputs(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


class RecomputeGroup:
    """One group of fleet's recompute groups, as the graphed entries that make it up see it."""

    def __init__(self, model, funcs: list):
        self.model = model
        self.funcs = funcs  # the group's entries as fleet keeps them (eager_view)
        self.active = False

    def enter(self, x) -> bool:
        """Fleet's decision for this micro-batch, on the group's input ``x`` (its first entry's)."""
        self.active = bool(self.model._need_recompute(self.funcs, _inputs(x)))
        return self.active


class EagerPart:
    """Consecutive eager entries of one recompute group: under fleet's ``recompute_hybrid`` when
    the group recomputes and their input needs a gradient, else one after the other. Not an
    ``nn.Layer``: the entries stay registered where fleet put them."""

    def __init__(self, group: RecomputeGroup, entries: list, opens: bool):
        self.group = group
        self.entries = entries
        self.opens = opens  # the group's first entry: it takes fleet's decision

    def __call__(self, x):
        active = self.group.enter(x) if self.opens else self.group.active
        inputs = _inputs(x)
        if active and any(paddle.is_tensor(t) and not t.stop_gradient for t in inputs):
            from paddle.distributed.fleet.meta_parallel.parallel_layers import pp_layers

            # looked up at each call: fleet_cpu's CPU adjustment replaces it on CPU ranks
            return pp_layers.recompute_hybrid(self.group.model.recompute_ctx, self._run, *inputs)
        return self._run(*inputs)

    def _run(self, *x):
        x = x[0] if len(x) == 1 else x
        for entry in self.entries:
            x = entry(x)
        return x

    def __repr__(self):
        return f"EagerPart({', '.join(_name(e) for e in self.entries)})"


def _name(entry) -> str:
    if isinstance(entry, nn.Layer):
        return type(entry).__name__
    target = getattr(entry, "func", entry)  # functools.partial: its function
    return getattr(target, "__name__", None) or type(target).__name__


def in_groups(model, runs: list, entries: list, start: int, interval: int) -> list:
    """The entries of one chunk, regrouped for ``recompute_interval``.

    Args:
        model: the fleet pipeline model.
        runs: the chunk's runs (``core.segment.Run``), cut at the group boundaries.
        entries: one per run, in order: a graphed run's call (it gets ``group`` and ``opens``
            set here) or an eager run's own entry.
        start: the chunk's first layer index (the runs' entries count from it).
        interval: ``recompute_interval`` (> 0).

    Returns:
        the chunk's new entry list (graphed runs' calls and :class:`EagerPart` objects).
    """
    members: dict = {}  # group number -> [(run, entry)], in the chunk's order
    for run, entry in zip(runs, entries):
        members.setdefault((run.start - start) // interval, []).append((run, entry))
    out: list = []
    for pairs in members.values():
        group = RecomputeGroup(model, [obj for run, _ in pairs for obj in run.objects()])
        parts: list = []  # graphed calls, and lists of consecutive eager entries
        for run, entry in pairs:
            if run.graphed:
                parts.append(entry)
            elif parts and isinstance(parts[-1], list):
                parts[-1].append(entry)
            else:
                parts.append([entry])
        for i, part in enumerate(parts):
            if isinstance(part, list):
                out.append(EagerPart(group, part, opens=i == 0))
            else:
                part.group, part.opens = group, i == 0
                out.append(part)
    return out
