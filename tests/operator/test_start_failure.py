"""A pod that cannot start (DESIGN §5 "Start failures"), as the operator reads it from the pod status the kubelet writes
(observe.pod_view) and decides on it (gang.plan, pure): a permanent line fails the job at once with StartFailed and the
pod's words, counting no restart; a transient one is a counted failure like any other; a rollout pod's reward code
that does not load stays a crash loop. And the phase says Running only once the trainer reported the attempt's start
(gang.require_started, job_status)."""

from __future__ import annotations

from dataclasses import replace

from rljob_api import protocol
from rljob_api.constants import ConditionType, Phase, Reason
from rljob_api.start_failure import StartFailure
from rljob_operator import gang, job_status, render
from rljob_operator.observe import pod_view

from operator_helpers import CRASHED, T0, kubelet_pod, kubelet_rollout_pod, make_spec

NOT_CACHED = StartFailure(
    "spec.model.name: 'Qwen/Qwen2.5-0.5B-Instruct': no tokenizer in the pod's Hugging Face cache "
    "(/root/.cache/huggingface/hub) and HF_HUB_OFFLINE is set, so nothing can be downloaded: put the model in that "
    "cache (a volume at HF_HOME in the pod templates), or mount it and use spec.model.source: path")
UNREACHABLE = StartFailure(
    "spec.model.name: 'Qwen/Qwen2.5-0.5B-Instruct': no tokenizer in the pod's Hugging Face cache "
    "(/root/.cache/huggingface/hub) and the Hugging Face Hub cannot be reached (ConnectError: [Errno 111] Connection "
    "refused): the pod is retried; ... (7 tries in 120 s)", permanent=False)
NO_VLLM = StartFailure("spec.rollout.backend: 'vllm' needs vLLM, which the rollout image 'rljob/trainer-cpu:0.1.0' "
                       "does not have: set spec.rollout.image to an image with vLLM ..., or backend to 'cpu'")
TORCHRUN_TAIL = ("[rank0]: torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
                 "============================================================\n")


def spec():
    return make_spec(model={"source": "huggingface", "name": "Qwen/Qwen2.5-0.5B-Instruct"}, trainer={"nodes": 2},
                     rollout={"replicas": 1})


def hashes():
    return render.config_hashes(render.job_config(render.Job("demo", "ns", spec())))


def labelled(raw: dict) -> dict:
    """``raw`` with the role config hash of the current spec (a pod made from it)."""
    h = hashes()
    labels = raw["metadata"]["labels"]
    labels["rljob.dev/role-config-hash"] = h.trainer if labels["rljob.dev/role"] == "trainer" else h.rollout
    return raw


def trainer_exited(index: int, message: str, exit_code: int = 1) -> dict:
    """Trainer pod ``index`` of attempt 0 after its container ended (restartPolicy Never): torchrun's exit code 1 for
    a rank that failed, the termination message ``message`` (the file the rank wrote)."""
    return labelled(kubelet_pod("trainer", index, "Failed", attempt=0, state={"terminated": {
        "exitCode": exit_code, "reason": "Error", "message": message,
        "startedAt": "2026-01-01T12:00:02Z", "finishedAt": "2026-01-01T12:00:09Z"}}))


def trainer_running(index: int) -> dict:
    return labelled(kubelet_pod("trainer", index, "Running", attempt=0,
                                state={"running": {"startedAt": "2026-01-01T12:00:02Z"}}))


def rollout_crashing(message: str, exit_code: int) -> dict:
    """Rollout pod 0 waiting to be restarted after a run that ended with ``message`` (restartPolicy OnFailure)."""
    return labelled(kubelet_rollout_pod(
        restartCount=1, state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}},
        lastState={"terminated": {"exitCode": exit_code, "reason": "Error", "message": message}}))


RUNNING = gang.Lifecycle(phase=Phase.RUNNING, gang_created=True, start_time=T0, reason=Reason.TRAINING,
                         message="attempt 0: all 2 trainer pods running")


