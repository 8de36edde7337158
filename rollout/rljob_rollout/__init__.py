"""Rollout workers (DESIGN §1-§3, §6): prompts → sampled completions → verifiable rewards → group-relative
advantages → documents on the Redis stream, tagged per token with the weights version that generated them.

Entry point: ``python -m rljob_rollout`` (:mod:`rljob_rollout.__main__`).

Modules: :mod:`.tasks` (prompts and rewards), :mod:`.advantages` (group normalisation and filtering),
:mod:`.backends` (``cpu`` and ``vllm`` generation behind one interface), :mod:`.writer` (stream writes,
back-pressure, the rollout hash), :mod:`.worker` (the loop: weights, generate, score, write).
"""
