"""Start processes in their own session, under a time limit, and leave none behind.

The one launcher of the trainer, the benchmarks, the GPU check and the distributed tests::

    from testing import launch

    port = launch.free_port()
    envs = launch.rank_envs(2, port=port)                 # RANK, WORLD_SIZE, MASTER_PORT, ...
    ends = launch.run_ranks([[sys.executable, "worker.py"]] * 2, envs=envs, timeout=150)
    assert [e.returncode for e in ends] == [0, 0], ends[0].stdout

Each process starts in a new session (``start_new_session=True``), so it leads a process group
that also holds what it starts itself (``paddle.distributed.launch``'s ranks, a DataLoader's
workers). The processes are stopped at the time limit, when one of them fails, on any exception
in the caller (``KeyboardInterrupt`` included) and on SIGTERM to the caller: each group gets
SIGTERM, and what is left of it after a grace period SIGKILL. A process that starts ranks
through this module itself (``tools/train_gpt.py``) stops them in turn when it gets SIGTERM.

Output is captured into temporary files, not pipes, so no number of ranks writing at once can
fill a pipe and stall.

Failure modes:
    * A process that leaves its group (``setsid`` of its own) is out of reach of the kill.
    * :func:`free_port` only finds a port that is free now; another process may take it before
      the ranks bind it. Callers that rendezvous retry (see the tests).
    * The SIGTERM hook is installed only when called from the main thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

__all__ = ["Finished", "free_port", "rank_envs", "start", "stop", "run", "run_ranks", "sigterm_raises"]

POLL_S = 0.2
PORT_TAKEN = "EADDRINUSE"  # how a rank reports that its rendezvous port was taken between the pick and the bind
GRACE_S = 5.0


@dataclass(frozen=True, slots=True)
class Finished:
    """How one process ended."""

    returncode: int
    """Exit status (negative: the signal that ended it)."""
    stdout: str
    """What it wrote to stdout ("" when not captured); with ``merge_stderr``, stderr too."""
    stderr: str
    """What it wrote to stderr ("" when not captured or merged)."""
    seconds: float
    """From the start of the run until this process ended."""
    stopped: bool
    """It was still running when stopped (time limit, a failed peer, ``abandon``); ``returncode``
    is then the signal's."""
    timed_out: bool
    """The run's time limit passed (for every process of the run)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_envs(world: int, *, port: int | None = None, base: dict | None = None, **extra: str) -> list[dict]:
    """One environment per rank for ``torch.distributed``'s ``env://`` rendezvous on this host.

    ``base`` (default ``os.environ``) plus ``extra``, then RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT (``port``, or a free one).
    """
    if world < 1:
        raise ValueError(f"rank_envs: world must be >= 1, got {world}")
    env = dict(os.environ if base is None else base, **extra)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or free_port()), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(world))
    return [dict(env, RANK=str(r), LOCAL_RANK=str(r)) for r in range(world)]


def start(cmd: Sequence[str], *, env: dict | None = None, cwd=None, stdout=None, stderr=None,
          text: bool = True) -> subprocess.Popen:
    """``subprocess.Popen`` in a new session; end it with :func:`stop`."""
    return subprocess.Popen(list(cmd), env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text,
                            start_new_session=True)


def terminate(proc: subprocess.Popen) -> None:
    """SIGTERM to ``proc``'s process group if ``proc`` still runs (:func:`stop` finishes the job)."""
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)


def stop(proc: subprocess.Popen, *, grace: float = GRACE_S) -> None:
    """End ``proc`` and everything in its process group, and reap ``proc``.

    A running ``proc`` gets SIGTERM (to its whole group) and ``grace`` seconds to exit, time for
    a launcher to stop its own ranks; then what is left in the group gets SIGKILL. For a
    ``proc`` that has exited, only the SIGKILL: it clears what it left behind.
    """
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def run(cmd: Sequence[str], *, timeout: float | None, env: dict | None = None, cwd=None,
        capture: bool = True, merge_stderr: bool = False,
        abandon: Callable[[float], bool] | None = None) -> Finished:
    """Run one command in its own session; see :func:`run_ranks` for the arguments."""
    return run_ranks([cmd], envs=None if env is None else [env], cwd=cwd, timeout=timeout, capture=capture,
                     merge_stderr=merge_stderr, abandon=abandon)[0]


