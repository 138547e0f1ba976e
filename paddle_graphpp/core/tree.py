"""Flatten nested call arguments and results into a list of leaves, and back.

Graphs see flat lists of tensors; users pass and return tuples, lists and dicts of them.
Containers handled: tuple (named tuples too), list, dict. Anything else is a leaf.
"""

from __future__ import annotations

from typing import Any

__all__ = ["flatten", "unflatten"]

# A spec is a small tree of tuples, hashable (a signature key holds it): ("leaf",),
# ("tuple", type, (specs)), ("list", None, (specs)), ("dict", keys, (specs)).
_LEAF = ("leaf",)


def flatten(obj: Any) -> tuple[list, Any]:
    """Leaves of ``obj`` in a fixed order, and the spec to rebuild it with :func:`unflatten`."""
    leaves: list = []
    spec = _flatten(obj, leaves)
    return leaves, spec


_CONTAINERS = (tuple, list, dict)


def _flatten(obj, leaves):
    if isinstance(obj, tuple):
        head, items = ("tuple", type(obj)), obj
    elif isinstance(obj, list):
        head, items = ("list", None), obj
    elif isinstance(obj, dict):
        keys = tuple(obj)
        head, items = ("dict", keys), [obj[k] for k in keys]  # as the mapping hands each out
    else:
        leaves.append(obj)
        return _LEAF
    specs = []
    for x in items:  # leaves without a call each: every graphed call flattens its arguments
        if isinstance(x, _CONTAINERS):
            specs.append(_flatten(x, leaves))
        else:
            leaves.append(x)
            specs.append(_LEAF)
    return (*head, tuple(specs))


def unflatten(spec: Any, leaves: list) -> Any:
    """Inverse of :func:`flatten`: rebuild the structure from ``leaves`` (consumed in order)."""
    it = iter(leaves)
    out = _unflatten(spec, it)
    return out


def _unflatten(spec, it):
    kind = spec[0]
    if kind == "leaf":
        return next(it)
    children = [next(it) if s is _LEAF else _unflatten(s, it) for s in spec[2]]
    if kind == "list":
        return children
    if kind == "dict":
        return dict(zip(spec[1], children))
    tuple_type = spec[1]
    if tuple_type is tuple:
        return tuple(children)
    if hasattr(tuple_type, "_fields"):  # named tuple
        return tuple_type(*children)
    return tuple_type(children)
