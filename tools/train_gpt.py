#!/usr/bin/env python
"""Train a small GPT with pipeline parallelism, eagerly or with CUDA graphs.

The demo and benchmark driver of paddle_graphpp. With no arguments it trains a tiny GPT with
Paddle fleet on two CPU ranks (gloo) for a few steps and finishes in well under a minute::

    python tools/train_gpt.py                                   # Paddle, pp=2, 1F1B
    python tools/train_gpt.py --framework torch --pp 2 --vpp 2  # torch.distributed.pipelining
    python tools/train_gpt.py --framework torch --cudagraph --hidden 512 --layers 12 \\
        --micro-batch-size 4 --seq-len 256 --micro-batches 8 --steps 50   # on 2 GPUs

Model: token + position embeddings whose token table is tied to the output head, N pre-norm
transformer blocks with dropout, and a cross-entropy loss. The tie crosses stages: Paddle
declares it with ``SharedLayerDesc`` (fleet syncs the gradient); PyTorch keeps one copy of
the weight on the first and one on the last stage and sums their gradients after each step.
With ``--cudagraph`` each stage's blocks are captured as CUDA graphs (``paddle_graphpp.
PipelineLayer(use_cudagraph=True)`` / ``paddle_graphpp.torch.pipeline.graph_stage_module``);
Paddle keeps the tied (``SharedLayerDesc``) layers eager, PyTorch graphs them with the blocks.
With ``--compile`` (PyTorch) each stage module and the loss run through ``torch.compile``
(Inductor); with ``--cudagraph`` too, the compiled kernels are what the graphs capture
(``graph_stage_module(..., compile=True)``, ``graph_loss(..., compile=True)``).
``--lr-warmup N`` ramps the learning rate up linearly over the first N steps.
On CPU the graphed layers run eagerly. On GPUs the torch path uses
NCCL (with ``NCCL_NVLS_ENABLE=0``) and TF32 matmuls, one GPU per rank; the paddle path needs a
Paddle build with CUDA for graphs.

Launching: run it directly and it starts one process per pipeline rank itself (through
``paddle.distributed.launch`` for Paddle); it also runs under ``python -m
paddle.distributed.launch`` and ``torchrun`` with ``--nproc_per_node`` equal to ``--pp``.

Output: one line per step with the loss (a progress bar instead on long runs in a terminal),
and as the LAST line one JSON object: framework, pp, vpp, cudagraph, steps, loss_first,
loss_last, tokens_per_s, peak_mem_mib, device, plus the rest of the configuration.
"""

from __future__ import annotations

import argparse
from typing import Optional
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, REPO)
from testing import launch  # noqa: E402

# Eager micro-batches each graphed run sees before it captures (the engine's default).
NUM_WARMUP_STEPS = 3
# Extra untimed steps of a --compile run. Dynamo compiles at a module's first call and AOTAutograd
# the backward at its first backward, both in step 0 (on CPU every compile falls there); the
# margin keeps a recompile in step 1 or 2 (a guard failing once the engine records its step on
# static buffers) out of the timing. The JSON line's per-rank compile_steps shows where they fell.
COMPILE_SETTLE_STEPS = 2
# --compile BACKEND: Inductor (the default), or dynamo + AOTAutograd without Inductor (fast, eager numerics)
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
# --schedule -> (torch.distributed.pipelining class, chunks placed in a V)
SCHEDULES = {
    "1f1b": (None, False),  # Schedule1F1B, or ScheduleInterleaved1F1B with --vpp > 1
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", False),
    "zbv": ("ScheduleZBVZeroBubble", True),
    "dualpipev": ("ScheduleDualPipeV", True),
}
VOCAB_SIZE = 256  # byte-level tokens: any text file works without a tokenizer
# When the run started (seconds since the epoch): the step lines count from it. The process that
# starts the ranks hands its own start to them, so the time includes the ranks' start-up.
STARTED_ENV = "TRAIN_GPT_STARTED"
STARTED = float(os.environ.get(STARTED_ENV, time.time()))
# Notes that Paddle's import and the launcher print on every machine without ccache or with
# setuptools' distutils shim; they say nothing about this run (PYTHONWARNINGS syntax).
QUIET_WARNINGS = ("ignore:No ccache found", "ignore:Setuptools is replacing distutils")


class ConfigError(ValueError):
    """A configuration that cannot work; the message says which flag to change."""


