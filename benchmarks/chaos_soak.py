"""Chaos soak: one RLTrainingJob on the local cluster trained for ``--minutes`` while faults drawn at random land every
``--min-gap``–``--max-gap`` seconds, overlapping at times; then the invariants, read from the stream, the progress hash
and the job's durable account (status.attempts, status.documentTotals). Outside CI (issue 24 item 7).

The job: the CPU example (examples/rljob-cpu.yaml: 2 trainer pods × 1 rank, 512 documents a step, a checkpoint every
5 steps on a claim, managed Redis with persistence, 1 CPU rollout worker) with ``maxSteps`` out of reach and
``backoffLimit`` 1000, so that only the faults decide what happens. After ``--minutes`` the faults stop, the job trains
again, and the soak ends it with one more config edit: ``maxSteps`` = the step reached + 10 (a ConfigChanged restart,
counted and explained like the others).

Faults, the kinds the chaos suite (tests/e2e) injects, all from outside (API calls and signals):

=====================  ==========================================================================================
trainer_pod_deleted    ``kubectl delete pod`` of a trainer pod (PodDeleted or PodFailed: a gang restart)
rank_killed            SIGKILL to the training process of one rank (PodFailed: a gang restart)
redis_pod_deleted      ``kubectl delete pod`` of the managed Redis (persistence: nothing lost, no restart)
rollout_pod_deleted    ``kubectl delete pod`` of a rollout pod (replaced, no restart)
operator_deleted       ``kubectl delete pod`` of the operator, graceful (its Deployment makes another)
operator_forced        the same with ``--grace-period=0 --force``
config_edit            ``spec.trainer.optimizer.learningRate`` toggled 0.002 ↔ 0.0019 (ConfigChanged restart)
suspend_resume         ``spec.runPolicy.suspend`` true, wait for Suspended (≤ 3 min), 5 s, then false (a new attempt)
rollouts_scaled        ``spec.rollout.replicas`` toggled 1 ↔ 2 (rollout pods only)
=====================  ==========================================================================================

``--seed`` draws the kinds, the gaps, which faults overlap (``--overlap``: the share followed 2–15 s later by a second
one) and the targets, so a failure replays (up to the cluster's own timing).

Invariants (exit 1 when one breaks):

- the job Succeeded;
- every document trained exactly once or reported lost: the progress hash's ``documents_seen`` = status.documentsSeen
  = maxSteps × documentsPerStep, nothing pending in the consumer group, and every lost or dead-lettered entry counted in
  status.documentTotals (the stream's dead-letter length = the kinds' sum; pending entries lost → lostPending; a lost
  stream → streamLosses and an attempt that ended StreamLost);
- every restart explained: each attempt before the last has a record (polled every 2 s, so records past the 20 that
  status keeps are seen too) with an end time, a reason and a message, and status.restarts = the records that ended in
  a restart (any reason but a suspend);
- no mixed attempts: every trainer pod of attempt k was deleted before any pod of attempt k+1 was created (a watch
  of the namespace's pods for the whole soak);
- the account outlives the Events: ``kubectl describe rljob`` reads the same above its Events section once the
  namespace's Events are deleted (as they expire after an hour), and shows Attempts, Document Totals and Restarts.

Figures: faults injected (and skipped for want of a target), restarts, and per kind the seconds from the end of a
fault's injection to training again (the first step the job's status reports after it within one attempt; status is
written by the operator, so an operator fault's figure includes its new pod's start), median and worst; restarts
whose reason no injected fault of its window can cause are listed (informational).

    python benchmarks/chaos_soak.py                          # 30 minutes, seed 0 (the local cluster runs after)
    python benchmarks/chaos_soak.py --minutes 5 --seed 3     # a short one
    python benchmarks/chaos_soak.py --down                   # stop the local cluster at the end

Needs root and ``scripts/setup.sh`` (the local cluster, its images); no other local cluster may run (e2e tests use
their own nodes). Exit status 0 when every invariant held, 1 when one broke, 2 on an error, 130 when interrupted.
A run's record goes to ``--results`` (JSON). Write-up: docs/chaos-soak.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the e2e suite's cluster helpers (tests/e2e/conftest.py, faults.py)

from rljob_api import constants as c  # noqa: E402

FAULT_KINDS = ("trainer_pod_deleted", "rank_killed", "redis_pod_deleted", "rollout_pod_deleted", "operator_deleted",
               "operator_forced", "config_edit", "suspend_resume", "rollouts_scaled")
RESTART_CAUSES = {
    "trainer_pod_deleted": {c.Reason.POD_DELETED.value, c.Reason.POD_FAILED.value},
    "rank_killed": {c.Reason.POD_FAILED.value},
    "config_edit": {c.Reason.CONFIG_CHANGED.value},
    "final_edit": {c.Reason.CONFIG_CHANGED.value},
    "suspend_resume": {c.Reason.JOB_SUSPENDED.value},
}
"""The reasons an attempt may end with after each kind of fault (the others end none)."""
NOT_RESTARTS = {c.Reason.JOB_SUSPENDED.value, c.Reason.EVICTED_BY_KUEUE.value, c.Reason.TRAINING_FINISHED.value}
"""Reasons of an attempt's end that status.restarts does not count (a hold, not a restart)."""
NAME = "soak"
SETTLE_SECONDS = 1200
"""Longest wait for the job to train again after the last fault, and for it to succeed after the final edit."""


