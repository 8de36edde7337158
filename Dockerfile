# syntax=docker/dockerfile:1
# The rljob operator image: the rljob-api and rljob-operator distributions (api/, operator/), no torch (the
# trainer has its own image, trainer_image/). Dependencies are pinned in their pyproject.toml; the base image by
# version.
#
#   docker build -t rljob/operator:0.1.0 .
#   docker run --rm rljob/operator:0.1.0 --help
#
# Build argument: PYTHON_IMAGE, the Python base (default the upstream slim image; the local cluster's
# localcluster/build-images.sh passes a locally made Debian bookworm base instead).

ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
# Wheels of the pinned dependencies first, from the two pyproject.toml files alone, so that a source change
# rebuilds only the small wheels of the packages themselves. The pip cache is a build cache mount: it never lands
# in a layer.
COPY scripts/requirements.py ./scripts/
COPY api/pyproject.toml ./api/
COPY operator/pyproject.toml ./operator/
RUN --mount=type=cache,target=/root/.cache/pip \
    python scripts/requirements.py api/pyproject.toml operator/pyproject.toml > /tmp/requirements.txt \
    && pip wheel --wheel-dir /wheels -r /tmp/requirements.txt
# Only the shared API and the operator: the trainer, rollout, wire and local-cluster packages never reach this image.
COPY api ./api
COPY operator ./operator
RUN --mount=type=cache,target=/root/.cache/pip \
    pip wheel --no-deps --wheel-dir /wheels ./api ./operator

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels rljob-operator \
    && useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin rljob \
    && python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080 9090
ENTRYPOINT ["rljob"]
CMD ["operator", "--all-namespaces"]