# ----------------------------------------------------------------------------- configuration
@dataclass(kw_only=True)
class Config:
    """What to train and how; one field per command-line flag."""

    framework: str = "paddle"
    """``paddle`` (fleet PipelineParallel) or ``torch`` (torch.distributed.pipelining)."""
    pp: int = 2
    """Pipeline stages."""
    tp: int = 1
    """Tensor-parallel ranks per stage (PyTorch): each block's heads and MLP split over them;
    ``tp * pp`` processes in all, the ranks of one stage adjacent (one GPU each)."""
    vpp: int = 1
    """Virtual chunks per process; > 1 selects the interleaved 1F1B schedule (with ``--schedule
    1f1b``)."""
    schedule: str = "1f1b"
    """PyTorch pipeline schedule: ``1f1b`` (``Schedule1F1B``, or ``ScheduleInterleaved1F1B``
    with ``--vpp`` > 1), or a zero-bubble one, whose backward runs as an input pass and a
    deferred weight pass: ``interleaved_zb`` (``ScheduleInterleavedZeroBubble``, ``--vpp`` 2
    or more), ``zbv`` (``ScheduleZBVZeroBubble``) or ``dualpipev`` (``ScheduleDualPipeV``);
    the last two place ``--vpp 2`` chunks per rank in a V (rank r holds chunks r and
    2*pp-1-r, so the first rank also holds the last chunk and computes the loss)."""
    micro_batches: int = 4
    """Micro-batches per step (gradient accumulation steps)."""
    micro_batch_size: int = 4
    """Sequences per micro-batch."""
    seq_len: int = 64
    """Tokens per sequence; every batch has exactly this length (graphs need fixed shapes)."""
    hidden: int = 64
    """Model width."""
    heads: int = 0
    """Attention heads; 0 for heads of 64 channels (one head below 64)."""
    vocab: int = 256
    """Token table rows (tied to the head); the data are byte tokens, so 256 covers them."""
    attention: str = "explicit"
    """``explicit`` (deterministic, bit-comparable) or ``sdpa`` (flash kernels on the GPU)."""
    dtype: str = "float32"
    """Parameter and activation dtype of the torch model: ``float32`` or ``bfloat16``."""
    layers: int = 4
    """Transformer blocks, split evenly over pp * vpp chunks."""
    steps: int = 8
    """Optimizer steps."""
    cudagraph: bool = False
    """Capture each stage's blocks as CUDA graphs (eager on CPU)."""
    seed: int = 1234
    """Seeds weights, data order and dropout; the same seed gives the same run."""
    data: str = ""
    """A text file to train on (bytes are tokens); empty for the built-in synthetic corpus."""
    dropout: float = 0.1
    """Dropout probability in the embeddings and blocks."""
    lr: float = 5e-3
    """AdamW learning rate (the peak, after ``--lr-warmup``). The default is the demo's: the loss
    falls clearly within its 8 steps (by about 40%). The benchmarks pass their own rate."""
    lr_warmup: int = 0
    """Steps of linear learning-rate warmup: step ``s`` (from 0) trains at ``lr * (s + 1) / N``
    for ``s < N``, then at ``lr`` (torch ``LambdaLR``, Paddle ``LambdaDecay``, the same factor).
    0: no warmup."""
    compile: str = ""
    """``torch.compile`` the stage modules (PyTorch): ``--compile`` is Inductor in its default mode;
    ``--compile BACKEND`` names another backend (``aot_eager``: AOTAutograd without Inductor, as
    the CPU tests use). Without ``--cudagraph`` every module of a stage (embedding, blocks, final
    norm, head) and the loss function run through ``torch.compile`` while the schedule and its
    sends and receives stay eager; with it, ``graph_stage_module(compile=...)`` and
    ``graph_loss(compile=...)`` compile the graphed runs' modules and the loss in the warmup and
    capture the compiled kernels. Empty: off."""
    timeout: int = 120
    """Seconds a rank waits for its peers before it gives up with an error."""
    graph_memory: str = "shared"
    """Memory mode of the graphed runs: ``shared`` or ``per_graph`` (PyTorch)."""
    graph_accumulate_grads: Optional[bool] = None
    """Accumulate parameter gradients into ``.grad`` inside the backward graphs (PyTorch;
    ``accumulate_grads`` of ``graph_stage_module``); ``None``: the library's default
    (``"auto"``)."""
    graph_loss: bool = True
    """With ``--cudagraph``, graph the last stage's loss too (``paddle_graphpp.torch.graph_loss``;
    Paddle: ``PipelineLayer(..., graph_loss=True)``): its temporaries share the graphs' pool."""
    graph_eager_tied: bool = False
    """With ``--cudagraph``, keep the tied embedding and output head eager (``shared=`` of
    ``graph_stage_module``; PyTorch) instead of graphing them with the blocks."""
    graph_optimizer: bool = False
    """Capture the optimizer step and gradient zeroing as one CUDA graph (PyTorch only;
    ``paddle_graphpp.GraphedOptimizer``); eager and bit-identical on CPU."""
    profile_steps: int = 0
    """Profile the last N steps with ``torch.profiler`` (PyTorch on GPUs) and add, per rank,
    ``compute_busy`` to the JSON line: the share of the time from the first to the last kernel
    of those steps during which a compute (non-NCCL) kernel runs (``tools/diagnostics/busy.py``)."""
    return_outputs: bool = True
    """PyTorch: ``return_outputs`` of the schedule's ``step`` (torch's default: on): the last
    stage keeps every micro-batch's output and concatenates them at the end of the step. The
    trainer never reads them; off, neither the kept outputs nor the concatenation take memory."""
    keep_grads: bool = False
    """PyTorch: ``zero_grad(set_to_none=False)`` between steps: the gradients stay allocated
    (zeroed) for the whole run, as a graph's gradient buffers do (a memory reference point;
    the default frees them and autograd allocates them again during the step)."""
    memory_trace: bool = False
    """Record every CUDA allocation (PyTorch) and add, per rank, where memory went at the peak
    to the JSON line (``tools/diagnostics/memtrace.py``); slows the run down."""

    @property
    def num_heads(self) -> int:
        return self.heads or max(1, self.hidden // 64)

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batches * self.micro_batch_size * self.seq_len


def parse_args(argv=None) -> Config:
    """Command line -> :class:`Config` (defaults from the dataclass)."""
    defaults = Config()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=["paddle", "torch"], default=defaults.framework)
    for flag in ("pp", "tp", "vpp", "micro_batches", "micro_batch_size", "seq_len", "hidden", "heads", "vocab",
                 "layers", "steps", "seed", "timeout"):
        parser.add_argument("--" + flag.replace("_", "-"), type=int, default=getattr(defaults, flag))
    parser.add_argument("--cudagraph", action="store_true", help="capture stage blocks as CUDA graphs")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default=defaults.schedule,
                        help="pipeline schedule (--framework torch; zero-bubble ones split each backward)")
    parser.add_argument("--graph-memory", choices=["shared", "per_graph"],
                        default=defaults.graph_memory, help="memory mode of the graphed runs (--framework torch)")
    parser.add_argument("--graph-accumulate-grads", action=argparse.BooleanOptionalAction, default=None,
                        help="accumulate parameter gradients inside the backward graphs, or not "
                             "(--framework torch; default: the library's, 'auto')")
    parser.add_argument("--graph-loss", action=argparse.BooleanOptionalAction, default=defaults.graph_loss,
                        help="with --cudagraph, graph the last stage's cross-entropy too (default: on)")
    parser.add_argument("--graph-eager-tied", action="store_true",
                        help="with --cudagraph, keep the tied embedding and head eager (--framework torch)")
    parser.add_argument("--graph-optimizer", action="store_true",
                        help="capture AdamW step + zero-grad as one CUDA graph (--framework torch)")
    parser.add_argument("--attention", choices=["explicit", "sdpa"], default=defaults.attention)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=defaults.dtype,
                        help="torch model dtype")
    parser.add_argument("--profile-steps", type=int, default=defaults.profile_steps,
                        help="profile the last N steps and report each rank's compute-busy share (torch, GPUs)")
    parser.add_argument("--return-outputs", action=argparse.BooleanOptionalAction, default=defaults.return_outputs,
                        help="torch schedules: keep and return the last stage's outputs from step() (default: on)")
    parser.add_argument("--keep-grads", action="store_true",
                        help="torch: zero_grad(set_to_none=False), the gradients stay allocated between steps")
    parser.add_argument("--memory-trace", action="store_true",
                        help="per rank, where memory went at the peak (torch on GPUs; slow)")
    parser.add_argument("--data", default=defaults.data, metavar="PATH", help="text file (default: synthetic)")
    parser.add_argument("--dropout", type=float, default=defaults.dropout)
    parser.add_argument("--lr", type=float, default=defaults.lr, help="AdamW learning rate (the peak)")
    parser.add_argument("--lr-warmup", type=int, default=defaults.lr_warmup, metavar="N",
                        help="linear learning-rate warmup over the first N steps (default: none)")
    parser.add_argument("--compile", nargs="?", const="inductor", default=defaults.compile, metavar="BACKEND",
                        help="torch.compile the stage modules (--framework torch; default backend: inductor); "
                             "with --cudagraph the compiled kernels are captured")
    args = parser.parse_args(argv)
    return Config(**vars(args))


def validate(cfg: Config) -> None:
    """Reject a configuration that cannot work, before any process starts.

    Raises:
        ConfigError: naming the flag to change.
    """
    for flag in ("pp", "tp", "vpp", "micro_batches", "micro_batch_size", "seq_len", "hidden", "vocab", "layers",
                 "steps", "timeout"):
        if getattr(cfg, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(cfg, flag)}")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"--dropout must be in [0, 1), got {cfg.dropout}")
    if not cfg.lr > 0:
        raise ConfigError(f"--lr must be positive, got {cfg.lr}")
    if cfg.lr_warmup < 0:
        raise ConfigError(f"--lr-warmup must be 0 (no warmup) or a number of steps, got {cfg.lr_warmup}")
    validate_compile(cfg)
    chunks = cfg.pp * cfg.vpp
    if cfg.layers % chunks:
        raise ConfigError(
            f"--layers {cfg.layers} cannot split into pp*vpp = {chunks} equal chunks; "
            f"use a multiple of {chunks} (e.g. --layers {chunks * max(1, round(cfg.layers / chunks))})"
        )
    if cfg.micro_batches < cfg.pp:
        raise ConfigError(
            f"--micro-batches {cfg.micro_batches} is fewer than --pp {cfg.pp}: a 1F1B pipeline needs at "
            f"least one micro-batch per stage; use --micro-batches {cfg.pp} or more"
        )
    if cfg.vpp > 1 and cfg.micro_batches % cfg.pp:
        raise ConfigError(
            f"the interleaved schedule (--vpp {cfg.vpp}) needs --micro-batches to be a multiple of "
            f"--pp {cfg.pp}, got {cfg.micro_batches}; use --micro-batches {cfg.pp * math.ceil(cfg.micro_batches / cfg.pp)}"
        )
    if cfg.schedule != "1f1b":
        if cfg.framework != "torch":
            raise ConfigError(f"--schedule {cfg.schedule} works with --framework torch (Paddle: fleet's DualPipeV, "
                              f"see docs/paddle.md)")
        if cfg.tp > 1:
            raise ConfigError(f"--schedule {cfg.schedule} with --tp is untested; use --tp 1")
        if cfg.schedule in ("zbv", "dualpipev") and cfg.vpp != 2:
            raise ConfigError(f"--schedule {cfg.schedule} places two chunks per rank in a V; pass --vpp 2")
        if cfg.schedule == "interleaved_zb" and cfg.vpp < 2:
            raise ConfigError("--schedule interleaved_zb needs --vpp 2 or more (chunks per rank)")
        if cfg.schedule == "dualpipev" and cfg.micro_batches < 2 * cfg.pp:
            raise ConfigError(f"--schedule dualpipev needs at least 2*pp = {2 * cfg.pp} micro-batches; "
                              f"use --micro-batches {2 * cfg.pp}")
    if cfg.graph_memory != "shared" and cfg.framework != "torch":
        raise ConfigError("--graph-memory works with --framework torch; paddle_graphpp.PipelineLayer uses "
                          "the shared pool")
    if cfg.graph_accumulate_grads is not None and cfg.framework != "torch":
        raise ConfigError("--graph-accumulate-grads works with --framework torch")
    if cfg.keep_grads and cfg.framework != "torch":
        raise ConfigError("--keep-grads works with --framework torch")
    if cfg.graph_eager_tied and cfg.framework != "torch":
        raise ConfigError("--graph-eager-tied works with --framework torch; Paddle keeps the tied layers eager")
    if cfg.graph_optimizer and cfg.framework != "torch":
        raise ConfigError("--graph-optimizer works with --framework torch; Paddle's fleet wraps the "
                          "optimizer itself (use paddle_graphpp.GraphedOptimizer in a custom loop)")
    if cfg.framework == "paddle" and cfg.vpp > 1:
        # fleet's interleaved schedule rejects 2 stages and fewer than 2*pp micro-batches.
        if cfg.pp < 3:
            raise ConfigError(f"Paddle's interleaved schedule needs --pp 3 or more (got --pp {cfg.pp} with "
                              f"--vpp {cfg.vpp}); raise --pp or use --vpp 1")
        if cfg.micro_batches < 2 * cfg.pp:
            raise ConfigError(f"Paddle's interleaved schedule needs at least 2*pp = {2 * cfg.pp} micro-batches; "
                              f"use --micro-batches {2 * cfg.pp}")
    if cfg.heads < 0:
        raise ConfigError(f"--heads must be at least 1 (or 0 for heads of 64 channels), got {cfg.heads}")
    if cfg.heads == 0 and cfg.hidden > 64 and cfg.hidden % 64:
        raise ConfigError(f"--hidden {cfg.hidden} must be a multiple of 64 (the attention head size), or 64 or less; "
                          "or pass --heads")
    if cfg.hidden % cfg.num_heads:
        raise ConfigError(f"--hidden {cfg.hidden} is not a multiple of --heads {cfg.num_heads}")
    if cfg.tp > 1:
        if cfg.framework != "torch":
            raise ConfigError("--tp works with --framework torch; for Paddle use fleet's mp_degree with its "
                              "ColumnParallelLinear/RowParallelLinear")
        if cfg.num_heads % cfg.tp:
            raise ConfigError(f"--tp {cfg.tp} must divide the {cfg.num_heads} attention heads; use --heads a multiple "
                              f"of {cfg.tp}")
    if cfg.vocab < VOCAB_SIZE:
        raise ConfigError(f"--vocab {cfg.vocab} is smaller than the {VOCAB_SIZE} byte tokens of the data; use --vocab "
                          f"{VOCAB_SIZE} or more")
    if cfg.framework != "torch" and (cfg.dtype != "float32" or cfg.attention != "explicit" or cfg.memory_trace):
        raise ConfigError("--dtype, --attention and --memory-trace work with --framework torch")
    most = cfg.steps - untimed_steps(cfg) - 1
    if cfg.profile_steps and (cfg.framework != "torch" or cfg.profile_steps < 0 or cfg.profile_steps > most):
        raise ConfigError(f"--profile-steps works with --framework torch and leaves at least one timed step after "
                          f"warmup and capture: at most {max(0, most)} with --steps {cfg.steps}")
    if cfg.data and not os.path.isfile(cfg.data):
        raise ConfigError(f"--data {cfg.data!r} is not a file; pass a text file or leave --data out")


