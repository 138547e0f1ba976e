"""`import paddle_graphpp` must import neither framework (DESIGN: the core knows no framework)."""
import subprocess
import sys


def _modules_after(code: str) -> set:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


def test_top_level_import_loads_no_framework():
    mods = _modules_after("import paddle_graphpp, paddle_graphpp.core.engine, paddle_graphpp.core.memory, "
                          "paddle_graphpp.core.schedule, paddle_graphpp.core.runtime")
    assert "torch" not in mods
    assert "paddle" not in mods


def test_core_modules_import_no_framework():
    import pathlib
    core = pathlib.Path(__file__).resolve().parents[1] / "paddle_graphpp" / "core"
    for path in core.glob("*.py"):
        text = path.read_text()
        for fw in ("torch", "paddle"):
            assert f"\nimport {fw}" not in text and f"\nfrom {fw}" not in text, f"{path.name} imports {fw}"


def test_unknown_public_name_is_a_clear_attribute_error():
    import paddle_graphpp
    try:
        paddle_graphpp.NoSuchThing
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:
        raise AssertionError("expected AttributeError")
