"""Rollout autoscaling on the local cluster (issue 28 item 6, the cluster half; the law against the best fixed count is
judged on the simulation, benchmarks/autoscale.py): the operator sizes the rollouts of a real job from what its trainer
and workers measure, and the count settles without reversals.

The job, per seed: the CPU example (examples/rljob-cpu.yaml: 2 trainer pods × 1 rank, 512 documents a step) made
rollout-bound: each rollout batch is 4 prompts × 16 samples (64 documents, an eighth of a step) and each rollout pod
is limited to :data:`ROLLOUT_CPU`, ``spec.rollout.autoscaling`` from 1 to :data:`MAX_REPLICAS` replicas with a
cooldown of :data:`COOLDOWN_S`, seeds ``trainer.seed`` and ``rollout.seed`` = the seed, no checkpoint claim, Redis
without persistence. It runs ``--minutes``, the status polled every :data:`POLL_S` seconds
(``status.autoscaling.replicas``, ``status.capacity``, the step), then is deleted.

One replica at its CPU limit leaves the trainer waiting, so the law, which adds replicas while the trainer waits and
the rollouts are not held, adds them until the trainer stops waiting, the rollouts are held, or the bound is reached;
where it stops depends on the machine (on 2 cores the trainer's ranks, the workers and the control plane share them).
Either way, per seed:

- **decisions**: the count's changes (each a ``RolloutsScaled`` Event, printed with the law's numbers);
- **balanced**: the count did not change during the last :data:`SETTLED_COOLDOWNS` cooldowns of the run, reached in at
  most :data:`TARGET_DECISIONS` decisions;
- **reversals**: consecutive changes in opposite directions less than :data:`COOLDOWNS_FOR_REVERSAL` cooldowns apart.

Targets: every seed balanced, no reversal. Exit 0 when both hold, 1 when one is missed, 2 when the run broke.

    python -m rljob_localcluster up        # or scripts/demo.sh, which leaves it running
    python benchmarks/autoscale_cluster.py --seeds 3 --minutes 8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the e2e suite's cluster helpers (tests/e2e/conftest.py)

from rljob_api import constants as c  # noqa: E402

NAME = "autoscale"
MAX_REPLICAS = 3
COOLDOWN_S = 90
"""A rollout pod's start (about 20 s on 2 cores) plus the 30 s window its first report needs, with a margin."""
ROLLOUT_CPU = "200m"
"""Each rollout pod's CPU request and limit (the kubelet's CFS quota): a replica's capacity is bounded whatever the
machine, so one replica cannot keep the trainer fed and another adds capacity until the cores run out. Without it, on
a faster 2-core machine one unbounded replica outran the trainer (held 38% of the time, the trainer waiting 4%) and
the law rightly never added one: a run that judges nothing."""
POLL_S = 5.0
SETTLED_COOLDOWNS = 2
TARGET_DECISIONS = 5
COOLDOWNS_FOR_REVERSAL = 3


@dataclass(frozen=True)
class Sample:
    """One poll of the job: seconds since the job was applied, the replicas the autoscaler runs, the step."""

    t: float
    replicas: Optional[int]
    step: int
    data_wait_share: Optional[float] = None
    held_share: Optional[float] = None


@dataclass(frozen=True)
class Change:
    t: float
    before: int
    after: int

    @property
    def up(self) -> bool:
        return self.after > self.before


@dataclass
class Verdict:
    seed: int
    changes: list[Change]
    end_t: float
    settled_since: Optional[float]
    reversals: int
    events: list[str] = field(default_factory=list)

    @property
    def balanced(self) -> bool:
        return self.settled_since is not None and len(self.changes) <= TARGET_DECISIONS


def changes_of(samples: Sequence[Sample]) -> list[Change]:
    """The count's changes, in order, from polls (a poll without a count is skipped)."""
    out: list[Change] = []
    last: Optional[int] = None
    for s in samples:
        if s.replicas is None:
            continue
        if last is not None and s.replicas != last:
            out.append(Change(s.t, last, s.replicas))
        last = s.replicas
    return out


def judge(seed: int, samples: Sequence[Sample], cooldown_s: float = COOLDOWN_S) -> Verdict:
    """The figures of one run (module docstring). ``settled_since``: the time of the last change (0 when none) when the
    count then held for ``SETTLED_COOLDOWNS`` cooldowns to the last poll, else None.

    Raises ValueError when there are no samples.
    """
    if not samples:
        raise ValueError("no samples: the job was never polled")
    changes = changes_of(samples)
    end_t = samples[-1].t
    since = changes[-1].t if changes else 0.0
    settled = since if end_t - since >= SETTLED_COOLDOWNS * cooldown_s else None
    reversals = sum(1 for a, b in zip(changes, changes[1:])
                    if a.up != b.up and b.t - a.t < COOLDOWNS_FOR_REVERSAL * cooldown_s)
    return Verdict(seed, changes, end_t, settled, reversals)


