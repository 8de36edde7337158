"""Tasks: toy digit prompts and rewards (copy, reverse, sort), GSM8K-style answer extraction, JSONL datasets, user reward functions."""

from __future__ import annotations

import json
import sys

import pytest

from rljob_api.spec import DIGIT_TASKS, ModelSpec, TaskSpec
from rljob_wire.model import TEXT_ALPHABET, DigitTokenizer, build_tokenizer
from rljob_rollout.tasks import DigitsTask, InvalidReward, Prompt, build_task, extract_number, load_reward_function

TOK = DigitTokenizer()
TEXT = DigitTokenizer(alphabet=TEXT_ALPHABET)


def _ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def test_digits_copy_prompts_and_rewards():
    task = build_task(TaskSpec(name="digits-copy", digits=4), TOK, seed=7)
    assert task.max_new_tokens == 4
    prompt = task.next_prompts(1)[0]
    assert len(prompt.text) == 4 and prompt.text.isdigit()
    assert list(prompt.token_ids) == TOK.encode(prompt.text + "|")  # <bos> digits |
    digits = prompt.text
    assert task.reward(prompt, _ids(digits), digits) == 1.0
    wrong_last = digits[:3] + str((int(digits[3]) + 1) % 10)
    assert task.reward(prompt, _ids(wrong_last), wrong_last) == 0.75
    assert task.reward(prompt, _ids(digits[:2]) + [TOK.eos_token_id], "") == 0.5  # stopped early
    assert task.reward(prompt, [], "") == 0.0


def test_digits_reverse_rewards_the_reversed_prompt():
    task = build_task(TaskSpec(name="digits-reverse", digits=3), TOK, seed=0)
    prompt = Prompt(tuple(TOK.encode("123|")), "123", tuple(_ids("321")))
    fresh = task.next_prompts(1)[0]
    assert fresh.reference == tuple(_ids(fresh.text[::-1]))
    assert task.reward(prompt, _ids("321"), "321") == 1.0
    assert task.reward(prompt, _ids("123"), "123") == pytest.approx(1 / 3)


def test_digits_sort_rewards_the_prompt_in_ascending_order():
    task = build_task(TaskSpec(name="digits-sort", digits=4), TOK, seed=3)
    assert task.name == "digits-sort" and task.max_new_tokens == 4
    for fresh in task.next_prompts(16):
        assert fresh.reference == tuple(_ids("".join(sorted(fresh.text))))
        assert list(fresh.token_ids) == TOK.encode(fresh.text + "|")
    prompt = Prompt(tuple(TOK.encode("3102|")), "3102", tuple(_ids("0123")))
    assert task.reward(prompt, _ids("0123"), "0123") == 1.0
    assert task.reward(prompt, _ids("0132"), "0132") == 0.5  # the last two swapped
    assert task.reward(prompt, _ids("3102"), "3102") == 0.25  # a copy of the prompt: only the 1 (position 1) is right
    assert task.reward(prompt, _ids("3210"), "3210") == 0.0  # descending: no position right
    assert task.reward(prompt, _ids("0") + [TOK.eos_token_id], "0") == 0.25  # stopped after one digit
    duplicates = build_task(TaskSpec(name="digits-sort", digits=4), TOK, seed=0)
    five = Prompt(tuple(TOK.encode("5505|")), "5505", tuple(_ids("0555")))
    assert duplicates.reward(five, _ids("0555"), "0555") == 1.0
    assert duplicates.reward(five, _ids("5550"), "5550") == 0.5  # positions 1 and 2 hold a 5 either way


def test_the_digit_tasks_and_the_default_task():
    assert set(DigitsTask.ORDERS) == set(DIGIT_TASKS) == {"digits-copy", "digits-reverse", "digits-sort"}
    assert TaskSpec().name == "digits-copy"  # the default is unchanged: jobs without a task resolve as before
    with pytest.raises(ValueError, match="spec.rollout.task.name"):
        DigitsTask(TOK, digits=4, order="shuffle", seed=0)


def test_tiny_tokenizer_alphabet_follows_the_task():
    tiny = ModelSpec(source="tiny")
    digits = build_tokenizer(tiny, TaskSpec(name="digits-reverse"))
    assert build_tokenizer(tiny) == digits == build_tokenizer(tiny, TaskSpec(name="digits-sort")) == TOK
    assert digits.vocab_size == 14  # 4 specials + 10 digits
    assert digits.encode("90|") == [1, 13, 4, 3] and digits.decode([1, 13, 4, 3, 2]) == "90|"
    with pytest.raises(ValueError, match="'a' is not in its alphabet '0123456789'"):
        digits.encode("a1")
    for name in ("math", "custom"):
        text = build_tokenizer(tiny, TaskSpec(name=name, dataset_path="d.jsonl"))
        assert text == TEXT and text.vocab_size == 45
        assert text.decode(text.encode("what is 2+3?")) == "what is 2+3?"


