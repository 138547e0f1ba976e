"""tools/train_gpt.py on CPU: the README's default command, both frameworks, bad input, a dying rank.

Every run is a subprocess in its own session, under a timeout, killed with its ranks afterwards.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from testing import launch
from tools.benchlib import last_json_line

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SCRIPT = os.path.join(REPO, "tools", "train_gpt.py")
FIELDS = {"framework", "pp", "vpp", "cudagraph", "steps", "loss_first", "loss_last", "tokens_per_s",
          "peak_mem_mib", "device"}


def train(args, timeout=150):
    """Run the trainer; returns (exit code, stdout, stderr, seconds). Kills every rank on timeout."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "PADDLE_TRAINER_ID")}
    end = launch.run([sys.executable, SCRIPT, *args], env=env, cwd=REPO, timeout=timeout)
    if end.timed_out:
        pytest.fail(f"train_gpt.py {' '.join(args)} did not finish in {timeout}s")
    return end.returncode, end.stdout, end.stderr, end.seconds


def last_json(out):
    record = last_json_line(out)
    assert record is not None, f"no JSON line at the end of the output:\n{out[-2000:]}"
    assert FIELDS <= set(record), f"missing fields {FIELDS - set(record)}"
    return record


def flaky_gloo_init(rc, out, err):
    # Gloo sometimes refuses a connection while groups are built on a loaded 2-core machine.
    return rc != 0 and "Connection refused" in out + err and '"framework"' not in out