@dataclass
class Injected:
    """One fault as it was injected: seconds from the soak's start, what, and the job's attempt and step then."""

    kind: str
    start: float
    end: float = 0.0
    detail: str = ""
    skipped: bool = False
    attempt: Optional[int] = None
    step: Optional[int] = None
    recovery: Optional[float] = None


@dataclass
class Sample:
    """The job's status at ``t`` (seconds from the soak's start)."""

    t: float
    phase: Optional[str]
    attempt: int
    step: Optional[int]
    restarts: int


@dataclass
class Outcome:
    faults: list[Injected] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)


# --- pure parts (tests/operator/test_chaos_soak.py) -----------------------------------------------------------------
def schedule(seed: int, seconds: float, min_gap: float, max_gap: float, overlap: float) -> list[tuple[float, str]]:
    """(offset in seconds, fault kind) of every fault of a soak of ``seconds``: gaps uniform in [min_gap, max_gap],
    the first after one gap; a share ``overlap`` of them followed 2–15 s later by a second fault. Same seed, same
    schedule."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.uniform(min_gap, max_gap)
        if t >= seconds:
            return out
        out.append((round(t, 1), rng.choice(FAULT_KINDS)))
        if rng.random() < overlap:
            out.append((round(t + rng.uniform(2, 15), 1), rng.choice(FAULT_KINDS)))


def recovery_seconds(samples: Sequence[Sample], after: float) -> Optional[float]:
    """Seconds from ``after`` to the first sample that shows a step made after it: a step larger than the sample before
    it within the same attempt, both taken after ``after``. None when none does."""
    previous = None
    for sample in samples:
        if sample.t < after:
            continue
        if (previous is not None and sample.step is not None and previous.step is not None
                and sample.attempt == previous.attempt and sample.step > previous.step):
            return round(sample.t - after, 1)
        previous = sample
    return None


def check_account(attempts: dict[int, dict[str, Any]], status: dict[str, Any]) -> list[str]:
    """Problems with the durable account of a finished job: an attempt before the last without a record, an end time,
    a reason or a message; status.restarts not the number of records that ended in a restart. ``attempts``: every
    status.attempts record seen, by attempt number (the last version of each)."""
    problems = []
    last = status.get("attempt", 0)
    restarts = 0
    for number in range(last):
        record = attempts.get(number)
        if record is None:
            problems.append(f"attempt {number}: no record in status.attempts was ever seen")
            continue
        missing = [key for key in ("endTime", "reason", "message") if not record.get(key)]
        if missing:
            problems.append(f"attempt {number}: its record has no {', '.join(missing)}: {record}")
        if record.get("reason") not in NOT_RESTARTS:
            restarts += 1
    if status.get("restarts", 0) != restarts:
        problems.append(f"status.restarts is {status.get('restarts', 0)}, but {restarts} attempts ended in a restart")
    return problems


def check_documents(snapshot: dict[str, Any], status: dict[str, Any], documents: int,
                    attempts: dict[int, dict[str, Any]]) -> list[str]:
    """Problems with what was trained: ``documents`` trained (progress hash and status agree), nothing pending, and
    every lost or dead-lettered entry counted in status.documentTotals. ``snapshot``: tests/e2e's redis_snapshot."""
    problems = []
    seen = int(snapshot["progress"].get("documents_seen", -1))
    if not seen == documents == status.get("documentsSeen"):
        problems.append(f"documents trained: progress hash {seen}, status.documentsSeen "
                        f"{status.get('documentsSeen')}, expected maxSteps × documentsPerStep = {documents}")
    pending = [g.get("pending") for g in snapshot["groups"]]
    if pending != [0]:
        problems.append(f"consumer groups' pending entries after success: {pending} (one group, 0 pending expected)")
    totals = status.get("documentTotals") or {}
    counters = json.loads(snapshot["progress"].get("stream") or "{}")
    dead = sum((totals.get("deadLettered") or {}).values())
    if snapshot.get("dead_letter", 0) != dead:
        problems.append(f"dead-letter stream holds {snapshot.get('dead_letter', 0)} entries, "
                        f"status.documentTotals.deadLettered counts {dead}")
    if counters.get("lost_pending", 0) > totals.get("lostPending", 0):
        problems.append(f"the last attempt lost {counters['lost_pending']} pending entries, status.documentTotals."
                        f"lostPending counts {totals.get('lostPending', 0)}")
    lost_streams = sum(1 for r in attempts.values() if r.get("reason") == c.Reason.STREAM_LOST.value)
    if totals.get("streamLosses", 0) != lost_streams:
        problems.append(f"status.documentTotals.streamLosses is {totals.get('streamLosses', 0)}, but {lost_streams} "
                        "attempts ended StreamLost")
    return problems


