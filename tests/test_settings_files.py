"""The settings that name a file: relative to the configuration file that names them, so a
file and the keys beside it go together wherever they are read from."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from streams.common.settings import FILE_SETTINGS, Settings, load_settings


def named_files(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Every setting of ``model`` whose name says it is a file."""
    found: set[tuple[str, ...]] = set()
    for name, field in model.model_fields.items():
        kind: Any = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            found |= named_files(kind, (*prefix, name))
        elif name.endswith(("_file", "cafile", "certfile", "keyfile")):
            found.add((*prefix, name))
    return found


def test_every_setting_that_names_a_file_is_listed() -> None:
    assert named_files(Settings) == set(FILE_SETTINGS)


def test_a_relative_path_in_the_file_is_relative_to_the_file_and_in_a_variable_to_the_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in os.environ if name.startswith("VMSTREAM_")]:
        monkeypatch.delenv(name)
    where = tmp_path / "etc"
    where.mkdir()
    (where / "config.yaml").write_text(
        "az: az1\n"
        "auth: {mode: jwt, jwks_file: keys/jwks.json}\n"
        "signing: {keys_file: /abs/signing}\n"
        "notify: {smtp: {ssl_cafile: ../ca.crt}}\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    settings = load_settings(Path("etc") / "config.yaml")
    assert settings.auth.jwks_file == str(where / "keys" / "jwks.json")
    assert settings.signing.keys_file == "/abs/signing"
    assert settings.notify.smtp.ssl_cafile == str(where / ".." / "ca.crt")
    monkeypatch.setenv("VMSTREAM_AUTH__JWKS_FILE", "from/cwd.json")
    assert load_settings(where / "config.yaml").auth.jwks_file == "from/cwd.json"
