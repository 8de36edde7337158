"""TCP relay from the ``kubernetes`` Service address to the API server.

The local control plane listens on loopback, which a pod's network namespace cannot reach, and
there is no kube-proxy to route the Service's ClusterIP. The agent puts the ClusterIP on the
bridge and relays ``<ClusterIP>:443`` to the API server byte for byte (TLS passes through; the
API server's certificate already names the ClusterIP). Pods thus get the same
KUBERNETES_SERVICE_HOST/PORT as in a real cluster.
"""

from __future__ import annotations

import asyncio
import logging
import threading

__all__ = ["TcpRelay"]

log = logging.getLogger(__name__)


class TcpRelay:
    """Relays connections from ``listen`` (host, port) to ``upstream`` (host, port) on a
    background thread with its own asyncio loop."""

    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int]) -> None:
        self.listen = listen
        self.upstream = upstream
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="api-relay", daemon=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError as e:
            log.warning("api relay: cannot reach %s:%s: %s", *self.upstream, e)
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    def start(self) -> TcpRelay:
        """Bind and start relaying.

        Raises:
            OSError: the listen address cannot be bound.
        """
        # reuse_port: a second agent on this host (same API server) can serve the same address
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, *self.listen, reuse_address=True, reuse_port=True))
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return

        async def close() -> None:
            self._server.close()
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # let them finish cancelling before the loop stops

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._server = None
