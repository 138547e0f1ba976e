"""One rank of a torch.distributed.pipelining run, started by unittests/test_torch_pipeline.py.

Runs as ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` say (gloo on CPU). It trains a
small stage model (blocks of the trainer's GPT, testing/gpt_torch.py) twice from the same seeds,
once with plain stage modules and once with ``graph_stage_module``, through the schedule
``--schedule`` names (``Schedule1F1B`` or ``ScheduleInterleaved1F1B`` by ``--vpp`` when not
given; the zero-bubble ones: ``interleaved_zb``, ``zbv``, ``dualpipev``), and writes
``rank<N>.json`` into ``--out``: the per-step losses of both runs (the rank holding the last
stage), every parameter's gradient after each step's schedule, and, per graphed run, the
engine's capture/replay counts.

``--device cuda`` runs on one GPU per rank with NCCL (fp32, TF32 off), so graphs are captured
and replayed for real: unittests/gpu/test_zero_bubble_gpu.py.

``--runtime fake`` plugs the fake graph runtime (unittests/fake_runtime.py) into
``CUDAGraphedModule``: capture and replay then only do bookkeeping (replayed values are stale),
which checks that the schedule's forward/backward order pairs up in every graphed run's FIFO.

Two faults a real run meets, in both runs alike: ``--shorten-at S`` trains from step ``S`` on
with sequences half as long (new stages and schedule around the same modules: every graphed run
sees a new signature); ``--fail-capture-rank R`` puts a layer that fails while being captured
(as a host sync would) into rank ``R``'s chunks, and builds the graphed stages with
``fallback="eager"``: that run turns eager and training goes on.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]

import torch  # noqa: E402
from workers.torch_ranks import run_rank  # noqa: E402
from torch import nn  # noqa: E402
import torch.distributed.pipelining as pipelining  # noqa: E402
from torch.distributed.pipelining import PipelineStage  # noqa: E402

import paddle_graphpp  # noqa: E402
from paddle_graphpp.torch.pipeline import graph_stage_module  # noqa: E402
from testing.gpt_torch import Block, GPTShape  # noqa: E402

WIDTH, MBS, SEQ = 16, 2, 4
SHAPE = GPTShape(hidden=WIDTH, heads=2, vocab=1, seq_len=SEQ, layers=3, dropout=0.1)


class Probe(nn.Module):
    """Syncs with the host, so it must stay out of graphs: marked below."""

    def forward(self, x):
        self.seen = float(x.sum().item())
        return x


def scale(x):  # a plain callable entry
    return x * 0.5


class FailsInCapture(nn.Module):
    """The identity, except while the graphed runtime captures it: then it fails as a host sync
    inside a capture does."""

    def forward(self, x):
        from paddle_graphpp.torch.runtime import active_runtime  # the real one, or the fake one set below

        if active_runtime().is_capturing():
            raise RuntimeError("FailsInCapture: a host sync inside the capture (injected by the test)")
        return x


def build_chunk(chunk, num_chunks, seed, fail_capture=False):
    torch.manual_seed(seed + chunk)
    entries = []
    if chunk == 0:
        entries.append(nn.Linear(WIDTH, WIDTH))
    entries += [Block(SHAPE), Block(SHAPE), scale, paddle_graphpp.mark_not_capturable(Probe()), Block(SHAPE)]
    if fail_capture:
        entries.insert(-1, FailsInCapture())  # in the last run of capturable layers
    if chunk == num_chunks - 1:
        entries.append(nn.Linear(WIDTH, 1))
    return entries


SCHEDULES = {  # name -> (class name, stages per rank, V-shaped placement)
    "1f1b": ("Schedule1F1B", 1, False),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, False),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", 2, False),
    "zbv": ("ScheduleZBVZeroBubble", 2, True),
    "dualpipev": ("ScheduleDualPipeV", 2, True),
}


def train(args, rank, world, graphed):
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", rank)) if args.device == "cuda" else None)
    cls_name, per_rank, v_shape = SCHEDULES[args.schedule]
    num_chunks = world * per_rank
    stage_ids = [rank, num_chunks - 1 - rank] if v_shape else [rank + k * world for k in range(per_rank)]
    modules, entry_params = {}, []
    fallback = "eager" if args.fail_capture_rank >= 0 else "error"
    for s in stage_ids:
        entries = build_chunk(s, num_chunks, args.seed, fail_capture=rank == args.fail_capture_rank)
        for e in entries:
            if isinstance(e, nn.Module):
                e.to(device)
        modules[s] = (graph_stage_module(entries, 2, memory=args.memory, name=f"chunk{s}", fallback=fallback)
                      if graphed else _Plain(entries))
        entry_params += [(f"chunk{s}.{i}.{n}", p) for i, e in enumerate(entries) if isinstance(e, nn.Module)
                         for n, p in e.named_parameters()]
    loss_fn = nn.MSELoss()
    cls = getattr(pipelining, cls_name)

    def make_schedule(seq):  # stages and schedule for one sequence length, around the same modules
        stages = []
        for s in stage_ids:
            x = torch.empty(MBS, seq, WIDTH, device=device, requires_grad=s > 0)
            y = torch.empty(MBS, seq, 1 if s == num_chunks - 1 else WIDTH, device=device, requires_grad=True)
            stages.append(PipelineStage(modules[s], s, num_chunks, device, input_args=(x,), output_args=(y,)))
        return cls(stages[0] if per_rank == 1 else stages, n_microbatches=args.micro_batches, loss_fn=loss_fn)

    schedule, seq = make_schedule(SEQ), SEQ
    has_first, has_last = 0 in stage_ids, num_chunks - 1 in stage_ids
    params = [p for m in modules.values() for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.05)
    data = torch.Generator().manual_seed(args.seed)
    losses, grads = [], []
    graphs_before_shorten = {}  # id(graphed run) -> its graph count when the sequences shorten
    for step in range(args.steps):
        if step == args.shorten_at:
            if graphed:
                graphs_before_shorten = {id(g): g.engine.graph_count() for m in modules.values()
                                         for g in m.graphed_modules}
            schedule, seq = make_schedule(SEQ // 2), SEQ // 2
        torch.manual_seed(args.seed * 7 + rank + 1000 * step)  # the dropout stream, the same in both runs
        x = torch.randn(args.micro_batches * MBS, seq, WIDTH, generator=data).to(device)
        y = x.sum(-1, keepdim=True).tanh()
        step_losses = [] if has_last else None
        opt.zero_grad()
        schedule.step(*((x,) if has_first else ()), target=y if has_last else None, losses=step_losses)
        grads.append({name: None if p.grad is None else p.grad.flatten().tolist() for name, p in entry_params})
        opt.step()
        if step_losses is not None:
            losses.append([v.item() for v in step_losses])
    stats = []
    if graphed:
        for s in stage_ids:
            for g in modules[s].graphed_modules:
                stats.append({"chunk": s, "captures": g.engine.captures, "replays": g.engine.replays,
                              "in_flight": g.engine.in_flight, "graphs": g.engine.graph_count(),
                              "positions": g.engine.position_kinds(),
                              "graphs_before_shorten": graphs_before_shorten.get(id(g))})
    runs = {s: modules[s].describe() for s in stage_ids} if graphed else {}
    return {"losses": losses, "grads": grads, "graphed_runs": stats, "segmentation": runs}


class _Plain(nn.Module):
    def __init__(self, entries):
        super().__init__()
        self.entries = entries
        self.mods = nn.ModuleList([e for e in entries if isinstance(e, nn.Module)])

    def forward(self, x):
        for e in self.entries:
            x = e(x)
        return x


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--vpp", type=int, default=1)
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default=None)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--runtime", choices=["real", "fake"], default="real")
    parser.add_argument("--memory", default="shared")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shorten-at", type=int, default=-1, help="from this step on, half-length sequences")
    parser.add_argument("--fail-capture-rank", type=int, default=-1,
                        help="this rank's chunks hold a layer whose capture fails (fallback='eager')")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.schedule is None:
        args.schedule = "1f1b" if args.vpp == 1 else "interleaved_1f1b"
    if not hasattr(pipelining, SCHEDULES[args.schedule][0]):
        print(f"this torch has no {SCHEDULES[args.schedule][0]}", file=sys.stderr)
        os._exit(3)
    def body(rank, world):
        result = {"rank": rank, "eager": train(args, rank, world, graphed=False)}
        if args.runtime == "fake":
            from fake_runtime import FakeGraphRuntime
            from paddle_graphpp.core.runtime import register_runtime

            register_runtime("torch", FakeGraphRuntime)  # what the graphed modules built from here use
        result["graphed"] = train(args, rank, world, graphed=True)
        return result

    run_rank(args.device, args.out, body)

if __name__ == "__main__":
    main()
