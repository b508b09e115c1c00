"""A forked recipe's files, as the config loader's and the command line's tests write them: an entry with a
section of its own and a main, and a YAML that starts from grpo_tiny."""

from __future__ import annotations

import textwrap
from pathlib import Path

# An entry file as small as a recipe can be: a section of its own and a main.
ENTRY = textwrap.dedent(
    """
    from dataclasses import dataclass

    from spmdrl.config import Config, choice, register_config_section


    @register_config_section("{section}")
    @dataclass
    class MySection:
        my_coef: float = 0.1
        mode: str = choice("fast", ("fast", "slow"))


    def main(cfg: Config) -> None:
        print("my_coef", cfg.section(MySection).my_coef)
    """
)


def fork_files(
    tmp_path: Path, yaml_text: str, *, section: str = "my_section", entry: str = "my_recipe.py"
) -> Path:
    (tmp_path / entry).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / entry).write_text(ENTRY.format(section=section))
    path = tmp_path / "my_grpo.yaml"
    path.write_text(textwrap.dedent(yaml_text))
    return path


FORK_YAML = """\
    defaults: [grpo_tiny, _self_]
    entry: my_recipe.py
    optim:
      lr: 0.5
    my_section:
      my_coef: 0.2
    """
