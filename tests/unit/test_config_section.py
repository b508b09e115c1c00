"""What a config section is made of (spmdrl/config_section.py)."""

from __future__ import annotations

import dataclasses

from spmdrl.config import Config
from spmdrl.config_section import BUILT_IN_KEYS


def test_the_built_in_keys_are_the_configs_fields() -> None:
    """register_config_section refuses a built-in key by a list of its own (it sits below spmdrl.config)."""
    assert tuple(f.name for f in dataclasses.fields(Config)) == BUILT_IN_KEYS
