"""Stream throughput: our encode → XADD → XREADGROUP → decode → pack path beside raw Redis on the same bytes.

Write side: ``encode_document`` + pipelined XADD, against pipelined XADD of the already-encoded field maps
(opaque payloads of the same fields and sizes). Read side: ``StreamReader.next_documents`` (XREADGROUP,
decode, validation) + ``pack_columns``, ``BATCH`` documents per call, against bare XREADGROUP loops over the
raw stream with the same COUNT, hiredis parser and bytes responses, so the difference is exactly our codec,
reader and packing. Every path runs in the same process against the same server, one after the other, repeated
``--repeats`` times; each path's best run counts. Target: ours >= 50% of raw on both sides.

The reader overlaps: it sends the next XREADGROUP before decoding the reply in hand, and with read-ahead (on
for one data-parallel rank, as here) the next call's read goes out before the caller packs. The raw baseline
is the faster of two plain loops with one XREADGROUP in flight, as ours: ``Redis.xreadgroup`` (redis-py's
pooled, retried call) and redis-py's connection API (``send_command`` / ``parse_response``, the reader's own
transport) with the next XREADGROUP sent as soon as a reply is read. "read, no ahead" is the path of a rank with
data-parallel peers (read-ahead off): it overlaps only reads within one call. For reference the report also
gives raw with two XREADGROUPs in flight, which overlaps Redis with the parsing of the previous reply, an
overlap our path does not have (it never keeps two reads in flight).

A second table splits the read side per document, measured in the same run on the raw stream: the
XREADGROUP round trip with redis-py's reply parsing (what raw pays too), ``decode_columns`` and
``pack_columns``, one after the other; "read ours" below their sum is what the overlap hides. On the write
side it gives ``encode_document`` alone.

The overlap needs a free core for Redis while this process decodes: on a machine whose cores are busy, Redis and
the reader take turns and "read" falls back towards "read, no ahead". Lengths run in one process also affect each
other (allocator state; packing 4096-token documents after the 512 run is up to 2x slower): for steady figures
run one length per invocation.

With ``--persistence`` every figure is measured twice in the same run, against a redis-server without persistence
and one that writes an append-only file with appendfsync everysec as the durable managed Redis does
(``spec.redis.persistence``, :data:`rljob_operator.render.REDIS_APPENDFSYNC`; its directory on the disk of
``--data-dir``), the two taking turns within each repeat, and a third table gives each path's rate with the file over
its rate without. The 50% targets hold for each server; the comparison is reported, not judged.

    python benchmarks/stream_throughput.py                 # starts its own redis-server on a free port
    python benchmarks/stream_throughput.py --lengths 4096 --megabytes 64
    python benchmarks/stream_throughput.py --persistence --data-dir /var/tmp   # without vs with the append-only file
    python benchmarks/stream_throughput.py --redis-url redis://:password@host:6379/0
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import redis

from rljob_api import RLTrainingJobSpec, resolve
from rljob_api.config import RedisConnection, RedisKeys
from rljob_operator.render import REDIS_APPENDFSYNC
from rljob_trainer.stream.batch import pack_columns
from rljob_wire.codec import Document, decode_columns, encode_document
from rljob_trainer.stream.reader import StreamReader

BATCH = 64
"""Documents per XADD pipeline and per XREADGROUP COUNT, on both paths."""


@dataclass
class Rate:
    documents_per_second: float
    tokens_per_second: float
    megabytes_per_second: float


def start_redis(persistent: bool = False, parent: Optional[str] = None) -> tuple[subprocess.Popen, str, str]:
    """A throw-away redis-server on a free loopback port; returns (process, url, data dir). Without ``persistent`` it
    keeps nothing on disk; with it, it writes an append-only file (appendfsync :data:`REDIS_APPENDFSYNC`, no RDB
    snapshots: the durable managed Redis's settings) in a new directory under ``parent`` (default: the temp dir).

    Raises:
        SystemExit: no redis-server on PATH, or it did not answer within 10 s.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed; pass --redis-url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data_dir = tempfile.mkdtemp(prefix="rljob-bench-redis-", dir=parent)
    persistence = ["--appendonly", "yes", "--appendfsync", REDIS_APPENDFSYNC] if persistent else ["--appendonly", "no"]
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *persistence, "--dir", data_dir],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            return process, f"redis://127.0.0.1:{port}/0", data_dir
        except redis.ConnectionError:
            time.sleep(0.05)
    process.kill()
    raise SystemExit("redis-server did not start")


def make_documents(count: int, length: int, seed: int) -> list[Document]:
    rng = np.random.default_rng(seed)
    prompt = length // 4
    return [
        Document(
            tokens=rng.integers(0, 150_000, length),
            old_log_probabilities=np.where(np.arange(length) < prompt, 0.0, -rng.random(length)).astype(np.float32),
            model_version=np.full(length, 1000 + i, np.int64),
            loss_masking_spans=[(0, prompt)],
            advantage=float(rng.normal()),
            reward=float(rng.random()),
        )
        for i in range(count)
    ]


def chunks(items: list, size: int) -> Iterator[list]:
    for begin in range(0, len(items), size):
        yield items[begin : begin + size]


def xadd_all(client: redis.Redis, stream: str, messages: Callable[[], Iterator[list[dict]]]) -> None:
    for batch in messages():
        with client.pipeline(transaction=False) as pipe:
            for message in batch:
                pipe.xadd(stream, message)
            pipe.execute()


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(client: redis.Redis, keys: RedisKeys, docs: list[Document], budget: int) -> dict[str, float]:
    """Seconds for each path on fresh streams, plus the read stages (``stage_*``) and ``encode`` alone."""
    raw_stream, raw_group = keys.stream + ":raw", keys.group + ":raw"
    client.delete(keys.stream, raw_stream)
    encoded = [encode_document(doc) for doc in docs]
    seconds = {
        "write_raw": timed(lambda: xadd_all(client, raw_stream, lambda: chunks(encoded, BATCH))),
        "write_ours": timed(
            lambda: xadd_all(client, keys.stream, lambda: (list(map(encode_document, b)) for b in chunks(docs, BATCH)))
        ),
        "encode": timed(lambda: [encode_document(doc) for doc in docs]),
    }
    client.xgroup_create(raw_stream, raw_group, id="0")
    for depth in (1, 2):
        client.xgroup_create(raw_stream, f"{raw_group}:pipelined{depth}", id="0")

    def read_raw() -> None:
        left = len(docs)
        while left:
            response = client.xreadgroup(raw_group, "bench", {raw_stream: ">"}, count=min(BATCH, left))
            left -= len(response[0][1])

    def read_raw_pipelined(depth: int) -> Callable[[], None]:
        """XREADGROUP COUNT BATCH on one connection with ``depth`` commands in flight (redis-py's connection API)."""
        group = f"{raw_group}:pipelined{depth}"
        command = ("XREADGROUP", "GROUP", group, "bench", "COUNT", BATCH, "STREAMS", raw_stream, ">")

        def run() -> None:
            connection = client.connection_pool.get_connection()
            unsent = -(-len(docs) // BATCH)
            for _ in range(min(depth, unsent)):
                connection.send_command(*command)
                unsent -= 1
            left = len(docs)
            while left:
                left -= len(client.parse_response(connection, "XREADGROUP")[0][1])
                if unsent:
                    connection.send_command(*command)
                    unsent -= 1
            client.connection_pool.release(connection)

        return run

    def read_ours(read_ahead: bool) -> Callable[[], None]:
        group_keys = keys if read_ahead else keys.model_copy(update={"group": keys.group + ":plain"})
        reader = StreamReader(
            client, group_keys, 0, 1, micro_batch_tokens=budget, require_metrics_fields=True, data_timeout_seconds=30,
            read_ahead=read_ahead,
        )
        reader.start()

        def run() -> None:
            left = len(docs)
            while left:
                got = reader.next_documents(min(BATCH, left))
                pack_columns(got.columns, budget)
                left -= len(got)
            assert reader.counters.documents_read == len(docs), reader.counters
            reader.close()

        return run

    seconds["read_raw_redis_py"] = timed(read_raw)
    seconds["read_raw_pipelined"] = timed(read_raw_pipelined(1))
    seconds["read_raw_two_in_flight"] = timed(read_raw_pipelined(2))
    seconds["read_ours"] = timed(read_ours(read_ahead=True))
    seconds["read_ours_no_ahead"] = timed(read_ours(read_ahead=False))
    seconds["read_raw"] = min(seconds["read_raw_redis_py"], seconds["read_raw_pipelined"])
    seconds.update(read_stages(client, raw_stream, keys.group + ":stages", len(docs), budget))
    client.delete(keys.stream, raw_stream)
    return seconds


def read_stages(client: redis.Redis, stream: str, group: str, count: int, budget: int) -> dict[str, float]:
    """Seconds spent in each read stage over ``count`` entries of ``stream``, read again by a new group."""
    client.xgroup_create(stream, group, id="0")
    stages = dict.fromkeys(("stage_xreadgroup", "stage_decode", "stage_pack"), 0.0)
    left = count
    while left:
        start = time.perf_counter()
        entries = client.xreadgroup(group, "bench", {stream: ">"}, count=min(BATCH, left))[0][1]
        read = time.perf_counter()
        columns, _, _ = decode_columns([fields for _, fields in entries], require_metrics_fields=True,
                                       max_tokens=budget)
        decoded = time.perf_counter()
        pack_columns(columns, budget)
        packed = time.perf_counter()
        stages["stage_xreadgroup"] += read - start
        stages["stage_decode"] += decoded - read
        stages["stage_pack"] += packed - decoded
        left -= len(entries)
    return stages


@dataclass
class Row:
    """One length's figures: rates per side and path, and per-document microseconds per stage."""

    length: int
    count: int
    entry_bytes: int
    best: dict[str, float]

    def rate(self, path: str) -> Rate:
        seconds = self.best[path]
        return Rate(
            self.count / seconds, self.count * self.length / seconds, self.count * self.entry_bytes / seconds / 1e6
        )

    def micros(self, path: str) -> float:
        """Microseconds per document of ``path``."""
        return self.best[path] / self.count * 1e6


def run(urls: list[str], lengths: list[int], megabytes: float, repeats: int) -> list[list[Row]]:
    """Every length against every Redis of ``urls``; the servers take turns within each repeat, so a change in the
    machine's load reaches them alike. Returns one list of rows per url."""
    clients = [redis.Redis.from_url(url) for url in urls]
    keys = resolve("bench", "bench", RLTrainingJobSpec.model_validate({"model": {"source": "tiny"}}), RedisConnection(host="unused")).keys
    keys = keys.model_copy(update={"stream": "rljob:bench:stream", "group": "rljob:bench:group"})
    rows: list[list[Row]] = [[] for _ in urls]
    for length in lengths:
        docs = make_documents(1, length, 0)
        entry_bytes = sum(len(v) for v in encode_document(docs[0]).values())
        count = max(BATCH, int(megabytes * 2**20 / entry_bytes))
        docs = make_documents(count, length, 0)
        best: list[dict[str, float]] = [{} for _ in urls]
        best_stages: list[dict[str, float]] = [{} for _ in urls]
        for _ in range(repeats):
            for server, client in enumerate(clients):
                seconds = measure(client, keys, docs, budget=max(8192, length))
                stages = {path: value for path, value in seconds.items() if path.startswith("stage_")}
                if not best_stages[server] or sum(stages.values()) < sum(best_stages[server].values()):
                    best_stages[server] = stages  # the stages of one run, so that they add up
                for path, value in seconds.items():
                    best[server][path] = min(best[server].get(path, float("inf")), value)
        for server in range(len(urls)):
            rows[server].append(Row(length, count, entry_bytes, {**best[server], **best_stages[server]}))
    for client in clients:
        client.close()
    return rows


def report(rows: list[Row]) -> str:
    """The two tables: rates and ratios per side, then microseconds per document per stage."""
    lines = [
        f"{'tokens/doc':>10} {'side':>14} {'ours docs/s':>12} {'ours Mtok/s':>12} {'ours MB/s':>10} "
        f"{'raw docs/s':>11} {'raw MB/s':>9} {'ours/raw':>9}"
    ]
    sides = (("write", "write_ours", "write_raw"), ("read", "read_ours", "read_raw"),
             ("read, no ahead", "read_ours_no_ahead", "read_raw"))
    for row in rows:
        for side, ours_path, raw_path in sides:
            ours, raw = row.rate(ours_path), row.rate(raw_path)
            ratio = ours.documents_per_second / raw.documents_per_second
            lines.append(
                f"{row.length:>10} {side:>14} {ours.documents_per_second:>12,.0f} {ours.tokens_per_second / 1e6:>12.2f} "
                f"{ours.megabytes_per_second:>10.1f} {raw.documents_per_second:>11,.0f} "
                f"{raw.megabytes_per_second:>9.1f} {ratio:>8.0%}{'' if ratio >= 0.5 else '  < 50% target'}"
            )
    lines += [
        "(read: read-ahead on, the path of a single data-parallel rank; read, no ahead: the path of a rank with\n"
        " data-parallel peers; raw: the faster one-in-flight raw loop, redis-py's call or its connection API)",
        "reference, raw with two XREADGROUPs in flight: "
        + ", ".join(
            f"{row.length} tokens {row.rate('read_raw_two_in_flight').documents_per_second:,.0f} docs/s "
            f"(read ours = {row.best['read_raw_two_in_flight'] / row.best['read_ours']:.0%} of it)"
            for row in rows
        ),
        "",
        "microseconds per document (best run of each path; the three read stages from their best run together):",
        f"{'tokens/doc':>10} {'write raw':>10} {'encode':>8} {'write ours':>11} | {'raw r-py':>9} {'raw pipe':>9} "
        f"{'xreadgroup':>11} {'decode':>7} {'pack':>6} {'read ours':>10} {'no ahead':>9}",
    ]
    for row in rows:
        lines.append(
            f"{row.length:>10} {row.micros('write_raw'):>10.1f} {row.micros('encode'):>8.1f} "
            f"{row.micros('write_ours'):>11.1f} | {row.micros('read_raw_redis_py'):>9.1f} "
            f"{row.micros('read_raw_pipelined'):>9.1f} {row.micros('stage_xreadgroup'):>11.1f} "
            f"{row.micros('stage_decode'):>7.1f} {row.micros('stage_pack'):>6.1f} {row.micros('read_ours'):>10.1f} "
            f"{row.micros('read_ours_no_ahead'):>9.1f}"
        )
    lines.append(
        "(xreadgroup + decode + pack = the read side done one stage after the other, measured on the raw stream;\n"
        " read ours below that sum is the overlap of Redis and the network with decoding and packing)"
    )
    return "\n".join(lines)


def targets_met(rows: list[Row]) -> bool:
    """Whether ours is at least 50% of raw on every side of every length (the report marks each miss)."""
    sides = (("write_ours", "write_raw"), ("read_ours", "read_raw"), ("read_ours_no_ahead", "read_raw"))
    return all(row.rate(ours).documents_per_second >= 0.5 * row.rate(raw).documents_per_second
               for row in rows for ours, raw in sides)


PATHS = (("write ours", "write_ours"), ("write raw", "write_raw"), ("read ours", "read_ours"),
         ("read, no ahead", "read_ours_no_ahead"), ("read raw", "read_raw"))
"""The paths the persistence comparison reports (label, key of :attr:`Row.best`)."""


def persistence_report(without: list[Row], with_file: list[Row], file_bytes: int) -> str:
    """Per length and path: documents/s without persistence, with the append-only file, and the ratio; then the size
    the file had at the end of the run (``file_bytes``)."""
    lines = [f"{'tokens/doc':>10} {'path':>15} {'no file docs/s':>15} {'everysec docs/s':>16} {'everysec/no file':>17}"]
    for off, on in zip(without, with_file, strict=True):
        for label, path in PATHS:
            before, after = off.rate(path).documents_per_second, on.rate(path).documents_per_second
            lines.append(f"{off.length:>10} {label:>15} {before:>15,.0f} {after:>16,.0f} {after / before:>16.0%}")
    lines.append(f"append-only file at the end of the run: {file_bytes / 1e6:,.1f} MB (every stream was deleted "
                 "after its run: what rewrites have not compacted yet)")
    return "\n".join(lines)


def _directory_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def main(argv: Optional[list[str]] = None) -> int:
    """Run and print the report; 0 when every target is met, 1 when one is missed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="use this Redis instead of starting a redis-server")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 4096], help="document lengths in tokens")
    parser.add_argument("--megabytes", type=float, default=32.0, help="stream payload per length and path (MiB)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per length; each path's best time counts")
    parser.add_argument("--persistence", action="store_true",
                        help="measure against a redis-server without persistence and one with an append-only file "
                        f"(appendfsync {REDIS_APPENDFSYNC}), taking turns, and compare")
    parser.add_argument("--data-dir", default=None,
                        help="where the append-only file of --persistence is written (default: the temp dir)")
    args = parser.parse_args(argv)
    if args.persistence and args.redis_url:
        parser.error("--persistence starts its own two redis-servers: leave out --redis-url")

    if args.redis_url is not None:
        (rows,) = run([args.redis_url], args.lengths, args.megabytes, args.repeats)
        print(report(rows))
        return 0 if targets_met(rows) else 1
    servers = [start_redis()] + ([start_redis(True, args.data_dir)] if args.persistence else [])
    try:
        results = run([url for _, url, _ in servers], args.lengths, args.megabytes, args.repeats)
        file_bytes = _directory_bytes(servers[-1][2])
    finally:
        for process, _, data_dir in servers:
            process.terminate()
            process.wait(10)
            shutil.rmtree(data_dir, ignore_errors=True)
    if not args.persistence:
        print(report(results[0]))
        return 0 if targets_met(results[0]) else 1
    rows, durable = results
    print("without persistence (--appendonly no):\n" + report(rows))
    print(f"\nwith the append-only file (--appendonly yes --appendfsync {REDIS_APPENDFSYNC}):\n" + report(durable))
    print("\npersistence, same run:\n" + persistence_report(rows, durable, file_bytes))
    return 0 if targets_met(rows) and targets_met(durable) else 1


if __name__ == "__main__":
    sys.exit(main())
