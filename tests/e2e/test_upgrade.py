"""Upgrading rljob under a running job restarts nothing (DESIGN §2 "Upgrades restart nothing"; issue 10 item 1).

The earlier version is a real one: the commit in ``tests/e2e/upgrade-from``, whose chart, CRD and example come from
``git archive`` and whose operator image is built from its own Dockerfile (``localcluster/build-release.sh``, run by
``scripts/setup.sh``, cached by commit). Its job's pods run this checkout's trainer image, which the job names: the
earlier trainer image would be another 2.9 GiB build and 6.3 GiB in each node, and the upgrade replaces the operator
only (the pods keep whatever image they run).

The upgrade as a user does it (helm/rljob-operator/README.md, "Upgrading"):

1. the suite's release and CRDs are removed and the earlier chart is ``helm install``ed from scratch (its own CRD);
2. the earlier version's CPU example (2 trainer pods, 1 rollout pod, a checkpoint claim) trains and commits a
   checkpoint;
3. this checkout's CRD is applied (``kubectl apply --server-side --force-conflicts``): the API server fills its new
   defaults into the stored job on every read, without bumping ``metadata.generation``;
4. ``helm upgrade`` to this checkout's chart and operator image. Once the new operator has made several passes and
   written the job's status, the trainer, rollout and Redis pods are the ones from before (their UIDs; the pods' watch
   stream saw no pod added or deleted), the Redis keeps its emptyDir (no data claim is made although the new CRD
   defaults ``spec.redis.persistence`` to enabled: moving it would empty the stream), no gang restart is counted
   (status and the operator's metric) and the config ConfigMap keeps its record byte for byte;
5. a rollout-only edit (``spec.rollout.maxLag``, README: rollout edits never restart the gang) replaces the rollout
   pod and no trainer pod, and the trainer's part of the resolved config stays as recorded (no new default in it);
6. a trainer edit (``spec.trainer.maxSteps``) restarts the gang (reason ConfigChanged), resolved by this version: the
   new defaults are in its config, but for ``spec.redis.persistence``, which stays as recorded (absent) until
   ``spec.redis.persistence``, ``image`` or ``mode`` is edited: the Redis pod and its emptyDir stay through the
   gang restart, and the restarted gang loads the checkpoint written before the upgrade (or a later one).

The defaulted fields this version adds over the earlier one are printed; while there are none the test checks the
operator and CRD swap all the same and says so in a warning. Between steps 3 and 4 the earlier operator reads a job
holding fields it does not know (its spec model refuses unknown fields): the (phase, Valid) statuses of that window
are printed. Tried with a synthetic defaulted ``spec.trainer.precision`` on top of this test: 52c9a9d's operator
reports Valid=False (InvalidSpec) there and goes on with the last valid spec, replacing no pod; the new operator sets
Valid=True again, and every step passed. The suite's release (this chart, these CRDs) is back in
place at the end, also after a failure.
"""

from __future__ import annotations

import json
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from rljob_api import constants as c
from rljob_api.spec import RLTrainingJobSpec
from rljob_api import names

from .conftest import (
    CHART,
    Cluster,
    Operator,
    Recorder,
    condition,
    get_job,
    image_values,
    phase,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]  # issue 11 item 6: part of the chaos suite

UPGRADE_FROM = Path(__file__).with_name("upgrade-from")
CRD_FILE = Path("crds") / "rltrainingjobs.rljob.dev.yaml"
MAX_STEPS = 100_000
"""Far more steps than the test lasts: the job trains through every step of it (the namespace goes at the end)."""
MAX_LAG = 1536
"""The rollout-only edit: the example's 1024 documents of lag plus one step."""
PASSES = 3
"""Reconcile passes of the new operator before its first checks."""


class UpgradeNote(UserWarning):
    """What this run of the upgrade test could not exercise (shown in pytest's warnings summary)."""


@dataclass(frozen=True)
class Earlier:
    """The earlier version: its commit, its source tree and its operator image (``REPOSITORY:TAG``)."""

    commit: str
    source: Path
    image: str

    @property
    def chart(self) -> Path:
        return self.source / "helm" / "rljob-operator"


