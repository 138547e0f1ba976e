"""The adjustments Paddle fleet's dygraph pipeline needs on CPU ranks (gloo), measured on Paddle
3.3.1's CPU wheel.

:func:`adjust_for_cpu`, after ``fleet.init`` (before it, it raises and changes nothing), sets the
device id fleet reads, turns batched p2p off, makes DualPipeV post its messages in an order gloo
accepts (tried at pp=2) and lets ``recompute_interval`` recompute on CPU (refusing offload and
partition); :func:`use_hop_groups` routes fleet's pipeline messages through one 2-rank gloo group
per hop where more than two stages need it. ``paddle_graphpp.PipelineLayer`` calls both; on a
build with a device both are no-ops (:func:`is_cpu_build`). What each works around:
docs/paddle.md#on-cpu-ranks.
"""

from __future__ import annotations

import functools
import threading

import paddle
import paddle.distributed as dist
from paddle.distributed import fleet
from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as _p2p

from ..core.process import current_process

__all__ = ["is_cpu_build", "adjust_for_cpu", "use_hop_groups", "pipe_backend"]


class HopGroups:
    """The pipeline's 2-rank groups and fleet's patched p2p in this process (a part of its paddle
    section)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.groups: dict = {}  # peer global rank -> 2-rank group holding this rank and the peer
        self.patched = False  # fleet's p2p goes through them (_install_patches)


def _hops() -> HopGroups:
    return current_process().section("paddle").part(HopGroups)


def is_cpu_build() -> bool:
    """True for a Paddle build with no CUDA, XPU or custom device support."""
    if paddle.is_compiled_with_cuda() or paddle.is_compiled_with_xpu():
        return False
    try:
        return not paddle.device.get_all_custom_device_type()
    except Exception:  # older builds without custom-device queries
        return True


def adjust_for_cpu() -> bool:
    """Make fleet's pipeline runnable on CPU ranks; a no-op (returning False) on device builds.

    Sets ``ParallelEnv._device_id`` to 0 where the build left it unset, turns
    ``pp_configs.use_batch_p2p_comm`` off in the strategy given to ``fleet.init``, and lets
    ``recompute_interval`` recompute on CPU (docs/paddle.md#on-cpu-ranks). Call it after
    ``fleet.init`` and before the model is wrapped (``fleet.distributed_model``). With
    PaddleFormers' ``Trainer``, ``TrainingArguments(...)`` is what calls ``fleet.init``: call this
    after it, before ``Trainer.train()``.

    Raises:
        RuntimeError: ``fleet.init`` has not been called yet (nothing is changed then).
    """
    return _adjust("paddle_graphpp.paddle.fleet_cpu.adjust_for_cpu()")


def _adjust(caller: str) -> bool:
    """:func:`adjust_for_cpu`, its error naming ``caller`` (the call the user made)."""
    if not is_cpu_build():
        return False
    from paddle.distributed.parallel import ParallelEnv

    strategy = getattr(fleet.fleet, "_user_defined_strategy", None)
    if strategy is None:
        raise RuntimeError(
            f"{caller} was called before fleet.init(is_collective=True, strategy=...): call it after "
            "fleet.init (with PaddleFormers' Trainer, after TrainingArguments(...), whose __post_init__ "
            "calls fleet.init) and before the model is wrapped by fleet.distributed_model or Trainer.train()")
    if not hasattr(ParallelEnv, "_device_id"):
        # A class-level default: instances made before and after this see 0.
        ParallelEnv._device_id = 0
    strategy.strategy.hybrid_configs.pp_configs.use_batch_p2p_comm = False
    _patch_dualpipev()
    _patch_recompute()
    return True


def _patch_recompute() -> None:
    """Make ``PipelineLayer``'s recompute groups run on CPU (docs/paddle.md#on-cpu-ranks)."""
    from paddle.distributed.fleet.meta_parallel.parallel_layers import pp_layers

    if getattr(pp_layers.recompute_hybrid, "_paddle_graphpp_cpu", False):
        return

    def recompute_hybrid_on_cpu(ctx, function, *args, **kwargs):
        from paddle.distributed.fleet.recompute.recompute import recompute

        if ctx.get("mp_group") is None:
            raise ValueError("recompute_ctx must hold an mp_group (fleet's recompute_hybrid asserts it too)")
        if ctx.get("offload", False) or ctx.get("partition", False):
            raise ValueError(
                "recompute_ctx offload=True or partition=True needs a device (it moves or splits activations "
                "there); set both to False on CPU ranks")
        return recompute(function, *args, preserve_rng_state=True, use_reentrant=False, **kwargs)

    recompute_hybrid_on_cpu._paddle_graphpp_cpu = True
    pp_layers.recompute_hybrid = recompute_hybrid_on_cpu


def _patch_dualpipev() -> None:
    """Make ``DualPipeVParallel`` exchange its messages with blocking gloo p2p (docs/paddle.md#on-cpu-ranks)."""
    try:
        from paddle.distributed.fleet.meta_parallel import dualpipev
    except ImportError:  # a Paddle without DualPipeV
        return
    cls = dualpipev.DualPipeVParallel
    if getattr(cls._commit_and_wait_comm, "_paddle_graphpp_cpu", False):
        return

    def commit_and_wait_on_cpu(self, p2p_overlap=False, use_outer_event_wait=False):
        me = dist.get_rank()

        def order(item):
            index, op = item
            sender, receiver = (me, op.peer) if op.op is dist.isend else (op.peer, me)
            return (min(sender, receiver), max(sender, receiver), sender > receiver, index)

        for ops in (self.comm_forward_ops, self.comm_backward_ops):
            requests = [op.op(op.tensor, op.peer, op.group) for _, op in sorted(enumerate(ops), key=order)]
            for request in requests:
                if request is not None:
                    request.wait()
        self.comm_forward_ops, self.comm_backward_ops = [], []
        self._free_tensors()
        return None  # no CUDA event to hand on (only overlapped forward-backward models read it)

    commit_and_wait_on_cpu._paddle_graphpp_cpu = True
    cls._commit_and_wait_comm = commit_and_wait_on_cpu


def pipe_backend(hcg) -> str:
    """The communication backend of the pipe group, lower case (``"gloo"``, ``"nccl"``, ...)."""
    group = hcg.get_pipe_parallel_group()
    backend = getattr(group, "backend", None)
    if backend is None:
        backend = "gloo" if is_cpu_build() else "nccl"
    return str(backend).lower()


def use_hop_groups(hcg) -> bool:
    """Route fleet's pipeline p2p through one 2-rank group per hop when gloo needs it.

    Needed only with gloo and more than two pipeline stages; returns whether it is in use.
    Every rank must call it, in the same order relative to other group creations
    (``PipelineLayer.__init__`` does, on every rank), because each group is created
    collectively.
    """
    if hcg.get_pipe_parallel_world_size() <= 2 or pipe_backend(hcg) != "gloo":
        return False
    me = dist.get_rank()
    hops = _hops()
    with hops.lock:
        if not hops.groups:
            for ranks in hcg.topology().get_comm_list("pipe"):
                seen = set()
                for idx, rank in enumerate(ranks):
                    peer = ranks[(idx + 1) % len(ranks)]
                    hop = tuple(sorted((rank, peer)))
                    if hop in seen:
                        continue
                    seen.add(hop)
                    group = dist.new_group(ranks=list(hop))
                    if me in hop:
                        hops.groups[hop[1] if hop[0] == me else hop[0]] = group
        _install_patches()
    return True


def _hop_group(peer: int):
    group = _hops().groups.get(peer)
    if group is None:
        raise RuntimeError(
            f"rank {dist.get_rank()} has no 2-rank pipeline group to rank {peer}; "
            "build paddle_graphpp.PipelineLayer on every rank before fleet.distributed_model"
        )
    return group


def _as_tuple(tensors):
    return tensors if isinstance(tensors, tuple) else (tensors,)


def _p2p_ops_per_hop(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, hcg):
    """Fleet's plain p2p step, each message on the 2-rank group of its hop.

    Keeps fleet's order (even stages send first, odd stages receive first), so that each
    pair of neighbours posts matching operations in the same order on their group.
    """
    prev_rank, next_rank = hcg._get_p2p_prev_rank(), hcg._get_p2p_next_rank()
    ops = [
        (dist.isend, tensor_send_next, next_rank),
        (dist.irecv, tensor_recv_prev, prev_rank),
        (dist.isend, tensor_send_prev, prev_rank),
        (dist.irecv, tensor_recv_next, next_rank),
    ]
    if hcg.get_stage_id() % 2 == 1:
        ops = [ops[1], ops[0], ops[3], ops[2]]
    reqs = []
    for func, tensors, peer in ops:
        if tensors is None:
            continue
        for tensor in _as_tuple(tensors):
            reqs.append(func(tensor, peer, _hop_group(peer)))
    return reqs


def _meta_on_hop(method, peer_of):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        # send_meta(tensor, group, reverse=False, broadcast=False) / recv_meta(group, reverse=False, broadcast=False)
        names = ("tensor", "group", "reverse", "broadcast") if method.__name__ == "send_meta" else (
            "group", "reverse", "broadcast")
        bound = dict(zip(names, args), **kwargs)
        if not bound.get("broadcast", False):
            bound["group"] = _hop_group(peer_of(bool(bound.get("reverse", False))))
        return method(self, **bound)

    wrapper._paddle_graphpp_hop = True
    return wrapper


def _install_patches() -> None:
    hops = _hops()
    if hops.patched:
        return
    hcg = lambda: _p2p._hcg  # noqa: E731  (set by fleet when the PipelineParallel is built)
    meta = _p2p.SendRecvMeta
    meta.send_meta = _meta_on_hop(meta.send_meta, lambda rev: hcg()._get_p2p_prev_rank() if rev
                                  else hcg()._get_p2p_next_rank())
    meta.recv_meta = _meta_on_hop(meta.recv_meta, lambda rev: hcg()._get_p2p_next_rank() if rev
                                  else hcg()._get_p2p_prev_rank())
    _p2p._p2p_ops = _p2p_ops_per_hop
    hops.patched = True