def validate_compile(cfg: Config) -> None:
    """The rules of ``--compile``: PyTorch only, and the schedules and layouts it was tried with."""
    if not cfg.compile:
        return
    if cfg.framework != "torch":
        raise ConfigError("--compile works with --framework torch; this trainer does not compile Paddle models "
                          "(paddle_graphpp.PipelineLayer's to_static=True does, docs/paddle.md)")
    if cfg.compile not in COMPILE_BACKENDS:
        raise ConfigError(f"--compile {cfg.compile}: the backend must be one of {', '.join(COMPILE_BACKENDS)} "
                          f"(Inductor's own CUDA graphs are not offered: use --cudagraph for graphs)")
    if cfg.tp > 1:
        raise ConfigError("--compile with --tp is untested (the tensor-parallel all-reduces run inside the "
                          "blocks); use --tp 1")
    if cfg.schedule != "1f1b":
        raise ConfigError(f"--compile with --schedule {cfg.schedule} (a split backward) is untested; use "
                          f"--schedule 1f1b")


def lr_factor(step: int, warmup: int) -> float:
    """The learning-rate multiplier of step ``step`` (from 0) under ``--lr-warmup warmup``."""
    return 1.0 if step >= warmup else (step + 1) / warmup


def untimed_steps(cfg: Config) -> int:
    """Steps before the timed ones: the eager warmup calls, the recorded step and the capture
    (``NUM_WARMUP_STEPS + 1`` steps, more than the engine needs with several micro-batches per
    step), and with ``--compile`` :data:`COMPILE_SETTLE_STEPS` more."""
    return NUM_WARMUP_STEPS + 1 + (COMPILE_SETTLE_STEPS if cfg.compile else 0)


# ------------------------------------------------------------------------------------- data
_WORDS = ("the graph replays kernels while the pipeline moves activations between stages and "
          "every micro batch waits for its turn a stage captures once then replays many times "
          "memory pools are shared gradients accumulate and the loss goes down").split()


def load_corpus(cfg: Config) -> np.ndarray:
    """Byte tokens of ``--data``, or of a deterministic synthetic text of about 200 KB."""
    if cfg.data:
        with open(cfg.data, "rb") as f:
            tokens = np.frombuffer(f.read(), dtype=np.uint8)
    else:
        rng = np.random.RandomState(0)
        words = rng.choice(len(_WORDS), size=40_000)
        text = " ".join(_WORDS[i] for i in words)
        tokens = np.frombuffer(text.encode(), dtype=np.uint8)
    if tokens.size < cfg.seq_len + 2:
        raise ConfigError(
            f"--data has {tokens.size} bytes, too few for --seq-len {cfg.seq_len}; "
            "use a longer file or a smaller --seq-len"
        )
    return tokens.astype(np.int64)


def batch_for_step(corpus: np.ndarray, cfg: Config, step: int) -> tuple:
    """Inputs and next-token labels of one step, ``[micro_batches * micro_batch_size, seq_len]`` each.

    Windows are drawn from a generator seeded by (seed, step), so every rank sees the same batch.
    """
    rng = np.random.RandomState((cfg.seed * 1_000_003 + step) % (2**32))
    count = cfg.micro_batches * cfg.micro_batch_size
    starts = rng.randint(0, corpus.size - cfg.seq_len - 1, size=count)
    idx = starts[:, None] + np.arange(cfg.seq_len + 1)[None, :]
    windows = corpus[idx]
    return windows[:, :-1].copy(), windows[:, 1:].copy()


def chunk_layout(cfg: Config, chunk: int) -> range:
    """Indices of the transformer blocks in pipeline chunk ``chunk`` (of pp * vpp)."""
    per = cfg.layers // (cfg.pp * cfg.vpp)
    return range(chunk * per, (chunk + 1) * per)


# --------------------------------------------------------------------------------- reporting
class Reporter:
    """Per-step loss lines (or a progress bar on long runs) and the final JSON line."""

    def __init__(self, cfg: Config, enabled: bool):
        self.cfg = cfg
        self.enabled = enabled
        self.losses: list = []
        self.bar = None
        if enabled and cfg.steps >= 20:
            try:  # the progress bar is the `demo` extra's (pip install paddle_graphpp[demo])
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            # disable=None: a bar on a terminal only, so captured logs stay one line per step
            if tqdm is not None:
                self.bar = tqdm(total=cfg.steps, unit="step", disable=None, file=sys.stderr)

    def step(self, step: int, loss: float, seconds: float) -> None:
        self.losses.append(loss)
        if not self.enabled:
            return
        line = (f"step {step + 1}/{self.cfg.steps} loss {loss:.6f} ({seconds * 1e3:.1f} ms, "
                f"{time.time() - STARTED:.1f} s elapsed)")
        if self.bar is not None and not self.bar.disable:
            self.bar.set_postfix(loss=f"{loss:.4f}")
            self.bar.update(1)
        else:
            print(line, flush=True)

    def finish(self, *, tokens_per_s: float, peak_mem_mib: float, device: str, **extra) -> dict:
        if self.bar is not None:
            self.bar.close()
        losses = self.losses
        record = {
            "framework": self.cfg.framework,
            "pp": self.cfg.pp,
            "tp": self.cfg.tp,
            "vpp": self.cfg.vpp,
            "schedule": self.cfg.schedule,
            "cudagraph": self.cfg.cudagraph,
            "steps": self.cfg.steps,
            "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None,
            "tokens_per_s": round(tokens_per_s, 1),
            "peak_mem_mib": round(peak_mem_mib, 1),
            "device": device,
            **extra,
            "losses": losses,
            "config": asdict(self.cfg),
        }
        if self.enabled:
            sys.stdout.flush()
            sys.stderr.flush()
            print(json.dumps(record), flush=True)
        return record


