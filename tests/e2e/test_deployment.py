"""The recipes of docs/deployment.md, each run for real: server flags, nginx, unix sockets.

Every request below comes from loopback with seven different forged
``X-Forwarded-For`` values. A recipe is right when the forgeries buy nothing:
exactly the limit passes, and the counter rows name one client.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from servers import free_port
from support import stop_process

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent
LIMIT = 5  # deploy_app.LIMIT
STARTUP = 30.0
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


@contextlib.contextmanager
def running(
    argv: list[str], data: Path, env: dict[str, str], health: str | None, name: str
) -> Iterator[subprocess.Popen[bytes]]:
    log = data / f"{name}.log"
    full_env = {
        **os.environ,
        "PORCH_DATA": str(data),
        "PYTHONPATH": os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]),
        **env,
    }
    with log.open("wb") as out:
        process = subprocess.Popen(argv, cwd=HERE, env=full_env, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + STARTUP
        while health is not None:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(health, timeout=2.0).status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{name} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        yield process
    finally:
        stop_process(process)


def forged_burst(url: str, source: str = "127.0.0.1") -> list[int]:
    """Seven requests from ``source``, each claiming another client in X-Forwarded-For."""
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(transport=transport, timeout=30) as client:
        return [
            client.get(url, headers={"X-Forwarded-For": f"203.0.113.{i}"}).status_code
            for i in range(7)
        ]


def counter_clients(data: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(f"file:{data}/porch.sqlite3?mode=ro", uri=True)) as db:
        return sorted(k.rsplit("\x1f", 1)[-1] for (k,) in db.execute("SELECT key FROM counters"))


def gunicorn_uvicorn(port: int, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gunicorn",
        "deploy_app:app",
        "--worker-class",
        "uvicorn.workers.UvicornWorker",
        "--workers",
        "2",
        "--bind",
        f"127.0.0.1:{port}",
        *flags,
    ]


@pytest.fixture(autouse=True)
def _needs_servers() -> None:
    for module in ("gunicorn", "uvicorn", "starlette"):
        if not _importable(module):
            pytest.skip(f"{module} is not installed (pip install -e '.[examples]')")


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_gunicorn_uvicorn_workers_with_the_documented_flag(tmp_path: Path) -> None:
    port = free_port()
    argv = gunicorn_uvicorn(port, "--forwarded-allow-ips=")
    with running(argv, tmp_path, {}, f"http://127.0.0.1:{port}/health", "gunicorn"):
        codes = forged_burst(f"http://127.0.0.1:{port}/hello")
    assert codes == [200] * LIMIT + [429] * (7 - LIMIT)
    assert counter_clients(tmp_path) == ["127.0.0.1"]


def test_gunicorn_uvicorn_workers_without_it_trust_loopback(tmp_path: Path) -> None:
    """Why the flag: gunicorn's default lets uvicorn rewrite the peer for loopback proxies."""
    port = free_port()
    with running(
        gunicorn_uvicorn(port), tmp_path, {}, f"http://127.0.0.1:{port}/health", "gunicorn"
    ):
        codes = forged_burst(f"http://127.0.0.1:{port}/hello")
    assert codes == [200] * 7
    assert len(counter_clients(tmp_path)) == 7


NGINX_CONF = """
worker_processes 1;
error_log {dir}/nginx-error.log;
pid {dir}/nginx.pid;
user root;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {dir}/nginx-body;
    proxy_temp_path {dir}/nginx-proxy;
    fastcgi_temp_path {dir}/nginx-fastcgi;
    uwsgi_temp_path {dir}/nginx-uwsgi;
    scgi_temp_path {dir}/nginx-scgi;
    upstream app {{ server {upstream}; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://app;
            proxy_set_header Host $host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto $scheme;
        }}
    }}
}}
"""


@pytest.mark.parametrize("socket", ["unix", "tcp"])
def test_uvicorn_behind_nginx(tmp_path: Path, socket: str) -> None:
    if NGINX is None:
        pytest.skip("nginx is not installed (apt-get install nginx-light)")
    if os.geteuid() != 0:
        pytest.skip("this nginx config runs its worker as root (tmp dirs are private)")
    nginx_port = free_port()
    if socket == "unix":
        sock = tmp_path / "app.sock"
        bind = ["--uds", str(sock)]
        upstream, trusted, health = f"unix:{sock}", "unix", None
    else:
        app_port = free_port()
        bind = ["--host", "127.0.0.1", "--port", str(app_port)]
        upstream, trusted = f"127.0.0.1:{app_port}", "127.0.0.1"
        health = f"http://127.0.0.1:{app_port}/health"
    conf = tmp_path / "nginx.conf"
    conf.write_text(
        NGINX_CONF.format(dir=tmp_path, upstream=upstream, port=nginx_port), encoding="utf-8"
    )
    uvicorn = [sys.executable, "-m", "uvicorn", "deploy_app:app", "--no-proxy-headers", *bind]
    env = {"PORCH_TRUSTED_PROXIES": trusted}
    nginx = [NGINX, "-p", str(tmp_path), "-c", str(conf), "-g", "daemon off;"]
    front = f"http://127.0.0.1:{nginx_port}"
    with (
        running(uvicorn, tmp_path, env, health, "uvicorn"),
        running(nginx, tmp_path, {}, None, "nginx"),
    ):
        deadline = time.monotonic() + STARTUP
        while True:  # nginx up, and the app behind it
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(front + "/health", timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail((tmp_path / "nginx-error.log").read_text()[-3000:])
            time.sleep(0.1)
        # The client is 127.0.0.2, not the proxy's trusted 127.0.0.1 (all of 127/8 is loopback).
        codes = forged_burst(front + "/hello", source="127.0.0.2")
    assert codes == [200] * LIMIT + [429] * (7 - LIMIT)
    # nginx appended the real client: the one entry porch reads. Never "unknown".
    assert counter_clients(tmp_path) == ["127.0.0.2"]