def unexpected_restarts(attempts: dict[int, dict[str, Any]], faults: Sequence[Injected],
                        started: float, slack: float = 120.0) -> list[str]:
    """Attempts that ended with a reason no fault injected in the ``slack`` seconds before their end can cause
    (informational). ``started``: the soak's start as a Unix time (records carry RFC 3339 times)."""
    from datetime import datetime

    out = []
    for number, record in sorted(attempts.items()):
        if not record.get("endTime") or record.get("reason") in (None, c.Reason.TRAINING_FINISHED.value):
            continue
        end = datetime.fromisoformat(record["endTime"].replace("Z", "+00:00")).timestamp() - started
        causes = set()
        for fault in faults:
            if not fault.skipped and fault.start - 5 <= end <= fault.end + slack:
                causes |= RESTART_CAUSES.get(fault.kind, set())
        if record["reason"] not in causes:
            near = sorted({f.kind for f in faults if abs(f.start - end) <= slack}) or ["none"]
            out.append(f"attempt {number} ended {record['reason']} at {end:.0f} s; faults near: {', '.join(near)}")
    return out


def describe_head(text: str) -> str:
    """``kubectl describe`` output without its Events section (the part that must not depend on Events)."""
    return text.split("\nEvents:", 1)[0]


def summarize(faults: Sequence[Injected]) -> dict[str, Any]:
    """Per kind and over all: faults injected, skipped, recovery median and worst (seconds)."""
    out: dict[str, Any] = {}
    kinds = sorted({f.kind for f in faults})
    for kind in [*kinds, "all"]:
        mine = [f for f in faults if kind in ("all", f.kind)]
        times = [f.recovery for f in mine if not f.skipped and f.recovery is not None]
        out[kind] = {"injected": sum(not f.skipped for f in mine), "skipped": sum(f.skipped for f in mine),
                     "not_recovered": sum(not f.skipped and f.recovery is None for f in mine),
                     "recovery_median_s": round(statistics.median(times), 1) if times else None,
                     "recovery_worst_s": max(times) if times else None}
    return out


