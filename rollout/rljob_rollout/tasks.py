"""Tasks with verifiable rewards: where prompts come from and how a completion is scored.

The tasks (``spec.rollout.task.name``):

* ``digits-copy`` / ``digits-reverse`` / ``digits-sort`` — the built-in toy tasks of DESIGN §10. A prompt is
  ``<bos>``, ``digits`` random digits and the separator ``|``; the completion is ``digits`` tokens; the reward is the
  fraction of positions whose token equals the prompt's digit (copy), the reversed prompt's digit (reverse) or the
  prompt's digits in ascending order (sort). A tiny random model learns copying by RL alone in about a minute of CPU
  with the settings of :class:`DigitsTask`, sorting in a few minutes.
* ``math`` — JSONL records ``{"question": str, "answer": str | number}`` (GSM8K layout: the answer text ends
  in ``#### <number>``), or ``{"prompt": str, "answer": ...}`` to give the prompt text verbatim. Reward 1.0
  when the number extracted from the completion equals the reference, else 0.0 (:func:`extract_number`).
* ``environment`` — multi-turn episodes against ``spec.rollout.environment`` (:mod:`rljob_rollout.environments`):
  a prompt is a seed, a sample an episode, its reward the environment's.
* ``custom`` — JSONL records with a ``prompt`` string (any other keys are passed through), scored by the user
  function named in ``rewardFunction`` as ``module:function``, imported with :mod:`importlib` (the module
  must be importable in the rollout image, e.g. installed or on ``PYTHONPATH``), or with ``rewardSource`` loaded
  from the file the operator mounts (:func:`load_reward_module`: a ConfigMap key or a file on a volume, env
  ``RLJOB_REWARD_SOURCE``) as that module, whatever the image holds under its name. It is called as
  ``function(prompt: str, completion: str, record: dict) -> float`` with the prompt text, the decoded
  completion (special tokens skipped) and the JSONL record. It may raise: the worker drops that sample and
  counts the exception's class name (:mod:`rljob_rollout.worker`).

Prompt text of ``math`` and ``custom`` goes through the tokenizer's chat template when it has one (a user
turn, generation prompt added), else it is encoded as is with the tokenizer's special tokens.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import math
import posixpath
import re
import sys
import traceback
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from rljob_api import protocol
from rljob_api.spec import RewardSourceSpec, TaskSpec

MATH_TEMPLATE = "{question}\nSolve the problem step by step. Write the final answer as '#### <number>'."
"""Prompt text of a ``math`` record that has a ``question`` and no ``prompt``."""


class InvalidReward(ValueError):
    """A reward function returned something that is not a finite real number (counted as ``InvalidReward``)."""


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task.

    Attributes:
        token_ids: the prompt's token ids, special tokens included (what the model is conditioned on).
        text: the prompt's text before tokenisation (the user's text for dataset tasks, digits for the toy task).
        reference: what the verifier compares with (target digits, reference number, or the record).
        record: the dataset record the prompt came from (empty for the toy task).
    """

    token_ids: tuple[int, ...]
    text: str
    reference: Any
    record: dict[str, Any] = field(default_factory=dict)


class Task(ABC):
    """Prompts and their verifier. Implementations are deterministic given their seed."""

    name: str
    max_new_tokens: Optional[int] = None
    """A task-imposed cap on completion length (tokens), applied on top of ``sampling.maxNewTokens``."""

    @abstractmethod
    def next_prompts(self, count: int) -> list[Prompt]:
        """The next ``count`` prompts (dataset tasks cycle through a reshuffled dataset, epoch after epoch)."""

    @abstractmethod
    def reward(self, prompt: Prompt, completion_ids: Sequence[int], completion_text: str) -> float:
        """The reward of one completion (finite float). May raise; the worker drops the sample and counts it."""

    def score(self, prompt: Prompt, completion: Any, tokenizer: Any) -> float:
        """The reward of ``completion`` (a :class:`~rljob_rollout.backends.base.Completion`): :meth:`reward` of its ids
        and their text (decoded, special tokens skipped). May raise, as :meth:`reward`."""
        return self.reward(prompt, completion.token_ids, tokenizer.decode(completion.token_ids, skip_special_tokens=True))


