"""The asynchronous pipeline's queue in a checkpoint (spmdrl/rl/async_queue.py): written and read back as
saved, and the checkpoints a run cannot continue exactly refused with what differs or what is missing.
The checkpoint directories are written here by the module's own writers, as a save does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spmdrl.errors import ConfigError
from spmdrl.rl.async_queue import (
    PipelineShape,
    QueuedBatch,
    check_resume,
    load_queue,
    queue_file,
    queue_payload,
)

SHAPE = PipelineShape(max_staleness=1, rollout_ranks=2, global_batch_size=8, rollout_n=4)
SAMPLER = {
    "epoch": 0,
    "step_in_epoch": 3,
    "num_samples": 256,
    "global_batch_size": 8,
    "seed": 1,
    "shuffle": True,
}


def _checkpoint(root: Path, step: int, shape: PipelineShape | None, queues: int) -> Path:
    """A step-<step> directory as a save leaves it: meta.json (with the pipeline's entry unless ``shape``
    is None) and the first ``queues`` rollout ranks' files, each holding batch step+1 by version step-1."""
    path = root / f"step-{step}"
    path.mkdir(parents=True)
    meta = {"step": step, "world_size": 4, **(shape.as_meta() if shape else {})}
    (path / "meta.json").write_text(json.dumps(meta))
    for j in range(queues):
        rows = {"input_ids_BT": torch.arange(12).view(2, 6) + j, "version": torch.full((2, 1), step - 1)}
        payload = queue_payload(step, [QueuedBatch(step + 1, step - 1, rows)], SAMPLER, carried=("a", "b"))
        (path / queue_file(j)).parent.mkdir(exist_ok=True)
        torch.save(payload, path / queue_file(j))
    return path


def test_queue_reads_back_as_saved(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, 2, SHAPE, queues=2)
    check_resume(path, SHAPE)
    saved = load_queue(path, 1, 2, torch.device("cpu"))
    assert saved is not None and saved.sampler == SAMPLER and saved.carried == ["a", "b"]
    [batch] = saved.batches
    assert (batch.step, batch.version) == (3, 1)
    assert torch.equal(batch.rows["input_ids_BT"], torch.arange(12).view(2, 6) + 1)
    with pytest.raises(RuntimeError, match="the checkpoint is of step 3"):
        load_queue(path, 0, 3, torch.device("cpu"))


@pytest.mark.parametrize(
    ("now", "match"),
    [
        (PipelineShape(1, 1, 8, 4), "parallel.rollout_ranks=2, this run has parallel.rollout_ranks=1"),
        (
            PipelineShape(1, 2, 16, 4),
            "trainer.global_batch_size=8, this run has trainer.global_batch_size=16",
        ),
        (PipelineShape(1, 2, 8, 8), "rollout.n=4, this run has rollout.n=8"),
    ],
)
def test_another_pipeline_shape_is_refused(tmp_path: Path, now: PipelineShape, match: str) -> None:
    path = _checkpoint(tmp_path, 2, SHAPE, queues=2)
    with pytest.raises(ConfigError, match=match) as e:
        check_resume(path, now)
    assert "to resume it, or start a new run in another trainer.output_dir" in str(e.value)


def test_another_max_staleness_continues_the_queue(tmp_path: Path) -> None:
    """k may change on resume: the queue is sent first; what that does is said, for the log."""
    path = _checkpoint(tmp_path, 2, SHAPE, queues=2)
    assert check_resume(path, SHAPE) == ""
    smaller = check_resume(path, PipelineShape(0, 2, 8, 4))
    assert "saved with 1" in smaller and "older than 0 versions are dropped or generated again" in smaller
    larger = check_resume(path, PipelineShape(3, 2, 8, 4))
    assert "the next 2 are generated ahead by the checkpoint's version" in larger
    # ... but never without the queue the checkpoint's k says it holds, whatever the new k.
    with pytest.raises(ConfigError, match=r"lacks rollout/queue-1.pt"):
        check_resume(_checkpoint(tmp_path / "a", 2, SHAPE, queues=1), PipelineShape(0, 2, 8, 4))


def test_missing_queue_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"lacks rollout/queue-1.pt \(the batches"):
        check_resume(_checkpoint(tmp_path / "a", 2, SHAPE, queues=1), SHAPE)
    with pytest.raises(ConfigError, match="holds no queue of the batches generated ahead"):
        check_resume(_checkpoint(tmp_path / "b", 2, None, queues=0), SHAPE)


def test_k0_needs_no_queue(tmp_path: Path) -> None:
    """With k = 0 nothing is queued at a step's end: a checkpoint from before queues were saved resumes."""
    k0 = PipelineShape(0, 2, 8, 4)
    old = _checkpoint(tmp_path / "old", 2, None, queues=0)
    check_resume(old, k0)
    assert load_queue(old, 0, 2, torch.device("cpu")) is None
    check_resume(_checkpoint(tmp_path / "new", 2, k0, queues=0), k0)
