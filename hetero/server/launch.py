"""Starting a server process and waiting for it: a free loopback port, /health polled until 200
(the tests, the benchmarks and examples/rag_server.py start `hetero serve` and its peers so)."""
from __future__ import annotations

import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300, what: str = "hetero serve") -> None:
    """Poll url + "/health" until it answers 200; RuntimeError if proc exits first or time runs out
    (the caller stops proc)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not answer {url}/health within {timeout:.0f} s")