def plan(*raw: dict, lc: gang.Lifecycle = RUNNING) -> gang.Plan:
    return gang.plan("demo", spec(), lc, [pod_view(p) for p in raw], hashes(), T0)


def test_a_trainer_pod_that_cannot_start_for_good_fails_the_job_at_once_in_its_words():
    """The rank's line is the file's content; torchrun's exit code 1 does not matter."""
    decided = plan(trainer_exited(0, NOT_CACHED.line + "\n"), trainer_running(1), rollout_crashing(NOT_CACHED.line, 78))
    lc = decided.lifecycle
    assert (lc.phase, lc.reason, lc.restarts, lc.failed_attempts, lc.attempt) == (
        Phase.FAILED, Reason.START_FAILED, 0, 0, 0)
    assert lc.message == (
        "trainer pod demo-trainer-0 of attempt 0 cannot start: " + NOT_CACHED.message + "; retrying cannot help, so "
        "the job failed without a restart: fix the spec and create the job again")
    assert lc.completion_time == T0
    assert decided.delete == ("demo-rollout-0", "demo-trainer-0", "demo-trainer-1")  # cleanPodPolicy All
    assert (decided.create_trainers, decided.create_rollouts) == ((), ())


def test_the_last_log_line_serves_when_the_file_was_not_written():
    """FallbackToLogsOnError: the log's tail, the line behind a log prefix."""
    logged = f"2026-01-01 12:00:08,120 rank 0 ERROR rljob_trainer: trainer: {NOT_CACHED.line}\n"
    assert pod_view(trainer_exited(0, logged)).start_failure == NOT_CACHED.message
    assert pod_view(trainer_exited(0, logged + TORCHRUN_TAIL)).start_failure == ""  # only the last line counts


def test_a_transient_start_failure_is_a_counted_restart_naming_the_model():
    decided = plan(trainer_exited(0, UNREACHABLE.line, exit_code=1), trainer_running(1), rollout_crashing("", 0))
    lc = decided.lifecycle
    assert (lc.phase, lc.reason, lc.restarts, lc.failed_attempts, lc.attempt) == (
        Phase.RESTARTING, Reason.POD_FAILED, 1, 1, 1)
    assert lc.message.startswith(
        "trainer pod demo-trainer-0 of attempt 0 container trainer exited with code 1 (Error): cannot start "
        "(transient, retried): spec.model.name: 'Qwen/Qwen2.5-0.5B-Instruct': no tokenizer in the pod's Hugging Face "
        "cache")
    assert decided.delete == ("demo-trainer-0", "demo-trainer-1")
    # ... and the last counted one ends the job with BackoffLimitExceeded, still in the pod's words
    last = plan(trainer_exited(0, UNREACHABLE.line), trainer_running(1),
                lc=replace(RUNNING, failed_attempts=3, restarts=3, attempt=0)).lifecycle
    assert (last.phase, last.reason) == (Phase.FAILED, Reason.BACKOFF_LIMIT_EXCEEDED)
    assert "spec.model.name: 'Qwen/Qwen2.5-0.5B-Instruct'" in last.message


def test_a_rollout_pod_that_cannot_start_for_good_fails_the_job():
    decided = plan(trainer_running(0), trainer_running(1), rollout_crashing(NO_VLLM.line + "\n", 78))
    lc = decided.lifecycle
    assert (lc.phase, lc.reason, lc.restarts) == (Phase.FAILED, Reason.START_FAILED, 0)
    assert lc.message.startswith("rollout pod demo-rollout-0 cannot start: spec.rollout.backend: 'vllm' needs vLLM, "
                                 "which the rollout image 'rljob/trainer-cpu:0.1.0' does not have")


def test_an_outdated_rollout_pod_is_replaced_not_failed_on():
    """The user fixed the rollout spec before the operator saw the crash: the pod goes, the job stays."""
    raw = rollout_crashing(NO_VLLM.line, 78)
    raw["metadata"]["labels"]["rljob.dev/role-config-hash"] = "an-earlier-rollout-config"
    decided = plan(trainer_running(0), trainer_running(1), raw)
    assert decided.lifecycle.phase == Phase.RUNNING
    assert decided.delete == ("demo-rollout-0",)