class StepTimer:
    """Wall time of the steps after warmup and capture, for tokens/s."""

    def __init__(self, cfg: Config, sync):
        self.sync = sync
        # Skip the eager warmup steps and the capture step (and, compiled, the steps that compile);
        # keep at least one timed step. The profiled steps (--profile-steps, at the end) are not
        # timed: the profiler slows them.
        self.skip = min(untimed_steps(cfg), cfg.steps - 1)
        self.last = max(self.skip, cfg.steps - 1 - cfg.profile_steps)
        self.timed_steps = self.last - self.skip + 1
        self.start = None
        self.elapsed = 0.0

    def before(self, step: int) -> None:
        if step == self.skip:
            self.sync()
            self.start = time.perf_counter()

    def after(self, step: int, cfg: Config) -> None:
        if step == self.last:
            self.sync()
            self.elapsed = time.perf_counter() - self.start

    def tokens_per_s(self, cfg: Config) -> float:
        return self.timed_steps * cfg.tokens_per_step / max(self.elapsed, 1e-9)


class CompileWatch:
    """The steps in which dynamo compiled a frame (a first compile or a recompile), for the
    JSON line: a compiled run's timing is sound when they all come before the timed steps."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.steps: list = []
        self._seen = 0

    @staticmethod
    def frames() -> int:
        from torch._dynamo.utils import counters

        return counters["frames"]["total"]

    def after(self, step: int) -> None:
        if self.enabled and (now := self.frames()) != self._seen:
            self._seen = now
            self.steps.append(step)

    def report(self) -> dict:
        return {"compile_steps": self.steps, "frames_compiled": self._seen} if self.enabled else {}


def cpu_peak_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ------------------------------------------------------------------------------------ torch
def model_shape(cfg: Config):
    """The model's :class:`testing.gpt_shape.GPTShape` for this configuration."""
    from testing.gpt_shape import GPTShape

    return GPTShape(hidden=cfg.hidden, heads=cfg.num_heads, vocab=cfg.vocab, seq_len=cfg.seq_len, layers=cfg.layers,
                    dropout=cfg.dropout, attention=cfg.attention)


def build_torch_chunk(cfg: Config, chunk: int, tp=None):
    """Chunk ``chunk`` of the model as ``nn.Sequential`` and its tied module(s) (or ``None``);
    ``tp``: the tensor-parallel all-reduce dispatcher, when ``cfg.tp > 1``.

    Every module is seeded by its position in the whole model, so weights do not depend on pp/vpp/tp.
    """
    from testing.gpt_torch import build_chunk

    return build_chunk(model_shape(cfg), chunk_layout(cfg, chunk), first=chunk == 0,
                       last=chunk == cfg.pp * cfg.vpp - 1, seed=cfg.seed, tp=tp)


def torch_mesh(cfg: Config, rank: int):
    """This rank's place in the tp x pp mesh: ``(pp_rank, tp_rank, tp_group, pp_group, tie_group)``.

    Ranks ``pp_rank * tp .. pp_rank * tp + tp - 1`` form one stage's tensor-parallel group
    (adjacent GPUs); ranks of the same ``tp_rank`` form a pipeline. Every rank creates every
    group, in the same order (``new_group`` is collective). ``tp_group`` and ``pp_group`` are
    ``None`` without tensor parallelism (the world is the pipeline), ``tie_group`` (first and
    last stage, for the tied embedding) with one stage.
    """
    import torch.distributed as dist

    pp_rank, tp_rank = divmod(rank, cfg.tp)
    mine = {}
    if cfg.tp > 1:
        for p in range(cfg.pp):
            group = dist.new_group([p * cfg.tp + t for t in range(cfg.tp)])
            if p == pp_rank:
                mine["tp"] = group
        for t in range(cfg.tp):
            group = dist.new_group([p * cfg.tp + t for p in range(cfg.pp)])
            if t == tp_rank:
                mine["pp"] = group
    if cfg.pp > 1:
        for t in range(cfg.tp):
            group = dist.new_group([t, (cfg.pp - 1) * cfg.tp + t])
            if t == tp_rank:
                mine["tie"] = group
    return pp_rank, tp_rank, mine.get("tp"), mine.get("pp"), mine.get("tie")


def _tied_pairs(tied_by_chunk: dict) -> list:
    out = []
    for t in tied_by_chunk.values():
        if t is None:
            continue
        out.extend(t if isinstance(t, tuple) else (t,))
    return out


def torch_compile_kwargs(cfg: Config):
    """``--compile`` as ``torch.compile`` keyword arguments (``None`` when off)."""
    if not cfg.compile:
        return None
    return {} if cfg.compile == "inductor" else {"backend": cfg.compile}


def torch_stage_module(cfg: Config, chunk, tied, *, name: str):
    """What ``PipelineStage`` runs for ``chunk``: the chunk itself, its modules each through
    ``torch.compile`` (``--compile``), or its graphed runs (``--cudagraph``, compiled inside the
    graphs with ``--compile``). ``tied``: the chunk's tied module(s), kept eager with
    ``--graph-eager-tied``."""
    from torch import nn

    options = torch_compile_kwargs(cfg)
    if not cfg.cudagraph:
        if options is None:
            return chunk
        from paddle_graphpp.torch.compile import compiled_module

        # the same torch.compile(module) per entry that graph_stage_module(compile=...) applies;
        # the parameters stay the chunk's (the optimizer and the tie hold them)
        return nn.Sequential(*[compiled_module(module, options) for module in chunk])
    from paddle_graphpp.torch.pipeline import graph_stage_module

    accumulate = "auto" if cfg.graph_accumulate_grads is None else cfg.graph_accumulate_grads
    # the tied embedding and head are graphed too (unless --graph-eager-tied); _sum_tied_grads
    # reads their .grad after the step
    keep = tied if cfg.graph_eager_tied else None
    return graph_stage_module(chunk, NUM_WARMUP_STEPS, memory=cfg.graph_memory, accumulate_grads=accumulate,
                              name=name, shared=() if keep is None else keep if isinstance(keep, tuple) else (keep,),
                              compile=options)


def torch_lr_schedule(cfg: Config, optimizer):
    """``--lr-warmup`` as a ``LambdaLR`` over ``optimizer`` (``None`` without warmup).

    Under ``--graph-optimizer`` it schedules the wrapped optimizer: ``GraphedOptimizer`` keeps
    ``lr`` in a device tensor the captured step reads, filled in place by the scheduler (or from
    a new value before the next replay), so every replay steps at the scheduled rate
    (``unittests/gpu/test_optim_gpu.py`` checks it against eager AdamW under ``LambdaLR``).
    """
    import torch

    if not cfg.lr_warmup:
        return None
    inner = getattr(optimizer, "optimizer", optimizer)  # GraphedOptimizer wraps the AdamW
    return torch.optim.lr_scheduler.LambdaLR(inner, lambda step: lr_factor(step, cfg.lr_warmup))


