"""Rebuild a guess-the-number episode from its own sampled turns and a fresh environment's answers to them: what its
context must be, token for token, when earlier turns are never re-tokenized (issue 27 item 2). Shared by the rollout
tests (episodes in process) and the end-to-end environment job (documents read from the stream)."""

from __future__ import annotations

from typing import Any, Sequence

from rljob_rollout.environments.episodes import ObservationEncoder
from rljob_rollout.environments.guess import GuessAction, GuessNumber


def replay(token_ids: Sequence[int], masked_spans: Sequence[tuple[int, int]], tokenizer: Any, *,
           seed: int | None = None, secret: int | None = None) -> list[int]:
    """The token ids the episode must have: the first observation, then per turn the sampled ids (the unmasked run
    after each masked span) and the environment's answer to them, encoded as the rollout encodes it.

    Args:
        token_ids: the episode's tokens (a stream document's ``tokens``).
        masked_spans: its masked [begin, end) spans, the first the prompt, then one per answer of the environment.
        seed: the episode's reset seed; or ``secret``: the secret to play against (a document carries no seed).

    Raises AssertionError when the first span is not the whole first observation.
    """
    env, encoder = GuessNumber(), ObservationEncoder(tokenizer)
    ids = encoder.first(env.reset(seed=seed).message)
    if secret is not None:
        env.secret = secret
    spans = [tuple(s) for s in masked_spans]
    assert spans[0] == (0, len(ids)), (spans[0], ids)
    for begin, end in turn_ranges(token_ids, spans):
        sampled = list(token_ids[begin:end])
        ids += sampled
        if end < len(token_ids):
            feedback = env.step(GuessAction(message=tokenizer.decode(sampled, skip_special_tokens=True))).message
            ids += encoder.next(feedback, sampled[-1] == tokenizer.eos_token_id)
    return ids


def turn_ranges(token_ids: Sequence[int], masked_spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The [begin, end) ranges of an episode's sampled turns: the unmasked run after each masked span."""
    spans = [tuple(s) for s in masked_spans]
    return [(spans[i][1], spans[i + 1][0] if i + 1 < len(spans) else len(token_ids)) for i in range(len(spans))]


def conversation(token_ids: Sequence[int], masked_spans: Sequence[tuple[int, int]], tokenizer: Any, *,
                 secret: int) -> list[dict[str, str]]:
    """The chat messages of an episode played against ``secret`` up to its last turn: the first observation (user),
    then per turn but the last its sampled text (assistant; special tokens kept, its end-of-sequence token left to the
    chat template) and the environment's answer to it (user)."""
    env = GuessNumber()
    messages = [{"role": "user", "content": env.reset(seed=0).message}]
    env.secret = secret
    for begin, end in turn_ranges(token_ids, masked_spans)[:-1]:
        sampled = list(token_ids[begin:end])
        said = sampled[:-1] if sampled[-1] == tokenizer.eos_token_id else sampled
        feedback = env.step(GuessAction(message=tokenizer.decode(sampled, skip_special_tokens=True))).message
        messages += [{"role": "assistant", "content": tokenizer.decode(said)}, {"role": "user", "content": feedback}]
    return messages


def secrets_replaying(token_ids: Sequence[int], masked_spans: Sequence[tuple[int, int]], tokenizer: Any) -> list[int]:
    """The secrets in [0, ``GuessNumber().high``] against which :func:`replay` gives exactly ``token_ids``: empty when
    no game of guess-the-number has these tokens."""
    found = []
    for secret in range(GuessNumber().high + 1):
        try:
            if replay(token_ids, masked_spans, tokenizer, seed=0, secret=secret) == list(token_ids):
                found.append(secret)
        except AssertionError:
            return []
    return found