def _single_token(tokenizer: Any, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(
            f"spec.rollout.task.name: the digits task needs every digit to be one token, but the tokenizer "
            f"encodes {text!r} as {ids}"
        )
    return ids[0]


class DigitsTask(Task):
    """The toy tasks of DESIGN §10: copy, reverse or sort ``digits`` random digits.

    Prompt tokens: ``[<bos>] + digit ids + ids("|")``; reward = (1/digits) · Σ_i [completion_ids[i] == target[i]]
    over i < digits, target = the prompt's digit ids, reversed for ``reverse``, in ascending order of the digits for
    ``sort`` (duplicates kept: ``5505`` → ``0555``). Missing positions (a completion that stopped early) count as
    wrong.

    Settings that learn (measured with the ``tiny`` model of DESIGN §10 — 2 layers, width 64, 4 heads, MLP 256 —
    and its digits-only tokenizer, vocabulary 14): ``digits: 4``, ``promptsPerBatch: 32``, ``samplesPerPrompt:
    16``, ``documentsPerStep: 512`` (one batch per step), AdamW ``learningRate: 2e-3``, ``beta2: 0.99``, no
    warm-up, ``gradClip: 1``, temperature 1, GRPO ε = 0.2, group-standardised advantages. Single-process runs
    with generation k steps behind the trained weights (mean reward over 5 steps, chance = 1/14 ≈ 0.07 per digit):

    ============  =====================  ===========================  ==============
    staleness     seeds                  first step with reward 0.8   step 100
    ============  =====================  ===========================  ==============
    0 (on-policy) 0-4                    53, 59, 63, 75, 89           0.79-0.996
    1 step        0-4                    60-71                        0.97-0.997
    2 steps       0-4                    63-73                        0.99-0.995
    3 steps       0-2                    72-75                        0.98
    4 steps       0-2                    81-85                        0.95
    ============  =====================  ===========================  ==============

    A little staleness helps: the clipped importance ratio damps the entropy collapse that stalls some
    on-policy seeds. The async path (2 trainer ranks + 1 CPU worker, ``maxLag`` = 2 steps, observed staleness
    ~1 step) reaches > 0.85 by step 70 in 30-60 s on 2 cores (``tests/rollout/test_learn.py``).

    What works less well: DESIGN §10's 16 x 8 = 128 documents per step turns the policy deterministic (often
    one digit repeated) before it learns to copy: at lr 3e-3 0.30-0.53 at step 150 over 3 seeds, lr 1e-3
    0.54-0.77, lr ≥ 1e-2 stuck near 0.1-0.2. Width 128, one layer, warm-up, beta2 0.999 or other RoPE bases
    did not fix it; 512 documents per step (or 256 with 2 steps of staleness) did. The 45-character text
    alphabet (vocabulary 45) learns more slowly than digits only. The reverse task is slower (0.5-0.7 at
    step 100).

    Sorting is harder (half of the 4-digit prompts repeat a digit, so the policy has to count): with the settings
    above it stalls near 0.7 from step ~100 on, a near-deterministic policy that emits the smallest digit and then
    repeats digits (mean new log-probability -0.03). At ``learningRate: 1e-3`` it learns: rollout reward 0.4 at step
    50, 0.7 at 100, first 0.9 at step 150, 0.94 on average over the last 20 of 300 steps (seed 0, the async path of
    the CPU example, benchmarks/learning_curve.py; two runs gave the same rewards), and the greedy policy then sorts
    96% of the positions right (98% on prompts of distinct digits, 93-94% with a repeat).
    """

    ORDERS = {"digits-copy": "copy", "digits-reverse": "reverse", "digits-sort": "sort"}
    """Task name → how the target is made from the prompt's digits."""

    def __init__(self, tokenizer: Any, *, digits: int, order: str, seed: int) -> None:
        if digits < 1:
            raise ValueError(f"spec.rollout.task.digits: must be >= 1, got {digits}")
        names = {value: name for name, value in self.ORDERS.items()}
        if order not in names:
            raise ValueError(f"spec.rollout.task.name: no digits task orders its target {order!r}")
        self.name = names[order]
        self.digits = digits
        self.order = order
        self.max_new_tokens = digits
        self._digit_ids = np.array([_single_token(tokenizer, str(d)) for d in range(10)], dtype=np.int64)
        bos = getattr(tokenizer, "bos_token_id", None)
        self._prefix = [bos] if bos is not None else []
        self._suffix = tokenizer.encode("|", add_special_tokens=False)
        self._rng = np.random.default_rng(seed)

    def next_prompts(self, count: int) -> list[Prompt]:
        values = self._rng.integers(0, 10, size=(count, self.digits))
        prompts = []
        for row in values:
            ids = self._digit_ids[row].tolist()
            target = self._digit_ids[self._target_digits(row)].tolist()
            text = "".join(str(int(d)) for d in row)
            prompts.append(Prompt(tuple(self._prefix + ids + self._suffix), text, tuple(target)))
        return prompts

    def _target_digits(self, row: np.ndarray) -> np.ndarray:
        if self.order == "reverse":
            return row[::-1]
        if self.order == "sort":
            return np.sort(row, kind="stable")
        return row

    def reward(self, prompt: Prompt, completion_ids: Sequence[int], completion_text: str) -> float:
        target = prompt.reference
        matches = sum(1 for i, token in enumerate(completion_ids[: len(target)]) if int(token) == target[i])
        return matches / len(target)


_NUMBER = r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_FINAL_ANSWER = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_BOXED = re.compile(r"\\boxed\{\s*\$?\s*(" + _NUMBER + r")\s*\}")
_ANY_NUMBER = re.compile(_NUMBER)


def extract_number(text: str) -> Optional[float]:
    """The final numeric answer of a GSM8K-style text, or None.

    Order of preference (as GSM8K's and the usual math verifiers' answer parsing): the last ``#### <number>``,
    else the last ``\\boxed{<number>}``, else the last number anywhere. Thousands separators and a leading
    ``$`` are ignored: ``"#### $1,234.5"`` → 1234.5.
    """
    for pattern in (_FINAL_ANSWER, _BOXED, _ANY_NUMBER):
        found = pattern.findall(text)
        if found:
            try:
                return float(found[-1].replace(",", ""))
            except ValueError:
                return None
    return None


def numbers_equal(a: float, b: float) -> bool:
    """``|a - b| <= 1e-6 · max(1, |b|)`` (answers are integers or short decimals)."""
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


def encode_prompt_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a user prompt: through the chat template (user turn + generation prompt) when the
    tokenizer has one, else ``tokenizer.encode(text)`` with its special tokens."""
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    return list(tokenizer.encode(text))


def load_jsonl(path: str, *, required: Sequence[str]) -> list[dict[str, Any]]:
    """Records of a JSONL file (blank lines skipped).

    Raises:
        FileNotFoundError: no file at ``path`` (message names ``spec.rollout.task.datasetPath``).
        ValueError: a line is not a JSON object, or lacks one of ``required`` (message names the line), or the
            file holds no record.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"spec.rollout.task.datasetPath: no file at {path!r}")
    records = []
    with file.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                raise ValueError(f"spec.rollout.task.datasetPath: {path}:{number} is not valid JSON ({error})") from None
            if not isinstance(record, dict):
                raise ValueError(f"spec.rollout.task.datasetPath: {path}:{number} is a JSON {type(record).__name__}, not an object")
            missing = [name for name in required if name not in record]
            if missing:
                raise ValueError(f"spec.rollout.task.datasetPath: {path}:{number} has no field {missing[0]!r}")
            records.append(record)
    if not records:
        raise ValueError(f"spec.rollout.task.datasetPath: {path} holds no record")
    return records


