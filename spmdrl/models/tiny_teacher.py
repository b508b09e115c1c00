"""The built-in teacher of on-policy distillation (``teacher.path: tiny-teacher``, recipe=opd_tiny): a wider
tiny Qwen2 than ``tiny`` (another architecture, the same tokenizer), trained once on the built-in tiny task's
correct demonstrations, so that it answers most held-out questions right.

It is built like the tiny model (spmdrl.models.build_once: once per cache directory, by one process under
a file lock, renamed into place): a fixed seed, a fixed number of SFT steps with spmdrl's SFT data and loss
(spmdrl.data.sft, spmdrl.algos.losses.masked_cross_entropy) in one process, no distributed job:
TEACHER_STEPS optimizer steps of TEACHER_BATCH demonstrations, about three quarters of the compute of
grpo_tiny's own warm-start (250 steps of 64 on the smaller model), once per cache.
"""

from __future__ import annotations

import logging
import math
import random
import shutil
from pathlib import Path

from spmdrl.data import tiny_task
from spmdrl.models import tiny

log = logging.getLogger(__name__)

# Bump when anything below (shape, data, steps, seed) changes: a cached teacher of the old recipe is not
# mistaken for the new one.
TEACHER_VERSION = 2
TEACHER_DIRNAME = f"tiny-teacher-qwen2-v{TEACHER_VERSION}"
TINY_TEACHER = tiny.TINY_TEACHER

# Wider than the tiny model (128), with 3 layers instead of 4: another architecture on the same tokenizer.
# head_dim = 192 / 6 = 32, as vLLM's CPU attention needs (should the teacher ever be served).
TEACHER_SHAPE = dict(
    hidden_size=192,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    intermediate_size=512,
    max_position_embeddings=tiny.MODEL_SHAPE["max_position_embeddings"],
)
# The task it learns: the tiny task of recipe=grpo_tiny / opd_tiny (operands up to 9, held-out questions),
# every demonstration right. Its test split is theirs: the teacher never sees a held-out question.
TEACHER_TASK = tiny_task.TinyTaskConfig(
    num_train=4000, num_test=200, max_operand=9, correct_fraction=1.0, held_out="questions"
)
# 240 x 32 when written: 0.975 greedy accuracy on the held-out questions (120 x 64, the same compute: 0.705;
# 200 x 32: 0.825; 300 x 32: 1.0), the student's grpo_tiny warm-start about 0.4.
TEACHER_STEPS = 240
TEACHER_BATCH = 32
TEACHER_LR = 3e-3
TEACHER_WARMUP = 10
SEED = 0


def build_tiny_teacher(out_dir: Path) -> None:
    """Trains the teacher and writes it with the tiny model's tokenizer to ``out_dir`` (uncached; use
    :func:`ensure_tiny_teacher`)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from spmdrl.algos.losses import masked_cross_entropy
    from spmdrl.data.sft import SFTDataset, collate_sft

    tokenizer = tiny.build_tokenizer()
    pad_id, eos_id = tokenizer.convert_tokens_to_ids([tiny.PAD_TOKEN, tiny.EOS_TOKEN])
    ids = dict(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id, dtype="float32")
    config = Qwen2Config(vocab_size=len(tokenizer), **TEACHER_SHAPE, tie_word_embeddings=True, **ids)
    config.architectures = [Qwen2ForCausalLM.__name__]
    task_dir = out_dir / "task"  # the demonstrations, read as any SFT data; removed before the rename
    files = tiny_task.write_split_files(task_dir, TEACHER_TASK)
    data = SFTDataset(
        [files["train"]],
        tokenizer,
        prompt_key="prompt",
        response_key="response",
        max_prompt_length=64,
        max_response_length=24,
        overlong="error",
    )
    order = list(range(len(data)))
    rng = random.Random(SEED)
    batches_per_epoch = len(order) // TEACHER_BATCH
    # A private RNG stream: the same weights every build, and the caller's torch RNG is left untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = Qwen2ForCausalLM(config).to(torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=TEACHER_LR, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine)
        for step in range(TEACHER_STEPS):
            if step % batches_per_epoch == 0:
                rng.shuffle(order)
            first = (step % batches_per_epoch) * TEACHER_BATCH
            batch = collate_sft([data[i] for i in order[first : first + TEACHER_BATCH]], pad_id)
            logits = model(
                input_ids=batch.input_ids_BT,
                attention_mask=batch.attention_mask_BT,
                position_ids=batch.position_ids_BT,
            ).logits
            targets = float(batch.loss_mask_BT[:, 1:].sum())
            loss, _ = masked_cross_entropy(
                logits, batch.input_ids_BT, batch.loss_mask_BT, num_global_tokens=targets
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            if step % 20 == 0 or step == TEACHER_STEPS - 1:
                log.info("tiny teacher: step %d/%d, loss %.4f", step + 1, TEACHER_STEPS, loss.item())
    shutil.rmtree(task_dir)
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def _warmup_cosine(step: int) -> float:
    """The learning rate's factor: linear warm-up, then cosine down to a tenth."""
    warm = min(1.0, (step + 1) / TEACHER_WARMUP)
    return warm * (0.1 + 0.45 * (1 + math.cos(math.pi * min(step, TEACHER_STEPS) / TEACHER_STEPS)))


def ensure_tiny_teacher(cache_dir: Path) -> Path:
    """The built-in teacher's directory under ``cache_dir``, trained on first use. Safe to call from every rank."""
    from spmdrl.models.build_once import build_once

    target = Path(cache_dir).expanduser() / TEACHER_DIRNAME
    return build_once(target, build_tiny_teacher, tiny.TINY_MODEL_FILES, f"built-in {TINY_TEACHER} model")
