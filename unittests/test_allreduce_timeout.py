"""The custom all-reduce's own timeout, on CPU: which timeout a group gets (argument, flag, half
the group's), the refusal of bad values, the error text, and the push kernel built for a Hopper
GPU with its bounded wait (Triton compiles it without a device). That the kernel gives up on a
GPU is ``unittests/gpu/test_allreduce_timeout_gpu.py``; a killed peer on two GPUs is
``unittests/gpu/test_dead_peer_gpu.py``."""
import datetime

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from paddle_graphpp.torch.collectives import allreduce as AR  # noqa: E402


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=90))
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_the_timeout_is_the_argument_else_the_flag_else_half_the_groups(group, monkeypatch):
    monkeypatch.delenv("FLAGS_graphpp_allreduce_timeout", raising=False)
    assert AR.allreduce_timeout(group, None) == 45.0  # before the replay watchdog's 90 s
    assert AR.allreduce_timeout(group, 7) == 7.0
    assert AR.allreduce_timeout(group, 0) is None  # waits for ever
    monkeypatch.setenv("FLAGS_graphpp_allreduce_timeout", "12.5")
    assert AR.allreduce_timeout(group, None) == 12.5
    assert AR.allreduce_timeout(group, 3) == 3.0
    monkeypatch.setenv("FLAGS_graphpp_allreduce_timeout", "0")
    assert AR.allreduce_timeout(group, None) is None
    monkeypatch.setenv("FLAGS_graphpp_allreduce_timeout", "inf")
    assert AR.allreduce_timeout(group, None) is None


@pytest.mark.parametrize("bad", [-1, "soon", float("nan")])
def test_a_bad_timeout_is_refused_naming_where_it_came_from(group, monkeypatch, bad):
    monkeypatch.delenv("FLAGS_graphpp_allreduce_timeout", raising=False)
    with pytest.raises(ValueError, match=r"create_allreduce\(timeout\)=.*the all-reduce timeout.*seconds"):
        AR.allreduce_timeout(group, bad)
    monkeypatch.setenv("FLAGS_graphpp_allreduce_timeout", str(bad))
    with pytest.raises(ValueError, match="FLAGS_graphpp_allreduce_timeout=.*seconds"):
        AR.allreduce_timeout(group, None)
    with pytest.raises(ValueError, match="FLAGS_graphpp_allreduce_timeout"):
        AR.create_allreduce(group)  # refused before anything collective happens


def test_without_cuda_the_backend_has_no_kernel_and_no_fault(group, monkeypatch):
    monkeypatch.delenv("FLAGS_graphpp_allreduce_timeout", raising=False)
    ar = AR.create_allreduce(group, timeout=4)
    assert ar.backend.timeout == 4.0 and ar.backend.fault() is None
    t = torch.ones(3)
    assert torch.equal(ar.all_reduce(t), torch.ones(3))  # one rank: the framework's all-reduce


def test_the_error_names_the_peer_the_timeout_and_what_to_do(group):
    text = AR._gave_up_text(group, 2, 1, 3.0)
    assert "waited 3 s for rank 1 and gave up" in text
    assert "rank 1's log" in text and "FLAGS_graphpp_allreduce_timeout" in text and "not valid" in text


def test_the_push_kernel_refuses_a_negative_timeout():
    pytest.importorskip("triton")
    from paddle_graphpp.torch.collectives.push_allreduce import PushAllReduce

    with pytest.raises(ValueError, match="timeout must be >= 0 seconds"):
        PushAllReduce(None, None, 0, 2, timeout=-1.0)


@pytest.mark.parametrize("rank,world", [(0, 2), (3, 4)])
def test_the_push_kernel_builds_for_hopper_with_a_timed_wait(rank, world):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from paddle_graphpp.torch.collectives import push_allreduce as P

    kernel = P._push_all_reduce
    constants = {"RANK": rank, "WORLD": world, "NBLK": P.MAX_BLOCKS, "SUB": P.SUB, "MASK": P.EPOCH_MASK,
                 "STATUS_AFTER_NS": P.STATUS_AFTER_NS, "THREADS": 32 * P.NUM_WARPS}
    kinds = {"inp": "*bf16", "out": "*bf16", "counters": "*i32", "gave_up": "*i32", "status": "*i32", "n": "i32",
             "chunk": "i32", "timeout_ms": "i32", **{f"r{i}": "*bf16" for i in range(8)}, **{f"f{i}": "*i32" for i in range(8)}}
    signature = {name: "constexpr" if name in constants else kinds[name] for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, constants, attrs={}), target=GPUTarget("cuda", 90, 32))
    ptx = compiled.asm["ptx"]
    assert compiled.asm["cubin"] and compiled.metadata.num_warps == 4
    # the timer is read before and inside each peer's wait
    assert ptx.count("%globaltimer") >= 2 * (world - 1)