class _DatasetTask(Task):
    """Shared prompt cycling of the JSONL tasks: a fresh shuffle of the records every epoch."""

    def __init__(self, tokenizer: Any, records: list[dict[str, Any]], seed: int) -> None:
        self._tokenizer = tokenizer
        self._records = records
        self._rng = np.random.default_rng(seed)
        self._order: list[int] = []

    def _next_record(self) -> dict[str, Any]:
        if not self._order:
            self._order = self._rng.permutation(len(self._records)).tolist()
        return self._records[self._order.pop()]

    def next_prompts(self, count: int) -> list[Prompt]:
        prompts = []
        for _ in range(count):
            record = self._next_record()
            text = self._prompt_text(record)
            ids = tuple(encode_prompt_text(self._tokenizer, text))
            prompts.append(Prompt(ids, text, self._reference(record), record))
        return prompts

    @abstractmethod
    def _prompt_text(self, record: dict[str, Any]) -> str: ...

    @abstractmethod
    def _reference(self, record: dict[str, Any]) -> Any: ...


class MathTask(_DatasetTask):
    """GSM8K-style word problems: reward 1.0 when the completion's final number equals the reference."""

    name = "math"

    def __init__(self, tokenizer: Any, path: str, seed: int) -> None:
        records = load_jsonl(path, required=("answer",))
        for number, record in enumerate(records, start=1):
            if "question" not in record and "prompt" not in record:
                raise ValueError(f"spec.rollout.task.datasetPath: record {number} of {path} has neither 'question' nor 'prompt'")
            if self._parse_reference(record["answer"]) is None:
                raise ValueError(
                    f"spec.rollout.task.datasetPath: record {number} of {path}: no number in answer {record['answer']!r}"
                )
        super().__init__(tokenizer, records, seed)

    @staticmethod
    def _parse_reference(answer: Any) -> Optional[float]:
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            return float(answer)
        return extract_number(str(answer))

    def _prompt_text(self, record: dict[str, Any]) -> str:
        return str(record["prompt"]) if "prompt" in record else MATH_TEMPLATE.format(question=record["question"])

    def _reference(self, record: dict[str, Any]) -> float:
        return self._parse_reference(record["answer"])

    def reward(self, prompt: Prompt, completion_ids: Sequence[int], completion_text: str) -> float:
        answer = extract_number(completion_text)
        return 1.0 if answer is not None and numbers_equal(answer, prompt.reference) else 0.0