def run_ranks(cmds: Sequence[Sequence[str]], *, timeout: float | None, envs: Sequence[dict] | None = None,
              cwd=None, capture: bool = True, merge_stderr: bool = False,
              abandon: Callable[[float], bool] | None = None) -> list[Finished]:
    """Run ``cmds`` at once, one process each, and wait for them; stop them all on the first failure.

    Args:
        cmds: one argv per process (rank).
        timeout: seconds for the whole run; ``None`` waits as long as they run.
        envs: one environment per process (:func:`rank_envs`); default the caller's.
        cwd: working directory of every process.
        capture: capture stdout and stderr into :attr:`Finished.stdout` / ``stderr``; ``False``
            lets them write to the caller's.
        merge_stderr: with ``capture``, stderr goes into ``stdout``, interleaved as written.
        abandon: called with the elapsed seconds on every poll; ``True`` stops the run (a
            caller that sees a run go wrong before the time limit).

    Returns:
        One :class:`Finished` per command, in order. When a process exits non-zero, the others
        are stopped at once (they would wait for their peer until a collective's timeout).
    """
    if envs is not None and len(envs) != len(cmds):
        raise ValueError(f"run_ranks: {len(cmds)} commands but {len(envs)} environments")
    files, procs, ends = [], [], {}
    start_t = time.monotonic()
    timed_out = False
    with sigterm_raises():
        try:
            for i, cmd in enumerate(cmds):
                out = err = None
                if capture:
                    out = tempfile.TemporaryFile("w+", errors="replace")
                    err = subprocess.STDOUT if merge_stderr else tempfile.TemporaryFile("w+", errors="replace")
                    files.append((out, err))
                procs.append(start(cmd, env=None if envs is None else envs[i], cwd=cwd, stdout=out, stderr=err))
            while len(ends) < len(procs):
                for i, p in enumerate(procs):
                    if i not in ends and p.poll() is not None:
                        ends[i] = time.monotonic() - start_t
                elapsed = time.monotonic() - start_t
                if any(procs[i].returncode != 0 for i in ends):
                    break
                if timeout is not None and elapsed >= timeout:
                    timed_out = True
                    break
                if abandon is not None and abandon(elapsed):
                    break
                if len(ends) < len(procs):
                    time.sleep(POLL_S)
        finally:
            for p in procs:
                stop(p)
    results = []
    for i, p in enumerate(procs):
        stdout = stderr = ""
        if capture:
            out, err = files[i]
            stdout = _read(out)
            stderr = "" if merge_stderr else _read(err)
        stopped = i not in ends
        results.append(Finished(returncode=p.returncode, stdout=stdout, stderr=stderr, stopped=stopped,
                                seconds=time.monotonic() - start_t if stopped else ends[i], timed_out=timed_out))
    return results


def run_worker_ranks(script: str, mode: str, out_dir, *, world: int = 2, timeout: float,
                     pythonpath: Sequence[str] = ()) -> list[dict]:
    """Run a test file as its own rank workers (``python SCRIPT MODE RANK PORT OUT_DIR``, each in
    its own session, on one free port) and return what each rank wrote to ``OUT_DIR/rank<r>.json``.
    Fails the calling test (``AssertionError`` with the ranks' output) when a rank exits non-zero
    or the run passes ``timeout`` seconds."""
    port = str(free_port())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*pythonpath, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    cmds = [[sys.executable, script, mode, str(r), port, str(out_dir)] for r in range(world)]
    ends = run_ranks(cmds, envs=[env] * world, cwd=str(out_dir), timeout=timeout, merge_stderr=True)
    assert all(e.returncode == 0 and not e.timed_out for e in ends), "\n".join(e.stdout[-3000:] for e in ends)
    return [json.load(open(os.path.join(str(out_dir), f"rank{r}.json"))) for r in range(world)]


def finish_worker_rank(result: dict, rank: int, out_dir, *, world: int = 2, wait: float = 60.0) -> None:
    """End a rank worker of :func:`run_worker_ranks`: write ``result`` to ``OUT_DIR/rank<rank>.json``,
    stay until every rank has written its own (rank 0 holds the store its peers may still read;
    at most ``wait`` seconds) and leave with ``os._exit(0)``, without ``destroy_process_group``
    (a broken gloo group, or NCCL work once captured, can hang there)."""
    with open(os.path.join(str(out_dir), f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(str(out_dir), f"rank{r}.json")) for r in range(world)):
        time.sleep(0.1)
    sys.stdout.flush()
    os._exit(0)


def _read(f) -> str:
    f.seek(0)
    text = f.read()
    f.close()
    return text


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # the group is gone
        pass


@contextlib.contextmanager
def sigterm_raises():
    """While active (main thread only), SIGTERM raises ``SystemExit(143)`` (once) so that the
    ``finally`` of :func:`run_ranks` (or a caller's) stops the processes instead of leaving them
    running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _exit_143)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if old is None else old)


def _exit_143(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second one must not cut the clean-up short
    raise SystemExit(143)
