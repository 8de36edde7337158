"""The README's main job: ``python -m rljob_localcluster demo`` (``scripts/demo.sh`` after ``scripts/setup.sh``).

1. starts the local cluster, or reuses the one that runs (``up``): the control plane and two real nodes
   (kubelet + containerd, four fake GPUs each) with the images built from the project's Dockerfiles;
2. ``helm upgrade --install rljob-operator helm/rljob-operator -n rljob-system --create-namespace --wait``
   (the operator runs as a pod under its own ServiceAccount);
3. ``kubectl apply -f examples/rljob-cpu.yaml`` (a finished job of the same name is deleted first);
4. shows live progress (:func:`rljob_operator.watch.watch`: step bar, reward, staleness, phase, conditions)
   until the job is Succeeded or Failed;
5. prints the final status (``kubectl get rljob``, the conditions) and where the metrics are;
6. leaves the cluster running (``--down`` stops it; ``python -m rljob_localcluster down`` later).

Exit status: 0 when the job Succeeded, 1 otherwise. Needs root (containerd, kubelet, CNI).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any, Sequence

import yaml

from . import clusterdir, images

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "rljob-operator"
EXAMPLE = REPO / "examples" / "rljob-cpu.yaml"
RELEASE, OPERATOR_NAMESPACE = "rljob-operator", "rljob-system"


class DemoError(RuntimeError):
    """A step of the demo failed; the message says which and what to look at."""


def _say(text: str) -> None:
    print(f"==> {text}", flush=True)


def _run(cmd: list[str], env: dict[str, str], what: str, *, timeout: float = 600,
         input: str | None = None) -> str:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, input=input, check=False)
    if proc.returncode != 0:
        raise DemoError(f"{what} failed ({' '.join(cmd)}):\n{proc.stderr}{proc.stdout}")
    return proc.stdout


def ensure_cluster(d: Path) -> tuple[str, Path, list[str]]:
    """Start (or reuse, :func:`reuse`) the control plane and the nodes of cluster dir ``d``; (kubeconfig, bin dir,
    the images a reused cluster's nodes got anew)."""
    running = clusterdir.daemon_pid(d) is not None
    state = clusterdir.read_state(d) if running else None
    imported: list[str] = []
    if running and (state is None or state.get("phase") != "ready"):
        raise DemoError(f"the local cluster in {d} is still starting (see {d / 'daemon.log'}); run the demo again "
                        "once 'python -m rljob_localcluster status' answers")
    if state is None:
        _say("starting the local cluster: control plane (kube-apiserver, etcd, controller-manager, scheduler) and "
             "two nodes (kubelet + containerd, 4 fake nvidia.com/gpu each)")
        proc = subprocess.run([sys.executable, "-m", "rljob_localcluster", "up", "--dir", str(d)],
                              stdout=subprocess.PIPE, text=True, check=False)
        state = clusterdir.read_state(d)
        if proc.returncode != 0 or state is None:
            raise DemoError(f"the control plane did not start; see {d / 'daemon.log'}")
    else:
        imported = reuse(d, state)
    return str(d / "kubeconfig"), Path(state["bin_dir"]), imported


def reuse(d: Path, state: dict) -> list[str]:
    """Check that the running cluster can run the demo (nodes, none failed) and bring its nodes' images up to date
    with index.json (an image rebuilt since the nodes started is imported; unchanged ones are skipped); returns the
    names imported.

    Raises:
        DemoError: the cluster runs without nodes, or a node process exited (``status`` says DEGRADED).
    """
    nodes = (state.get("nodes") or {}).get("nodes") or {}
    if not nodes:
        raise DemoError(f"the local cluster in {d} runs without nodes (up --nodes 0), so no pod can start: "
                        "'python -m rljob_localcluster down' first, then run the demo again")
    if state.get("exited"):
        raise DemoError(f"node processes of the local cluster exited {state['exited']} (status: DEGRADED): "
                        "'python -m rljob_localcluster down' first, then run the demo again")
    _say(f"reusing the local cluster at {state['server']}; bringing its nodes' images up to date")
    imported: set[str] = set()
    for name, node in nodes.items():
        try:
            done = images.import_into(node["containerd_socket"], snapshotter=state["nodes"].get("snapshotter", ""),
                                      log=lambda m, name=name: _say(f"{name}: {m}"))
        except (RuntimeError, FileNotFoundError) as err:
            raise DemoError(f"importing the images into {name} failed: {err}") from err
        if done:
            _say(f"{name}: imported {', '.join(done)}")
        imported.update(done)
    return sorted(imported)


def install_operator(env: dict[str, str], bin_dir: Path, imported: Sequence[str] = ()) -> None:
    """Install or upgrade the chart and wait for the operator pod; on failure the message carries its pod and logs.
    When ``imported`` (:func:`ensure_cluster`'s) names an operator image, the running operator is restarted onto it
    (same tag, new image)."""
    _say(f"helm upgrade --install {RELEASE} {CHART.relative_to(REPO)} -n {OPERATOR_NAMESPACE}")
    try:
        _run([str(bin_dir / "helm"), "upgrade", "--install", RELEASE, str(CHART), "-n", OPERATOR_NAMESPACE,
              "--create-namespace", "--wait", "--timeout", "5m"], env, "installing the operator chart")
    except DemoError as err:
        kubectl = [str(bin_dir / "kubectl"), "-n", OPERATOR_NAMESPACE]
        pods = subprocess.run([*kubectl, "get", "pods", "-o", "wide"], env=env, capture_output=True, text=True,
                              check=False).stdout
        logs = subprocess.run([*kubectl, "logs", f"deploy/{RELEASE}", "--tail=40"], env=env, capture_output=True,
                              text=True, check=False)
        raise DemoError(f"{err}\noperator pods:\n{pods}\noperator logs:\n{logs.stdout}{logs.stderr}") from err
    if any("/operator:" in name for name in imported):
        _say("restarting the operator on its newly imported image")
        _run([str(bin_dir / "kubectl"), "-n", OPERATOR_NAMESPACE, "rollout", "restart", f"deploy/{RELEASE}"], env,
             "restarting the operator")
        _run([str(bin_dir / "kubectl"), "-n", OPERATOR_NAMESPACE, "rollout", "status", f"deploy/{RELEASE}",
              "--timeout=180s"], env, "waiting for the restarted operator")


def apply_example(env: dict[str, str], bin_dir: Path, namespace: str) -> str:
    """Apply the CPU example in ``namespace`` (deleting an earlier job of the same name and its checkpoint claim
    first, so training starts at step 0); the job's name."""
    kubectl = [str(bin_dir / "kubectl"), "-n", namespace]
    name = next(d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d and d.get("kind") == "RLTrainingJob")[
        "metadata"]["name"]
    existing = subprocess.run([*kubectl, "get", "rljob", name, "-o", "json"], env=env, capture_output=True,
                              text=True, check=False)
    if existing.returncode == 0:
        phase = (json.loads(existing.stdout).get("status") or {}).get("phase")
        _say(f"deleting the earlier {name} ({phase}) to start afresh")
        _run([*kubectl, "delete", "-f", str(EXAMPLE), "--ignore-not-found", "--wait=true", "--timeout=120s"], env,
             "deleting the earlier job and its checkpoint claim")
    _say(f"kubectl apply -f {EXAMPLE.relative_to(REPO)}")
    _run([*kubectl, "apply", "-f", str(EXAMPLE)], env, "applying the example")
    return name


def _progress_hash(job: dict[str, Any], pod_ip: str | None, password: str | None) -> dict[str, str]:
    """The trainer's progress hash, read from the host (pod addresses are routable on the local cluster)."""
    if not pod_ip:
        return {}
    import redis
    from rljob_api.config import RedisKeys
    from rljob_api.spec import RLTrainingJobSpec

    meta = job["metadata"]
    keys = RedisKeys.build(meta["namespace"], meta["name"], RLTrainingJobSpec.model_validate(job["spec"]))
    try:
        client = redis.Redis(host=pod_ip, password=password, decode_responses=True, socket_timeout=5)
        return {"key": keys.progress, **client.hgetall(keys.progress)}
    except redis.RedisError:
        return {}


def condition_lines(conditions: list[dict[str, Any]]) -> list[str]:
    """One line per condition: type, status, reason, message — a message an earlier condition already showed (a
    finished job's conditions echo the finish) is shown as "(as <that condition's type>)"."""
    told: dict[str, str] = {}
    lines = []
    for cond in conditions:
        message = cond.get("message", "")
        shown = f"(as {told[message]})" if message in told else message
        told.setdefault(message, cond["type"])
        lines.append(f"  {cond['type']:<13} {cond['status']:<6} {cond['reason']:<18} {shown}")
    return lines


def report(job: dict[str, Any], env: dict[str, str], bin_dir: Path, d: Path, *, kept: bool = True) -> None:
    """Print the final status and where the metrics, the progress hash and the logs are (``kept``: the cluster
    stays up afterwards, so its endpoints can be visited)."""
    meta, status = job["metadata"], job.get("status") or {}
    name, namespace = meta["name"], meta["namespace"]
    kubectl = [str(bin_dir / "kubectl"), "-n", namespace]
    print()
    _say(f"kubectl get rljob {name}")
    print(_run([*kubectl, "get", "rljob", name], env, "kubectl get rljob"), end="")
    print()
    _say("conditions")
    for line in condition_lines(status.get("conditions") or []):
        print(line)
    print()
    _say(f"status.lastMetrics (step {status.get('step')}, documentsSeen {status.get('documentsSeen')}, "
         f"modelVersion {status.get('modelVersion')}, rolloutReward {status.get('rolloutReward')})")
    metrics = sorted((status.get("lastMetrics") or {}).items())
    width = max((len(key) for key, _ in metrics), default=0)
    for key, value in metrics:
        print(f"  {key:<{width}} {value:.6g}")
    redis_pods = json.loads(_run([*kubectl, "get", "pods", "-l", f"rljob.dev/job-name={name},rljob.dev/role=redis",
                                  "-o", "json"], env, "listing the Redis pod"))["items"]
    pod_ip = (redis_pods[0].get("status") or {}).get("podIP") if redis_pods else None
    secret = subprocess.run([*kubectl, "get", "secret", f"{name}-redis-auth", "-o", "jsonpath={.data.password}"],
                            env=env, capture_output=True, text=True, check=False).stdout
    import base64

    password = base64.b64decode(secret).decode() if secret else None
    progress = _progress_hash(job, pod_ip, password)
    print()
    if progress:
        _say(f"progress hash in the job's Redis ({pod_ip}:6379): HGETALL {progress.pop('key')}")
        for key in ("step", "documents_seen", "model_version", "tokens_per_second", "stream", "updated_at"):
            if key in progress:
                print(f"  {key:<18} {progress[key]}")
    print()
    _say("where to look next")
    # The host does not resolve cluster DNS names, but pod IPs on the nodes' bridges are reachable from it.
    operator_pods = json.loads(_run([str(bin_dir / "kubectl"), "-n", OPERATOR_NAMESPACE, "get", "pods", "-l",
                                     f"app.kubernetes.io/instance={RELEASE}", "-o", "json"], env,
                                    "listing the operator pods"))["items"]
    operator_ip = next((ip for p in operator_pods if (ip := (p.get("status") or {}).get("podIP"))), "<operator pod IP>")
    operator_metrics = f"http://{operator_ip}:9090/metrics"
    lines = [
        f"kubectl get rljob {name} -n {namespace} -o yaml      # status: conditions, lastMetrics, rolloutReward",
        f"kubectl get events -n {namespace} --field-selector involvedObject.name={name}",
        f"trainer Prometheus endpoint while it runs: http://<{name}-trainer-0 pod IP>:9400/metrics (rljob_trainer_*; "
        f"also the rollout pods on :9400; in a cluster: {name}-trainer-0.{name}-trainer.{namespace}:9400)",
        f"operator metrics: {operator_metrics} (in a cluster: the Service {RELEASE}-metrics.{OPERATOR_NAMESPACE}:9090)",
    ]
    if kept:
        lines += [
            f"pod logs: kubectl logs -n {namespace} {name}-trainer-0 (--previous after a container restart; a "
            f"deleted pod's logs go with it)",
            f"control-plane logs: {d / 'data' / 'logs'}; kubelet, containerd, kube-proxy and CoreDNS logs: "
            f"{d / 'nodes' / 'logs'}",
            'use this cluster: eval "$(python -m rljob_localcluster env)"; '
            'stop it (removes the control-plane logs, keeps the node logs): python -m rljob_localcluster down',
        ]
    else:
        lines.append(f"control-plane logs: removed with the cluster (--down); node logs: {d / 'nodes' / 'logs'}")
    for line in lines:
        print(f"  {line}")
    try:
        with urllib.request.urlopen(operator_metrics, timeout=5) as response:
            samples = [ln for ln in response.read().decode().splitlines()
                       if ln.startswith("rljob_operator_gang_restarts_total")
                       or (ln.startswith("rljob_operator_jobs{") and not ln.endswith(" 0.0"))]
        if samples:
            print("  operator metrics now: " + "; ".join(samples[:4]))
    except OSError:
        pass


def run(args: argparse.Namespace) -> int:
    """The demo (see the module docstring); returns the exit status."""
    if os.geteuid() != 0:
        print("the local cluster needs root (containerd, kubelet, CNI)", file=sys.stderr)
        return 2
    d: Path = args.dir.resolve()
    d.mkdir(parents=True, exist_ok=True)
    succeeded = False
    try:
        kubeconfig, bin_dir, imported = ensure_cluster(d)
        env = {**os.environ, "KUBECONFIG": kubeconfig}
        install_operator(env, bin_dir, imported)
        name = apply_example(env, bin_dir, args.namespace)
        _say(f"watching {args.namespace}/{name} (Ctrl-C stops watching; the job goes on)")
        from kubernetes import config
        from rljob_operator.watch import watch

        config.load_kube_config(config_file=kubeconfig)
        job = watch(name, args.namespace, timeout_seconds=args.timeout)
        succeeded = (job.get("status") or {}).get("phase") == "Succeeded"
        report(job, env, bin_dir, d, kept=not args.down)
    except (DemoError, TimeoutError) as err:
        print(f"demo failed: {err}", file=sys.stderr)
    except KeyboardInterrupt:
        print("\nstopped watching", file=sys.stderr)
    finally:
        if args.down:
            _say("stopping the local cluster (--down)")
            clusterdir.down(d)
    print()
    _say("the job Succeeded" if succeeded else "the job did not succeed")
    return 0 if succeeded else 1


def add_parser(sub, default_dir: Path) -> None:
    """The ``demo`` subcommand of ``python -m rljob_localcluster``."""
    p = sub.add_parser("demo", help="start the local cluster, install the operator, train the CPU example",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=default_dir, help="cluster state dir (RLJOB_CLUSTER_DIR)")
    p.add_argument("--namespace", default="default", help="namespace of the job (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the job to finish")
    p.add_argument("--down", action="store_true", help="stop the local cluster at the end (default: keep it)")
    p.set_defaults(fn=run)
