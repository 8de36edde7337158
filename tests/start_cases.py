"""Models a pod cannot load, and an entry point run as a pod runs it, for the start-failure tests of both roles
(rljob_api.start_failure, DESIGN §5 "Start failures")."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from rljob_api import constants as c
from source_tree import pythonpath

QWEN = "Qwen/Qwen2.5-0.5B-Instruct"
UNLOADABLE = ("no-such-path", "no-tokenizer", "hub-offline")
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def unloadable(case: str, directory: Path) -> tuple[dict, dict[str, str], str]:
    """(spec.model, the process's extra env, how its failure's message starts) of model ``case`` under ``directory``:
    a ``path`` that is no directory, a ``path`` whose directory has a config but no tokenizer, a ``huggingface`` id with
    HF_HUB_OFFLINE=1 and an empty cache."""
    if case == "no-such-path":
        path = directory / "nope"
        return ({"source": "path", "path": str(path)}, {},
                f"spec.model.path: {str(path)!r}: no such directory in this container: mount the model there")
    if case == "no-tokenizer":
        from transformers import LlamaConfig

        path = directory / "model"
        LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=1, intermediate_size=128,
                    vocab_size=14).save_pretrained(path)
        return ({"source": "path", "path": str(path)}, {},
                f"spec.model.path: {str(path)!r}: the directory has no loadable tokenizer (")
    assert case == "hub-offline", case
    home = directory / "hf-home"
    return ({"source": "huggingface", "name": QWEN}, {"HF_HUB_OFFLINE": "1", "HF_HOME": str(home)},
            f"spec.model.name: {QWEN!r}: no tokenizer in the pod's Hugging Face cache ({home}/hub) and HF_HUB_OFFLINE "
            "is set, so nothing can be downloaded")


@dataclass(frozen=True)
class Ended:
    """How an entry point ended: its exit code, its stderr and what it left in its termination message file."""

    returncode: int
    stderr: str
    termination: str

    @property
    def last_line(self) -> str:
        return self.stderr.strip().splitlines()[-1]


def env_of_pod(config: Path, termination: Path, extra: Mapping[str, str], password: str = "") -> dict[str, str]:
    """This process's env without torchrun's variables, plus what a pod gives its container: RLJOB_CONFIG, the Redis
    password, the termination message file (made empty, as the kubelet makes it) and ``extra``."""
    termination.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env.update({c.ENV_CONFIG: str(config), c.ENV_REDIS_PASSWORD: password, c.ENV_TERMINATION_LOG: str(termination),
                c.ENV_ATTEMPT: "0", "OMP_NUM_THREADS": "1", **extra})
    env["PYTHONPATH"] = pythonpath(env)
    return env


def run_entry(module_args: Sequence[str], config: Path, termination: Path, extra: Mapping[str, str],
              password: str = "", timeout: float = 180) -> Ended:
    """``python <module_args>`` (``-m rljob_rollout``, ``-m rljob_trainer.train``) as a pod runs it."""
    result = subprocess.run([sys.executable, *module_args], env=env_of_pod(config, termination, extra, password),
                            capture_output=True, text=True, timeout=timeout)
    return Ended(result.returncode, result.stderr, termination.read_text())
