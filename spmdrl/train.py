"""``torchrun --nproc_per_node=N -m spmdrl.train recipe=<name> [key=value ...]``

Every rank runs this same program. It composes the typed config (configs/config.yaml, the
selected configs/recipe/<name>.yaml, then the command-line overrides), and runs the recipe named
by the config's ``entry`` (spmdrl.recipes.<entry>.main). Any rank's failure ends the whole job.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import sys
import time
from collections.abc import Callable
from typing import NoReturn

import torch.distributed as dist

from spmdrl.config import Config, ConfigError
from spmdrl.config_loader import load_config
from spmdrl.distributed.failure import run_or_die

EXIT_CONFIG_ERROR = 2


# A segfault in an extension (a kernel, the engine) would otherwise show only "exit -11": print every
# thread's Python stack on SIGSEGV / SIGFPE / SIGABRT / SIGBUS / SIGILL first.
faulthandler.enable(all_threads=True)


# How long a rank other than 0 waits before exiting on a config error (see exit_config_error).
_NONZERO_RANK_EXIT_DELAY_S = 5.0


def exit_config_error(message: str) -> NoReturn:
    """Print ``message`` once for the whole job and exit 2.

    Every rank reads the same config and fails the same way, so rank 0 alone prints. The others wait
    before exiting: torchrun ends the job as soon as one rank exits, and a rank 1 that exited first could
    get rank 0 killed before it printed (the cause was lost, intermittently). Rank 0 exits during that
    wait, which ends the job; a rank still alive after it (its cause was local to it) prints the message.
    """
    if os.environ.get("RANK", "0") != "0":
        time.sleep(_NONZERO_RANK_EXIT_DELAY_S)
    sys.stderr.write(f"spmdrl: config error: {message}\n")
    sys.stderr.flush()
    sys.exit(EXIT_CONFIG_ERROR)


def parse_config(argv: list[str]) -> Config:
    """The config, or a clean exit 2 with the message (printed once, not once per rank)."""
    try:
        return load_config(argv)
    except ConfigError as e:
        exit_config_error(str(e))


def run_recipe(recipe_main: Callable[[Config], None], argv: list[str] | None = None) -> None:
    """Parses the command line and runs ``recipe_main(cfg)``; what a forked recipe's ``__main__`` calls."""
    cfg = parse_config(sys.argv[1:] if argv is None else argv)
    run_or_die(lambda: _run(recipe_main, cfg))


def _run(recipe_main: Callable[[Config], None], cfg: Config) -> None:
    recipe_main(cfg)
    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(sys.argv[1:] if argv is None else argv)
    try:
        recipe = importlib.import_module(f"spmdrl.recipes.{cfg.entry}")
    except ModuleNotFoundError as e:
        exit_config_error(f"entry={cfg.entry!r}: no recipe module spmdrl.recipes.{cfg.entry} ({e})")
    run_or_die(lambda: _run(recipe.main, cfg))


if __name__ == "__main__":
    main()
