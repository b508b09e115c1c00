"""The ``env`` section: an environment package as the job's prompts and reward (docs/environments.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spmdrl.config_section import mapping, register_config_section
from spmdrl.errors import ConfigError

# The kinds of env.source: "<kind>:<name>".
KINDS = ("verifiers",)


@register_config_section("env")
@dataclass
class EnvConfig:
    """``env.source=verifiers:<name>``: the installed verifiers environment ``<name>`` gives the prompts
    (data.train_files / data.val_files are not read) and scores them (reward.fn is not used)."""

    # "" (none: data.* and reward.fn as usual) or "verifiers:<name>" (an installed environment package).
    source: str = ""
    # Keyword arguments of a 0.3.x environment's load_environment(**args), or the fields of a 0.4 taskset's
    # config (verifiers.v1 TasksetConfig), as one mapping: env.args={num_examples: 100} (free-form: the
    # environment checks its arguments when it loads).
    args: Any = mapping()
    # Training prompts: the first num_train of the environment's dataset (0: all of them).
    num_train: int = 0
    # Validation prompts: the first num_val of its eval dataset (0: all); an environment without one gives
    # the last num_val rows of its dataset instead, held out of training (0 there: no validation).
    num_val: int = 64

    def __post_init__(self) -> None:
        if self.args is None:
            self.args = {}
        if not isinstance(self.args, dict):
            raise ConfigError(
                f"env.args must be a mapping of the environment's arguments, e.g. env.args={{num_examples: "
                f"100}}; got {self.args!r}"
            )
        if self.num_train < 0 or self.num_val < 0:
            raise ConfigError(
                f"env.num_train and env.num_val must be >= 0 (0: all), got {self.num_train}, {self.num_val}"
            )
        if self.source:
            self.kind_and_name()

    @property
    def enabled(self) -> bool:
        return bool(self.source)

    def kind_and_name(self) -> tuple[str, str]:
        """("verifiers", "<name>") of env.source; ConfigError naming the form if it has none."""
        kind, sep, name = self.source.partition(":")
        if not sep or kind not in KINDS or not name.strip():
            raise ConfigError(
                f"env.source={self.source!r} is not <kind>:<name> with a kind of {', '.join(KINDS)}; "
                "e.g. env.source=verifiers:my_env (an installed verifiers environment package)"
            )
        return kind, name.strip()
