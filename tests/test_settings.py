"""Settings: defaults, then IDLEGRID_* variables, then explicit (non-None) overrides."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from idlegrid.settings import CoordinatorSettings, WorkerSettings


def test_defaults_without_environment() -> None:
    settings = CoordinatorSettings.from_env({})
    assert settings == CoordinatorSettings()
    assert settings.database == f"sqlite+idlegrid:///{Path('idlegrid-data') / 'idlegrid.db'}"


def test_environment_is_read_with_types() -> None:
    settings = CoordinatorSettings.from_env(
        {
            "IDLEGRID_DATA_DIR": "/srv/grid",
            "IDLEGRID_PORT": "9000",
            "IDLEGRID_HEARTBEAT_INTERVAL_S": "2.5",
            "IDLEGRID_HOST": "0.0.0.0",
            "IDLEGRID_DATABASE_URL": "postgresql://db/grid",
            "UNRELATED": "x",
        }
    )
    assert settings.data_dir == Path("/srv/grid")
    assert isinstance(settings.data_dir, Path)
    assert settings.port == 9000 and isinstance(settings.port, int)
    assert settings.heartbeat_interval_s == 2.5 and isinstance(settings.heartbeat_interval_s, float)
    assert settings.host == "0.0.0.0"
    assert settings.database == "postgresql://db/grid"
    assert settings.blob_dir == Path("/srv/grid/blobs")
    assert settings.admin_token_file == Path("/srv/grid/admin-token")


def test_worker_tuples_bools_and_paths() -> None:
    settings = WorkerSettings.from_env(
        {
            "IDLEGRID_SERVERS": "http://a:8000, http://b:8000,,",
            "IDLEGRID_KINDS": "sleep",
            "IDLEGRID_REBENCHMARK": "yes",
            "IDLEGRID_BENCHMARK": "0",
            "IDLEGRID_STATE_DIR": "/var/lib/idlegrid",
            "IDLEGRID_SLOTS": "3",
            "IDLEGRID_BACKOFF_MAX_S": "60",
        }
    )
    assert settings.servers == ("http://a:8000", "http://b:8000")
    assert settings.kinds == ("sleep",)
    assert settings.rebenchmark is True
    assert settings.benchmark is False
    assert settings.state_dir == Path("/var/lib/idlegrid")
    assert settings.slots == 3
    assert settings.backoff_max_s == 60.0


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        ("on", True),
        ("yes", True),
        ("0", False),
        ("false", False),
        ("no", False),
        ("off", False),
    ],
)
def test_bool_spellings(raw: str, value: bool) -> None:
    assert WorkerSettings.from_env({"IDLEGRID_REBENCHMARK": raw}).rebenchmark is value


def test_empty_variables_are_ignored() -> None:
    settings = CoordinatorSettings.from_env({"IDLEGRID_PORT": "", "IDLEGRID_HOST": ""})
    assert settings.port == 8000 and settings.host == "127.0.0.1"


def test_explicit_overrides_win_over_environment() -> None:
    env = {"IDLEGRID_PORT": "9000", "IDLEGRID_HOST": "0.0.0.0"}
    settings = CoordinatorSettings.from_env(env, port=9100, data_dir=Path("/x"))
    assert settings.port == 9100
    assert settings.host == "0.0.0.0"
    assert settings.data_dir == Path("/x")


def test_none_overrides_are_ignored() -> None:
    env = {"IDLEGRID_PORT": "9000"}
    settings = CoordinatorSettings.from_env(env, port=None, host=None)
    assert settings.port == 9000
    assert settings.host == "127.0.0.1"


def test_from_env_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IDLEGRID_MAX_ATTEMPTS", "7")
    monkeypatch.setenv("IDLEGRID_NAME", "den-pc")
    assert CoordinatorSettings.from_env().max_attempts == 7
    assert WorkerSettings.from_env().name == "den-pc"


def test_bad_numbers_raise() -> None:
    with pytest.raises(ValueError):
        CoordinatorSettings.from_env({"IDLEGRID_PORT": "eighty"})


def test_unknown_override_raises() -> None:
    with pytest.raises(TypeError):
        CoordinatorSettings.from_env({}, no_such_setting=1)


def test_settings_are_frozen_and_keyword_only() -> None:
    settings = CoordinatorSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        CoordinatorSettings(Path("/x"))  # type: ignore[misc]


def test_every_field_can_come_from_the_environment() -> None:
    # Each field's type must be one _coerce understands: a new field of another type
    # would silently arrive as a string.
    samples = {
        "Path": "/p",
        "str": "s",
        "int": "3",
        "float": "1.5",
        "bool": "1",
        "tuple[str, ...]": "a,b",
    }
    for cls in (CoordinatorSettings, WorkerSettings):
        fields = dataclasses.fields(cls)
        env = {f"IDLEGRID_{f.name.upper()}": samples[str(f.type)] for f in fields}
        settings = cls.from_env(env)
        for f in fields:
            value = getattr(settings, f.name)
            expected_type = {
                "Path": Path,
                "str": str,
                "int": int,
                "float": float,
                "bool": bool,
                "tuple[str, ...]": tuple,
            }[str(f.type)]
            assert isinstance(value, expected_type), (cls.__name__, f.name, value)
