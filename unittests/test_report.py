"""``python -m paddle_graphpp``: the environment report runs fast on a CPU machine, imports no
framework there, and says what falls back."""
import json
import subprocess
import sys
import time

from paddle_graphpp import report


def test_the_command_prints_the_report_and_exits_0_quickly():
    start = time.monotonic()
    end = subprocess.run([sys.executable, "-m", "paddle_graphpp"], capture_output=True, text=True, timeout=60)
    assert end.returncode == 0, end.stderr
    assert time.monotonic() - start < 20  # a second where no GPU is visible; generous for a busy CI machine
    for part in ("integrations", "torch", "transformers", "settings in force", "features", "cuda_graphs"):
        assert part in end.stdout


def test_json_names_every_integration_and_feature():
    end = subprocess.run([sys.executable, "-m", "paddle_graphpp", "--json", "--no-device"], capture_output=True,
                         text=True, timeout=60, check=True)
    data = json.loads(end.stdout)
    assert set(data["integrations"]) == {"torch", "paddle", "transformers", "paddleformers", "megatron-core"}
    assert set(data["features"]) >= {"cuda_graphs", "custom_all_reduce", "expandable_graph_pools",
                                     "stream_ordered_allocator", "capture_agreement_and_replay_watchdog"}
    assert data["torch"] is None  # --no-device: no framework imported, no capture tried


def test_without_a_working_capture_the_features_say_what_falls_back(monkeypatch):
    monkeypatch.setenv("FLAGS_graphpp_pool_expandable", "0")
    monkeypatch.setenv("FLAGS_graphpp_replay_timeout", "60")
    data = report.environment_report(check_device=False)
    assert data["features"]["cuda_graphs"].startswith("falls back to eager")
    assert "falls back to NCCL" in data["features"]["custom_all_reduce"]
    assert data["features"]["expandable_graph_pools"].startswith("off")
    assert data["settings"]["FLAGS_graphpp_replay_timeout"] == "60"
    assert "paddle_graphpp" in report.format_report(data)


def test_no_framework_is_imported_without_a_device():
    code = ("import sys; from paddle_graphpp import report; report.environment_report(check_device=False); "
            "print(sorted(m for m in ('torch', 'paddle') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
