"""The send-wait pass: trade a forward send's ``c_sync_comm_stream`` for a ``nop`` after a recv.

In a 1F1B static pipeline each forward ``send_v2`` on the communication stream is followed by a
``c_sync_comm_stream`` so that the sent tensor is not freed while the send is in flight. Once a
backward ``recv_v2`` *from the stage the send went to* has completed, that stage has finished
the forward of this micro-batch, hence received the tensor: the send is complete. So the sync
can go, and a ``nop`` right after that recv, taking the sent variables as input and output,
keeps them alive until then (Paddle measured 0.2-2.1% more throughput).

Command line::

    python -m static_passes.send_wait IN.pdmodel -o OUT.pdmodel [--startup STARTUP.pdmodel]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from .report import ExistingNop, InsertedNop, KeptSend, PeerInfo, RemovedSync, SendWaitReport
from .rings import RingTable

__all__ = ["SendWaitError", "optimize_pipeline_send_wait", "main"]

_SENDS = ("send_v2", "partial_send")
_RECVS = ("recv_v2", "partial_recv")
# Ops that pass a variable through without writing new data into it.
_PASS_THROUGH = ("c_sync_comm_stream", "c_sync_calc_stream", "nop")
# OpRole values (paddle/fluid/framework/op_proto_maker.h); stable since Paddle 1.x.
_FORWARD, _BACKWARD, _LOSS = 0x0000, 0x0001, 0x0100

_PIR_REASON = (
    "PIR pipeline programs hold no c_sync_comm_stream to remove: Paddle 3.x's PIR pipeline "
    "passes (paddle.distributed.passes.pipeline_scheduler_pass) put pd_op.send_v2/recv_v2 on "
    "the calc stream with their own execution stream and let the PIR executor's stream events "
    "and per-job skip-gc lists keep sent tensors alive; forward sends and backward recvs also "
    "live in different job programs. (A legacy program translated with paddle.pir.translate_to_pir "
    "does keep pd_op.sync_comm_stream_, but its results are SSA values rewired through "
    "builtin.combine/slice: apply this pass to the legacy program before translating.) Build the "
    "program with FLAGS_enable_pir_api=0 set before paddle is imported to get a legacy program "
    "this pass can rewrite."
)


class SendWaitError(ValueError):
    """The send-wait pass was given something it cannot rewrite; the message says what to do."""


# --------------------------------------------------------------------------- program facts


@dataclass(frozen=True)
class _Comm:
    index: int
    type: str
    vars: tuple[str, ...]
    ring: int | None
    peer_rank: int | None
    role: int | None
    calc_stream: bool | None

    @property
    def forward(self):
        return self.role in (_FORWARD, _FORWARD | _LOSS)

    @property
    def backward(self):
        return self.role in (_BACKWARD, _BACKWARD | _LOSS)


def _attr(op, name):
    return op.attr(name) if op.has_attr(name) else None


def _comm(index, op, var_names):
    ring, peer, role, calc = (_attr(op, n) for n in ("ring_id", "peer", "op_role", "use_calc_stream"))
    return _Comm(
        index,
        op.type,
        tuple(var_names),
        None if ring is None else int(ring),
        None if peer is None else int(peer),
        None if role is None else int(role),
        None if calc is None else bool(calc),
    )


def _interleaved(ops):
    """True when forward compute follows backward compute (several micro-batches unrolled)."""
    seen_backward = False
    for op in ops:
        if op.type in _PASS_THROUGH or op.type in _SENDS or op.type in _RECVS:
            continue
        role = _attr(op, "op_role")
        role = None if role is None else int(role)
        if role in (_BACKWARD, _BACKWARD | _LOSS):
            seen_backward = True
        elif role in (_FORWARD, _FORWARD | _LOSS) and seen_backward:
            return True
    return False


class _Peers:
    """Decides whether a send and a recv talk to the same process."""

    def __init__(self, rings: RingTable):
        self.rings = rings

    def info(self, c: _Comm) -> PeerInfo:
        return self.rings.peer(c.ring, c.peer_rank)

    def same(self, send: _Comm, recv: _Comm):
        """(True/False/None, evidence): None when the program cannot tell."""
        if send.ring is not None and send.ring == recv.ring and send.peer_rank == recv.peer_rank:
            return True, f"same ring {send.ring} and ring peer {send.peer_rank}"
        a, b = self.info(send), self.info(recv)
        if a.endpoint is None or b.endpoint is None:
            return None, "peer unknown"
        if a.endpoint == b.endpoint:
            return True, f"communicator setup: send and recv both reach {a.endpoint}"
        return False, f"the recv comes from {b.endpoint}, the send goes to {a.endpoint}"


# --------------------------------------------------------------------------- the pass


def _legacy_program_types():
    try:
        import paddle  # noqa: F401  (the pass needs a Paddle install to know its Program type)
        from paddle.base.framework import Program
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SendWaitError(
            "static_passes.send_wait needs PaddlePaddle: pip install paddlepaddle (or paddlepaddle-gpu)"
        ) from exc
    try:
        from paddle.pir import Program as PirProgram
    except ImportError:  # pragma: no cover - Paddle without PIR
        PirProgram = ()
    return Program, PirProgram


def _require_legacy(obj, what: str, expected: str):
    """``Program`` if ``obj`` is a legacy program; a clear error for a PIR program or anything else."""
    Program, PirProgram = _legacy_program_types()
    if PirProgram and isinstance(obj, PirProgram):
        raise SendWaitError(f"optimize_pipeline_send_wait got a PIR {what}. {_PIR_REASON}")
    if not isinstance(obj, Program):
        raise TypeError(f"{expected}, got {type(obj).__module__}.{type(obj).__qualname__}")
    return Program


def _section_and_schedule(program):
    Program = _require_legacy(program, "program", "optimize_pipeline_send_wait expects a legacy "
                              "paddle.static.Program (built with FLAGS_enable_pir_api=0)")
    opt = getattr(program, "_pipeline_opt", None) or {}
    section = opt.get("section_program", program)
    if not isinstance(section, Program):
        raise TypeError(f"program._pipeline_opt['section_program'] is a {type(section).__name__}, not a Program")
    return section, opt.get("schedule_mode")


def _startup_desc(startup_program):
    if startup_program is None:
        return None
    Program = _require_legacy(startup_program, "startup program",
                              "startup_program must be a legacy paddle.static.Program or None")
    # After PipelineOptimizer.minimize the startup program keeps this rank's split copy here;
    # fleet writes the communicator setup into that copy.
    inner = (getattr(startup_program, "_pipeline_opt", None) or {}).get("startup_program")
    return (inner if isinstance(inner, Program) else startup_program).desc


def optimize_pipeline_send_wait(program, startup_program=None) -> SendWaitReport:
    """Remove provably redundant forward-send syncs of a static pipeline section, in place.

    For every forward ``send_v2``/``partial_send`` on the communication stream, the pass looks
    for the ``c_sync_comm_stream`` that guards it and for a later backward ``recv_v2``/
    ``partial_recv`` from the same process. When both exist and it is safe, it removes the sync
    and inserts one ``nop`` right after that recv holding every variable whose sync went.

    Args:
        program: a legacy ``paddle.static.Program`` (``FLAGS_enable_pir_api=0``): a section
            program, or the main program after fleet/``PipelineOptimizer.minimize``, whose
            ``_pipeline_opt["section_program"]`` is rewritten (its ``schedule_mode`` is honoured).
            Only block 0 is rewritten. Call once per section program.
        startup_program: the startup program holding the communicator setup
            (``c_comm_init``/``c_gen_*_id``), or the one passed to ``minimize`` (its per-rank
            copy is used). It is how the pass knows which stage each ring reaches: upstream uses
            one ring per direction, so the ring id alone proves nothing.

    Returns:
        A :class:`~static_passes.report.SendWaitReport`: every removed sync with its send, ring
        and peer, every inserted ``nop`` with its variables, every other send with the reason it
        was kept, the ``nop`` ops already present, and notes (fallbacks used).

    Raises:
        TypeError: ``program`` or ``startup_program`` is not a legacy Program.
        SendWaitError: a PIR program (the rewrite does not apply; the message says why).

    Warnings:
        * The same process is proven by the same ring and ring peer, or by the endpoints of the
          communicator setup. Where neither is available the pass falls back to upstream's
          1F1B rule (the first backward recv of the program) and says so in ``report.notes``.
          Pass ``startup_program`` to avoid the fallback.
        * A sync is kept when the schedule is F-then-B, when no backward recv follows the send,
          when the recv comes from another stage, when the sent variable is written again
          before the recv, and when the sync also guards other communication or variables.
        * In a program that unrolls several micro-batches (forward compute after backward
          compute), only a recv of ``<sent var>@GRAD`` counts as proof.
        * Idempotent: a second call changes nothing; ``nop`` ops already there (upstream's
          ``_optimize_forward_send_sync``, or an earlier run) are listed, never touched.
    """
    section, schedule = _section_and_schedule(program)
    startup = _startup_desc(startup_program)
    rings = RingTable([d for d in (startup, section.desc) if d is not None])
    report = SendWaitReport()
    if rings.conflicts:
        report.notes.append(f"rings {sorted(rings.conflicts)} have contradictory communicator setups: ignored")
    block = section.global_block()
    peers = _Peers(rings)
    with _static_mode():
        plan = _plan(list(block.ops), peers, schedule, report)
        _apply(block, plan, peers, report)
    return report


def _static_mode():
    """Program edits create Operators, which need static mode even if the caller is in dygraph."""
    from paddle.base.framework import _dygraph_guard

    return _dygraph_guard(None)


# --------------------------------------------------------------------------- analysis


@dataclass
class _Decision:
    send: _Comm
    sync: _Comm | None = None
    recv: _Comm | None = None
    evidence: str = ""
    reason: str | None = None  # set when the send keeps its sync


def _plan(ops, peers: _Peers, schedule, report):
    sends = [_comm(i, op, op.input_arg_names) for i, op in enumerate(ops) if op.type in _SENDS]
    recvs = [_comm(i, op, op.output_arg_names) for i, op in enumerate(ops) if op.type in _RECVS]
    syncs = [_comm(i, op, op.input_arg_names) for i, op in enumerate(ops) if op.type == "c_sync_comm_stream"]
    backward_recvs = [r for r in recvs if r.backward]
    existing = _existing_nops(ops, sends, recvs, peers, report)
    interleaved = _interleaved(ops)
    fallback_used = set()

    decisions = []
    for send in sends:
        d = _Decision(send)
        decisions.append(d)
        if not send.forward:
            d.reason = f"not a forward send (op_role={send.role}): its sync is outside this pass"
            continue
        if send.calc_stream is not False:
            d.reason = "sends on the calc stream (use_calc_stream=True): no comm-stream sync to remove"
            continue
        d.sync = next(
            (s for s in syncs if s.index > send.index and s.ring == send.ring and set(s.vars) & set(send.vars)),
            None,
        )
        if d.sync is None:
            held = [e for e in existing if set(e.var_names) & set(send.vars)]
            d.reason = (
                f"already optimised: held by the existing nop #{held[0].index}"
                if held
                else f"no c_sync_comm_stream on ring {send.ring} guards it: nothing to remove"
            )
            continue
        if schedule is not None and schedule != "1F1B":
            d.reason = f"the schedule is {schedule}: the pass only rewrites 1F1B pipelines"
            continue
        _choose_recv(d, backward_recvs, peers, interleaved, fallback_used)
        if d.reason is None:
            d.reason = _overwritten(ops, d)

    _check_guards(ops, decisions, syncs)
    for ring in sorted(fallback_used):
        report.notes.append(
            f"ring {ring}: the peer stage is unknown (no communicator setup for it in the program "
            "or startup program), so upstream's 1F1B rule was used: the first backward recv of "
            "the program is taken to come from the stage the send went to"
        )
    for d in decisions:
        if d.reason is not None:
            report.kept_sends.append(KeptSend(d.send.index, d.send.vars, d.send.ring, d.reason))
    return [d for d in decisions if d.reason is None]


def _choose_recv(d: _Decision, backward_recvs, peers: _Peers, interleaved, fallback_used):
    send = d.send
    later = [r for r in backward_recvs if r.index > send.index]
    if interleaved:
        later = [r for r in later if any(v.startswith(s + "@GRAD") for v in r.vars for s in send.vars)]
        if not later:
            d.reason = (
                "the program unrolls several micro-batches and no later backward recv of "
                f"{send.vars[0]}@GRAD proves the send finished"
            )
            return
    if not later:
        d.reason = "no backward recv after the send in this program (F-then-B, or the last stage)"
        return
    verdicts = [(r, *peers.same(send, r)) for r in later]
    proven = next(((r, why) for r, ok, why in verdicts if ok), None)
    if proven is not None:
        d.recv, d.evidence = proven
        return
    if all(ok is False for _, ok, _ in verdicts):
        d.reason = f"the backward recv #{later[0].index} comes from another stage ({verdicts[0][2]})"
        return
    # Upstream's rule: the first backward recv of the program, taken when it follows the send.
    first = backward_recvs[0]
    ok, why = peers.same(send, first)
    if first.index < send.index or ok is False:
        d.reason = f"peer unknown and upstream's 1F1B rule does not apply (first backward recv #{first.index}: {why})"
        return
    d.recv, d.evidence = first, "upstream 1F1B rule (peer stages unknown)"
    fallback_used.add(send.ring)


def _overwritten(ops, d: _Decision):
    sent = set(d.send.vars)
    for i in range(d.send.index + 1, d.recv.index + 1):
        op = ops[i]
        if op.type in _PASS_THROUGH:
            continue
        hit = sent & set(op.output_arg_names)
        if hit:
            return f"{sorted(hit)[0]} is written again by op #{i} ({op.type}) before the recv #{d.recv.index}"
    return None


def _check_guards(ops, decisions, syncs):
    """Keep a sync that also guards something other than removable forward sends."""
    by_sync = {}
    for d in decisions:
        if d.sync is not None:
            by_sync.setdefault(d.sync.index, []).append(d)
    for sync_index, group in by_sync.items():
        sync = group[0].sync
        previous = max((s.index for s in syncs if s.ring == sync.ring and s.index < sync_index), default=-1)
        group_sends = {d.send.index for d in group}
        problem = None
        for i in range(previous + 1, sync_index):
            op = ops[i]
            ring = _attr(op, "ring_id")
            if ring is None or int(ring) != sync.ring or op.type in _PASS_THROUGH:
                continue
            if _attr(op, "use_calc_stream") is True:
                continue
            if i not in group_sends:
                problem = f"the sync #{sync_index} also guards op #{i} ({op.type}) on ring {sync.ring}"
                break
        sent = {v for d in group for v in d.send.vars}
        extra = [v for v in sync.vars if v not in sent]
        if problem is None and extra:
            problem = f"the sync #{sync_index} also guards {extra[0]}, which no forward send on ring {sync.ring} sent"
        blocked = [d for d in group if d.reason is not None]
        if problem is None and blocked:
            problem = f"the sync #{sync_index} also guards send #{blocked[0].send.index}, which keeps it"
        if problem is not None:
            for d in group:
                if d.reason is None:
                    d.reason = problem


def _existing_nops(ops, sends, recvs, peers: _Peers, report):
    recv_at = {r.index: r for r in recvs}
    found = []
    for i, op in enumerate(ops):
        if op.type != "nop":
            continue
        anchor = i - 1
        while anchor >= 0 and ops[anchor].type == "nop":
            anchor -= 1
        held = tuple(op.input_arg_names)
        recv = recv_at.get(anchor)
        if recv is None or not recv.backward:
            entry = ExistingNop(i, held, None, None, "not right after a backward recv: left as is")
        else:
            verdicts = []
            for v in held:
                send = next((s for s in reversed(sends) if s.index < anchor and v in s.vars), None)
                verdicts.append(None if send is None else peers.same(send, recv)[0])
            verified = False if False in verdicts else (True if verdicts and all(verdicts) else None)
            note = {
                True: f"holds them after the recv #{anchor} from the stage they were sent to",
                False: f"holds a variable sent to another stage than the recv #{anchor} comes from: not proven safe",
                None: f"after the recv #{anchor}; the peers are unknown, so it is not verified",
            }[verified]
            entry = ExistingNop(i, held, anchor, verified, note)
        found.append(entry)
        report.existing_nops.append(entry)
    return found


# --------------------------------------------------------------------------- rewrite


def _apply(block, decisions, peers: _Peers, report):
    if not decisions:
        return
    removed = sorted({d.sync.index for d in decisions})
    nop_vars = {}
    for d in decisions:
        held = nop_vars.setdefault(d.recv.index, [])
        held.extend(v for v in d.send.vars if v not in held)
    # Edit from the end so that earlier indices stay valid; a nop goes at recv + 1.
    events = [(i, "remove") for i in removed] + [(r + 0.5, "nop") for r in nop_vars]
    for key, kind in sorted(events, reverse=True):
        if kind == "remove":
            block._remove_op(key, sync=False)
            continue
        recv_index = int(key)
        recv_op = block.ops[recv_index]
        variables = [block.var(v) for v in nop_vars[recv_index]]
        attrs = {"op_role": _BACKWARD}
        if recv_op.has_attr("op_device"):
            attrs["op_device"] = recv_op.attr("op_device")
        block._insert_op_without_sync(
            recv_index + 1, type="nop", inputs={"X": variables}, outputs={"Out": variables}, attrs=attrs
        )
    block._sync_with_cpp()

    def new_index(i):
        return i - sum(r < i for r in removed) + sum(r < i for r in nop_vars)

    recv_of = {d.recv.index: d.recv for d in decisions}
    for recv_index, names in sorted(nop_vars.items()):
        report.inserted_nops.append(
            InsertedNop(new_index(recv_index) + 1, recv_index, peers.info(recv_of[recv_index]), tuple(names))
        )
    for d in decisions:
        report.removed_syncs.append(
            RemovedSync(
                d.sync.index, d.send.index, d.send.vars, d.send.ring, peers.info(d.send),
                d.recv.index, new_index(d.recv.index) + 1, d.evidence,
            )
        )


# --------------------------------------------------------------------------- command line


def _load(path, what):
    """A legacy Program from a serialized ProgramDesc file (.pdmodel), with clear errors."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise SendWaitError(f"cannot read the {what} {path!r}: {exc.strerror}") from exc
    if path.endswith(".json") or data[:1] in (b"{", b"["):
        raise SendWaitError(f"{path!r} holds a PIR program (Paddle 3.x JSON format). {_PIR_REASON}")
    if not data:
        raise SendWaitError(f"the {what} {path!r} is empty: expected a serialized ProgramDesc (.pdmodel)")
    from paddle.base.framework import Program

    try:
        with _static_mode():
            return Program.parse_from_string(data)
    except Exception as exc:
        raise SendWaitError(
            f"the {what} {path!r} is not a serialized legacy ProgramDesc (.pdmodel, as written by "
            f"paddle.static.save_inference_model with FLAGS_enable_pir_api=0): {str(exc).splitlines()[0]}"
        ) from exc


