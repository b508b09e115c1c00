"""A verifiers 0.3.x MultiTurnEnv: guess a secret number, told "higher" or "lower" after each guess.

The game ends when a guess is right (a stop condition) or after max_turns guesses; the rubric rewards the
last guess being right and reads the guesses the environment kept in its state. Arguments that make it
fail on purpose, for the tests: ``raise_on_turn=k`` (env_response raises at the k-th answer; with
``raise_secrets``, only in the games of those secrets), ``hang_on_turn=k`` (it sleeps there),
``rewrite_on_turn=k`` (it rewrites the first user message there).
"""

import asyncio
import random

import verifiers as vf
from datasets import Dataset

PROMPT = "Guess my number from 1 to {high}. Write your guess after ####."


def _guess(text: str) -> int | None:
    tail = text.rsplit("####", 1)[-1].strip().split()
    return int(tail[0]) if "####" in text and tail and tail[0].isdigit() else None


class GuessEnv(vf.MultiTurnEnv):
    def __init__(self, raise_on_turn: int = 0, hang_on_turn: int = 0, rewrite_on_turn: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.raise_on_turn, self.hang_on_turn, self.rewrite_on_turn = (
            raise_on_turn,
            hang_on_turn,
            rewrite_on_turn,
        )

    async def setup_state(self, state: vf.State) -> vf.State:
        state["guesses"] = []
        return state

    @vf.stop
    async def guessed(self, state: vf.State) -> bool:
        return bool(state["guesses"]) and state["guesses"][-1] == int(state["answer"])

    async def add_trajectory_step(self, state: vf.State, trajectory_step) -> None:
        await super().add_trajectory_step(state, trajectory_step)
        content = trajectory_step["completion"][-1].content or ""
        state["guesses"].append(_guess(content))

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
        turn = len(state["trajectory"])
        if turn == self.raise_on_turn and (
            not self.raise_secrets or int(state["answer"]) in self.raise_secrets
        ):
            raise RuntimeError("the game server went away")
        if turn == self.hang_on_turn:
            await asyncio.sleep(3600)
        if turn == self.rewrite_on_turn:
            messages[0] = vf.UserMessage(content="A different game.")
        guess, secret = state["guesses"][-1], int(state["answer"])
        if guess is None:
            return [vf.UserMessage(content="Write a number after ####.")]
        return [vf.UserMessage(content="Higher." if guess < secret else "Lower.")]


def load_environment(
    num_train: int = 64,
    num_eval: int = 8,
    high: int = 9,
    max_turns: int = 3,
    raise_on_turn: int = 0,
    raise_secrets: tuple[int, ...] = (),
    hang_on_turn: int = 0,
    rewrite_on_turn: int = 0,
) -> vf.Environment:
    rng = random.Random(0)
    rows = [
        {
            "prompt": [{"role": "user", "content": PROMPT.format(high=high)}],
            "answer": str(rng.randint(1, high)),
        }
        for _ in range(num_train + num_eval)
    ]

    def won(completion, answer) -> float:
        said = [m for m in completion if m["role"] == "assistant"]
        return 1.0 if said and _guess(said[-1]["content"] or "") == int(answer) else 0.0

    def guesses_made(state) -> float:
        return float(sum(g is not None for g in state["guesses"]))

    rubric = vf.Rubric(funcs=[won, guesses_made], weights=[1.0, 0.0])
    return GuessEnv(
        raise_on_turn=raise_on_turn,
        raise_secrets=raise_secrets,
        hang_on_turn=hang_on_turn,
        rewrite_on_turn=rewrite_on_turn,
        max_turns=max_turns,
        dataset=Dataset.from_list(rows[:num_train]),
        eval_dataset=Dataset.from_list(rows[num_train:]),
        rubric=rubric,
    )