# --- the cluster side ---------------------------------------------------------------------------------------------
class NoTarget(Exception):
    """The fault has nothing to hit right now (e.g. no trainer pod while the gang restarts)."""


class Soak:
    """The job, its watchers and the faults' actions."""

    def __init__(self, cluster, operator, namespace: str, seed: int) -> None:
        from kubernetes import client as kube_client

        self.cluster, self.operator, self.namespace = cluster, operator, namespace
        self.rng = random.Random(seed + 1)  # targets; the schedule has its own
        self.api = kube_client.CustomObjectsApi(cluster.api_client())
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        self.samples: list[Sample] = []
        self.attempts: dict[int, dict[str, Any]] = {}
        self.status: dict[str, Any] = {}
        self.poll_errors = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._poller = threading.Thread(target=self._poll, name="soak-poll", daemon=True)

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    # status
    def _poll(self) -> None:
        while not self._stop.wait(2.0):
            try:
                job = self.api.get_namespaced_custom_object(c.GROUP, c.VERSION, self.namespace, c.PLURAL, NAME)
            except Exception:  # noqa: BLE001 - a missed sample; counted
                self.poll_errors += 1
                continue
            status = job.get("status") or {}
            with self._lock:
                self.status = status
                self.samples.append(Sample(self.now(), status.get("phase"), status.get("attempt", 0),
                                           status.get("step"), status.get("restarts", 0)))
                for record in status.get("attempts") or []:
                    self.attempts[record["attempt"]] = record

    def start(self) -> None:
        self._poller.start()

    def stop(self) -> None:
        self._stop.set()
        self._poller.join(timeout=10)

    def current(self) -> dict[str, Any]:
        with self._lock:
            return dict(self.status)

    def wait_status(self, predicate: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.current()
            if status.get("phase") == c.Phase.FAILED.value:
                raise RuntimeError(f"the job Failed while waiting for {what}: {status.get('conditions')}")
            if predicate(status):
                return status
            time.sleep(2)
        raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}; status: {self.current()}")

    # the faults
    def _pods(self, role: str) -> list[dict[str, Any]]:
        return [p for p in self.cluster.items("pods", self.namespace, f"{c.LABEL_ROLE}={role}")
                if not p["metadata"].get("deletionTimestamp") and p.get("status", {}).get("phase") == "Running"]

    def _one(self, pods: list[dict[str, Any]], what: str) -> dict[str, Any]:
        if not pods:
            raise NoTarget(f"no running {what}")
        return self.rng.choice(sorted(pods, key=lambda p: p["metadata"]["name"]))

    def _delete_pod(self, namespace: str, pod: dict[str, Any], *extra: str) -> str:
        name = pod["metadata"]["name"]
        self.cluster.kubectl("delete", "pod", "-n", namespace, name, "--wait=false", *extra)
        return name

    def _patch(self, patch: dict[str, Any]) -> None:
        self.cluster.kubectl("patch", "rljob", NAME, "-n", self.namespace, "--type=merge", "-p", json.dumps(patch))

    def _spec(self) -> dict[str, Any]:
        return self.cluster.get("rljob", NAME, "-n", self.namespace)["spec"]

    def trainer_pod_deleted(self) -> str:
        return self._delete_pod(self.namespace, self._one(self._pods("trainer"), "trainer pod"))

    def rank_killed(self) -> str:
        from e2e.faults import rank_pids, signal_all

        pod = self._one(self._pods("trainer"), "trainer pod")
        ranks = rank_pids(pod["metadata"]["uid"])
        if not ranks:
            raise NoTarget(f"no training process in {pod['metadata']['name']} yet")
        rank = self.rng.choice(sorted(ranks))
        signal_all([ranks[rank]], signal.SIGKILL)
        return f"rank {rank} (pid {ranks[rank]}) of {pod['metadata']['name']}"

    def redis_pod_deleted(self) -> str:
        return self._delete_pod(self.namespace, self._one(self._pods("redis"), "Redis pod"))

    def rollout_pod_deleted(self) -> str:
        return self._delete_pod(self.namespace, self._one(self._pods("rollout"), "rollout pod"))

    def _operator_pod(self) -> dict[str, Any]:
        pods = [p for p in self.operator.pods() if not p["metadata"].get("deletionTimestamp")]
        return self._one(pods, "operator pod")

    def operator_deleted(self) -> str:
        return self._delete_pod(self.operator.namespace, self._operator_pod())

    def operator_forced(self) -> str:
        return self._delete_pod(self.operator.namespace, self._operator_pod(), "--grace-period=0", "--force")

    def config_edit(self) -> str:
        rate = self._spec()["trainer"]["optimizer"]["learningRate"]
        new = 0.0019 if abs(rate - 0.002) < 1e-9 else 0.002
        self._patch({"spec": {"trainer": {"optimizer": {"learningRate": new}}}})
        return f"learningRate {rate} -> {new}"

    def suspend_resume(self) -> str:
        self._patch({"spec": {"runPolicy": {"suspend": True}}})
        t = time.monotonic()
        try:
            self.wait_status(lambda s: s.get("phase") == c.Phase.SUSPENDED.value, 180, "Suspended")
            held = f"Suspended after {time.monotonic() - t:.0f} s"
            time.sleep(5)
        except RuntimeError as err:
            held = f"not Suspended ({err})"
        self._patch({"spec": {"runPolicy": {"suspend": False}}})
        return held

    def rollouts_scaled(self) -> str:
        replicas = self._spec()["rollout"]["replicas"]
        new = 2 if replicas == 1 else 1
        self._patch({"spec": {"rollout": {"replicas": new}}})
        return f"rollout replicas {replicas} -> {new}"

    def inject(self, kind: str, fault: Injected) -> None:
        status = self.current()
        fault.attempt, fault.step = status.get("attempt"), status.get("step")
        try:
            fault.detail = getattr(self, kind)()
        except NoTarget as why:
            fault.skipped, fault.detail = True, str(why)
        except BaseException as err:  # noqa: BLE001 - kubectl's failure is pytest's Failed; reported, the soak goes on
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            fault.skipped, fault.detail = True, f"injection failed: {err!r}"
        fault.end = self.now()
        mark = "skipped" if fault.skipped else "injected"
        print(f"[{fault.start:7.1f} s] {kind:<20} {mark}: {fault.detail} (attempt {fault.attempt}, step {fault.step})",
              flush=True)


