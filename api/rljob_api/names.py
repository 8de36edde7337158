"""Child object names (DESIGN §2, §5): deterministic, DNS-1123, within 63 characters.

A job name too long for a suffix is cut and given a short hash, so two long names never collide.
"""

from __future__ import annotations

import hashlib

MAX_NAME = 63


def base_name(job: str, longest_suffix: str = "-rollout-9999") -> str:
    """The job name, or a cut name + 6-hex hash when ``job + longest_suffix`` would pass 63 characters."""
    if len(job) + len(longest_suffix) <= MAX_NAME:
        return job
    digest = hashlib.sha256(job.encode()).hexdigest()[:6]
    keep = MAX_NAME - len(longest_suffix) - len(digest) - 1
    return f"{job[:keep].rstrip('-')}-{digest}"


def job_label(job: str) -> str:
    """The job name as a label value (at most 63 characters): the name itself, or a cut name + hash when longer."""
    return base_name(job, longest_suffix="")


def trainer_service(job: str) -> str:
    return f"{base_name(job)}-trainer"


def trainer_pod(job: str, index: int) -> str:
    return f"{base_name(job)}-trainer-{index}"


def rollout_pod(job: str, index: int) -> str:
    return f"{base_name(job)}-rollout-{index}"


def redis_name(job: str) -> str:
    """Managed Redis Deployment and Service name."""
    return f"{base_name(job)}-redis"


def redis_claim(job: str) -> str:
    """PersistentVolumeClaim of the managed Redis's data (``spec.redis.persistence``)."""
    return f"{base_name(job)}-redis-data"


def redis_secret(job: str) -> str:
    return f"{base_name(job)}-redis-auth"


def environment(job: str) -> str:
    """Deployment and Service of the environment server the operator runs (``spec.rollout.environment.server``)."""
    return f"{base_name(job)}-environment"


def environment_url(job: str, namespace: str, port: int) -> str:
    """Base URL at which rollout workers reach the job's environment server: its Service's DNS name and ``port``."""
    return f"http://{service_dns(environment(job), namespace)}:{port}"


def config_map(job: str) -> str:
    return f"{base_name(job)}-config"


def workload(job: str) -> str:
    """The job's Kueue Workload (with a ``kueue.x-k8s.io/queue-name`` label on the job)."""
    return f"{base_name(job)}-workload"


def pod_dns(pod: str, service: str, namespace: str) -> str:
    """``<pod>.<service>.<namespace>.svc.cluster.local`` (pod hostname + headless subdomain)."""
    return f"{pod}.{service}.{namespace}.svc.cluster.local"


def service_dns(service: str, namespace: str) -> str:
    return f"{service}.{namespace}.svc.cluster.local"