def job_manifest(seed: int) -> dict[str, Any]:
    from e2e.conftest import load_example, merge

    spec = merge(load_example("rljob-cpu.yaml")["spec"], {
        "trainer": {"maxSteps": 1_000_000, "seed": seed, "checkpoint": {"everySteps": 5, "keepLast": 1}},
        "rollout": {"replicas": 1, "promptsPerBatch": 4, "maxLag": 2048, "seed": seed,
                    "resources": {"requests": {"cpu": ROLLOUT_CPU}, "limits": {"cpu": ROLLOUT_CPU}},
                    "autoscaling": {"minReplicas": 1, "maxReplicas": MAX_REPLICAS, "cooldownSeconds": COOLDOWN_S}},
        "redis": {"persistence": {"enabled": False}},
        "runPolicy": {"backoffLimit": 10},
    })
    spec["trainer"]["checkpoint"].pop("volume", None)
    spec["trainer"].pop("parallelism", None)  # fsdp, as docs/autoscaling.md measured it
    spec["runPolicy"].pop("activeDeadlineSeconds", None)
    return {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": NAME}, "spec": spec}


def run_seed(cluster: Any, seed: int, minutes: float) -> Verdict:
    namespace = f"autoscale-{seed}-{int(time.time()) % 100000}"
    cluster.kubectl("create", "namespace", namespace)
    samples: list[Sample] = []
    try:
        cluster.apply(job_manifest(seed), namespace)
        t0 = time.monotonic()
        while time.monotonic() - t0 < minutes * 60:
            status = (cluster.get("rljob", NAME, "-n", namespace) or {}).get("status") or {}
            if status.get("phase") in (c.Phase.FAILED.value, c.Phase.INVALID.value):
                raise RuntimeError(f"seed {seed}: the job is {status['phase']}: {json.dumps(status)[:2000]}")
            capacity = status.get("capacity") or {}
            sample = Sample(time.monotonic() - t0, (status.get("autoscaling") or {}).get("replicas"),
                            status.get("step") or 0, capacity.get("dataWaitShare"), capacity.get("heldShare"))
            if not samples or (sample.replicas, sample.step) != (samples[-1].replicas, samples[-1].step):
                print(f"  seed {seed} [{sample.t:6.1f} s] step {sample.step:4d} replicas {sample.replicas} "
                      f"data-wait {sample.data_wait_share} held {sample.held_share}", flush=True)
            samples.append(sample)
            time.sleep(POLL_S)
        events = [e.get("message", "") for e in (cluster.get("events", "-n", namespace) or {}).get("items", [])
                  if e.get("reason") == "RolloutsScaled"]
    finally:
        cluster.kubectl("delete", "rljob", NAME, "-n", namespace, "--wait=true", "--timeout=120s", check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
    verdict = judge(seed, samples)
    verdict.events = events
    return verdict


def report(verdicts: Sequence[Verdict], seeds: int) -> bool:
    print("\n| seed | decisions | counts | settled since s | run s | reversals |")
    print("| --- | --- | --- | --- | --- | --- |")
    for v in verdicts:
        counts = " → ".join([str(v.changes[0].before)] + [str(ch.after) for ch in v.changes]) if v.changes else "-"
        settled = "not settled" if v.settled_since is None else f"{v.settled_since:.0f}"
        print(f"| {v.seed} | {len(v.changes)} | {counts} | {settled} | {v.end_t:.0f} | {v.reversals} |")
        for message in v.events:
            print(f"    RolloutsScaled: {message}")
    targets = [
        (f"every seed balanced within {TARGET_DECISIONS} decisions (settled for {SETTLED_COOLDOWNS} cooldowns)",
         len(verdicts) == seeds and all(v.balanced for v in verdicts)),
        (f"no reversal within {COOLDOWNS_FOR_REVERSAL} cooldowns", all(v.reversals == 0 for v in verdicts)),
    ]
    for what, ok in targets:
        print(f"target {what}: {'met' if ok else 'MISSED'}")
    return all(ok for _, ok in targets)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 (default %(default)s)")
    parser.add_argument("--minutes", type=float, default=8.0, help="minutes per seed (default %(default)s)")
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get("RLJOB_CLUSTER_DIR",
                                                                        Path.home() / ".cache/rljob/cluster")))
    args = parser.parse_args(argv)
    if args.minutes * 60 < (SETTLED_COOLDOWNS + 1) * COOLDOWN_S:
        parser.error(f"--minutes must leave room for a decision and {SETTLED_COOLDOWNS} settled cooldowns "
                     f"(at least {(SETTLED_COOLDOWNS + 1) * COOLDOWN_S / 60:g})")
    if os.geteuid() != 0:
        print("the local cluster needs root (containerd, kubelet, CNI)", file=sys.stderr)
        return 2
    from e2e.conftest import Cluster
    from rljob_localcluster import demo

    verdicts: list[Verdict] = []
    try:
        kubeconfig, bin_dir, imported = demo.ensure_cluster(args.dir.resolve())
        demo.install_operator({**os.environ, "KUBECONFIG": kubeconfig}, bin_dir, imported)
        cluster = Cluster(kubeconfig, bin_dir, "local")
        for seed in range(args.seeds):
            print(f"seed {seed}: {args.minutes:g} min, autoscaling 1-{MAX_REPLICAS}, cooldown {COOLDOWN_S} s",
                  flush=True)
            verdicts.append(run_seed(cluster, seed, args.minutes))
    except KeyboardInterrupt:
        report(verdicts, args.seeds)
        return 130
    except BaseException:  # noqa: BLE001 - printed; exit 2 (kubectl's failures are pytest's Failed)
        traceback.print_exc()
        report(verdicts, args.seeds)
        return 2
    return 0 if report(verdicts, args.seeds) else 1


if __name__ == "__main__":
    sys.exit(main())