def run_torch(cfg: Config) -> None:
    """One torch pipeline rank: build its chunks, run the schedule ``cfg.steps`` times, report."""
    import datetime

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if world != cfg.pp * cfg.tp:
        raise ConfigError(f"started with {world} processes but --pp {cfg.pp} x --tp {cfg.tp}; launch pp * tp processes "
                          f"(torchrun --nproc_per_node {cfg.pp * cfg.tp})")
    use_cuda = torch.cuda.is_available()
    dtype = getattr(torch, cfg.dtype)
    if use_cuda:
        if torch.cuda.device_count() <= local_rank:
            raise ConfigError(f"--pp {cfg.pp} x --tp {cfg.tp} needs {world} GPUs, one per rank, but "
                              f"{torch.cuda.device_count()} are visible (rank {rank} has none); lower --pp or --tp "
                              f"or make more GPUs visible")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        # TF32 matmuls, as GPU training runs them; eager and graphed runs use the same kernels.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # multicast off on the lent machines, whatever the launcher says
        if cfg.memory_trace:
            from tools.diagnostics import memtrace

            memtrace.start()
    else:
        device = torch.device("cpu")
    if world > 1 or "MASTER_ADDR" in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(launch.free_port()))
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=cfg.timeout))
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    pp_rank, tp_rank, tp_group, pp_group, tie_group = torch_mesh(cfg, rank)
    tp = None
    if tp_group is not None:
        from paddle_graphpp.torch.collectives.allreduce import create_allreduce

        tp = create_allreduce(tp_group)  # the custom kernel on NVLink peers, NCCL or gloo otherwise
    num_stages = cfg.pp * cfg.vpp
    schedule_name, v_shape = SCHEDULES[cfg.schedule]
    if schedule_name is not None and not hasattr(pipelining, schedule_name):
        raise ConfigError(f"--schedule {cfg.schedule}: torch {torch.__version__} has no {schedule_name}")
    if v_shape:
        stage_ids = [pp_rank, num_stages - 1 - pp_rank]
        tie_group = None  # the first and the last chunk are both on the first rank
    else:
        stage_ids = [pp_rank + k * cfg.pp for k in range(cfg.vpp)]
    first_rank, last_rank = 0 in stage_ids, num_stages - 1 in stage_ids
    chunks, tied_by_chunk = {}, {}
    for s in stage_ids:
        chunks[s], tied_by_chunk[s] = build_torch_chunk(cfg, s, tp)
        chunks[s].to(device=device, dtype=dtype)
    tied = _tied_pairs(tied_by_chunk)  # the tied weights this rank holds (0, 1 or 2)
    params = [p for s in stage_ids for p in chunks[s].parameters()]

    graphed = []
    stage_modules = {}
    for s in stage_ids:
        stage_modules[s] = torch_stage_module(cfg, chunks[s], tied_by_chunk[s], name=f"stage{s}")
        graphed.extend(getattr(stage_modules[s], "graphed_modules", []))

    mbs, seq, hid = cfg.micro_batch_size, cfg.seq_len, cfg.hidden
    hidden_meta = torch.empty(mbs, seq, hid, device=device, dtype=dtype, requires_grad=True)  # carries gradients
    stages = []
    for s in stage_ids:
        inp = torch.zeros(mbs, seq, dtype=torch.long, device=device) if s == 0 else hidden_meta
        out = (torch.empty(mbs, seq, cfg.vocab, device=device, dtype=dtype, requires_grad=True)
               if s == num_stages - 1 else hidden_meta)
        stages.append(PipelineStage(stage_modules[s], s, num_stages, device, input_args=(inp,), output_args=(out,),
                                    group=pp_group))

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    options = torch_compile_kwargs(cfg)
    if cfg.cudagraph and cfg.graph_loss and last_rank:
        from paddle_graphpp.torch.pipeline import graph_loss

        loss_fn = graph_loss(loss_fn, NUM_WARMUP_STEPS, memory=cfg.graph_memory, compile=options)
        graphed.append(loss_fn)
    elif options is not None and last_rank:
        loss_fn = torch.compile(loss_fn, **options)  # as the graphed runs compile it

    if schedule_name is not None:
        schedule = getattr(pipelining, schedule_name)(stages, n_microbatches=cfg.micro_batches, loss_fn=loss_fn)
    elif cfg.vpp == 1:
        schedule = Schedule1F1B(stages[0], n_microbatches=cfg.micro_batches, loss_fn=loss_fn)
    else:
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=cfg.micro_batches, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr)
    if cfg.graph_optimizer:
        from paddle_graphpp import GraphedOptimizer

        optimizer = GraphedOptimizer(optimizer)  # step + in-place zero-grad, one graph replay
    lr_schedule = torch_lr_schedule(cfg, optimizer)
    # The tie between the first and the last stage: each holds a copy, gradients are summed
    # over tie_group (from torch_mesh).

    # torch before 2.10 has no return_outputs (and always keeps the outputs)
    step_kwargs = {} if cfg.return_outputs else {"return_outputs": False}
    corpus = load_corpus(cfg)
    # dropout stream, the same with and without graphs, and on every rank of a tensor-parallel group
    torch.manual_seed(cfg.seed * 7 + pp_rank)
    reporter = Reporter(cfg, enabled=last_rank and tp_rank == 0)
    sync = (lambda: torch.cuda.synchronize(device)) if use_cuda else (lambda: None)
    timer = StepTimer(cfg, sync)
    compiles = CompileWatch(bool(cfg.compile))
    memory = None
    if use_cuda:
        from tools.benchlib import DeviceMemory

        memory = DeviceMemory(device)  # under cudaMallocAsync it counts the driver's graph memory too
        memory.reset_peak()
    peak_before_steady = 0.0
    steady_since_us = None
    step_starts_us = []
    profiler = None
    for step in range(cfg.steps):
        if use_cuda and cfg.profile_steps and step == cfg.steps - cfg.profile_steps:
            from tools.diagnostics import busy

            profiler = busy.start()
        if use_cuda and step == timer.skip:  # warmup and capture are over: the steady state begins
            peak_before_steady = memory.peak_mib()
            memory.reset_peak()
            steady_since_us = time.time() * 1e6
        timer.before(step)
        step_starts_us.append(time.time() * 1e6)
        t0 = time.perf_counter()
        x, y = batch_for_step(corpus, cfg, step)
        args = (torch.from_numpy(x).to(device),) if first_rank else ()
        target = torch.from_numpy(y).to(device) if last_rank else None
        losses = [] if last_rank else None
        optimizer.zero_grad(**({} if cfg.graph_optimizer else {"set_to_none": not cfg.keep_grads}))
        schedule.step(*args, target=target, losses=losses, **step_kwargs)
        _sum_tied_grads(tied, tie_group)
        optimizer.step()
        if lr_schedule is not None:
            lr_schedule.step()
        loss = torch.stack(losses).float().mean().item() if last_rank else 0.0
        timer.after(step, cfg)
        compiles.after(step)
        reporter.step(step, loss, time.perf_counter() - t0)

    compute_busy = idle = None
    if profiler is not None:
        from tools.diagnostics import busy

        compute_busy, idle = busy.stop(profiler, gaps=True)
    if use_cuda:
        steady = memory.peak_mib()
        mine = {"peak_mem_mib": round(max(peak_before_steady, steady), 1), "steady_peak_mem_mib": round(steady, 1)}
        device_name = torch.cuda.get_device_name(device)
    else:
        mine = {"peak_mem_mib": round(cpu_peak_mib(), 1), "steady_peak_mem_mib": round(cpu_peak_mib(), 1)}
        device_name = "cpu"
    mine.update(compiles.report())
    if compute_busy is not None:
        mine["compute_busy"] = compute_busy
        mine["idle_gaps"] = idle
    if cfg.cudagraph:
        from paddle_graphpp.core.memory import memory_report

        mine["memory_report"] = memory_report()
        if use_cuda:
            from paddle_graphpp.torch.runtime import RUNTIME

            if (lending := RUNTIME.lending_report()) is not None:
                mine["pool_lending"] = lending
    if cfg.memory_trace and use_cuda:
        from tools.diagnostics import memtrace

        snapshot = torch.cuda.memory._snapshot()
        mine["memory_trace"] = memtrace.analyze(snapshot, steady_since_us=steady_since_us,
                                                 step_starts_us=step_starts_us)
        memtrace.write_raw(snapshot, f"rank{rank}", step_starts_us)  # with GRAPHPP_MEMTRACE_RAW=<folder>
        del snapshot
    per_rank = [None] * world
    if world > 1:
        dist.all_gather_object(per_rank, mine)
    else:
        per_rank = [mine]
    reporter.finish(tokens_per_s=timer.tokens_per_s(cfg), device=device_name,
                    peak_mem_mib=max(r["peak_mem_mib"] for r in per_rank),
                    steady_peak_mem_mib=max(r["steady_peak_mem_mib"] for r in per_rank),
                    per_rank=per_rank,
                    graphed_runs_on_rank=len(graphed),
                    graphs_active=bool(cfg.cudagraph and use_cuda), timed_steps=timer.timed_steps,
                    untimed_steps=timer.skip, torch_version=torch.__version__)
    if world > 1:
        dist.barrier()