def _source_origin(source: Optional[RewardSourceSpec], module_file: str, file: str) -> str:
    """Where ``file`` (the reward module's ``module_file`` or a file beside it) comes from, in the user's terms:
    " (ConfigMap rewards, key reward.py)", " (claim rewards)", or ""."""
    if source is None:
        return ""
    if source.config_map_key_ref is not None:
        key = f", key {posixpath.basename(file)}" if posixpath.dirname(file) == posixpath.dirname(module_file) else ""
        return f" (ConfigMap {source.config_map_key_ref.name}{key})"
    return f" (claim {source.volume})" if source.volume else ""


def _failed_at(error: BaseException, module_file: str) -> tuple[str, Optional[int]]:
    """(file, line) where loading the reward module failed: a SyntaxError's own, else the innermost frame in the
    module's file or a file beside it (what it imports from there), else the module's file (no line)."""
    if isinstance(error, SyntaxError) and error.filename:
        return error.filename, error.lineno
    here = posixpath.dirname(module_file)
    frames = [f for f in traceback.extract_tb(error.__traceback__) if posixpath.dirname(f.filename) == here]
    return (frames[-1].filename, frames[-1].lineno) if frames else (module_file, None)


def load_reward_module(module_name: str, file: str, source: Optional[RewardSourceSpec] = None, *,
                       field: str = "spec.rollout.task.rewardSource",
                       name_field: str = "spec.rollout.task.rewardFunction") -> Any:
    """Load the Python source ``file`` (any name: a ConfigMap key need not end in ``.py``) as the module
    ``module_name`` (``sys.modules`` holds it under that name), with ``file``'s directory first on ``sys.path`` so
    that it imports the files beside it. ``source``: the spec's ``rewardSource`` (or ``environment.python.source``),
    named in errors; ``field`` and ``name_field``: the spec fields of the source and of the module's name, which the
    messages name.

    Raises:
        ValueError: ``module_name`` is a module this process has imported already (a standard or installed one, which
            the reward module would replace under everything that uses it); no file at ``file``; or running it raised
            (a SyntaxError, an ImportError of what it imports, any exception at import). The message is one line naming ``spec.rollout.task.rewardSource``, the file and line
            where it failed (:func:`_failed_at`) with where that file comes from, and the exception, e.g.
            "spec.rollout.task.rewardSource: /etc/rljob-reward/reward.py:3 (ConfigMap rewards, key reward.py):
            SyntaxError: '(' was never closed".
    """
    if module_name in sys.modules:
        raise ValueError(f"{name_field}: the module name {module_name!r} is taken by a module the "
                         "rollout process has imported already; give the reward module another name")
    if not posixpath.isfile(file):
        raise ValueError(f"{field}: no file at {file}{_source_origin(source, file, file)}")
    directory = posixpath.dirname(file)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    loader = importlib.machinery.SourceFileLoader(module_name, file)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(module_name, loader))
    sys.modules[module_name] = module
    try:
        loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - user code: whatever it raises is reported with its line
        sys.modules.pop(module_name, None)
        failed, line = _failed_at(error, file)
        where = f"{failed}:{line}" if line else failed
        message = error.msg if isinstance(error, SyntaxError) else str(error)
        raise ValueError(f"{field}: {where}{_source_origin(source, file, failed)}: "
                         f"{protocol.reward_error_key(type(error).__name__, message)}") from error
    return module


