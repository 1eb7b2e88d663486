import pytest

import torchport
from torchport import _settings


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in _settings.VARIABLES.values():
        monkeypatch.delenv(variable, raising=False)
    assert _settings.get() == _settings.Settings()


def test_environment_is_read_and_normalised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHPORT_DEVICE", " NPU:1 ")
    monkeypatch.setenv("TORCHPORT_SIMULATE_DEVICES", "2")
    monkeypatch.setenv("TORCHPORT_PROBE", "off")
    s = _settings.get()
    assert (s.device, s.simulate_devices, s.probe) == ("npu:1", 2, False)


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("TORCHPORT_DEVICE", "gpu 0", "is not a device"),
        ("TORCHPORT_DEVICE", "npu:-1", "is not a device"),
        ("TORCHPORT_SIMULATE", "cuda", "valid values: npu"),
        ("TORCHPORT_SIMULATE_DEVICES", "0", "integers 1 to 16"),
        ("TORCHPORT_SIMULATE_DEVICES", "two", "integers 1 to 16"),
        ("TORCHPORT_PROBE", "maybe", "valid values: 1, true"),
        ("TORCHPORT_LOG", "compile,pases", "unknown log topic(s) pases; valid: compile, kernels, fallback, all"),
        ("TORCHPORT_STRICT", "2", "valid values: 1, true"),
        ("TORCHPORT_DIST_TIMEOUT", "0", "a positive number of seconds"),
        ("TORCHPORT_DIST_TIMEOUT", "soon", "a positive number of seconds"),
        ("TORCHPORT_LOSS_WORKSPACE_MIB", "-8", "a number of MiB, 0 or more"),
        ("TORCHPORT_LOSS_WORKSPACE_MIB", "256MiB", "a number of MiB, 0 or more"),
    ],
)
def test_invalid_values_name_the_variable_and_the_valid_ones(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, expected: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=variable) as err:
        _settings.get()
    assert expected in str(err.value)


def test_override_wins_over_environment_and_is_scoped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHPORT_DEVICE", "npu")
    with torchport.settings.override(device="cpu") as s:
        assert s.device == "cpu"
        assert _settings.get().device == "cpu"
        with torchport.settings.override(probe=False):
            assert _settings.get().device == "cpu" and _settings.get().probe is False
    assert _settings.get().device == "npu"


def test_override_rejects_unknown_and_invalid() -> None:
    with pytest.raises(ValueError, match="unknown torchport setting.*devise.*valid: device"):
        with torchport.settings.override(devise="cpu"):
            pass
    with pytest.raises(ValueError, match="not a device"):
        with torchport.settings.override(device="np u"):
            pass


def test_environment_lists_what_matters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("TORCHPORT_PROBE", "1")
    monkeypatch.setenv("UNRELATED_VARIABLE", "x")
    env = _settings.environment()
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1" and env["TORCHPORT_PROBE"] == "1"
    assert "UNRELATED_VARIABLE" not in env


def test_log_strict_and_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("TORCHPORT_LOG", " Compile , fallback")
    monkeypatch.setenv("TORCHPORT_STRICT", "yes")
    monkeypatch.setenv("TORCHPORT_CACHE_DIR", str(tmp_path / "cache"))
    s = _settings.get()
    assert s.log == {"compile", "fallback"} and s.strict is True
    assert _settings.logging_enabled("compile") and not _settings.logging_enabled("kernels")
    assert _settings.cache_dir() == str(tmp_path / "cache")
    monkeypatch.setenv("TORCHPORT_LOG", "all")
    assert _settings.value("log") == set(_settings.LOG_TOPICS)
    monkeypatch.delenv("TORCHPORT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _settings.cache_dir() == str(tmp_path / "xdg" / "torchport")
    with pytest.raises(ValueError, match="unknown log topic 'pases'"):
        _settings.logging_enabled("pases")


def test_log_messages_reach_stderr_only_when_asked(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from torchport import _logging

    monkeypatch.delenv("TORCHPORT_LOG", raising=False)
    _logging.log("compile", "pass %s changed %d nodes", "rms_norm", 3)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("TORCHPORT_LOG", "compile")
    _logging.log("compile", "pass %s changed %d nodes", "rms_norm", 3)
    _logging.log("kernels", "not wanted")
    err = capsys.readouterr().err
    assert "[torchport.compile] pass rms_norm changed 3 nodes" in err and "not wanted" not in err
