"""Admission: what one pass of a job may run, decided from its name, its spec and what this process knows.

Pure: :func:`decide` takes the job, the pass's observations and the record of the job's config (the pass reads it,
:func:`.resolution.known_record`, at its I/O edge) and returns one :class:`Decision`, the config the pass runs resolved
once (:func:`.resolution.effective_config`) and handed down with it:

- the job's name and spec are checked (:func:`check`, each role's ``podTemplate`` against the pods rljob renders for
  that config, rendered again only when the config changes); a child the API server refused (400/422) for this
  generation is one more problem;
- an edit of ``spec.redis.podTemplate`` that would replace a managed Redis keeping its data in an emptyDir is a
  problem unless the job accepts the loss (:func:`redis_template_problems`);
- a valid spec runs, unless children of an earlier job of the same name are still there (:func:`foreign_children`):
  the pass waits for the garbage collector;
- an invalid spec of a job with pods (Pending, Starting, Running, Restarting) or of a suspended job does not orphan
  or forget them: the job goes on with its last valid spec (:func:`kept_spec`: the last one this process applied, or
  the recorded one), and Valid=False says so;
- otherwise nothing runs (phase Invalid; a finished job stays finished).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

from pydantic import ValidationError

from rljob_api import constants as c
from rljob_api.config import JobConfig
from rljob_api.constants import Phase
from rljob_api.pod_template import PodTemplateOverride
from rljob_api.spec import RLTrainingJobSpec, RunPolicySpec
from rljob_api.validation import SpecProblem, check_spec, topology_numbers

from rljob_operator import environment as environment_server, gang, render, resolution, workload
from rljob_operator.observe import DeploymentView, PodView
from rljob_operator.runtime import JobRuntime, Recorded

NAME_PATTERN = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

#: Phases whose pods an invalid edit leaves running on the last valid spec (:func:`kept_spec`).
KEEP_PHASES = (Phase.PENDING, Phase.STARTING, Phase.RUNNING, Phase.RESTARTING, Phase.SUSPENDED)


@dataclass(frozen=True)
class Decision:
    """What a pass runs.

    ``spec``: the parsed spec (None when it does not parse); ``problems``: every reason it cannot run, a refused child
    included; ``run``: the spec whose children and pods this pass keeps — ``spec`` when it has no problem, the kept
    spec, or None (nothing runs); ``note``: what Valid's message adds after the problems (what the job goes on with
    meanwhile); ``leftovers``: children of an earlier job of the same name to wait for; ``config``: the config the
    pass runs for ``run`` (:func:`.resolution.effective_config`), resolved once (None when nothing runs).
    """

    spec: Optional[RLTrainingJobSpec]
    problems: tuple[SpecProblem, ...] = ()
    run: Optional[RLTrainingJobSpec] = None
    note: Optional[str] = None
    leftovers: tuple[str, ...] = ()
    config: Optional[JobConfig] = None

    @property
    def applies(self) -> bool:
        """Whether the pass applies the children of ``spec``: it is valid and nothing is left to wait for."""
        return self.run is not None and not self.problems and not self.leftovers


def check(name: str, raw: Mapping[str, Any], namespace: str = "default", labels: Optional[Mapping[str, str]] = None,
          *, uid: str = "", generation: Optional[int] = None, recorded: Optional[Recorded] = None,
          runtime: Optional[JobRuntime] = None) -> tuple[Optional[RLTrainingJobSpec], list[SpecProblem],
                                                          Optional[JobConfig]]:
    """Validate the job's name and ``raw`` spec with the pydantic model, then :func:`check_spec`, each role's
    ``podTemplate`` against the pods rljob renders from the config the pass runs (:func:`override_problems`) and the
    job's Kueue labels (:func:`.workload.label_problems`).

    Returns (spec or None, problems, config or None): every problem names its field (``metadata.name``, ``spec.a.b``);
    the config is :func:`.resolution.effective_config` of the spec (``generation``, ``recorded``), None when the spec
    does not parse or resolve (its check says why). The name rule is checked here, not by CEL: the API server cannot
    bound the cost of a regex on metadata.name.
    """
    problems = []
    if not NAME_PATTERN.match(name):
        problems.append(SpecProblem(
            "metadata.name",
            f"{name!r} must start with a lowercase letter and hold only lowercase letters, digits and '-' "
            "(it names the job's Services and pod hostnames); a name cannot be changed: delete the job and create it "
            "again under another name",
        ))
    try:
        spec = RLTrainingJobSpec.model_validate(raw)
    except ValidationError as err:
        return None, problems + [
            SpecProblem("spec." + ".".join(str(part) for part in e["loc"]) if e["loc"] else "spec", e["msg"])
            for e in err.errors()
        ], None
    job = render.Job(name, namespace, spec, dict(labels or {}), uid)
    try:
        config = resolution.effective_config(job, generation, recorded)
    except ValueError:
        config = None  # check_spec names the field
    overrides = [] if config is None else override_problems(job, config, runtime)
    return spec, problems + check_spec(spec) + overrides + workload.label_problems(labels or {}, namespace), config


def parse_spec(name: str, raw: Mapping[str, Any], namespace: str = "default",
               labels: Optional[Mapping[str, str]] = None) -> tuple[Optional[RLTrainingJobSpec], list[SpecProblem]]:
    """(spec or None, problems) of :func:`check` for a job seen for the first time (nothing recorded)."""
    spec, problems, _ = check(name, raw, namespace, labels)
    return spec, problems


def override_problems(job: render.Job, config: JobConfig, runtime: Optional[JobRuntime] = None) -> list[SpecProblem]:
    """:func:`.render.override_problems` of ``job`` and ``config``, kept in ``runtime`` while the config, the job's
    labels and uid stay the same, so a pass renders the pods for this check only when one of them changed."""
    if runtime is None:
        return render.override_problems(job, config)
    key = (config.to_json(), tuple(sorted(render.role_hashes(config).items())), tuple(sorted(job.labels.items())),
           job.uid)
    if runtime.override_check is None or runtime.override_check[0] != key:
        runtime.override_check = (key, tuple(render.override_problems(job, config)))
    return list(runtime.override_check[1])


def redis_template_problems(job: render.Job, config: JobConfig, recorded: Optional[Recorded],
                            annotations: Mapping[str, str]) -> list[SpecProblem]:
    """The problem of an edit of ``spec.redis.podTemplate`` that replaces the managed Redis pod while it keeps its data
    in an emptyDir (the ``recorded`` config's Redis has no claim, and the edit does not move it to one): the new pod
    would start empty. None when the job's ``annotations`` accept the loss
    (:data:`~rljob_api.constants.ANNOTATION_ALLOW_REDIS_DATA_LOSS`), or nothing is recorded yet. ``config``: what the
    pass runs for ``job`` (:func:`.resolution.effective_config`)."""
    if recorded is None or job.spec.redis.mode != "managed" or recorded.config.spec.redis.mode != "managed":
        return []
    if annotations.get(c.ANNOTATION_ALLOW_REDIS_DATA_LOSS) == "true":
        return []
    if render.redis_persistence(recorded.config) is not None or render.redis_persistence(config) is not None:
        return []  # durable: the new pod reads the same file; or a move to a claim, which starts empty anyway
    before = recorded.config.spec.redis.pod_template or PodTemplateOverride()
    if before == (config.spec.redis.pod_template or PodTemplateOverride()):
        return []
    return [SpecProblem("spec.redis.podTemplate", (
        "changing it replaces the managed Redis pod, and this Redis keeps its data in an emptyDir "
        "(spec.redis.persistence.enabled is false, or the Redis was made before persistence existed): the new pod "
        "would start without the stream, its consumer group and the progress and checkpoint hashes, and the gang "
        "would restart from its newest checkpoint. Enable spec.redis.persistence instead (that also replaces the Redis "
        f"pod, once), or accept the loss: kubectl annotate rljob {job.name} {c.ANNOTATION_ALLOW_REDIS_DATA_LOSS}=true"))]


def kept_topology(kept: RLTrainingJobSpec, spec: Optional[RLTrainingJobSpec]) -> str:
    """What Valid's note adds when an invalid edit changes the trainer's topology: the counts the running gang keeps,
    e.g. "; its gang keeps processesPerNode 4, tensorParallel 1" (the problems name the edited values); "" when the
    edit changes none of them or does not parse."""
    if spec is None:
        return ""
    before, after = topology_numbers(kept), topology_numbers(spec)
    kept_counts = [f"{name} {value}" for name, value in before.items() if after[name] != value]
    return f"; its gang keeps {', '.join(kept_counts)}" if kept_counts else ""


def live_workers(pods: Iterable[PodView]) -> list[PodView]:
    """The trainer and rollout pods of ``pods`` that are not being deleted (the managed Redis pod is not one)."""
    return [p for p in pods if p.role in (c.Role.TRAINER, c.Role.ROLLOUT) and not p.deleting]


def foreign_children(uid: Optional[str], pods: Iterable[PodView], redis: Optional[DeploymentView],
                     environment: Optional[DeploymentView] = None) -> list[str]:
    """Names of pods and of the Redis and environment server Deployments that carry the job's labels but belong to
    another owner: a deleted job of the same name whose children the garbage collector has not removed yet."""
    found = [p.name for p in pods if p.owner_uid and p.owner_uid != uid]
    for deployment in (redis, environment):
        if deployment is not None and deployment.owner_uid and deployment.owner_uid != uid:
            found.append(deployment.name)
    return found


def kept_spec(raw: Mapping[str, Any], runtime: JobRuntime,
              recorded: Optional[Recorded]) -> Optional[tuple[Optional[int], RLTrainingJobSpec]]:
    """The (generation or None, spec) an active job goes on with while its spec is invalid: the last valid spec this
    process applied, or — after an operator restart — the ``recorded`` one (read from the job's config ConfigMap: the
    resolved config of the last valid spec). Its ``runPolicy`` is the invalid ``raw`` spec's when that part validates
    on its own (suspend, deadlines and backoffLimit still act; the recorded copy holds only defaults), else the last
    valid one's. None when there is none (a job that was never valid). The caller drops a kept spec equal to the
    current one (a spec whose children the API server refused)."""
    if runtime.last_valid is not None:
        generation, spec = runtime.last_valid
    elif recorded is not None:
        generation, spec = None, recorded.config.spec
    else:
        return None
    try:
        run_policy = RunPolicySpec.model_validate(raw.get("runPolicy") or {})
    except ValidationError:
        return generation, spec
    return generation, spec.model_copy(update={"run_policy": run_policy})


_REFUSED_ROLE = re.compile(
    r'(?:Pod|pods|Deployment(?:\.apps)?) "[^"]*-(trainer|rollout|redis|environment)(?:-[0-9]+)?" is '
    r'(?:invalid|forbidden)')
MISSING_REFERENCES = {
    "priorityClassName": re.compile(r"no PriorityClass with name \S+ was found"),
    "serviceAccountName": re.compile(r'serviceaccount "[^"]*" not found'),
    "runtimeClassName": re.compile(r'RuntimeClass "[^"]*" not found'),
}
"""What the API server's admission plugins say (403 Forbidden) when a pod names a PriorityClass, ServiceAccount or
RuntimeClass that does not exist, by the ``podTemplate.spec`` field that names it."""


def refusal_of_spec(status: int, message: str) -> bool:
    """Whether the API server's refusal of a child (HTTP ``status``, ``message``) is the spec's to fix: invalid
    (400/422), or a pod naming a PriorityClass, ServiceAccount or RuntimeClass that does not exist (403,
    :data:`MISSING_REFERENCES`; not a missing permission of the operator's, nor a quota)."""
    return status in (400, 422) or (status == 403 and missing_reference(message) is not None)


def missing_reference(message: str) -> Optional[str]:
    """The ``podTemplate.spec`` field whose object a 403 refusal ``message`` says does not exist; None if none."""
    return next((field for field, pattern in MISSING_REFERENCES.items() if pattern.search(message)), None)

_REFUSED_PART = re.compile(r"\.(resources|nodeSelector|tolerations)\b")
_REFUSED_TEMPLATE_PART = re.compile(
    r"(?:\bmetadata\.(?:labels|annotations)|\bspec\.(?:template\.spec\.)?(?:initContainers|volumes|affinity|"
    r"topologySpreadConstraints|imagePullSecrets|securityContext|serviceAccountName|priorityClassName|"
    r"runtimeClassName|schedulerName)|\.(?:env|envFrom|volumeMounts|securityContext))\b")
"""Parts of a pod only a ``podTemplate`` sets or adds to."""
_REFUSED_SERVER_PART = re.compile(r"\.(image|command|args|resources|env|nodeSelector|tolerations)\b")
"""Parts of the environment server's pods that ``spec.rollout.environment.server`` sets (its field of the same name)."""


def refused_field(message: str) -> str:
    """The spec field a refusal of the API server points at, e.g. ``spec.trainer.resources`` for a trainer pod whose
    ``spec.containers[0].resources.limits`` is invalid, ``spec.trainer.podTemplate`` for one whose volumes are;
    ``spec`` when the message names no role's object."""
    role = _REFUSED_ROLE.search(message)
    if role is None:
        return "spec"
    if role.group(1) == c.Role.ENVIRONMENT.value:  # the server has no podTemplate: its fields are the server's own
        part = _REFUSED_SERVER_PART.search(message[role.end():])
        return environment_server.FIELD + (f".{part.group(1)}" if part else "")
    if (missing := missing_reference(message)) is not None:
        return f"spec.{role.group(1)}.podTemplate.spec.{missing}"
    rest = message[role.end():]
    part = _REFUSED_PART.search(rest)
    if part is None and _REFUSED_TEMPLATE_PART.search(rest):
        return f"spec.{role.group(1)}.podTemplate"
    return f"spec.{role.group(1)}" + (f".{part.group(1)}" if part else "")


def decide(body: Mapping[str, Any], before: gang.Lifecycle, pods: Iterable[PodView], redis: Optional[DeploymentView],
           runtime: JobRuntime, recorded: Optional[Recorded], *, environment: Optional[DeploymentView] = None
           ) -> Decision:
    """Decide what the pass over the job ``body`` (saved lifecycle ``before``, observed ``pods``, managed ``redis``
    and ``environment`` server Deployments, the ``recorded`` config: :func:`.resolution.known_record`) runs; see the
    module docstring. Forgets a refused child of an older generation."""
    meta = body["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation")
    labels, uid = meta.get("labels") or {}, meta.get("uid") or ""
    spec, problems, config = check(name, body.get("spec") or {}, namespace, labels, uid=uid, generation=generation,
                                   recorded=recorded, runtime=runtime)
    if runtime.rejected and runtime.rejected[0] != generation:
        runtime.rejected = None
    if runtime.rejected:
        retried = " (tried again every 30 s)" if missing_reference(runtime.rejected[1]) else ""
        problems.append(SpecProblem(refused_field(runtime.rejected[1]),
                                    f"the API server refused a child object: {runtime.rejected[1]}{retried}"))
    if spec is not None and not problems and spec.redis.mode == "managed":
        job = render.Job(name, namespace, spec, dict(labels), uid)
        problems += redis_template_problems(job, config, recorded, meta.get("annotations") or {})
    if spec is not None and not problems:
        leftovers = tuple(foreign_children(meta.get("uid"), pods, redis, environment))
        return Decision(spec, run=spec, leftovers=leftovers, config=config)
    pods = list(pods)
    kept = None
    if before.phase in KEEP_PHASES and (before.phase == Phase.SUSPENDED or live_workers(pods)):
        kept = kept_spec(body.get("spec") or {}, runtime, recorded)
    if kept is not None and spec is not None and kept[1].model_copy(update={"run_policy": spec.run_policy}) == spec:
        kept = None  # the last valid spec is this one, refused by the API server: nothing valid to go on with
    if kept is not None:
        kept_generation, kept_run = kept
        note = ("the job goes on with its last valid spec"
                + (f" (generation {kept_generation})" if kept_generation is not None else "") + " until then"
                + kept_topology(kept_run, spec))
        kept_config = resolution.effective_config(render.Job(name, namespace, kept_run, dict(labels), uid),
                                                  generation, recorded)
        return Decision(spec, tuple(problems), run=kept_run, note=note, config=kept_config)
    note = f"the job has {before.phase.value}: a spec edit changes nothing" if before.phase in gang.FINISHED else None
    return Decision(spec, tuple(problems), note=note)