def load_reward_function(reference: str, file: Optional[str] = None,
                         source: Optional[RewardSourceSpec] = None) -> Callable[[str, str, dict], Any]:
    """Import ``module:function`` (``module`` may be dotted): from ``file`` when given (``spec.rollout.task.
    rewardSource``, :func:`load_reward_module`), else from the image.

    Raises:
        ValueError: not of the form ``module:function``, the module cannot be imported or loaded from ``file``, or it
            has no callable of that name (each message names ``spec.rollout.task.rewardFunction`` or, for what
            ``file`` raised, ``spec.rollout.task.rewardSource``).
    """
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"spec.rollout.task.rewardFunction: must be 'module:function', got {reference!r}")
    if file is not None:
        module = load_reward_module(module_name, file, source)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ValueError(f"spec.rollout.task.rewardFunction: cannot import {module_name!r}: {error}") from error
    function = module
    for part in attribute.split("."):
        function = getattr(function, part, None)
    if not callable(function):
        raise ValueError(f"spec.rollout.task.rewardFunction: {module_name!r} has no callable {attribute!r}")
    return function


class CustomTask(_DatasetTask):
    """Prompts from JSONL (``prompt`` field), rewards from a user function (see the module docstring)."""

    name = "custom"

    def __init__(self, tokenizer: Any, path: str, reward_function: str, seed: int, reward_file: Optional[str] = None,
                 reward_source: Optional[RewardSourceSpec] = None) -> None:
        self._function = load_reward_function(reward_function, reward_file, reward_source)
        super().__init__(tokenizer, load_jsonl(path, required=("prompt",)), seed)

    def _prompt_text(self, record: dict[str, Any]) -> str:
        return str(record["prompt"])

    def _reference(self, record: dict[str, Any]) -> dict[str, Any]:
        return record

    def reward(self, prompt: Prompt, completion_ids: Sequence[int], completion_text: str) -> float:
        value = self._function(prompt.text, completion_text, prompt.record)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise InvalidReward(f"reward function returned {type(value).__name__} {value!r}, not a number")
        if not math.isfinite(float(value)):
            raise InvalidReward(f"reward function returned {value}, not a finite number")
        return float(value)


def build_task(spec: TaskSpec, tokenizer: Any, seed: int, reward_file: Optional[str] = None) -> Task:
    """The task named by ``spec.name``, seeded with ``seed`` (the rollout seed + the replica index). ``reward_file``:
    the file of ``spec.rewardSource`` in this container (env ``RLJOB_REWARD_SOURCE``), for the custom task.

    Raises:
        ValueError / FileNotFoundError: a missing or malformed dataset, reward function or tokenizer
            mismatch; each message names the spec field.
    """
    if spec.name in DigitsTask.ORDERS:
        return DigitsTask(tokenizer, digits=spec.digits, order=DigitsTask.ORDERS[spec.name], seed=seed)
    if spec.name == "environment":
        from rljob_rollout.environments.task import EnvironmentTask

        return EnvironmentTask(seed)
    if not spec.dataset_path:
        raise ValueError(f"spec.rollout.task.datasetPath: required for task {spec.name!r}")
    if spec.name == "math":
        return MathTask(tokenizer, spec.dataset_path, seed)
    if not spec.reward_function:
        raise ValueError("spec.rollout.task.rewardFunction: required for task 'custom'")
    return CustomTask(tokenizer, spec.dataset_path, spec.reward_function, seed, reward_file, spec.reward_source)
