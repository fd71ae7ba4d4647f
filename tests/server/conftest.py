"""A real ``jaxkv serve`` process per test module, on a free loopback port: ``server`` gives
``(process, base_url)``. A module sets ``SERVER_ARGS`` to change the flags (default below)."""

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

MODEL = "smollm2"
SERVER_ARGS = ("--kv-memory", "128MiB", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
               "--max-model-len", "512", "--max-waiting", "40")  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    """The server process and its base URL; stopped with SIGTERM (it drains, then exits 0). Its
    output goes to a file (a pipe nobody reads would block it once full)."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "serve.log"
    cli = Path(sys.executable).with_name("jaxkv")
    args = getattr(request.module, "SERVER_ARGS", SERVER_ARGS)
    command = [str(cli), "serve", "--model", MODEL, "--port", str(port), *args]
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("the server did not report ready in 300 s")
    yield proc, url
    if proc.poll() is None:  # a test may have stopped it first (test_sigterm_drains_requests_in_flight)
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