def account_without_events(cluster, namespace: str) -> list[str]:
    """Problems with what ``kubectl describe rljob`` tells once the namespace's Events are gone (they expire after an
    hour; deleted here): everything above its Events section must read as before, the account included."""
    def describe() -> str:
        return cluster.kubectl("describe", "rljob", NAME, "-n", namespace).stdout

    before = describe()
    cluster.kubectl("delete", "events", "--all", "-n", namespace)
    after = describe()
    problems = []
    if describe_head(before) != describe_head(after):
        problems.append("kubectl describe reads differently once the Events are gone")
    for part in ("Attempts:", "Document Totals:", "Restarts:"):
        if part not in describe_head(after):
            problems.append(f"kubectl describe does not show {part!r} without the Events")
    print("\nkubectl describe rljob, the Events deleted:\n" + after, flush=True)
    return problems


def job_manifest() -> tuple[dict[str, Any], dict[str, Any]]:
    """(the checkpoint claim, the RLTrainingJob) of the soak."""
    from e2e.conftest import load_example, merge, pvc

    claim = f"{NAME}-checkpoints"
    spec = merge(load_example("rljob-cpu.yaml")["spec"], {
        "trainer": {"maxSteps": 1_000_000, "checkpoint": {"volume": claim}},
        "runPolicy": {"backoffLimit": 1000},
    })
    spec["runPolicy"].pop("activeDeadlineSeconds", None)
    spec["trainer"].pop("parallelism", None)  # the default, fsdp: its restarts reshard sharded checkpoints (as e2e's jobs)
    job = {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": NAME}, "spec": spec}
    return pvc(claim), job


def run(args: argparse.Namespace, outcome: Outcome) -> None:
    from e2e.conftest import Cluster, Operator, Recorder, check_attempts_never_mixed, redis_snapshot
    from rljob_localcluster import demo

    d = args.dir.resolve()
    kubeconfig, bin_dir, imported = demo.ensure_cluster(d)
    demo.install_operator({**os.environ, "KUBECONFIG": kubeconfig}, bin_dir, imported)
    cluster = Cluster(kubeconfig, bin_dir, "local")
    operator = Operator(cluster)
    namespace = f"chaos-soak-{args.seed}-{int(time.time()) % 100000}"
    cluster.kubectl("create", "namespace", namespace)
    print(f"namespace {namespace}; faults for {args.minutes} min, seed {args.seed}", flush=True)
    claim, job = job_manifest()
    plan = schedule(args.seed, args.minutes * 60, args.min_gap, args.max_gap, args.overlap)
    with Recorder(cluster, namespace, "pods") as pods:
        cluster.apply(claim, namespace)
        cluster.apply(job, namespace)
        soak = Soak(cluster, operator, namespace, args.seed)
        soak.start()
        try:
            soak.wait_status(lambda s: (s.get("step") or 0) >= 5, 600, "the first 5 steps")
            print(f"[{soak.now():7.1f} s] training; the faults start", flush=True)
            begin = soak.now()
            threads = []
            for offset, kind in plan:
                time.sleep(max(0.0, begin + offset - soak.now()))
                fault = Injected(kind, soak.now())
                outcome.faults.append(fault)
                thread = threading.Thread(target=soak.inject, args=(kind, fault), daemon=True)
                thread.start()
                threads.append(thread)
            time.sleep(max(0.0, begin + args.minutes * 60 - soak.now()))
            for thread in threads:
                thread.join(timeout=300)
            print(f"[{soak.now():7.1f} s] faults over; waiting for the job to train again", flush=True)
            quiet = soak.now()
            soak.wait_status(lambda s: recovery_seconds(soak.samples, quiet) is not None, SETTLE_SECONDS,
                             "training after the last fault")
            step = soak.current()["step"]
            final = Injected("final_edit", soak.now(), attempt=soak.current().get("attempt"), step=step)
            soak._patch({"spec": {"trainer": {"maxSteps": step + 10}}})
            final.end, final.detail = soak.now(), f"maxSteps -> {step + 10}"
            outcome.faults.append(final)
            print(f"[{final.start:7.1f} s] final_edit {final.detail}", flush=True)
            status = soak.wait_status(lambda s: s.get("phase") == c.Phase.SUCCEEDED.value, SETTLE_SECONDS,
                                      "Succeeded")
            time.sleep(4)  # one more poll with the final account
        finally:
            soak.stop()
            for fault in outcome.faults:  # also for an interrupted run's report
                if not fault.skipped:
                    fault.recovery = recovery_seconds(soak.samples, fault.end)
        pods.check()
        status = soak.current()
        spec = cluster.get("rljob", NAME, "-n", namespace)
        documents = spec["spec"]["trainer"]["maxSteps"] * spec["spec"]["trainer"]["batch"]["documentsPerStep"]
        snapshot = redis_snapshot(cluster, namespace, spec, lambda: "")
        outcome.problems += check_documents(snapshot, status, documents, soak.attempts)
        outcome.problems += check_account(soak.attempts, status)
        try:
            check_attempts_never_mixed(pods, status["attempt"] + 1)
        except AssertionError as err:
            outcome.problems.append(f"mixed attempts: {err}")
        outcome.problems += account_without_events(cluster, namespace)
        outcome.unexpected = unexpected_restarts(soak.attempts, outcome.faults, soak.wall0)
        outcome.figures = {
            "seconds": soak.now(), "attempts": status["attempt"] + 1, "restarts": status["restarts"],
            "steps": status.get("step"), "documents": documents, "documentTotals": status.get("documentTotals"),
            "status_poll_errors": soak.poll_errors, "recovery": summarize(outcome.faults),
        }
    if not args.keep:
        cluster.kubectl("delete", "rljob", "--all", "-n", namespace, "--wait=true", "--timeout=120s", check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
    if args.down:
        from rljob_localcluster import clusterdir

        clusterdir.down(d)


def report(outcome: Outcome) -> bool:
    print("\nfaults")
    for f in outcome.faults:
        recovered = "-" if f.skipped else ("never" if f.recovery is None else f"{f.recovery:.1f} s")
        print(f"  {f.start:7.1f} s  {f.kind:<20} {'skipped' if f.skipped else 'ok':<8} training again {recovered:>8}"
              f"  {f.detail}")
    if outcome.figures:
        fig = outcome.figures
        print(f"\nfigures: {fig['seconds']:.0f} s, {fig['attempts']} attempts, {fig['restarts']} restarts, "
              f"{fig['steps']} steps, {fig['documents']} documents; documentTotals {fig['documentTotals']}")
        print(f"  {'kind':<20} {'injected':>8} {'skipped':>8} {'median s':>9} {'worst s':>8} {'never':>6}")
        for kind, row in fig["recovery"].items():
            print(f"  {kind:<20} {row['injected']:>8} {row['skipped']:>8} {row['recovery_median_s'] or '-':>9} "
                  f"{row['recovery_worst_s'] or '-':>8} {row['not_recovered']:>6}")
    if outcome.unexpected:
        print("\nrestarts no fault of their window explains (informational):")
        for line in outcome.unexpected:
            print(f"  {line}")
    ok = bool(outcome.figures) and not outcome.problems
    print("\ninvariants: " + ("all held" if ok else "BROKEN" if outcome.figures else "not judged (the soak did not end)"))
    for problem in outcome.problems:
        print(f"  - {problem}")
    return ok


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="minutes of faults (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-gap", type=float, default=60.0, help="seconds between faults, at least")
    parser.add_argument("--max-gap", type=float, default=120.0, help="seconds between faults, at most")
    parser.add_argument("--overlap", type=float, default=0.25, help="share of faults followed by a second one")
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get("RLJOB_CLUSTER_DIR",
                                                                        Path.home() / ".cache/rljob/cluster")))
    parser.add_argument("--results", type=Path, default=None, help="write the run's record here (JSON)")
    parser.add_argument("--keep", action="store_true", help="keep the job and its namespace")
    parser.add_argument("--down", action="store_true", help="stop the local cluster at the end")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("the local cluster needs root (containerd, kubelet, CNI)", file=sys.stderr)
        return 2
    outcome = Outcome()
    code = 0
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops it like Ctrl-C: the figures so far
    try:
        run(args, outcome)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - printed; exit 2 (kubectl's failures are pytest's Failed)
        traceback.print_exc()
        code = 2
    ok = report(outcome)
    if args.results:
        args.results.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "ok": ok,
                                            "faults": [asdict(f) for f in outcome.faults],
                                            "problems": outcome.problems, "unexpected": outcome.unexpected,
                                            "figures": outcome.figures}, indent=1))
    return code or (0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