def _write_atomically(path, data):
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.send_wait.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def main(argv=None) -> int:
    """Apply the pass to a saved program: print the report, write OUT, never touch IN."""
    parser = argparse.ArgumentParser(
        prog="python -m static_passes.send_wait",
        description="Remove provably redundant forward-send c_sync_comm_stream ops from a saved "
        "legacy Paddle static pipeline section program, inserting nop ops after the backward recvs.",
    )
    parser.add_argument("input", help="the section program (.pdmodel, a serialized ProgramDesc)")
    parser.add_argument("-o", "--output", required=True, help="where to write the rewritten program")
    parser.add_argument("--startup", help="the startup program holding the communicator setup (c_comm_init)")
    args = parser.parse_args(argv)
    try:
        if os.path.exists(args.output) and os.path.samefile(args.input, args.output):
            raise SendWaitError("the output path is the input file: choose another -o, IN is never modified")
        # Legacy programs only; this must happen before paddle is imported.
        os.environ["FLAGS_enable_pir_api"] = "0"
        program = _load(args.input, "input program")
        startup = _load(args.startup, "startup program") if args.startup else None
        report = optimize_pipeline_send_wait(program, startup)
        _write_atomically(args.output, program.desc.serialize_to_string())
    except (SendWaitError, TypeError, OSError) as exc:
        print(f"static_passes.send_wait: error: {exc}", file=sys.stderr)
        return 2
    print(report)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