def upgrade_from() -> str:
    """The commit of ``tests/e2e/upgrade-from`` (its first line that is not a comment)."""
    lines = [ln.strip() for ln in UPGRADE_FROM.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return lines[0]


def restore(cluster: Cluster, operator: Operator) -> None:
    """The suite's release as the ``operator`` fixture installed it: this checkout's CRDs and chart, its values."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    cluster.helm("upgrade", "--install", operator.release, str(CHART), "-n", operator.namespace, "--reset-values",
                 "--wait", "--timeout", "5m", *operator.values)


@pytest.fixture()
def earlier(cluster: Cluster, operator: Operator, namespace: str, request: pytest.FixtureRequest) -> Iterator[Earlier]:
    """The earlier version, its operator image on the nodes (local cluster: built by build-release.sh, cached, then
    imported; ``--cluster=existing``: ``--earlier-operator-image``). Afterwards :func:`restore` (before the namespace
    goes, so that this checkout's operator deletes its job)."""
    from rljob_localcluster import images

    commit = upgrade_from()
    if cluster.mode == "local":
        release = images.build_release(commit)
        (image,) = images.load_index(release / "images" / "index.json")
        cluster.nodes.import_images([image])
        name = image.name.removeprefix("docker.io/")
    else:
        name = request.config.getoption("--earlier-operator-image")
        if not name:
            pytest.fail(f"--cluster=existing needs --earlier-operator-image: the operator image of {commit} "
                        "(tests/e2e/kind/run.sh builds and loads it)")
        release = images.build_release(commit, source_only=True)
    try:
        yield Earlier(commit, release / "src", name)
    finally:
        start = time.monotonic()
        restore(cluster, operator)
        print(f"the suite's release restored in {time.monotonic() - start:.0f} s")


# --- reading the cluster ------------------------------------------------------------------------------------------
def schema_defaults(crd_file: Path) -> dict[str, Any]:
    """{dotted path: default} of every property of the CRD's stored version that has a default (not inside lists or
    maps: those are defaulted per item)."""
    crd = yaml.safe_load(crd_file.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    found: dict[str, Any] = {}

    def walk(schema: dict[str, Any], path: str) -> None:
        if "default" in schema and path:
            found[path] = schema["default"]
        for key, sub in (schema.get("properties") or {}).items():
            walk(sub, f"{path}.{key}" if path else key)

    walk(version["schema"]["openAPIV3Schema"], "")
    return found


def lookup(obj: Any, path: str) -> tuple[bool, Any]:
    """(found, value) of the dotted ``path`` in ``obj``."""
    for part in path.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return False, None
        obj = obj[part]
    return True, obj


def missing_defaults(obj: dict[str, Any], defaults: dict[str, Any], prefix: str = "spec.") -> dict[str, Any]:
    """{path: (default, what ``obj`` has)} for each default under ``prefix`` that ``obj`` lacks although the object
    holding it is there: a scalar must equal its default, an object must be there (its fields' own defaults say
    what it holds; an object default applies only where the object is absent)."""
    wrong = {}
    for path, default in sorted(defaults.items()):
        if not path.startswith(prefix) or not lookup(obj, path.rsplit(".", 1)[0])[0]:
            continue
        found, value = lookup(obj, path)
        ok = found and (isinstance(value, dict) if isinstance(default, dict) else value == default)
        if not ok:
            wrong[path] = (default, value if found else "<absent>")
    return wrong


def workers(cluster: Cluster, namespace: str) -> dict[str, dict[str, tuple[str, str]]]:
    """{role: {pod name: (uid, role-config-hash label)}} of the trainer and rollout pods not being deleted."""
    out: dict[str, dict[str, tuple[str, str]]] = {c.Role.TRAINER.value: {}, c.Role.ROLLOUT.value: {}}
    for pod in cluster.items("pods", namespace, f"{c.LABEL_ROLE} in (trainer,rollout)"):
        meta = pod["metadata"]
        if not meta.get("deletionTimestamp"):
            labels = meta["labels"]
            out[labels[c.LABEL_ROLE]][meta["name"]] = (meta["uid"], labels.get(c.LABEL_ROLE_CONFIG_HASH, ""))
    return out


def recorded(cluster: Cluster, namespace: str, job: str) -> dict[str, Any]:
    """The job's config ConfigMap record: the config's bytes, the generation and role hashes it was resolved with."""
    cm = cluster.get("configmap", names.config_map(job), "-n", namespace) or {}
    annotations = cm.get("metadata", {}).get("annotations") or {}
    return {"config": (cm.get("data") or {}).get(c.CONFIG_FILE_NAME),
            "generation": annotations.get(c.ANNOTATION_RESOLVED_GENERATION),
            "hashes": json.loads(annotations.get(c.ANNOTATION_ROLE_CONFIG_HASHES) or "{}")}


def operator_metrics(cluster: Cluster, operator: Operator, pod: str) -> dict[str, float]:
    """The operator pod's Prometheus samples without labels (the metrics port through the API server's pod proxy,
    which works on any cluster)."""
    port = yaml.safe_load((CHART / "values.yaml").read_text())["metrics"]["port"]
    text = cluster.kubectl("get", "--raw", f"/api/v1/namespaces/{operator.namespace}/pods/{pod}:{port}/proxy/metrics",
                           check=False).stdout
    samples = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.startswith("#") and "{" not in parts[0]:
            samples[parts[0]] = float(parts[1])
    return samples


def the_operator_pod(operator: Operator, old: str | None = None) -> dict[str, Any] | None:
    """The release's one operator pod, ready and not ``old`` (None while there are others or it is not ready)."""
    pods = operator.pods()
    if len(pods) != 1 or pods[0]["metadata"]["name"] == old or pods[0]["metadata"].get("deletionTimestamp"):
        return None
    conditions = (pods[0].get("status") or {}).get("conditions") or []
    return pods[0] if any(cd["type"] == "Ready" and cd["status"] == "True" for cd in conditions) else None


def image_of(pod: dict[str, Any]) -> str:
    return pod["spec"]["containers"][0]["image"]


def current_image(operator: Operator) -> str:
    """The operator image the suite's release runs: ``--operator-image``, else the chart's repository:appVersion."""
    sets = dict(arg.split("=", 1) for arg in operator.values[1::2])
    if "image.repository" in sets:
        return f"{sets['image.repository']}:{sets['image.tag']}"
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    return f"{yaml.safe_load((CHART / 'values.yaml').read_text())['image']['repository']}:{chart['appVersion']}"


def defaults_added(earlier: Earlier) -> dict[str, Any]:
    """{path: default} of the defaults this checkout's CRD has and the earlier one has not: a field's default that is
    new or another value, an object's default where the object is new (an object's default changes with its fields';
    it applies only where the object is absent). Printed, and said in a warning while there are none."""
    before, now = schema_defaults(earlier.chart / CRD_FILE), schema_defaults(CHART / CRD_FILE)
    added = {path: value for path, value in now.items()
             if path not in before or (before[path] != value and not isinstance(value, dict))}
    if added:
        print(f"upgrade from {earlier.commit[:12]}: this checkout's CRD adds {len(added)} default(s): "
              + ", ".join(f"{path}={json.dumps(value)}" for path, value in sorted(added.items())))
    else:
        warnings.warn(UpgradeNote(f"upgrade from {earlier.commit[:12]}: this checkout's CRD adds no defaulted field "
                                  "yet, so the upgrade changed the operator and the CRD but no default"))
    return added


def install_earlier(cluster: Cluster, operator: Operator, earlier: Earlier) -> dict[str, Any]:
    """Step 1: the suite's release and CRDs removed, the earlier chart installed as on a new cluster (Helm installs
    its crds/ only where they do not exist yet). Returns its operator pod."""
    left = [f"{j['metadata']['namespace']}/{j['metadata']['name']}" for j in cluster.get("rljob", "-A")["items"]]
    assert not left, f"RLTrainingJobs of other tests are left ({left}): deleting the CRD would delete them"
    cluster.helm("uninstall", operator.release, "-n", operator.namespace, "--wait", "--timeout", "2m")
    cluster.kubectl("delete", "-f", str(CHART / "crds"), "--ignore-not-found", "--wait=true", "--timeout=120s")
    cluster.helm("install", operator.release, str(earlier.chart), "-n", operator.namespace, "--create-namespace",
                 "--wait", "--timeout", "5m", *image_values(earlier.image))
    pod = wait_for(lambda: the_operator_pod(operator), 60, "the earlier operator pod", operator.logs)
    assert image_of(pod) == earlier.image, pod["spec"]
    return pod


def earlier_example(earlier: Earlier) -> tuple[str, str]:
    """The earlier version's ``examples/rljob-cpu.yaml`` (its checkpoint claim and job, written for its CRD) with
    ``maxSteps`` raised to MAX_STEPS: (the job's name, the manifests)."""
    docs = [d for d in yaml.safe_load_all((earlier.source / "examples" / "rljob-cpu.yaml").read_text()) if d]
    job = next(d for d in docs if d["kind"] == c.KIND)
    job["spec"]["trainer"]["maxSteps"] = MAX_STEPS
    return job["metadata"]["name"], yaml.safe_dump_all(docs)


def redis_state(cluster: Cluster, namespace: str, job: str) -> dict[str, Any]:
    """The managed Redis: {pod name: (uid, "")} of its pods not being deleted (the shape of :func:`workers`' roles),
    its Deployment's volumes and whether its data claim exists."""
    pods = {p["metadata"]["name"]: (p["metadata"]["uid"], "")
            for p in cluster.items("pods", namespace, f"{c.LABEL_ROLE}=redis") if not p["metadata"].get("deletionTimestamp")}
    deployment = cluster.get("deployment", names.redis_name(job), "-n", namespace) or {}
    volumes = deployment.get("spec", {}).get("template", {}).get("spec", {}).get("volumes")
    return {"pods": pods, "volumes": volumes,
            "claim": cluster.get("pvc", names.redis_claim(job), "-n", namespace) is not None}


REDIS_STORAGE = "spec.redis.persistence"
"""Defaults under this path stay as recorded when a new resolution is made (rljob_operator.resolution
REDIS_STORAGE_FIELDS): an earlier job's Redis keeps its emptyDir until the user edits its storage."""


def kept(pods: Recorder, role: str, before: dict[str, tuple[str, str]]) -> bool:
    """Whether the pods of ``role`` the watch saw since the job started are exactly ``before``'s, none deleted."""
    lives = pods.lifetimes(role)
    return set(lives) == {uid for uid, _ in before.values()} and all(dead is None for _, _, dead in lives.values())


# Long waits on a 2-core machine (the trainer ranks train all along): install, first steps, upgrade, gang restart.
@pytest.mark.timeout(1500)
def test_upgrade_restarts_nothing_until_an_edit_reaches_a_role(cluster, operator, namespace, diagnostics, earlier):
    started = time.monotonic()
    added = defaults_added(earlier)
    earlier_pod = install_earlier(cluster, operator, earlier)
    name, manifests = earlier_example(earlier)
    diagnostics.job = name
    passes = "rljob_operator_reconcile_duration_seconds_count"
    timings = {"earlier operator installed": time.monotonic() - started}

    with Recorder(cluster, namespace, "pods") as pods, Recorder(cluster, namespace, "rljobs") as jobs:
        # Step 2: the earlier version's job trains.
        cluster.apply(manifests, namespace)
        training = wait_for(lambda: (j := get_job(cluster, namespace, name)) and phase(j) == "Running"
                            and ((j.get("status") or {}).get("step") or 0) >= 1 and j, 600,
                            "the earlier operator's job to train", diagnostics)
        trainer0 = f"{name}-trainer-0"
        log = wait_for(lambda: "checkpoint: committed" in (text := cluster.kubectl(
            "logs", "-n", namespace, trainer0, check=False).stdout) and text, 300, "a committed checkpoint", diagnostics)
        checkpointed = max(int(s) for s in re.findall(r"checkpoint: committed \S+step-(\d+)", log))
        training = get_job(cluster, namespace, name)
        generation = training["metadata"]["generation"]
        before, record = workers(cluster, namespace), recorded(cluster, namespace, name)
        assert (len(before["trainer"]), len(before["rollout"])) == (2, 1), before
        redis_before = redis_state(cluster, namespace, name)
        assert len(redis_before["pods"]) == 1 and redis_before["volumes"] == [{"name": "data", "emptyDir": {}}], \
            redis_before
        assert not redis_before["claim"], redis_before
        assert record["config"] and record["generation"] == str(generation), record
        timings["job training"] = time.monotonic() - started

        # Step 3: this checkout's CRD; the stored job reads with its defaults, its generation unchanged.
        window = len(jobs.events)
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
        stored = wait_for(lambda: not missing_defaults(j := get_job(cluster, namespace, name), added) and j, 60,
                          "the new CRD's defaults in the stored job",
                          lambda: str(missing_defaults(get_job(cluster, namespace, name), added)))
        assert stored["metadata"]["generation"] == generation

        # Step 4: helm upgrade to this checkout; the new operator's passes keep every pod and the record.
        cluster.helm("upgrade", operator.release, str(CHART), "-n", operator.namespace, "--reset-values", "--wait",
                     "--timeout", "5m", *operator.values)
        new_pod = wait_for(lambda: the_operator_pod(operator, old=earlier_pod["metadata"]["name"]), 120,
                           "the earlier operator pod gone and the new one ready", operator.logs)
        assert image_of(new_pod) == current_image(operator), new_pod["spec"]
        step = get_job(cluster, namespace, name)["status"]["step"]
        metrics, upgraded = wait_for(
            lambda: (m := operator_metrics(cluster, operator, new_pod["metadata"]["name"])).get(passes, 0) >= PASSES
            and ((j := get_job(cluster, namespace, name))["status"].get("step") or 0) > step and (m, j),
            180, f"{PASSES} passes of the new operator and a status it wrote with a later step", diagnostics)
        jobs.check()
        seen = sorted({(e.status.get("phase"), condition(e.object, c.ConditionType.VALID).get("status"),
                        condition(e.object, c.ConditionType.VALID).get("reason")) for e in jobs.events[window:]})
        print(f"(phase, Valid, reason) from the new CRD to the new operator's passes: {seen}")
        assert workers(cluster, namespace) == before, diagnostics()
        assert kept(pods, "trainer", before["trainer"]) and kept(pods, "rollout", before["rollout"]), pods.events
        assert redis_state(cluster, namespace, name) == redis_before and kept(pods, "redis", redis_before["pods"]), (
            redis_before, redis_state(cluster, namespace, name))
        assert recorded(cluster, namespace, name) == record
        status = upgraded["status"]
        assert (status["restarts"], status["attempt"], status["failedAttempts"]) == (0, 0, 0), status
        valid = condition(upgraded, c.ConditionType.VALID).get("status")
        assert (status["phase"], valid) == ("Running", "True"), status
        assert metrics.get("rljob_operator_gang_restarts_total") == 0, metrics
        timings["upgraded"] = time.monotonic() - started

        # Step 5: a rollout-only edit replaces the rollout pod, no trainer pod; the trainer's config stays as recorded.
        cluster.kubectl("patch", "rljob", name, "-n", namespace, "--type=merge",
                        "-p", json.dumps({"spec": {"rollout": {"maxLag": MAX_LAG}}}))
        (old_rollout,) = [uid for uid, _ in before["rollout"].values()]
        count = operator_metrics(cluster, operator, new_pod["metadata"]["name"])[passes]
        edited = wait_for(lambda: (w := workers(cluster, namespace))["rollout"]
                          and old_rollout not in {uid for uid, _ in w["rollout"].values()}
                          and pods.lifetimes("rollout").get(old_rollout, (0, 0, None))[2] is not None
                          and operator_metrics(cluster, operator, new_pod["metadata"]["name"])[passes] >= count + 2
                          and w, 180, "the rollout pod replaced and two more passes", diagnostics)
        assert edited["trainer"] == before["trainer"] and kept(pods, "trainer", before["trainer"]), pods.events
        after_edit = recorded(cluster, namespace, name)
        config, earlier_config = json.loads(after_edit["config"]), json.loads(record["config"])
        assert config["spec"]["rollout"]["maxLag"] == MAX_LAG
        assert config["spec"]["trainer"] == earlier_config["spec"]["trainer"], "the trainer's config changed"
        assert after_edit["hashes"]["trainer"] == record["hashes"]["trainer"], (after_edit, record)
        assert after_edit["generation"] == str(generation + 1), after_edit
        status = get_job(cluster, namespace, name)["status"]
        assert (status["restarts"], status["attempt"]) == (0, 0), status
        timings["rollout edit"] = time.monotonic() - started

        # Step 6: a trainer edit restarts the gang, resolved by this version: every new default is in its config.
        cluster.kubectl("patch", "rljob", name, "-n", namespace, "--type=merge",
                        "-p", json.dumps({"spec": {"trainer": {"maxSteps": MAX_STEPS + 1}}}))
        gang = wait_for(lambda: len(w := {n: v for n, v in workers(cluster, namespace)["trainer"].items()
                                          if v[0] not in {uid for uid, _ in before["trainer"].values()}}) == 2 and w,
                        300, "the trainer pods of the restarted gang", diagnostics)
        restarted = get_job(cluster, namespace, name)
        rec = recorded(cluster, namespace, name)
        config = json.loads(rec["config"])
        assert config["spec"]["trainer"]["maxSteps"] == MAX_STEPS + 1 and rec["generation"] == str(generation + 2), rec
        # Fields added later that hold their default are left out of a resolved config by design
        # (rljob_api.spec.omitted_at_default): expected are the defaults a fresh dump of this spec carries.
        fresh = {"spec": RLTrainingJobSpec.model_validate(config["spec"]).model_dump(mode="json", by_alias=True)}
        carried = {p: v for p, v in added.items() if not p.startswith(REDIS_STORAGE) and lookup(fresh, p)[0]}
        assert not missing_defaults(config, carried), missing_defaults(config, carried)
        assert "persistence" not in config["spec"]["redis"], config["spec"]["redis"]  # kept as recorded
        assert rec["hashes"]["trainer"] != record["hashes"]["trainer"] and {h for _, h in gang.values()} == {
            rec["hashes"]["trainer"]}, (rec, gang)
        assert (restarted["status"]["restarts"], restarted["status"]["attempt"]) == (1, 1), restarted["status"]
        reasons = wait_for(lambda: {condition(e.object, c.ConditionType.RESTARTING).get("reason") for e in jobs.events
                                    if e.status.get("phase") == "Restarting"}, 30, "the Restarting status on the watch")
        assert reasons == {c.Reason.CONFIG_CHANGED.value}, reasons
        assert redis_state(cluster, namespace, name) == redis_before and kept(pods, "redis", redis_before["pods"]), (
            redis_before, redis_state(cluster, namespace, name))  # the stream outlived the gang restart
        # The restarted gang went on from a checkpoint written before the upgrade, or a later one.
        resumed = wait_for(lambda: re.findall(r"checkpoint: loaded \S+ \(step (\d+)", cluster.kubectl(
            "logs", "-n", namespace, trainer0, check=False).stdout), 300, "the restarted gang to load a checkpoint",
            diagnostics)
        assert int(resumed[-1]) >= checkpointed, (resumed, checkpointed)
        timings["trainer edit"] = time.monotonic() - started
    pods.check()
    jobs.check()
    print("upgrade test, seconds since start: " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))
