"""Keeps name resolution files current: a managed block in the host's /etc/hosts (for processes
on the host and hostNetwork pods) and each pod's own hosts file (bind-mounted at its /etc/hosts).

A pod's file is rewritten in place (same inode, since it is bind-mounted): new content over the old,
then truncated to length, so a concurrent reader never finds it empty (at worst it sees trailing
bytes of the old content for an instant).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path

from .dns import DnsRecord, hosts_lines, pod_hosts_file, replace_managed_block

__all__ = ["HostsManager"]

log = logging.getLogger(__name__)


def _write_in_place(path: Path, content: str) -> None:
    data = content.encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


class HostsManager:
    """Cluster DNS records → hosts files.

    Args:
        cluster_domain: e.g. ``cluster.local``.
        etc_hosts: the host's hosts file to keep a managed block in, or None for none.
        tag: block marker (``# BEGIN <tag>`` / ``# END <tag>``).
        static: records that always exist (the ``kubernetes`` Service).
    """

    def __init__(self, cluster_domain: str, etc_hosts: Path | None, tag: str, static: Iterable[DnsRecord] = ()) -> None:
        self.cluster_domain = cluster_domain
        self.etc_hosts = etc_hosts
        self.tag = tag
        self.static = list(static)
        self._records: list[DnsRecord] = list(self.static)
        self._pods: dict[str, tuple[Path, dict, str]] = {}
        self._written: dict[str, str] = {}
        self._lock = threading.Lock()

    def set_records(self, records: Iterable[DnsRecord]) -> None:
        """Replace the cluster records (plus the static ones) and rewrite what changed."""
        with self._lock:
            self._records = sorted(set(self.static) | set(records))
            self._flush()

    def register(self, uid: str, path: Path, pod: dict, pod_ip: str) -> None:
        """Write and from now on maintain pod ``uid``'s hosts file at ``path``."""
        with self._lock:
            self._pods[uid] = (path, pod, pod_ip)
            self._flush()

    def unregister(self, uid: str) -> None:
        with self._lock:
            entry = self._pods.pop(uid, None)
            if entry:
                self._written.pop(str(entry[0]), None)

    def records(self) -> list[DnsRecord]:
        with self._lock:
            return list(self._records)

    def _flush(self) -> None:
        for path, pod, ip in self._pods.values():
            content = pod_hosts_file(pod, ip, self._records, self.cluster_domain)
            if self._written.get(str(path)) != content:
                _write_in_place(path, content)
                self._written[str(path)] = content
        if self.etc_hosts is not None:
            self._write_etc_hosts(hosts_lines(self._records, self.cluster_domain))

    def _write_etc_hosts(self, lines: list[str]) -> None:
        try:
            old = self.etc_hosts.read_text()
        except FileNotFoundError:
            old = ""
        new = replace_managed_block(old, lines, self.tag)
        if new == old:
            return
        # In place, never by rename: every container bind-mounts its pod's hosts file over /etc/hosts, and
        # renaming over a mount point on the host detaches those mounts in every container's mount namespace
        # (Linux >= 3.18), after which the containers would read the host's file instead.
        _write_in_place(self.etc_hosts, new)

    def restore(self) -> None:
        """Remove the managed block from the host's hosts file (agent shutdown)."""
        with self._lock:
            if self.etc_hosts is not None:
                self._write_etc_hosts([])