def _sum_tied_grads(tied: list, group) -> None:
    """Sum the tied weight's gradient over its copies (same rank: add; first/last rank: all-reduce)."""
    import torch.distributed as dist

    if not tied:
        return
    grad = tied[0].weight.grad
    for other in tied[1:]:
        grad.add_(other.weight.grad)
    if group is not None:
        dist.all_reduce(grad, group=group)
    for other in tied[1:]:
        other.weight.grad.copy_(grad)


# ----------------------------------------------------------------------------------- paddle
def run_paddle(cfg: Config) -> None:
    """One Paddle fleet rank: PipelineLayer with a SharedLayerDesc tie, ``train_batch`` per step."""
    quiet_paddle()
    import paddle
    import paddle.distributed as dist
    from paddle import nn
    from paddle.distributed import fleet
    from paddle.distributed.fleet.meta_parallel import LayerDesc, SharedLayerDesc
    from paddle.distributed.fleet.utils import log_util as fleet_log

    import paddle_graphpp

    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    if world != cfg.pp:
        raise ConfigError(f"started with {world} processes but --pp {cfg.pp}; "
                          f"launch --pp processes (python -m paddle.distributed.launch --nproc_per_node {cfg.pp})")
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    # at INFO fleet logs its topology and every layer it builds (the strategy logs at once): the
    # losses would drown in it
    fleet_log.set_log_level("WARNING")
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": cfg.pp, "sharding_degree": 1}
    strategy.pipeline_configs = {"accumulate_steps": cfg.micro_batches, "micro_batch_size": cfg.micro_batch_size}
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    rank = dist.get_rank()

    from tools.gpt_paddle import Block, EmbeddingPipe, LossPipe, head_forward

    shape = model_shape(cfg)
    descs = [SharedLayerDesc("embed", EmbeddingPipe, shared_weight_attr="weight", shape=shape, seed=cfg.seed)]
    descs += [LayerDesc(Block, shape, i, cfg.seed) for i in range(cfg.layers)]
    descs += [LayerDesc(nn.LayerNorm, cfg.hidden),
              SharedLayerDesc("embed", EmbeddingPipe, forward_func=head_forward, shared_weight_attr="weight",
                              shape=shape, seed=cfg.seed)]
    model = paddle_graphpp.PipelineLayer(
        descs, num_stages=cfg.pp, loss_fn=LossPipe(cfg.vocab), seg_method="layer:Block",
        num_virtual_pipeline_stages=cfg.vpp if cfg.vpp > 1 else None, use_cudagraph=cfg.cudagraph,
        num_warmup_steps=NUM_WARMUP_STEPS, graph_loss=cfg.graph_loss)
    lr_schedule = paddle_lr_schedule(cfg)  # fleet's train_batch steps it after each optimizer step
    optimizer = paddle.optimizer.AdamW(learning_rate=cfg.lr if lr_schedule is None else lr_schedule,
                                       parameters=model.parameters())
    if cfg.pp > 1:
        model = fleet.distributed_model(model)
        optimizer = fleet.distributed_optimizer(optimizer)

    corpus = load_corpus(cfg)
    paddle.seed(cfg.seed * 7 + rank)  # dropout stream, the same with and without graphs
    use_cuda = paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    reporter = Reporter(cfg, enabled=rank == 0)  # fleet hands every rank the step's loss
    timer = StepTimer(cfg, paddle.device.cuda.synchronize if use_cuda else (lambda: None))
    for step in range(cfg.steps):
        timer.before(step)
        t0 = time.perf_counter()
        x, y = (paddle.to_tensor(a) for a in batch_for_step(corpus, cfg, step))
        if cfg.pp > 1:
            loss = model.train_batch([x, y], optimizer, lr_schedule)
        else:
            loss = _paddle_single_stage_step(model, optimizer, x, y, cfg)
            if lr_schedule is not None:
                lr_schedule.step()
        loss = float(np.asarray(loss).reshape(-1)[0])
        timer.after(step, cfg)
        reporter.step(step, loss, time.perf_counter() - t0)

    if use_cuda:
        peak = paddle.to_tensor([paddle.device.cuda.max_memory_reserved() / 2**20])
        device_name = paddle.device.cuda.get_device_name()
    else:
        peak = paddle.to_tensor([cpu_peak_mib()])
        device_name = "cpu"
    if world > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    inner = model._layers if cfg.pp > 1 else model
    reporter.finish(tokens_per_s=timer.tokens_per_s(cfg), peak_mem_mib=float(peak.item()), device=device_name,
                    graphed_runs_on_rank=len(inner.graphed_layers()), graphs_active=bool(cfg.cudagraph and use_cuda),
                    timed_steps=timer.timed_steps, paddle_version=paddle.__version__)
    if world > 1:
        dist.barrier()


