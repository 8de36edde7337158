"""The container images, checked without a container engine (none on these machines; the kind workflow builds
them): every Dockerfile copies paths that exist, installs extras that pyproject defines and starts a command the
image has; the operator image's install (the package without extras) resolves to no torch and no CUDA wheel."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = ["Dockerfile", "trainer_image/Dockerfile", "trainer_image/Dockerfile.cpu", "trainer_image/Dockerfile.vllm"]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: comments dropped, backslash continuations joined."""
    joined, current = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        joined.append(current.strip())
        current = ""
    return [(word.upper(), rest.strip()) for word, _, rest in (line.partition(" ") for line in joined)]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_copies_existing_paths_and_installs_defined_extras(name):
    steps = instructions(REPO / name)
    assert steps and steps[0][0] in ("FROM", "ARG"), steps[:1]
    copies = [shlex.split(args) for kind, args in steps if kind == "COPY"]
    assert copies, f"{name} copies nothing"
    for words in copies:
        if any(w.startswith("--from") for w in words):
            continue
        sources = [w for w in words[:-1] if not w.startswith("--")]
        for source in sources:
            assert (REPO / source).exists(), f"{name}: COPY {source} does not exist in the build context (repo root)"
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    for kind, args in steps:
        if kind == "RUN":
            for asked in re.findall(r'"\.\[([a-z,]+)\]"', args):
                assert set(asked.split(",")) <= extras, f"{name}: pip install .[{asked}] but pyproject has {extras}"


def test_image_commands_exist_in_the_images():
    scripts = set(PYPROJECT["project"]["scripts"])
    for name in DOCKERFILES:
        steps = dict(instructions(REPO / name))
        command = json.loads(steps.get("ENTRYPOINT") or steps["CMD"])
        if command[0] in scripts:
            assert command[0] == "rljob"
        else:
            assert command[0] in ("torchrun", "python"), (name, command)
            module = command[command.index("-m") + 1]
            assert (REPO / "trainer_image" / Path(*module.split("."))).with_suffix(".py").exists() or (
                REPO / "trainer_image" / Path(*module.split(".")) / "__main__.py").exists(), (name, module)
    operator = dict(instructions(REPO / "Dockerfile"))
    assert json.loads(operator["CMD"]) == ["operator", "--all-namespaces"]


def test_the_operator_install_pulls_no_torch(tmp_path):
    """What the operator image installs (the package, no extras), resolved against the package index."""
    report = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--disable-pip-version-check",
         "--report", str(report), str(REPO)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    names = {item["metadata"]["name"].lower().replace("_", "-") for item in json.loads(report.read_text())["install"]}
    assert {"rljob", "kopf", "kubernetes", "pydantic", "redis"} <= names
    heavy = {n for n in names if n in ("torch", "transformers", "vllm", "triton") or n.startswith("nvidia-")}
    assert heavy == set(), heavy
