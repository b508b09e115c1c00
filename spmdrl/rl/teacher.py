"""On-policy distillation's teacher (teacher.*): a frozen model on the actor's ranks, like the reference, or
on ranks of its own (parallel.teacher_ranks, spmdrl/distributed/placement.py), that scores the tokens the
actor sampled (spmdrl/algos/distill.py turns its logprobs into the actor's
training signal).

Its architecture may differ from the actor's (a larger model, another family): it reads the actor's rows
token by token, so what must match is the tokenizer. :func:`check_same_tokenizer` refuses one that differs
(vocabulary, special tokens, the ids of a probe text) at load, before the warm-start and the models.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from spmdrl.algos.config import TeacherConfig
from spmdrl.distributed.placement import Meshes
from spmdrl.errors import ConfigError
from spmdrl.models.build import build_fsdp_model, model_spec, resolve_dtype
from spmdrl.models.causal_attention import use_causal_sdpa
from spmdrl.models.config import ModelConfig
from spmdrl.models.varlen import apply_packed_attention
from spmdrl.trainer_config import TrainerConfig

log = logging.getLogger("spmdrl")

# Tokenized by both tokenizers, which must give the same ids: words, digits, punctuation, a chat turn.
PROBE_TEXT = "Question: Ada has 12 apples and eats 7. How many are left? Answer: 12 - 7 = 5\n#### 5 (ok)."


@dataclass(frozen=True)
class Teacher:
    """The teacher's FSDP2 module on its ranks (frozen, eval mode) and where it came from."""

    model: nn.Module
    path: Path

    def describe(self) -> str:
        return f"teacher {self.path} ({type(self.model).__name__.removeprefix('FSDP')})"


def check_same_tokenizer(student: Any, teacher: Any, student_dir: Path, teacher_dir: Path) -> None:
    """The teacher scores the actor's token ids, so its tokenizer must be the actor's: the same vocabulary
    (size and every token's id), the same special tokens and the same ids for a probe text. A ConfigError
    naming the first difference, both directories and the fix."""

    def refuse(what: str) -> None:
        raise ConfigError(
            f"teacher.path: the teacher's tokenizer ({teacher_dir}) differs from the actor's ({student_dir}): "
            f"{what}. On-policy distillation scores the actor's token ids with the teacher, so both must "
            "share one tokenizer: choose a teacher of the actor's family and tokenizer (or distil into a "
            "student that shares the teacher's)"
        )

    if len(student) != len(teacher):
        refuse(f"{len(teacher)} tokens against the actor's {len(student)}")
    for name in ("eos_token", "pad_token", "bos_token"):
        s, t = getattr(student, f"{name}_id"), getattr(teacher, f"{name}_id")
        if s != t:
            refuse(
                f"{name} is id {t} ({getattr(teacher, name)!r}) against the actor's {s} ({getattr(student, name)!r})"
            )
    s_special, t_special = sorted(student.all_special_tokens), sorted(teacher.all_special_tokens)
    if s_special != t_special:
        refuse(f"special tokens {t_special} against the actor's {s_special}")
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if s_vocab != t_vocab:
        differs = sorted(k for k in s_vocab.keys() | t_vocab.keys() if s_vocab.get(k) != t_vocab.get(k))
        refuse(f"{len(differs)} tokens have other ids (first: {differs[:3]})")
    s_ids = student(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    t_ids = teacher(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    if s_ids != t_ids:
        refuse(
            f"the probe text {PROBE_TEXT!r} encodes to {t_ids[:12]}... against the actor's {s_ids[:12]}..."
        )


def build_teacher(
    teacher_cfg: TeacherConfig,
    model_cfg: ModelConfig,
    trainer: TrainerConfig,
    teacher_dir: Path,
    device: torch.device,
    meshes: Meshes,
) -> Teacher:
    """The teacher, FSDP2 on its ranks (the actor's, or the last parallel.teacher_ranks, which hold no
    actor; its shards stored in teacher.dtype, host memory under teacher.offload), attending as the actor's
    passes do (packed rows, causal SDPA)."""
    spec = model_spec(model_cfg, teacher_dir, device, train=False)
    dtype = spec.param_dtype if teacher_cfg.dtype == "auto" else resolve_dtype(teacher_cfg.dtype, device)
    spec = dataclasses.replace(spec, param_dtype=dtype, offload=teacher_cfg.offload, lora=None)
    model = build_fsdp_model(spec, meshes.fsdp("teacher"), device)
    use_causal_sdpa(model)
    apply_packed_attention(
        model, trainer.packed_attention, packed=trainer.pack_sequences, device=device, dtype=dtype
    )
    teacher = Teacher(model, teacher_dir)
    log.info("%s, %s", teacher.describe(), dtype)
    return teacher
