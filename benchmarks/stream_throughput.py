"""Stream throughput: our encode → XADD → XREADGROUP → decode → pack path beside raw Redis on the same bytes.

Write side: ``encode_document`` + pipelined XADD, against pipelined XADD of the already-encoded field maps
(opaque payloads of the same fields and sizes). Read side: ``StreamReader.next_documents`` (XREADGROUP,
decode, validation) + ``pack_documents``, against a bare XREADGROUP of the raw stream with the same COUNT.
Both run in the same process against the same server, one after the other, best of ``--repeats``.
Target: ours >= 50% of raw on both sides.

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
from rljob_trainer.stream.codec import Document, encode_document
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
    """Seconds for each of the four paths on fresh streams."""
    raw_stream, raw_group = keys.stream + ":raw", keys.group + ":raw"
    client.delete(keys.stream, raw_stream)
    encoded = [encode_document(doc) for doc in docs]
    seconds = {
        "write_raw": timed(lambda: xadd_all(client, raw_stream, lambda: chunks(encoded, BATCH))),
        "write_ours": timed(
            lambda: xadd_all(client, keys.stream, lambda: (list(map(encode_document, b)) for b in chunks(docs, BATCH)))
        ),
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
    client.delete(keys.stream, raw_stream)
    return seconds


def run(url: str, lengths: list[int], megabytes: float, repeats: int) -> list[tuple[int, str, Rate, Rate]]:
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
        for _ in range(repeats):
            for path, seconds in measure(client, keys, docs, budget=max(8192, length)).items():
                best[path] = min(best.get(path, float("inf")), seconds)
        for side in ("write", "read"):
            ours, raw = (
                Rate(
                    count / best[f"{side}_{p}"],
                    count * length / best[f"{side}_{p}"],
                    count * entry_bytes / best[f"{side}_{p}"] / 1e6,
                )
                for p in ("ours", "raw")
            )
            rows.append((length, side, ours, raw))
    client.close()
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="use this Redis instead of starting a redis-server")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 4096], help="document lengths in tokens")
    parser.add_argument("--megabytes", type=float, default=32.0, help="stream payload per length and path (MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per length; the best time counts")
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

    print(
        f"{'tokens/doc':>10} {'side':>5} {'ours docs/s':>12} {'ours Mtok/s':>12} {'ours MB/s':>10} "
        f"{'raw docs/s':>11} {'raw MB/s':>9} {'ours/raw':>9}"
    )
    for length, side, ours, raw in rows:
        ratio = ours.documents_per_second / raw.documents_per_second
        print(
            f"{length:>10} {side:>5} {ours.documents_per_second:>12,.0f} {ours.tokens_per_second / 1e6:>12.2f} "
            f"{ours.megabytes_per_second:>10.1f} {raw.documents_per_second:>11,.0f} {raw.megabytes_per_second:>9.1f} "
            f"{ratio:>8.0%}{'' if ratio >= 0.5 else '  < 50% target'}"
        )


if __name__ == "__main__":
    main()