def quiet_paddle() -> None:
    """Before Paddle is imported in this process: leave out the import notes of
    :data:`QUIET_WARNINGS` and the INFO lines of Paddle's C++ log (its TCP store's "create libuv
    server", "Successfully connected"); ``GLOG_minloglevel=0`` in the environment keeps them."""
    for spec in QUIET_WARNINGS:
        action, message = spec.split(":", 1)
        warnings.filterwarnings(action, message)
    os.environ.setdefault("GLOG_minloglevel", "1")


def paddle_lr_schedule(cfg: Config):
    """``--lr-warmup`` as Paddle's ``LambdaDecay`` with the torch run's factor (``None`` without
    warmup): step ``s`` trains at ``lr * lr_factor(s)`` in both frameworks."""
    import paddle

    if not cfg.lr_warmup:
        return None
    return paddle.optimizer.lr.LambdaDecay(cfg.lr, lambda step: lr_factor(step, cfg.lr_warmup))


def _paddle_single_stage_step(model, optimizer, x, y, cfg: Config):
    """What ``train_batch`` does, on one stage: mean loss over micro-batches, then one update."""
    total = 0.0
    mbs = cfg.micro_batch_size
    for m in range(cfg.micro_batches):
        out = model(x[m * mbs:(m + 1) * mbs])
        loss = model._loss_fn[0](out, y[m * mbs:(m + 1) * mbs]) if isinstance(model._loss_fn, list) \
            else model._loss_fn(out, y[m * mbs:(m + 1) * mbs])
        (loss / cfg.micro_batches).backward()
        total += float(loss)
    optimizer.step()
    optimizer.clear_grad()
    return total / cfg.micro_batches


# ----------------------------------------------------------------------------------- launch
def under_launcher(framework: str) -> bool:
    """True when a launcher (torchrun / paddle.distributed.launch / our own) started this process."""
    if framework == "torch":
        return "RANK" in os.environ and "WORLD_SIZE" in os.environ
    return "PADDLE_TRAINER_ID" in os.environ


def spawn_ranks(cfg: Config, argv: list) -> int:
    """Start one process per rank (pp x tp) running this script; return the first failure's code.

    When a rank fails, the others are stopped at once rather than left to time out.
    """
    script = os.path.abspath(__file__)
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1", **{STARTED_ENV: repr(STARTED)})
    log_dir = None
    if cfg.framework == "paddle":
        log_dir = tempfile.mkdtemp(prefix="train_gpt_paddle_")
        # the launcher imports Paddle too: its import notes go the way of the ranks' (quiet_paddle)
        env["PYTHONWARNINGS"] = ",".join(filter(None, [env.get("PYTHONWARNINGS"), *QUIET_WARNINGS]))
        env.setdefault("GLOG_minloglevel", "1")
        # paddle's launcher prints rank 0's output and stops every rank when one fails; at WARNING
        # it leaves out its configuration dump and keeps its errors and the failed rank's log tail
        cmds = [[sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(cfg.pp),
                 "--log_dir", log_dir, "--log_level", "WARNING", script, *argv]]
        envs = [env]
    else:
        cmds = [[sys.executable, script, *argv]] * (cfg.pp * cfg.tp)
        envs = launch.rank_envs(cfg.pp * cfg.tp, base=env)
    try:
        ends = launch.run_ranks(cmds, envs=envs, timeout=None, capture=False)
    except KeyboardInterrupt:
        return 130
    failed = [e.returncode for e in ends if e.returncode != 0 and not e.stopped]
    if failed:
        where = f" (rank logs in {log_dir})" if log_dir else ""
        print(f"train_gpt: a rank exited with code {failed[0]}; stopped the others{where}", file=sys.stderr)
        return failed[0]
    if log_dir:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 0


# ------------------------------------------------------------------------------------- main
def first_rank() -> bool:
    """Whether this process is rank 0 of its launcher (or started alone)."""
    return os.environ.get("PADDLE_TRAINER_ID", os.environ.get("RANK", "0")) == "0"


def announce(cfg: Config) -> None:
    """The run's first line, before any framework is imported: what trains, and that the step
    lines follow once the ranks have imported their framework and built the model."""
    layout = f"pp={cfg.pp}" + (f" vpp={cfg.vpp}" if cfg.vpp > 1 else "") + (f" tp={cfg.tp}" if cfg.tp > 1 else "")
    print(f"train_gpt: {cfg.framework} {layout}, {cfg.layers} blocks of width {cfg.hidden}, {cfg.steps} steps of "
          f"{cfg.tokens_per_step} tokens, CUDA graphs {'on' if cfg.cudagraph else 'off'}; starting "
          f"{cfg.pp * cfg.tp} rank(s) (the first step follows imports and warmup)", flush=True)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = parse_args(argv)
        validate(cfg)
        load_corpus(cfg)
    except ConfigError as exc:
        print(f"train_gpt: error: {exc}", file=sys.stderr)
        return 2
    ranks = cfg.pp * cfg.tp
    spawning = not under_launcher(cfg.framework) and ranks > 1
    if spawning or (STARTED_ENV not in os.environ and first_rank()):
        announce(cfg)
    if spawning:
        # Each rank checks that its GPU exists (run_torch) before it joins the others; this
        # process does not import torch for that (seconds per run, which a test suite of many
        # short runs pays many times).
        return spawn_ranks(cfg, argv)
    try:
        if cfg.framework == "torch":
            run_torch(cfg)
        else:
            run_paddle(cfg)
    except ConfigError as exc:
        print(f"train_gpt: error: {exc}", file=sys.stderr, flush=True)
        os._exit(2)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # do not wait in process-group teardown for peers that may be gone
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: destroying NCCL communicators after captured work can hang.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
