"""The ``rljob`` command line (typer): one subcommand per role.

``rljob operator`` runs the kopf operator; ``rljob crd`` prints the CRD; ``rljob watch JOB`` shows a
job's progress live. Other roles add their own
subcommands to :data:`app`.
"""

from __future__ import annotations

import json
import logging
from typing import List, Optional

import typer

app = typer.Typer(help="rljob: streaming RL post-training of LLMs on Kubernetes.", no_args_is_help=True)


@app.callback()
def main() -> None:
    """rljob: streaming RL post-training of LLMs on Kubernetes."""


@app.command()
def operator(
    namespace: List[str] = typer.Option([], "--namespace", "-n", help="Namespace to watch (repeatable)."),
    all_namespaces: bool = typer.Option(False, "--all-namespaces", "-A", help="Watch every namespace."),
    peering: Optional[str] = typer.Option(
        None, help="ClusterKopfPeering object shared by the replicas (one active); default: run standalone."
    ),
    priority: Optional[int] = typer.Option(
        None, help="Peering priority: the highest live replica works, the others wait (default: random)."
    ),
    liveness_port: int = typer.Option(8080, help="Port of kopf's liveness endpoint /healthz (0 disables)."),
    metrics_port: int = typer.Option(9090, help="Port of the Prometheus endpoint /metrics (0 disables)."),
    active_interval: float = typer.Option(5.0, help="Seconds between passes of an active job."),
    idle_interval: float = typer.Option(60.0, help="Seconds between passes of a suspended/finished/invalid job."),
    kubeconfig: Optional[str] = typer.Option(None, envvar="KUBECONFIG", help="Kubeconfig (default: in-cluster)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
) -> None:
    """Run the RLTrainingJob operator (kopf)."""
    import kopf

    from rljob_operator import handlers, settings  # noqa: F401  (registers the handlers)

    if bool(namespace) == all_namespaces:
        raise typer.BadParameter("give --namespace (one or more) or --all-namespaces, not both or neither")
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not verbose:  # kopf logs every handler success per object; the job's Events and status say more
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    options = settings.OperatorOptions(
        namespaces=tuple(namespace),
        metrics_port=metrics_port or None,
        kubeconfig=kubeconfig,
        active_interval_s=active_interval,
        idle_interval_s=idle_interval,
    )
    kopf.run(
        clusterwide=all_namespaces,
        namespaces=list(namespace),
        standalone=peering is None,
        peering_name=peering,
        priority=priority if priority is not None else settings.draw_priority(),
        liveness_endpoint=f"http://0.0.0.0:{liveness_port}/healthz" if liveness_port else None,
        memo=kopf.Memo(options=options),
    )


@app.command()
def crd() -> None:
    """Print the RLTrainingJob CRD (YAML)."""
    from rljob_operator.crd import crd_yaml

    typer.echo(crd_yaml(), nl=False)


def _names_object(body: Optional[str], name: str) -> bool:
    """Whether a 404's body is the API server's Status for the object ``name`` (not a missing resource type)."""
    try:
        status = json.loads(body or "")
    except ValueError:
        return False
    return isinstance(status, dict) and (status.get("details") or {}).get("name") == name


WATCH_SUCCEEDED, WATCH_FAILED, WATCH_TIMEOUT, WATCH_NOT_FOUND, WATCH_API_ERROR = 0, 1, 2, 3, 4
"""Exit codes of ``rljob watch`` (also in its help)."""


@app.command()
def watch(
    name: str = typer.Argument(..., help="RLTrainingJob name."),
    namespace: str = typer.Option("default", "--namespace", "-n", help="Its namespace."),
    timeout: float = typer.Option(3600.0, help="Seconds to wait for Succeeded or Failed."),
    kubeconfig: Optional[str] = typer.Option(None, envvar="KUBECONFIG", help="Kubeconfig (default: ~/.kube/config)."),
) -> None:
    """Show a job's progress live (step, rewards, staleness, conditions) until it finishes.

    Exit codes (errors are printed on one line):
    0 the job Succeeded,
    1 the job Failed,
    2 --timeout passed first,
    3 no such job in the namespace,
    4 no kubeconfig, the API server refused or could not be reached, or the CRD is not installed.
    """
    from kubernetes import config as kube_config
    from kubernetes.client import ApiException
    from urllib3.exceptions import HTTPError

    from rljob_api import constants as c

    from rljob_operator.watch import watch as watch_job

    try:
        kube_config.load_kube_config(config_file=kubeconfig)
        final = watch_job(name, namespace, timeout_seconds=timeout)
    except TimeoutError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(WATCH_TIMEOUT)
    except ApiException as err:
        if err.status == 404 and _names_object(err.body, name):
            typer.echo(f"{c.SINGULAR} {name} not found in namespace {namespace}", err=True)
            raise typer.Exit(WATCH_NOT_FOUND)
        if err.status == 404:
            typer.echo(f"the API server has no {c.PLURAL}.{c.GROUP}: the CRD is not installed (see `rljob crd`)",
                       err=True)
            raise typer.Exit(WATCH_API_ERROR)
        typer.echo(f"cannot read {c.SINGULAR} {namespace}/{name}: HTTP {err.status} {err.reason}", err=True)
        raise typer.Exit(WATCH_API_ERROR)
    except (HTTPError, OSError, kube_config.ConfigException) as err:
        typer.echo(f"cannot read {c.SINGULAR} {namespace}/{name}: {err}", err=True)
        raise typer.Exit(WATCH_API_ERROR)
    raise typer.Exit(WATCH_SUCCEEDED if final["status"]["phase"] == "Succeeded" else WATCH_FAILED)


if __name__ == "__main__":
    app()
