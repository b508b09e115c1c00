"""A verifiers 0.3.x environment: spmdrl's tiny arithmetic task as a vf.SingleTurnEnv scored by a vf.Rubric."""

import time

import verifiers as vf
from datasets import Dataset

from spmdrl.data.tiny_task import TinyTaskConfig, generate


def _rows(rows: list[dict]) -> Dataset:
    return Dataset.from_list(
        [{"prompt": r["prompt"], "answer": r["reward_model"]["ground_truth"]} for r in rows]
    )


class RetryEnv(vf.MultiTurnEnv):
    """A multi-turn variant: after each reply the user asks for the answer again (at most max_turns)."""

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
        return [vf.UserMessage(content="Check it and give the answer again after ####.")]


def load_environment(
    num_train: int = 400,
    num_eval: int = 40,
    max_operand: int = 9,
    eval_split: bool = True,
    fail_every: int = 0,
    hang_every: int = 0,
    raise_on_load: bool = False,
    multi_turn: bool = False,
) -> vf.Environment:
    if raise_on_load:
        raise RuntimeError("the task server is unreachable")
    train, test = generate(
        TinyTaskConfig(num_train=num_train, num_test=num_eval, max_operand=max_operand, held_out="questions")
    )
    parser = vf.Parser(extract_fn=lambda text: text.rsplit("####", 1)[-1].strip() if "####" in text else "")

    def correct_answer(completion, answer, parser) -> float:
        if fail_every and int(answer) % fail_every == 0:
            raise ValueError(f"cannot grade answer {answer}")
        if hang_every and int(answer) % hang_every == 0:
            time.sleep(3600)
        return 1.0 if parser.parse_answer(completion) == answer else 0.0

    async def has_answer(completion, parser) -> float:
        return 1.0 if parser.parse_answer(completion) else 0.0

    rubric = vf.Rubric(funcs=[correct_answer, has_answer], weights=[1.0, 0.1], parser=parser)
    datasets = {"dataset": _rows(train), "eval_dataset": _rows(test) if eval_split else None}
    if multi_turn:
        return RetryEnv(max_turns=2, **datasets, parser=parser, rubric=rubric)
    return vf.SingleTurnEnv(**datasets, parser=parser, rubric=rubric)
