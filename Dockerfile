# syntax=docker/dockerfile:1
# The rljob operator image: the shared API package + the kopf operator, no torch (the trainer has its own
# image, trainer_image/). Dependencies are pinned in pyproject.toml; the base image by version.
#
#   docker build -t rljob/operator:0.1.0 .
#   docker run --rm rljob/operator:0.1.0 --help

ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY api ./api
COPY operator ./operator
COPY trainer_image ./trainer_image
COPY localcluster ./localcluster
# Wheels of the package and its pinned base dependencies (the `trainer` and `vllm` extras are not installed).
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

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
