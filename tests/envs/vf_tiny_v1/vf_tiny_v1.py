"""A verifiers 0.4 taskset: spmdrl's tiny arithmetic task, scored by the task's @vf.reward methods."""

import asyncio

import verifiers.v1 as vf

from spmdrl.data.tiny_task import TinyTaskConfig, generate


class TinyData(vf.TaskData):
    answer: str


class TinyTaskConfig_(vf.TaskConfig):
    fail_every: int = 0
    hang_every: int = 0


def _reply_answer(trace: vf.Trace) -> str:
    text = trace.last_reply
    return text.rsplit("####", 1)[-1].strip() if "####" in text else ""


class TinyTask(vf.Task[TinyData, vf.State, TinyTaskConfig_]):
    @vf.reward(weight=1.0)
    async def correct_answer(self, task: TinyData, trace: vf.Trace) -> float:
        if self.config.fail_every and int(task.answer) % self.config.fail_every == 0:
            raise ValueError(f"cannot grade answer {task.answer}")
        if self.config.hang_every and int(task.answer) % self.config.hang_every == 0:
            await asyncio.sleep(3600)
        return 1.0 if _reply_answer(trace) == task.answer else 0.0

    @vf.metric
    async def has_answer(self, trace: vf.Trace) -> float:
        return 1.0 if _reply_answer(trace) else 0.0


class TinyTasksetConfig(vf.TasksetConfig):
    task: TinyTaskConfig_ = TinyTaskConfig_()
    num_tasks: int = 440
    max_operand: int = 9


class TinyTaskset(vf.Taskset[TinyTask, TinyTasksetConfig]):
    def load(self):
        train, _ = generate(
            TinyTaskConfig(num_train=self.config.num_tasks, num_test=1, max_operand=self.config.max_operand)
        )
        for row in train:
            data = TinyData(prompt=row["prompt"][0]["content"], answer=row["reward_model"]["ground_truth"])
            yield TinyTask(data, self.config.task)


__all__ = ["TinyTaskset"]
