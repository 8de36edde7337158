"""TRL's ``GRPOTrainer`` on rljob's toy task, the outside reference of benchmarks/time_to_reward.py (variant c).

Run by time_to_reward.py as ``torchrun --nproc-per-node=2 benchmarks/trl_grpo.py --spec spec.json --out log.jsonl``
(2 data-parallel processes on CPU, as rljob's trainer has; gloo), with the ``benchmark`` extra installed (pinned
``trl``). Everything it trains comes from the same RLTrainingJob spec rljob runs:

* the model: ``rljob_wire.model.build_model`` of ``spec.model`` (the same tiny Llama, the same seeded
  initialisation as rljob's trainer with ``spec.trainer.seed``);
* the tokenizer: :func:`hf_digit_tokenizer`, a ``PreTrainedTokenizerFast`` built in code (no download) with exactly
  the ids of :class:`rljob_wire.model.DigitTokenizer` (``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``|`` 3, the digits
  4-13; a leading ``<bos>``), so a prompt is the same token sequence in both;
* the prompts and the reward: ``rljob_rollout.tasks.build_task`` of ``spec.rollout.task`` (seeded with
  ``spec.rollout.seed``), the reward read from TRL's ``completion_ids``;
* the batch: ``promptsPerBatch`` × ``samplesPerPrompt`` completions per optimizer step (``per_device_train_batch_size``
  = that / processes, ``num_generations`` = samplesPerPrompt, one optimizer step per generation batch, no reuse:
  ``num_iterations`` 1), ``maxSteps`` steps;
* the loss: TRL's GRPO with ``loss_type="dapo"`` (token-level, normalised by the labelled tokens of the whole global
  batch, as rljob's GRPO), clip ε = ``algorithm.epsilonLow/High`` (0.2), no KL (``beta`` 0), group-standardised
  advantages (``scale_rewards="group"``);
* the optimizer: AdamW with ``spec.trainer.optimizer``'s learning rate, betas, weight decay and gradient clip, a
  constant rate after ``warmupSteps`` (no decay), sampling at ``spec.rollout.sampling``'s temperature and top-p,
  at most ``maxNewTokens`` (and the task's length) tokens.

Each logged step appends a JSON line to ``--out`` (rank 0): ``{"step", "reward", "time"}``; the reward is TRL's
``reward`` metric of that step: the mean over the whole generation batch (every process), sampled with the weights
after ``step - 1`` updates; ``time`` (``time.time()``) is when rank 0's reward function scored its part of that batch,
as rljob's rollout scores a batch before the trainer trains on it. With ``--stop-at R`` training stops after the first
step whose reward is >= R.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / folder) for folder in ("api", "wire", "trainer", "rollout")]


def hf_digit_tokenizer() -> Any:
    """A ``transformers.PreTrainedTokenizerFast`` with the ids of :class:`rljob_wire.model.DigitTokenizer` (digits
    alphabet): one token per character, ``<bos>`` prepended by its post-processor, ``<pad>``/``<bos>``/``<eos>``
    special; decoding joins the characters without spaces."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from rljob_wire.model import DigitTokenizer

    reference = DigitTokenizer()
    vocab = {"<pad>": reference.pad_token_id, "<bos>": reference.bos_token_id, "<eos>": reference.eos_token_id,
             "|": reference.sep_token_id}
    vocab.update({ch: reference.num_special + i for i, ch in enumerate(reference.alphabet)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", reference.bos_token_id)])
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   padding_side="left")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", required=True, help="JSON file: the RLTrainingJob spec rljob runs (camelCase)")
    parser.add_argument("--out", required=True, help="JSON lines, one per logged step (rank 0)")
    parser.add_argument("--stop-at", type=float, default=None, help="stop after the first step with reward >= this")
    args = parser.parse_args(argv)

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rljob_api.spec import RLTrainingJobSpec
    from rljob_rollout.tasks import build_task
    from rljob_wire.model import DigitTokenizer, build_model

    torch.set_num_threads(1)
    spec = RLTrainingJobSpec.model_validate(json.loads(Path(args.spec).read_text()))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    rollout, trainer, opt = spec.rollout, spec.trainer, spec.trainer.optimizer
    per_step = rollout.prompts_per_batch * rollout.samples_per_prompt
    if per_step % world:
        raise SystemExit(f"{per_step} completions per step do not split over {world} processes")

    digits = DigitTokenizer()
    task = build_task(rollout.task, digits, rollout.seed)
    prompts = task.next_prompts(rollout.prompts_per_batch * trainer.max_steps)  # one per prompt slot of the run
    by_text = {p.text: p for p in prompts}
    dataset = Dataset.from_list([{"prompt": p.text + "|"} for p in prompts])

    scored_at: dict[int, float] = {}  # global_step while the batch was scored (updates before it) -> time.time()

    def reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]], trainer_state: Any,
               **_: Any) -> list[float]:
        rewards = [task.reward(by_text[prompt[:-1]], ids, text)
                   for prompt, text, ids in zip(prompts, completions, completion_ids)]
        scored_at[trainer_state.global_step] = time.time()
        return rewards

    tokenizer = hf_digit_tokenizer()
    assert tokenizer("0123|")["input_ids"] == digits.encode("0123|"), "the two tokenizers disagree"
    model = build_model(spec.model, digits.vocab_size, seed=trainer.seed)
    model.generation_config.eos_token_id = digits.eos_token_id
    model.generation_config.pad_token_id = digits.pad_token_id
    epsilon_low = spec.algorithm.epsilon_low if spec.algorithm.epsilon_low is not None else 0.2
    epsilon_high = spec.algorithm.epsilon_high if spec.algorithm.epsilon_high is not None else epsilon_low
    max_new = min(rollout.sampling.max_new_tokens, task.max_new_tokens or rollout.sampling.max_new_tokens)
    config = GRPOConfig(
        output_dir=str(Path(args.out).parent / "trl-output"),
        use_cpu=True, bf16=False, fp16=False, seed=trainer.seed, data_seed=trainer.seed,
        per_device_train_batch_size=per_step // world, gradient_accumulation_steps=1,
        num_generations=rollout.samples_per_prompt, steps_per_generation=1, num_iterations=1,
        max_steps=trainer.max_steps, max_completion_length=max_new,
        temperature=rollout.sampling.temperature, top_p=rollout.sampling.top_p, top_k=0,
        learning_rate=opt.learning_rate, adam_beta1=opt.beta1, adam_beta2=opt.beta2, weight_decay=opt.weight_decay,
        max_grad_norm=opt.grad_clip if opt.grad_clip > 0 else 1e9, warmup_steps=opt.warmup_steps,
        lr_scheduler_type="constant_with_warmup" if opt.warmup_steps else "constant",
        beta=0.0, epsilon=epsilon_low, epsilon_high=epsilon_high, loss_type="dapo", scale_rewards="group",
        logging_steps=1, report_to="none", save_strategy="no", disable_dropout=True, shuffle_dataset=False,
        dataloader_num_workers=0, log_completions=False, ddp_backend="gloo" if world > 1 else None,
    )
    out = Path(args.out)

    class Record(TrainerCallback):
        def on_log(self, _args: Any, state: Any, control: Any, logs: dict | None = None, **__: Any) -> None:
            if not logs or "reward" not in logs:
                return
            if rank == 0:
                with out.open("a") as f:
                    f.write(json.dumps({"step": state.global_step, "reward": logs["reward"],
                                        "time": scored_at.get(state.global_step - 1, time.time())}) + "\n")
            if args.stop_at is not None and logs["reward"] >= args.stop_at:
                control.should_training_stop = True

    GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer,
                callbacks=[Record()]).train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
