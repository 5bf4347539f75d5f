"""The worker's page token (streams/settings.py): from the environment or a file, never
served empty; the guard itself is exercised over HTTP in tests/kafka/test_authn.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from streams.settings import WorkerSettings, load_settings
from streams.worker import PUBLIC_PAGES

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_no_token_by_default_and_probes_stay_public() -> None:
    assert WorkerSettings().page_token() is None
    assert WorkerSettings().web_host == "127.0.0.1"
    assert PUBLIC_PAGES == ("/health", "/ready")


def test_the_token_comes_from_a_file_trimmed(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("s3cret-token\n")
    assert WorkerSettings(web_token_file=str(path)).page_token() == "s3cret-token"
    path.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        WorkerSettings(web_token_file=str(path)).page_token()


def test_the_environment_gives_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMSTREAM_WORKER__WEB_TOKEN", "from-env")
    assert load_settings(EXAMPLES / "config.yaml").worker.page_token() == "from-env"
