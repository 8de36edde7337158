# syntax=docker/dockerfile:1
# The rljob operator image: the shared API package + the kopf operator, no torch (the trainer has its own
# image, trainer_image/). Dependencies are pinned in pyproject.toml; the base image by version.
#
#   docker build -t rljob/operator:0.1.0 .
#   docker run --rm rljob/operator:0.1.0 --help
#
# Build argument: PYTHON_IMAGE, the Python base (default the upstream slim image; the local cluster's
# localcluster/build-images.sh passes a locally made Debian bookworm base instead).

ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
# Wheels of the pinned base dependencies first (the `trainer` and `vllm` extras are not installed), from
# pyproject.toml alone, so that a source change rebuilds only the small wheel of the package itself. The
# pip cache is a build cache mount: it never lands in a layer.
COPY pyproject.toml ./
RUN --mount=type=cache,target=/root/.cache/pip \
    python -c "import tomllib; print('\\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip wheel --wheel-dir /wheels -r /tmp/requirements.txt
# Only the shared API and the operator: the wheel holds exactly the rljob_* packages present (setuptools finds
# them under pyproject's `where` folders; absent folders give none), so the trainer, rollout and local-cluster
# packages never reach this image.
COPY README.md ./
COPY api ./api
COPY operator ./operator
RUN --mount=type=cache,target=/root/.cache/pip \
    pip wheel --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels rljob \
    && useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin rljob \
    && python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080 9090
ENTRYPOINT ["rljob"]
CMD ["operator", "--all-namespaces"]
