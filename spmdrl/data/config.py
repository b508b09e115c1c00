"""The ``data`` section: the prompt (and SFT response) files and their length limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from spmdrl.config_section import choice
from spmdrl.errors import ConfigError


@dataclass
class DataConfig:
    # Parquet files. "tiny:train" / "tiny:test" name the built-in task's generated splits,
    # "tiny_tools:train" / "tiny_tools:test" those of the built-in tool task (their settings: the
    # tiny_task / tools_task sections, spmdrl.data.tiny_task / spmdrl.data.tools_task).
    train_files: list[str] = field(default_factory=lambda: ["tiny:train"])
    val_files: list[str] = field(default_factory=lambda: ["tiny:test"])
    # Column holding the prompt: a list of chat messages (verl's schema) or a plain string.
    prompt_key: str = "prompt"
    # SFT only: column holding the response (a string, or a list of messages whose last is the answer).
    response_key: str = "response"
    max_prompt_length: int = 128
    max_response_length: int = 64
    # What to do with a sample longer than the limits: "filter" (drop it, count logged) or "error".
    overlong: str = choice("filter", ("filter", "error"))
    shuffle: bool = True
    seed: int = 0

    def check(self) -> None:
        for key, value in {
            "data.max_prompt_length": self.max_prompt_length,
            "data.max_response_length": self.max_response_length,
        }.items():
            if value <= 0:
                raise ConfigError(f"{key} must be > 0, got {value}")
