"""The worker's page token (streams/common/settings.py): from the environment or a file, never
served empty; the guard itself is exercised over HTTP in tests/kafka/test_authn.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from streams.common.settings import WorkerSettings, load_settings
from streams.worker.app import PUBLIC_PAGES

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


def test_a_header_that_is_not_utf8_is_refused_like_any_wrong_token() -> None:
    """Header bytes that are not UTF-8 (aiohttp keeps them as surrogates): a 401, not a 500
    with a traceback in the log for every such request."""
    import asyncio
    import socket

    import aiohttp.web

    from streams.worker.app import pages_guard

    async def page(request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"pending": []})

    async def status_lines() -> list[bytes]:
        app = aiohttp.web.Application(middlewares=[pages_guard("s3cret-token")])
        app.router.add_get("/pending", page)
        runner = aiohttp.web.AppRunner(app)
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            lines = []
            for token in (b"\xff\xfe", b"s3cret-token"):
                reader, writer = await asyncio.open_connection("127.0.0.1", port, family=socket.AF_INET)
                writer.write(b"GET /pending HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + token
                             + b"\r\nConnection: close\r\n\r\n")
                lines.append((await reader.readline()).strip())
                writer.close()
            return lines
        finally:
            await runner.cleanup()

    assert asyncio.run(status_lines()) == [b"HTTP/1.1 401 Unauthorized", b"HTTP/1.1 200 OK"]
