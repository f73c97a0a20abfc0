"""An unexpected error in a route is the 500 ``internal`` problem and the connection goes on
serving: a real uvicorn on loopback, two requests on one keep-alive connection. (Starlette's
outermost error middleware re-raises what it answered, so uvicorn logged it again and the
client's next request on the connection could be reset.)"""

from __future__ import annotations

import logging
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI

from bnrecal.api.problems import install_problem_handlers
from tests.api.conftest import free_port


def test_an_unexpected_error_is_a_500_problem_and_the_connection_stays_usable(caplog):
    app = FastAPI()
    install_problem_handlers(app)

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("database or something broke")

    @app.get("/fine")
    def fine() -> dict[str, str]:
        return {"status": "ok"}

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        with caplog.at_level(logging.ERROR), httpx.Client(base_url=f"http://127.0.0.1:{server.config.port}") as client:
            failed = client.get("/boom")
            assert failed.status_code == 500 and failed.headers["content-type"] == "application/problem+json"
            assert failed.json()["type"] == "https://bnrecal.dev/problems/internal"
            assert "RuntimeError" in failed.json()["detail"] and "database" not in failed.json()["detail"]
            assert client.get("/fine").json() == {"status": "ok"}  # the same connection, not reset
        assert not [r for r in caplog.records if r.name.startswith("uvicorn") and r.levelno >= logging.ERROR]
    finally:
        server.should_exit = True
        thread.join(10)