def train_ok(args, timeout=150):
    """A run that must succeed: (its JSON record, its stdout followed by its stderr, seconds)."""
    for _ in range(4):  # Paddle's gloo setup in fleet.init now and then refuses a connection
        rc, out, err, seconds = train(args, timeout)
        if not flaky_gloo_init(rc, out, err):
            break
    assert rc == 0, f"rc={rc}\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}"
    return last_json(out), out + err, seconds


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_default_command_trains_paddle_pp2_within_a_minute():
    record, out, seconds = train_ok(["--cudagraph"])  # the README's demo command
    assert seconds < 60, f"the README's command took {seconds:.0f}s"
    assert (record["framework"], record["pp"], record["vpp"], record["device"]) == ("paddle", 2, 1, "cpu")
    assert record["cudagraph"] is True and record["graphed_runs_on_rank"] >= 1
    assert len(record["losses"]) == record["steps"]
    assert record["loss_last"] <= 0.7 * record["loss_first"], record["losses"]  # the demo visibly learns
    assert record["tokens_per_s"] > 0 and record["peak_mem_mib"] > 0
    lines = out.splitlines()
    assert lines[0].startswith("train_gpt: paddle pp=2"), lines[0]  # at once, before the ranks import Paddle
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == record["steps"] and all(line.endswith(" s elapsed)") for line in steps), steps
    # the losses and the summary, not the launcher's configuration dump, fleet's INFO log or Paddle's import notes
    assert "LAUNCH INFO" not in out and "pp_layers.py" not in out and "topology.py" not in out, out[-4000:]
    assert "No ccache found" not in out and "tcp_store" not in out, out[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(280)
@pytest.mark.parametrize("framework,extra", [
    ("paddle", []),
    ("torch", []),
    ("torch", ["--vpp", "2"]),
    ("torch", ["--graph-optimizer"]),
    ("torch", ["--vpp", "2", "--schedule", "interleaved_zb"]),
    ("torch", ["--vpp", "2", "--schedule", "zbv"]),
    ("torch", ["--vpp", "2", "--schedule", "dualpipev"]),
], ids=["paddle-1F1B", "torch-1F1B", "torch-interleaved", "torch-graph-optimizer", "torch-interleaved-zb",
        "torch-zbv", "torch-dualpipev"])
def test_cudagraph_on_and_off_give_identical_losses(framework, extra):
    args = ["--framework", framework, "--steps", "5", *extra]
    eager, _, _ = train_ok(args)
    graphed, _, _ = train_ok(args + ["--cudagraph"])
    assert graphed["cudagraph"] is True and graphed["graphed_runs_on_rank"] >= 1
    assert graphed["losses"] == eager["losses"]
    assert all(loss == loss for loss in eager["losses"])


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_tied_embedding_gives_the_same_model_whatever_the_pipeline():
    # dropout off: pp=1 (both tie ends on one rank), pp=2 and pp=2 x vpp=2 compute the same losses
    args = ["--framework", "torch", "--steps", "3", "--dropout", "0"]
    single, _, _ = train_ok(args + ["--pp", "1"])
    piped, _, _ = train_ok(args + ["--pp", "2", "--vpp", "2"])
    assert piped["losses"] == pytest.approx(single["losses"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(280)
@pytest.mark.parametrize("schedule", ["interleaved_zb", "zbv", "dualpipev"])
def test_zero_bubble_schedules_train_the_same_model(schedule):
    # dropout off: the zero-bubble schedules (V-shaped placement for zbv and dualpipev, tied
    # embedding then on one rank) compute the losses of the model on one rank
    args = ["--framework", "torch", "--steps", "3", "--dropout", "0"]
    single, _, _ = train_ok(args + ["--pp", "1"])
    piped, _, _ = train_ok(args + ["--pp", "2", "--vpp", "2", "--schedule", schedule, "--cudagraph"])
    assert piped["schedule"] == schedule
    assert piped["losses"] == pytest.approx(single["losses"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(280)
@pytest.mark.parametrize("pp", [1, 2])
def test_tensor_parallel_blocks_compute_the_dense_model(pp):
    # dropout off: tp=2 (heads and MLP split over 2 gloo ranks, all-reduces through the
    # project's dispatcher) trains the same model as tp=1; graphed (eager on CPU) as well
    args = ["--framework", "torch", "--steps", "3", "--dropout", "0", "--heads", "2", "--pp", str(pp)]
    dense, _, _ = train_ok(args)
    split, _, _ = train_ok(args + ["--tp", "2", "--cudagraph"])
    assert (split["tp"], dense["tp"]) == (2, 1)
    assert len(split["per_rank"]) == 2 * pp
    assert split["losses"] == pytest.approx(dense["losses"], rel=1e-5)
    assert split["loss_last"] < split["loss_first"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_text_file_data(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("pipeline stages pass activations along; " * 200)
    record, _, _ = train_ok(["--framework", "torch", "--pp", "1", "--steps", "2", "--data", str(text)])
    assert record["config"]["data"] == str(text)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args,fix", [
    (["--layers", "5"], "--layers"),
    (["--framework", "torch", "--vpp", "2", "--micro-batches", "3"], "--micro-batches 4"),
    (["--micro-batches", "1"], "--micro-batches 2"),
    (["--vpp", "2"], "--pp 3"),
    (["--data", "/nonexistent/corpus.txt"], "--data"),
    (["--hidden", "100"], "--hidden"),
    (["--graph-optimizer"], "--framework torch"),
    (["--graph-accumulate-grads"], "--framework torch"),
    (["--keep-grads"], "--framework torch"),
    (["--tp", "2"], "--framework torch"),
    (["--framework", "torch", "--tp", "2", "--heads", "3", "--hidden", "96"], "--heads a multiple of 2"),
    (["--schedule", "zbv"], "--framework torch"),
    (["--framework", "torch", "--schedule", "zbv"], "--vpp 2"),
    (["--framework", "torch", "--schedule", "interleaved_zb"], "--vpp 2"),
    (["--framework", "torch", "--vpp", "2", "--schedule", "dualpipev", "--micro-batches", "2"], "--micro-batches 4"),
    (["--compile"], "--framework torch"),
    (["--framework", "torch", "--compile", "cudagraphs"], "--compile cudagraphs: the backend must be one of"),
    (["--framework", "torch", "--compile", "--tp", "2", "--heads", "2"], "--tp 1"),
    (["--framework", "torch", "--compile", "--vpp", "2", "--schedule", "zbv"], "--schedule 1f1b"),
    (["--lr-warmup", "-1"], "--lr-warmup"),
    (["--lr", "0"], "--lr must be positive"),
])
def test_bad_configurations_fail_before_any_rank_starts(args, fix):
    rc, out, err, seconds = train(args, timeout=60)
    assert rc == 2, (out, err)
    assert fix in err and "error" in err
    assert seconds < 20


@pytest.mark.timeout(60)
def test_text_too_short_for_the_sequence_length(tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("too short")
    rc, out, err, _ = train(["--data", str(text), "--seq-len", "64"], timeout=30)
    assert rc == 2 and "smaller --seq-len" in err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_dying_rank_stops_the_others():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = launch.start([sys.executable, SCRIPT, "--framework", "torch", "--steps", "100000"],
                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
    try:
        # rank 1 prints the step lines: once one is out, both ranks are training
        assert proc.stdout.readline().startswith("train_gpt: torch"), "no first line"
        assert proc.stdout.readline().startswith("step "), "training did not start"
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            ranks = [int(pid) for pid in f.read().split()]
        assert len(ranks) == 2
        os.kill(ranks[0], signal.SIGKILL)
        start = time.monotonic()
        rc = proc.wait(timeout=60)
        assert rc != 0
        assert time.monotonic() - start < 30
        for pid in ranks:
            assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid), f"rank process {pid} still running"
    finally:
        launch.stop(proc)


def _is_zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_validation_rules_as_a_library():
    from tools.train_gpt import ConfigError, batch_for_step, load_corpus, parse_args, validate

    validate(parse_args([]))  # the defaults work
    validate(parse_args(["--framework", "torch", "--pp", "2", "--vpp", "2", "--micro-batches", "4"]))
    with pytest.raises(ConfigError, match="multiple of 4"):
        validate(parse_args(["--framework", "torch", "--pp", "2", "--vpp", "2", "--layers", "6"]))
    with pytest.raises(ConfigError, match="2\\*pp = 8"):
        validate(parse_args(["--pp", "4", "--vpp", "2", "--layers", "8", "--micro-batches", "4"]))
    cfg = parse_args(["--micro-batches", "2", "--micro-batch-size", "3", "--seq-len", "16"])
    corpus = load_corpus(cfg)
    x, y = batch_for_step(corpus, cfg, 7)
    assert x.shape == y.shape == (6, 16)
    assert (x[:, 1:] == y[:, :-1]).all()
    x2, _ = batch_for_step(corpus, cfg, 7)
    assert (x == x2).all()  # every rank draws the same batch


@pytest.mark.slow
def test_benchmark_run_starts_again_once_when_its_rendezvous_port_was_taken(monkeypatch):
    """tools.bench_pipeline.run_one (every benchmark's and the 2-GPU tests' runner): a run whose
    port was taken by another job on the host (a rank's EADDRINUSE) is started once more; any
    other failure is reported as it is."""
    from tools import bench_pipeline

    real_run, calls = launch.run, []

    def port_taken_once(argv, **kw):
        calls.append(argv)
        if len(calls) == 1:
            return launch.Finished(1, "", "DistNetworkError: ... errno: 98 - EADDRINUSE, message: address "
                                   "already in use\ntrain_gpt: a rank exited with code 1", 0.1, False, False)
        return real_run(argv, **kw)

    monkeypatch.setattr(bench_pipeline.launch, "run", port_taken_once)
    args = ["--framework", "torch", "--pp", "2", "--hidden", "32", "--layers", "2", "--heads", "2",
            "--seq-len", "16", "--micro-batches", "2", "--steps", "2"]
    record = bench_pipeline.run_one(args, timeout=120)
    assert "error" not in record, record
    assert record["port_retries"] == 1 and len(record["losses"]) == 2 and len(calls) == 2

    calls.clear()
    monkeypatch.setattr(bench_pipeline.launch, "run", lambda argv, **kw: calls.append(argv) or real_run(argv, **kw))
    record = bench_pipeline.run_one(args + ["--micro-batches", "1"], timeout=120)  # fewer than --pp: refused
    assert record["error"].startswith("exit code") and "port_retries" not in record and len(calls) == 1


def test_compile_and_warmup_flags_as_a_library():
    from tools.train_gpt import StepTimer, lr_factor, parse_args, torch_compile_kwargs, untimed_steps, validate

    plain = parse_args(["--framework", "torch"])
    compiled = parse_args(["--framework", "torch", "--compile", "--cudagraph"])
    assert (compiled.compile, compiled.cudagraph) == ("inductor", True)  # --compile takes no value from the next flag
    assert parse_args(["--framework", "torch", "--compile", "aot_eager"]).compile == "aot_eager"
    validate(compiled)
    assert (torch_compile_kwargs(plain), torch_compile_kwargs(compiled)) == (None, {})
    assert torch_compile_kwargs(parse_args(["--compile", "aot_eager"])) == {"backend": "aot_eager"}
    # compiled runs leave two more steps untimed, and the timer starts after them
    assert (untimed_steps(plain), untimed_steps(compiled)) == (4, 6)
    long = parse_args(["--framework", "torch", "--compile", "--steps", "12"])
    assert StepTimer(long, lambda: None).skip == 6 and StepTimer(long, lambda: None).timed_steps == 6
    assert StepTimer(parse_args(["--framework", "torch", "--compile", "--steps", "5"]), lambda: None).skip == 4
    # --profile-steps counts the compiled run's untimed steps
    validate(parse_args(["--framework", "torch", "--steps", "12", "--profile-steps", "7"]))
    with pytest.raises(Exception, match="at most 5 with --steps 12"):
        validate(parse_args(["--framework", "torch", "--compile", "--steps", "12", "--profile-steps", "7"]))
    assert [lr_factor(s, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [lr_factor(s, 0) for s in range(2)] == [1.0, 1.0]


def test_the_warmup_schedules_the_same_rates_in_both_frameworks():
    import torch

    from tools.train_gpt import paddle_lr_schedule, parse_args, torch_lr_schedule

    cfg = parse_args(["--lr", "1e-3", "--lr-warmup", "3"])
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=cfg.lr)
    sched, paddle_sched = torch_lr_schedule(cfg, opt), paddle_lr_schedule(cfg)
    torch_rates, paddle_rates = [], []
    for _ in range(5):
        torch_rates.append(opt.param_groups[0]["lr"])
        paddle_rates.append(paddle_sched())
        opt.step()
        sched.step()
        paddle_sched.step()
    assert torch_rates == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3, 1e-3])
    assert paddle_rates == pytest.approx(torch_rates)
    assert torch_lr_schedule(parse_args([]), opt) is None and paddle_lr_schedule(parse_args([])) is None


def test_under_the_graphed_optimizer_the_warmup_fills_the_lr_tensor_the_graph_reads():
    # On a GPU GraphedOptimizer turns lr into a device tensor that the captured step reads; the
    # schedule must update that tensor in place (a new object would leave the graph at the old
    # rate). A tensor lr on the CPU shows what the scheduler does to it.
    import torch

    from paddle_graphpp import GraphedOptimizer
    from tools.train_gpt import parse_args, torch_lr_schedule

    lr = torch.tensor(1e-3)
    param = torch.nn.Parameter(torch.ones(2))
    gopt = GraphedOptimizer(torch.optim.AdamW([param], lr=lr, foreach=False))
    sched = torch_lr_schedule(parse_args(["--lr", "1e-3", "--lr-warmup", "4"]), gopt)
    assert sched.optimizer is gopt.optimizer
    seen = []
    for _ in range(5):
        param.grad = torch.ones(2)
        gopt.step()
        sched.step()
        assert gopt.optimizer.param_groups[0]["lr"] is lr
        seen.append(lr.item())
    assert seen == pytest.approx([5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_compiled_stages_train_the_eager_model_with_and_without_graphs():
    # aot_eager (dynamo + AOTAutograd, eager kernels; what the compile tests use on CPU): the
    # compiled stages, and the compiled stages inside the graphed runs (eager on CPU), give
    # eager's losses bit for bit; every rank compiles, in the first step only.
    args = ["--framework", "torch", "--steps", "7", "--dropout", "0"]
    eager, _, _ = train_ok(args)
    compiled, _, _ = train_ok(args + ["--compile", "aot_eager"])
    both, _, _ = train_ok(args + ["--compile", "aot_eager", "--cudagraph"])
    for run in (compiled, both):
        assert run["losses"] == eager["losses"]
        assert run["config"]["compile"] == "aot_eager" and run["untimed_steps"] == 6 and run["timed_steps"] == 1
        assert [r["compile_steps"] for r in run["per_rank"]] == [[0], [0]]
        assert all(r["frames_compiled"] >= 2 for r in run["per_rank"])  # the embedding or head, and the blocks
    assert both["graphed_runs_on_rank"] >= 1 and "compile_steps" not in eager["per_rank"][0]


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_inductor_compiled_graphed_stages_train_like_eager():
    args = ["--framework", "torch", "--steps", "5", "--dropout", "0", "--layers", "2"]
    eager, _, _ = train_ok(args)
    both, _, _ = train_ok(args + ["--compile", "--cudagraph"], timeout=240)
    assert both["config"]["compile"] == "inductor"
    assert both["losses"] == pytest.approx(eager["losses"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(280)
@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_lr_warmup_starts_at_a_fraction_of_the_rate(framework):
    # the first step's loss comes before any update; warmup then takes smaller steps than the
    # full rate, so the second loss differs; the graphed optimizer follows the same schedule
    args = ["--framework", framework, "--steps", "3", "--dropout", "0", "--lr", "3e-3"]
    full, _, _ = train_ok(args)
    warm, _, _ = train_ok(args + ["--lr-warmup", "3"])
    assert warm["config"]["lr_warmup"] == 3
    assert warm["losses"][0] == full["losses"][0] and warm["losses"][1] != full["losses"][1]
    assert warm["loss_last"] < warm["loss_first"]
    if framework == "torch":
        graphed_opt, _, _ = train_ok(args + ["--lr-warmup", "3", "--graph-optimizer"])
        assert graphed_opt["losses"] == warm["losses"]