def test_digit_prompts_are_seeded():
    a = build_task(TaskSpec(digits=4), TOK, seed=5).next_prompts(8)
    b = build_task(TaskSpec(digits=4), TOK, seed=5).next_prompts(8)
    c = build_task(TaskSpec(digits=4), TOK, seed=6).next_prompts(8)
    assert [p.text for p in a] == [p.text for p in b] != [p.text for p in c]


@pytest.mark.parametrize(
    "text, number",
    [
        ("so she has 3 + 4 = 7 apples.\n#### 7", 7.0),
        ("#### $1,234.50", 1234.5),
        ("first 12, then #### -3", -3.0),
        ("the answer is \\boxed{42}", 42.0),
        ("we get 5 then 17.", 17.0),
        ("no digits here", None),
        ("#### 8 and later #### 9", 9.0),
    ],
)
def test_extract_number(text, number):
    assert extract_number(text) == number


def _jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def test_math_task_scores_the_final_number(tmp_path):
    path = _jsonl(tmp_path / "math.jsonl", [
        {"prompt": "what is 2+3?", "answer": "2+3 = 5\n#### 5"},
        {"prompt": "what is 10-4?", "answer": 6},
    ])
    task = build_task(TaskSpec(name="math", dataset_path=path), TEXT, seed=0)
    prompts = task.next_prompts(4)  # one epoch of 2, then a reshuffled second epoch
    assert sorted(p.text for p in prompts[:2]) == sorted(p.text for p in prompts[2:]) == ["what is 10-4?", "what is 2+3?"]
    by_text = {p.text: p for p in prompts}
    five = by_text["what is 2+3?"]
    assert list(five.token_ids) == TEXT.encode("what is 2+3?")
    assert task.reward(five, [], "2 + 3 = 5 #### 5") == 1.0
    assert task.reward(five, [], "#### 6") == 0.0
    assert task.reward(five, [], "i do not know") == 0.0
    assert task.reward(by_text["what is 10-4?"], [], "it is 6") == 1.0


def test_math_task_formats_questions_with_the_template(tmp_path):
    path = _jsonl(tmp_path / "gsm.jsonl", [{"question": "How many?", "answer": "#### 3"}])

    class Recorder:  # a tokenizer that records what it encodes
        bos_token_id = None
        seen: list = []

        def encode(self, text, add_special_tokens=True):
            self.seen.append(text)
            return [1, 2, 3]

    task = build_task(TaskSpec(name="math", dataset_path=path), Recorder(), seed=0)
    prompt = task.next_prompts(1)[0]
    assert prompt.text.startswith("How many?\n") and "####" in prompt.text
    assert prompt.token_ids == (1, 2, 3) and Recorder.seen == [prompt.text]


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"prompt": "x"}'], "has no field 'answer'"),
        (['{"prompt": "x", "answer": "none"}'], "no number in answer"),
        (['not json'], "is not valid JSON"),
        (['[1, 2]'], "not an object"),
        ([''], "holds no record"),
    ],
)
def test_bad_math_datasets_name_the_field_and_line(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines))
    with pytest.raises(ValueError, match=message) as error:
        build_task(TaskSpec(name="math", dataset_path=str(path)), TEXT, seed=0)
    assert "spec.rollout.task.datasetPath" in str(error.value)


def test_missing_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="spec.rollout.task.datasetPath"):
        build_task(TaskSpec(name="math", dataset_path=str(tmp_path / "nope.jsonl")), TEXT, seed=0)


REWARDS_MODULE = '''
def length_reward(prompt, completion, record):
    return len(completion) / record["scale"]

def returns_text(prompt, completion, record):
    return "high"

def returns_nan(prompt, completion, record):
    return float("nan")
'''


@pytest.fixture()
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "user_rewards_for_tasks.py").write_text(REWARDS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_rewards_for_tasks"
    sys.modules.pop("user_rewards_for_tasks", None)


def test_custom_task_calls_the_user_function(tmp_path, reward_module):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "abc", "scale": 4}])
    task = build_task(TaskSpec(name="custom", dataset_path=path, reward_function=f"{reward_module}:length_reward"), TEXT, 0)
    prompt = task.next_prompts(1)[0]
    assert prompt.record == {"prompt": "abc", "scale": 4}
    assert task.reward(prompt, [], "xy") == 0.5


@pytest.mark.parametrize("function", ["returns_text", "returns_nan"])
def test_custom_rewards_that_are_not_finite_numbers_raise_invalid_reward(tmp_path, reward_module, function):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "abc"}])
    task = build_task(TaskSpec(name="custom", dataset_path=path, reward_function=f"{reward_module}:{function}"), TEXT, 0)
    with pytest.raises(InvalidReward):
        task.reward(task.next_prompts(1)[0], [], "x")


@pytest.mark.parametrize(
    "reference, message",
    [("no_colon", "must be 'module:function'"), ("no_such_module_xyz:f", "cannot import"), ("json:no_such_function", "no callable")],
)
def test_bad_reward_function_references(reference, message):
    with pytest.raises(ValueError, match=message) as error:
        load_reward_function(reference)
    assert "spec.rollout.task.rewardFunction" in str(error.value)
