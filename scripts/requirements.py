"""The third-party requirements of some of rljob's distributions, one per line, for an image's dependency layer.

    python requirements.py api/pyproject.toml operator/pyproject.toml
    python requirements.py trainer/pyproject.toml:trackers ...     # with the named extras (comma-separated)
    python requirements.py --constraints trainer/pyproject.toml    # the pinned ones only, as a pip constraints file

rljob's own distributions (``rljob-*``) are left out: an image installs them from its source folders, after the
layer these requirements make, so that a source change rebuilds only the small last layer. A requirement without
``==`` is left out where another of the files pins the name. With ``--constraints`` only the pinned requirements
are printed, without their extras (pip refuses extras in a constraints file). Exits 2 on an extra a file does not
define.
"""

from __future__ import annotations

import re
import sys
import tomllib


def requirements(arguments: list[str]) -> list[str]:
    lines: list[str] = []
    for argument in arguments:
        path, _, extras = argument.partition(":")
        with open(path, "rb") as file:
            project = tomllib.load(file)["project"]
        lines += project.get("dependencies", [])
        defined = project.get("optional-dependencies", {})
        for extra in filter(None, extras.split(",")):
            if extra not in defined:
                raise SystemExit(f"{path} defines no extra {extra!r} (it has {sorted(defined)})")
            lines += defined[extra]
    own = re.compile(r"^rljob-[a-z]+\b")
    name = re.compile(r"^[A-Za-z0-9_.-]+")
    lines = [line for line in dict.fromkeys(lines) if not own.match(line)]
    pinned = {name.match(line).group(0).lower() for line in lines if "==" in line}
    # A loose requirement (rljob-wire's "torch", "numpy>=2") adds nothing where another distribution pins the name.
    return [line for line in lines if "==" in line or name.match(line).group(0).lower() not in pinned]


def constraints(arguments: list[str]) -> list[str]:
    return [re.sub(r"\[[^\]]*\]", "", line) for line in requirements(arguments) if "==" in line]


if __name__ == "__main__":
    try:
        if sys.argv[1:2] == ["--constraints"]:
            print("\n".join(constraints(sys.argv[2:])))
        else:
            print("\n".join(requirements(sys.argv[1:])))
    except SystemExit as error:
        print(error, file=sys.stderr)
        sys.exit(2)
