"""Metrics are optional: without the ``prometheus`` extra nothing of ``prometheus_client``
is imported, ``/metrics`` says which extra to install, and health still answers; with it
installed, an app without a port or ``metrics=True`` does not import it either."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_WITHOUT_EXTRA = textwrap.dedent(
    """
    import asyncio, sys
    sys.modules["prometheus_client"] = None  # as if the extra were not installed
    import httpx
    from eventflow import App

    async def main() -> None:
        try:
            App("x", metrics=True)
        except ImportError as exc:
            assert "pip install 'eventflow[prometheus]'" in str(exc), exc
        else:
            raise AssertionError("metrics=True without the extra")
        async with App("x", http_port=0, http_host="127.0.0.1") as app:
            assert app.metrics is None
            port = app.http_address[1]
            async with httpx.AsyncClient() as client:
                metrics = await client.get(f"http://127.0.0.1:{port}/metrics")
                ready = await client.get(f"http://127.0.0.1:{port}/readyz")
        assert metrics.status_code == 503, metrics
        assert "pip install 'eventflow[prometheus]'" in metrics.text, metrics.text
        assert ready.status_code == 200, ready.text
        print("ok")

    asyncio.run(main())
    """
)

_NO_PORT = textwrap.dedent(
    """
    import asyncio, sys
    from eventflow import App

    async def main() -> None:
        async with App("x") as app:
            assert app.metrics is None and app.http_address is None
        assert "prometheus_client" not in sys.modules
        print("ok")

    asyncio.run(main())
    """
)


def _run(code: str) -> None:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_without_the_extra_metrics_answer_503_naming_it_and_health_works() -> None:
    _run(_WITHOUT_EXTRA)


def test_an_app_without_a_port_does_not_import_prometheus_client() -> None:
    _run(_NO_PORT)
