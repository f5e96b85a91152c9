"""The settings file: defaults, overrides, unknown keys, corruption, atomic 0600 writes."""

import logging
import stat

import pytest
import yaml

from localrt import settings as settings_mod
from localrt.settings import SettingsError


def test_created_with_defaults_on_first_load(home):
    s = settings_mod.load()
    rc = home / ".localrtrc"
    assert s.path == rc and rc.exists()
    assert stat.S_IMODE(rc.stat().st_mode) == 0o600
    data = yaml.safe_load(rc.read_text())
    assert data["apiServerHost"] == "127.0.0.1"
    assert data["apiServerPort"] == 39281
    assert data["dataFolderPath"] == str(home / "localrt")
    assert data["logFolderPath"] == str(home / "localrt" / "logs")
    assert data["cors"] is True and data["noProxy"] == "localhost,127.0.0.1,::1"


def test_env_var_and_explicit_path_override_home(home, tmp_path, monkeypatch):
    other = tmp_path / "elsewhere.yml"
    monkeypatch.setenv("LOCALRT_CONFIG", str(other))
    assert settings_mod.load().path == other and other.exists()
    explicit = tmp_path / "explicit.yml"
    assert settings_mod.load(explicit).path == explicit
    assert not (home / ".localrtrc").exists()


def test_paths_derive_from_settings(home):
    rc = home / ".localrtrc"
    rc.write_text(f"dataFolderPath: {home}/data\n")
    s = settings_mod.load()
    assert s.data_dir == home / "data"
    assert s.log_dir == home / "data" / "logs"


def test_unknown_keys_are_kept_and_warned(home, caplog):
    rc = home / ".localrtrc"
    rc.write_text("apiServerPort: 4000\nfutureKey: [1, 2]\n")
    with caplog.at_level(logging.WARNING):
        s = settings_mod.load()
    assert "futureKey" in caplog.text
    s.update({"cors": False})
    data = yaml.safe_load(rc.read_text())
    assert data["futureKey"] == [1, 2] and data["cors"] is False and data["apiServerPort"] == 4000


@pytest.mark.parametrize("text, line", [
    ("apiServerPort: 4000\ncors: [true\n", 3),
    ("apiServerPort: 4000\n  bad: indent\n", 2),
])
def test_corrupt_yaml_names_file_and_line_and_is_left_alone(home, text, line):
    rc = home / ".localrtrc"
    rc.write_text(text)
    with pytest.raises(SettingsError) as info:
        settings_mod.load()
    assert f"{rc}:{line}" in str(info.value)
    assert rc.read_text() == text


def test_wrong_type_names_key_and_line(home):
    rc = home / ".localrtrc"
    rc.write_text("cors: true\napiServerPort: lots\n")
    with pytest.raises(SettingsError) as info:
        settings_mod.load()
    assert f"{rc}:2: apiServerPort" in str(info.value)


def test_not_a_mapping(home):
    (home / ".localrtrc").write_text("- a\n- b\n")
    with pytest.raises(SettingsError, match="mapping"):
        settings_mod.load()


def test_api_field_names_are_read_as_aliases(home):
    (home / ".localrtrc").write_text("proxy_url: http://p:3128\n")
    assert settings_mod.load()["proxyUrl"] == "http://p:3128"


def test_update_is_atomic_and_keeps_mode(home):
    s = settings_mod.load()
    rc = home / ".localrtrc"
    rc.chmod(0o644)
    s.update({"proxyPassword": "secret"})
    assert stat.S_IMODE(rc.stat().st_mode) == 0o600
    assert [p.name for p in home.iterdir()] == [".localrtrc"]  # no temp files left
    assert yaml.safe_load(rc.read_text())["proxyPassword"] == "secret"


def test_update_keeps_hand_edits(home):
    s = settings_mod.load()
    rc = home / ".localrtrc"
    rc.write_text(rc.read_text().replace("apiServerPort: 39281", "apiServerPort: 40000"))
    s.update({"cors": False})
    data = yaml.safe_load(rc.read_text())
    assert data["apiServerPort"] == 40000 and data["cors"] is False


def test_overrides_are_not_written(home):
    s = settings_mod.load()
    s.override(apiServerPort=5555)
    assert s["apiServerPort"] == 5555
    s.update({"cors": False})
    assert yaml.safe_load((home / ".localrtrc").read_text())["apiServerPort"] == 39281