def test_reward_code_that_does_not_load_stays_a_crash_loop():
    """Exit 2 with "rollout: cannot start: ...": fixed by editing the ConfigMap, which replaces the pod (DESIGN §2)."""
    decided = plan(trainer_running(0), trainer_running(1), rollout_crashing(CRASHED["terminated"]["message"], 2))
    assert decided.lifecycle.phase == Phase.RUNNING
    assert pod_view(rollout_crashing(CRASHED["terminated"]["message"], 2)).start_failure == ""


def test_a_trainer_pod_of_an_earlier_attempt_is_not_read():
    old = trainer_exited(0, NOT_CACHED.line)
    old["metadata"]["labels"]["rljob.dev/attempt"] = "0"
    decided = plan(old, lc=replace(RUNNING, phase=Phase.RESTARTING, attempt=1, restarts=1, gang_created=False,
                                   reason=Reason.POD_DELETED, message="restarting"))
    assert decided.lifecycle.phase == Phase.RESTARTING


# --- Running only once the trainer reported the attempt's start ----------------------------------------------------
def test_a_gang_whose_pods_run_is_starting_until_its_trainer_reports_the_attempts_start():
    planned = plan(trainer_running(0), trainer_running(1)).lifecycle
    assert planned.phase == Phase.RUNNING  # what the pods alone say
    empty = protocol.parse_progress({}, {})  # a new job: no progress hash yet
    waiting = gang.require_started(planned, empty, RUNNING)
    assert (waiting.phase, waiting.reason, waiting.message) == (
        Phase.STARTING, Reason.TRAINER_STARTING,
        "attempt 0: all 2 trainer pods running; the trainer is loading the model and the newest checkpoint: no step "
        "before its rank 0 reports the attempt's start")
    previous = protocol.parse_progress({k: str(v) for k, v in protocol.start_fields(40, 2560, attempt=0).items()}, {})
    assert gang.require_started(replace(planned, attempt=1), previous, RUNNING).phase == Phase.STARTING
    started = protocol.parse_progress({k: str(v) for k, v in protocol.start_fields(40, 2560, attempt=1).items()}, {})
    assert started.started_attempt == 1
    assert gang.require_started(replace(planned, attempt=1), started, RUNNING) == replace(planned, attempt=1)
    # a pass that did not read Redis keeps what the saved status said of this attempt
    assert gang.require_started(planned, None, waiting) == waiting
    assert gang.require_started(planned, None, RUNNING) == planned
    assert gang.require_started(replace(planned, attempt=1), None, waiting).phase == Phase.RUNNING
    # a trainer older than started_attempt: started once it wrote a step
    older = protocol.parse_progress({protocol.PROGRESS_STEP: "3", protocol.PROGRESS_UPDATED_AT: "1767268800.0"}, {})
    assert gang.require_started(planned, older, RUNNING) == planned
    assert gang.require_started(planned, protocol.parse_progress({protocol.PROGRESS_STEP: "0"}, {}),
                                RUNNING).phase == Phase.STARTING


def test_running_is_false_with_trainer_starting_in_the_status():
    waiting = gang.require_started(RUNNING, protocol.parse_progress({}, {}), RUNNING)
    st = job_status.build_status(
        job_status.RLTrainingJobStatus(), generation=1, lifecycle=waiting, problems=(), data_parallel_size=2,
        redis=job_status.RedisHealth(True, "ready"), pods=[pod_view(trainer_running(0)), pod_view(trainer_running(1))],
        nodes=2, replicas=0, progress=None, now=T0)
    running = st.condition(ConditionType.RUNNING)
    assert (st.phase, running.status, running.reason) == (Phase.STARTING, "False", "TrainerStarting")
    assert st.condition(ConditionType.TRAINER_READY).status == "True"  # the pods run; the trainer has not started
    assert gang.Lifecycle.from_status(st).reason == Reason.TRAINER_STARTING  # what the next pass reads back
