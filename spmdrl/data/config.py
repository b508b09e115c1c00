"""The ``data`` section: the prompt (and SFT response) files and their length limits."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from spmdrl.config_section import choice
from spmdrl.errors import ConfigError


@dataclass
class ColumnMap:
    """data.columns: for each column spmdrl reads, the source's column that holds it ("": its own name).
    A dataclass, not a dict, so that ``data.columns.prompt=question`` and ``data.columns={prompt: question}``
    both work and a misspelled column gets the valid ones."""

    prompt: str = ""
    response: str = ""  # SFT
    # A column of plain answers, read as verl's reward_model struct ({ground_truth: <value>}).
    ground_truth: str = ""
    reward_model: str = ""
    data_source: str = ""
    extra_info: str = ""

    def mapping(self) -> dict[str, str]:
        """spmdrl's column -> the source's, for the columns that are mapped."""
        return {ours: theirs for ours, theirs in asdict(self).items() if theirs}


@dataclass
class DataConfig:
    # Each entry: a .parquet, .jsonl or .json file, a datasets directory (save_to_disk, or a folder of
    # data files), or a hub dataset id (org/name; "org/name:split", "org/name:config:split") - see
    # spmdrl.data.sources. "tiny:train" / "tiny:test" name the built-in task's generated splits,
    # "tiny_tools:train" / "tiny_tools:test" those of the built-in tool task (their settings: the
    # tiny_task / tools_task sections, spmdrl.data.tiny_task / spmdrl.data.tools_task).
    # "reasoning_gym:<task>:train" / ":test" those of a reasoning-gym task (spmdrl.data.reasoning_gym_task,
    # its settings: the reasoning_gym section).
    train_files: list[str] = field(default_factory=lambda: ["tiny:train"])
    val_files: list[str] = field(default_factory=lambda: ["tiny:test"])
    # A generated source as one setting: "reasoning_gym:<task>" sets train_files to its train split and
    # val_files to its test split (replacing theirs). "": train_files and val_files as given.
    source: str = ""
    # Directories and hub ids: the split of train_files and of val_files, and the dataset's config (TRL's
    # dataset_train_split, dataset_test_split, dataset_config). An entry's own ":split" wins.
    train_split: str = "train"
    val_split: str = "test"
    dataset_config: str = ""
    # spmdrl's column -> the source's, for every entry: {prompt: question} (ColumnMap).
    columns: ColumnMap = field(default_factory=ColumnMap)
    # The command that makes train_files / val_files when they come from a prep script; a missing file's
    # error names it.
    prepare: str = ""
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

    def __post_init__(self) -> None:
        if self.source:
            from spmdrl.data.reasoning_gym_task import source_files

            self.train_files, self.val_files = source_files(self.source)

    def check(self) -> None:
        for key, value in {
            "data.max_prompt_length": self.max_prompt_length,
            "data.max_response_length": self.max_response_length,
        }.items():
            if value <= 0:
                raise ConfigError(f"{key} must be > 0, got {value}")
        self._check_columns()

    def _check_columns(self) -> None:
        mapped = self.columns.mapping()
        for ours, key, value in (
            ("prompt", "data.prompt_key", self.prompt_key),
            ("response", "data.response_key", self.response_key),
        ):
            if ours in mapped and value != ours:
                raise ConfigError(
                    f"data.columns.{ours} and {key}={value} both name the {ours} column; set one of them"
                )
        if {"ground_truth", "reward_model"} <= set(mapped):
            raise ConfigError(
                "data.columns.ground_truth and data.columns.reward_model both give the reward's ground truth; "
                "set one of them (ground_truth: a column of plain answers; reward_model: verl's struct)"
            )
