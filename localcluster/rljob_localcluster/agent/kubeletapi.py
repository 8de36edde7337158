"""The one kubelet endpoint the agent serves: container logs, so ``kubectl logs [-f]`` works.

The API server proxies ``pods/log`` to ``https://<node InternalIP>:<kubeletEndpoint port>/containerLogs/
<namespace>/<pod>/<container>`` (kubelet's server.go). All the agent's nodes share one address
(the bridge), so one HTTPS server answers for all of them. Its certificate is self-signed; the
local API server runs without ``--kubelet-certificate-authority`` and so does not verify it. Test
use only: requests are not authenticated. Query parameters honoured: ``follow``, ``tailLines``,
``limitBytes``; ``previous`` is not (the runs of a pod's container are appended in one file; earlier pods
of the same name are in ``logs/previous/``, which this endpoint does not serve).
"""

from __future__ import annotations

import os
import ssl
import tempfile
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

from ..pki import CertificateAuthority
from .logs import log_path

__all__ = ["LogServer"]

FOLLOW_POLL_SECONDS = 0.2


def tail_bytes(data: bytes, lines: int | None, limit: int | None) -> bytes:
    """The last ``lines`` lines of ``data`` (all when None), cut to the first ``limit`` bytes."""
    if lines is not None:
        data = b"".join(data.splitlines(keepends=True)[-lines:]) if lines > 0 else b""
    if limit is not None:
        data = data[:limit]
    return data


def _replaced(path: Path, f) -> bool:
    """Whether ``path`` no longer names the open file ``f`` (moved to ``logs/previous/`` for a new pod)."""
    try:
        return path.stat().st_ino != os.fstat(f.fileno()).st_ino
    except FileNotFoundError:
        return True


class LogServer:
    """HTTPS server for ``/containerLogs/...`` on ``(host, port)`` (port 0: any free port).

    Args:
        state_dir: the agent's state dir (logs live under ``logs/``).
        is_running: ``(namespace, pod, container) -> bool``; a follow stream ends once it is False
            and the file has been sent to its end.
    """

    def __init__(self, host: str, port: int, state_dir: Path, is_running: Callable[[str, str, str], bool]) -> None:
        self.state_dir = state_dir
        self.is_running = is_running
        self._server = ThreadingHTTPServer((host, port), self._handler_class())
        self._server.daemon_threads = True
        # the TLS handshake happens on the handler's thread, so a slow client cannot stall accept()
        self._server.socket = self._tls_context(host).wrap_socket(
            self._server.socket, server_side=True, do_handshake_on_connect=False)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kubelet-logs", daemon=True)

    @staticmethod
    def _tls_context(host: str) -> ssl.SSLContext:
        pair = CertificateAuthority("rljob-local-node-agent").serving_cert("rljob-local-node-agent", ["localhost"], [host])
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        with tempfile.TemporaryDirectory() as d:
            cert, key = Path(d) / "tls.crt", Path(d) / "tls.key"
            pair.write(cert, key)
            ctx.load_cert_chain(cert, key)
        return ctx

    def start(self) -> LogServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                url = urlparse(self.path)
                parts = [unquote(p) for p in url.path.split("/") if p]
                if parts == ["healthz"]:
                    return self._reply(200, b"ok")
                if len(parts) != 4 or parts[0] != "containerLogs":
                    return self._reply(404, b"the rljob local node agent serves only /containerLogs")
                _, ns, pod, container = parts
                q = {k: v[-1] for k, v in parse_qs(url.query).items()}
                path = log_path(server.state_dir, ns, pod, container)
                if not path.exists():
                    return self._reply(404, f"no log for container {container} of pod {ns}/{pod}".encode())
                lines = int(q["tailLines"]) if "tailLines" in q else None
                limit = int(q["limitBytes"]) if "limitBytes" in q else None
                with open(path, "rb") as f:
                    data = tail_bytes(f.read(), lines, limit)
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain")
                    if q.get("follow") != "true":
                        self.send_header("Content-Length", str(len(data)))
                        self.end_headers()
                        self.wfile.write(data)
                        return None
                    self.end_headers()  # HTTP/1.0 without a length: the body ends when the connection closes
                    try:
                        while True:
                            if data:
                                self.wfile.write(data)
                                self.wfile.flush()
                            elif not server.is_running(ns, pod, container) or _replaced(path, f):
                                break  # the container ended, or a new pod of that name took the file over
                            else:
                                time.sleep(FOLLOW_POLL_SECONDS)
                            data = f.read()
                    except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
                        pass
                return None

            def _reply(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler
