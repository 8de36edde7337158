"""Stream throughput: our encode → XADD → XREADGROUP → decode → pack path beside raw Redis on the same bytes.

Write side: ``encode_document`` + pipelined XADD, against pipelined XADD of the already-encoded field maps
(opaque payloads of the same fields and sizes). Read side: ``StreamReader.next_documents`` (XREADGROUP,
decode, validation) + ``pack_documents``, against a bare XREADGROUP loop over the raw stream with the same
COUNT and the same redis-py call (``Redis.xreadgroup``, hiredis parser, bytes responses), so the difference
is exactly our codec, reader and packing. Every path runs in the same process against the same server, one
after the other, repeated ``--repeats`` times; each path's best run counts. Target: ours >= 50% of raw on both
sides.

A second table splits the read side per document, measured in the same run on the raw stream: the
XREADGROUP round trip with redis-py's reply parsing (what raw pays too), ``decode_entries`` and
``pack_documents``; what is left of "ours" is the reader's bookkeeping plus the run-to-run spread of the round
trip. On the write side it gives ``encode_document`` alone.

    python benchmarks/stream_throughput.py                 # starts its own redis-server on a free port
    python benchmarks/stream_throughput.py --redis-url redis://:password@host:6379/0
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np
import redis

from rljob_api import RLTrainingJobSpec, resolve
from rljob_api.config import RedisConnection, RedisKeys
from rljob_trainer.stream.batch import pack_documents
from rljob_trainer.stream.codec import Document, decode_entries, encode_document
from rljob_trainer.stream.reader import StreamReader

BATCH = 64
"""Documents per XADD pipeline and per XREADGROUP COUNT, on both paths."""


@dataclass
class Rate:
    documents_per_second: float
    tokens_per_second: float
    megabytes_per_second: float


def start_redis() -> tuple[subprocess.Popen, str, str]:
    """A throw-away redis-server on a free loopback port (no persistence); returns (process, url, data dir)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed; pass --redis-url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data_dir = tempfile.mkdtemp(prefix="rljob-bench-redis-")
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", data_dir],
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

    def read_raw() -> None:
        left = len(docs)
        while left:
            response = client.xreadgroup(raw_group, "bench", {raw_stream: ">"}, count=min(BATCH, left))
            left -= len(response[0][1])

    reader = StreamReader(
        client, keys, 0, 1, micro_batch_tokens=budget, require_metrics_fields=True, data_timeout_seconds=30
    )
    reader.start()

    def read_ours() -> None:
        left = len(docs)
        while left:
            got = reader.next_documents(min(BATCH, left))
            pack_documents([doc for _, doc in got], budget)
            left -= len(got)

    seconds["read_raw"] = timed(read_raw)
    seconds["read_ours"] = timed(read_ours)
    assert reader.counters.documents_read == len(docs), reader.counters
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
        results = decode_entries([fields for _, fields in entries], require_metrics_fields=True, max_tokens=budget)
        decoded = time.perf_counter()
        pack_documents(results, budget)
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


def run(url: str, lengths: list[int], megabytes: float, repeats: int) -> list[Row]:
    client = redis.Redis.from_url(url)
    keys = resolve("bench", "bench", RLTrainingJobSpec(), RedisConnection(host="unused")).keys
    keys = keys.model_copy(update={"stream": "rljob:bench:stream", "group": "rljob:bench:group"})
    rows = []
    for length in lengths:
        docs = make_documents(1, length, 0)
        entry_bytes = sum(len(v) for v in encode_document(docs[0]).values())
        count = max(BATCH, int(megabytes * 2**20 / entry_bytes))
        docs = make_documents(count, length, 0)
        best: dict[str, float] = {}
        best_stages: dict[str, float] = {}
        for _ in range(repeats):
            seconds = measure(client, keys, docs, budget=max(8192, length))
            stages = {path: value for path, value in seconds.items() if path.startswith("stage_")}
            if not best_stages or sum(stages.values()) < sum(best_stages.values()):
                best_stages = stages  # the stages of one run, so that they add up
            for path, value in seconds.items():
                best[path] = min(best.get(path, float("inf")), value)
        rows.append(Row(length, count, entry_bytes, {**best, **best_stages}))
    client.close()
    return rows


def report(rows: list[Row]) -> str:
    """The two tables: rates and ratios per side, then microseconds per document per stage."""
    lines = [
        f"{'tokens/doc':>10} {'side':>5} {'ours docs/s':>12} {'ours Mtok/s':>12} {'ours MB/s':>10} "
        f"{'raw docs/s':>11} {'raw MB/s':>9} {'ours/raw':>9}"
    ]
    for row in rows:
        for side in ("write", "read"):
            ours, raw = row.rate(f"{side}_ours"), row.rate(f"{side}_raw")
            ratio = ours.documents_per_second / raw.documents_per_second
            lines.append(
                f"{row.length:>10} {side:>5} {ours.documents_per_second:>12,.0f} {ours.tokens_per_second / 1e6:>12.2f} "
                f"{ours.megabytes_per_second:>10.1f} {raw.documents_per_second:>11,.0f} "
                f"{raw.megabytes_per_second:>9.1f} {ratio:>8.0%}{'' if ratio >= 0.5 else '  < 50% target'}"
            )
    lines += [
        "",
        "microseconds per document (best run of each path; the three read stages from their best run together):",
        f"{'tokens/doc':>10} {'write raw':>10} {'encode':>8} {'write ours':>11} | {'read raw':>9} "
        f"{'xreadgroup':>11} {'decode':>7} {'pack':>6} {'rest':>7} {'read ours':>10}",
    ]
    for row in rows:
        read_ours = row.micros("read_ours")
        rest = read_ours - sum(row.micros(f"stage_{s}") for s in ("xreadgroup", "decode", "pack"))
        lines.append(
            f"{row.length:>10} {row.micros('write_raw'):>10.1f} {row.micros('encode'):>8.1f} "
            f"{row.micros('write_ours'):>11.1f} | {row.micros('read_raw'):>9.1f} "
            f"{row.micros('stage_xreadgroup'):>11.1f} {row.micros('stage_decode'):>7.1f} "
            f"{row.micros('stage_pack'):>6.1f} {rest:>7.1f} {read_ours:>10.1f}"
        )
    lines.append(
        "(rest = read ours minus the three stages: the reader's bookkeeping plus the run-to-run spread of the\n"
        " XREADGROUP round trip, which 'read raw' and 'xreadgroup' measure twice on the same bytes)"
    )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="use this Redis instead of starting a redis-server")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 4096], help="document lengths in tokens")
    parser.add_argument("--megabytes", type=float, default=32.0, help="stream payload per length and path (MiB)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per length; each path's best time counts")
    args = parser.parse_args(argv)

    process = data_dir = None
    url = args.redis_url
    if url is None:
        process, url, data_dir = start_redis()
    try:
        rows = run(url, args.lengths, args.megabytes, args.repeats)
    finally:
        if process is not None:
            process.terminate()
            process.wait(10)
            shutil.rmtree(data_dir, ignore_errors=True)

    print(report(rows))


if __name__ == "__main__":
    main()
