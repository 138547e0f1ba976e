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
    if not report._gpu_visible():  # what does not apply here is not said (a setting in force is still listed)
        features = end.stdout.split("\nfeatures:\n", 1)[1]
        for absent in ("expandable_graph_pools", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "custom_all_reduce"):
            assert absent not in features
        assert "cuda_graphs: falls back to eager (no GPU visible)" in features


def test_json_names_every_integration_and_feature():
    end = subprocess.run([sys.executable, "-m", "paddle_graphpp", "--json", "--no-device"], capture_output=True,
                         text=True, timeout=60, check=True)
    data = json.loads(end.stdout)
    assert set(data["integrations"]) == {"torch", "paddle", "transformers", "paddleformers", "megatron-core"}
    assert "cuda_graphs" in data["features"]
    assert data["torch"] is None  # --no-device: no framework imported, no capture tried


def test_the_gpu_features_are_listed_only_where_a_graph_captured():
    assert list(report._features(None, gpu_visible=False)) == ["cuda_graphs"]
    assert report._features(None, gpu_visible=True)["cuda_graphs"].startswith("not checked")
    failed = report._features({"capture": "fails: RuntimeError: no kernel image"}, gpu_visible=True)
    assert failed == {"cuda_graphs": "falls back to eager (fails: RuntimeError: no kernel image)"}
    on_gpu = {"capture": "works", "devices": ["H200", "H200"], "allocator_backend": "native"}
    features = report._features(on_gpu, gpu_visible=True)
    assert set(features) == {"cuda_graphs", "custom_all_reduce", "expandable_graph_pools",
                             "stream_ordered_allocator", "capture_agreement_and_replay_watchdog"}
    assert features["cuda_graphs"] == "available" and features["expandable_graph_pools"] == "on"


def test_the_all_reduce_advice_is_given_only_where_it_could_run(monkeypatch):
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
    one = report._features({"capture": "works", "devices": ["H200"]}, gpu_visible=True)["custom_all_reduce"]
    assert "needs 2 or 4 GPUs; 1 here" in one and "TORCH_SYMM_MEM_DISABLE_MULTICAST" not in one
    two = {"capture": "works", "devices": ["H200", "H200"]}
    assert "set TORCH_SYMM_MEM_DISABLE_MULTICAST=1" in report._features(two, gpu_visible=True)["custom_all_reduce"]
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    assert report._features(two, gpu_visible=True)["custom_all_reduce"] == "available for groups of 2 or 4 ranks"


def test_the_console_script_is_the_report():
    from importlib import metadata

    scripts = {e.name: e.value for e in metadata.entry_points(group="console_scripts")}
    assert scripts.get("paddle-graphpp-report") == "paddle_graphpp.report:main"


def test_without_a_working_capture_the_features_say_what_falls_back(monkeypatch):
    monkeypatch.setenv("FLAGS_graphpp_pool_expandable", "0")
    monkeypatch.setenv("FLAGS_graphpp_replay_timeout", "60")
    monkeypatch.setattr(report, "_gpu_visible", lambda: False)  # a CPU machine, wherever this runs
    data = report.environment_report(check_device=False)
    assert data["features"]["cuda_graphs"].startswith("falls back to eager (no GPU visible)")
    assert set(data["features"]) == {"cuda_graphs"}
    assert data["settings"]["FLAGS_graphpp_replay_timeout"] == "60"  # the settings are listed all the same
    on_gpu = report._features({"capture": "works", "devices": ["H200"]}, gpu_visible=True)
    assert on_gpu["expandable_graph_pools"] == "off (FLAGS_graphpp_pool_expandable=0)"
    assert "paddle_graphpp" in report.format_report(data)


def test_no_framework_is_imported_without_a_device():
    code = ("import sys; from paddle_graphpp import report; report.environment_report(check_device=False); "
            "print(sorted(m for m in ('torch', 'paddle') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
