"""``torchrun --nproc_per_node=N -m spmdrl.train recipe=<name or path/to/recipe.yaml> [key=value ...]``

Every rank runs this same program. It composes the typed config (configs/config.yaml, the selected
recipe YAML, then the command-line overrides), imports the recipe the config's ``entry`` names (a shipped
recipe, spmdrl.recipes.<entry>, or a Python file: spmdrl.config_loader.import_entry) and runs its
``main(cfg)``. Any rank's failure ends the whole job. ``--help`` lists the recipes; ``--cfg job`` prints
the composed config and exits.

Module-level imports stay light (no torch), so that --help answers at once.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from spmdrl.config import ConfigError

if TYPE_CHECKING:
    from spmdrl.config import Config

EXIT_CONFIG_ERROR = 2


# A segfault in an extension (a kernel, the engine) would otherwise show only "exit -11": print every
# thread's Python stack on SIGSEGV / SIGFPE / SIGABRT / SIGBUS / SIGILL first.
faulthandler.enable(all_threads=True)


# How long a rank other than 0 waits before exiting on a config error (see exit_config_error).
_NONZERO_RANK_EXIT_DELAY_S = 5.0

_USAGE = """\
usage: torchrun --nproc_per_node=N -m spmdrl.train recipe=<name | path/to/recipe.yaml> [key=value ...]
       python -m spmdrl.train recipe=<...> [key=value ...] --cfg job    print the composed config, exit
       python -m spmdrl.train --help                                     this text

Shipped recipes (recipe=<name>: configs/recipe/<name>.yaml):
{recipes}

Overrides (Hydra's grammar; every key, its type and default: spmdrl/config.py):
  key=value             e.g. optim.lr=1e-5 trainer.total_steps=100 rollout.n=8
  key=[a,b]             a list, e.g. data.train_files=[train.parquet]
  recipe=path/to/x.yaml a recipe YAML anywhere (absolute, or relative to the working directory); it may
                        start from a shipped recipe and set only what differs:
                            defaults: [grpo_tiny, _self_]
                            entry: my_grpo.py          # a Python file, relative to the YAML (or a shipped
                                                       # recipe by name: entry: grpo)
                            my_section:                # settings the recipe registered
                              my_coef: 0.1             # (@register_config_section("my_section"))
  my_section.key=value  a recipe's own settings, checked against its dataclass like any other key
  --cfg job             print the composed, validated config (what the run saves as config.yaml) and exit

A misspelled key or a wrong type fails at once, naming the valid keys. docs/configuration.md has the
details; docs/forking.md walks through forking a recipe."""


def usage() -> str:
    from spmdrl.config_loader import recipe_summaries

    summaries = recipe_summaries()
    width = max(map(len, summaries), default=0)
    return _USAGE.format(recipes="\n".join(f"  {n:<{width}}  {s}" for n, s in summaries.items()))


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


def parse_config(argv: list[str], *, import_entry: bool = True) -> Config:
    """The config, or a clean exit 2 with the message (printed once, not once per rank).

    ``--help`` prints :func:`usage` and exits 0; ``--cfg job`` prints the config and exits 0."""
    from spmdrl.config_loader import load_config, to_yaml

    if "--help" in argv or "-h" in argv:
        print(usage())
        sys.exit(0)
    argv, print_cfg = _pop_cfg_flag(argv)
    try:
        cfg = load_config(argv, import_entry_module=import_entry)
    except ConfigError as e:
        exit_config_error(str(e))
    if print_cfg:
        if os.environ.get("RANK", "0") == "0":
            print(to_yaml(cfg), end="")
        sys.exit(0)
    return cfg


def _pop_cfg_flag(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` without Hydra's ``--cfg job`` (or ``--cfg=job``), and whether it was there."""
    rest, found, i = [], False, 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--cfg", "-c") or arg.startswith("--cfg="):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            if value != "job":
                exit_config_error(f"{arg} {value}: spmdrl prints only the job's config: --cfg job")
            found = True
            i += 1 if "=" in arg else 2
            continue
        rest.append(arg)
        i += 1
    return rest, found


def run_recipe(recipe_main: Callable[[Config], None], argv: list[str] | None = None) -> None:
    """Parses the command line and runs ``recipe_main(cfg)``; what a recipe file's ``__main__`` calls
    (``torchrun my_grpo.py recipe=...``). The recipe is the running script, so ``entry`` is not imported."""
    from spmdrl.distributed.failure import run_or_die

    cfg = parse_config(sys.argv[1:] if argv is None else argv, import_entry=False)
    run_or_die(lambda: _run(recipe_main, cfg))


def _run(recipe_main: Callable[[Config], None], cfg: Config) -> None:
    import torch.distributed as dist

    recipe_main(cfg)
    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    from spmdrl.config_loader import import_entry
    from spmdrl.distributed.failure import run_or_die

    cfg = parse_config(sys.argv[1:] if argv is None else argv)
    try:
        recipe = import_entry(cfg.entry)  # load_config imported it already: this returns the same module
    except ConfigError as e:
        exit_config_error(str(e))
    run_or_die(lambda: _run(recipe.main, cfg))


if __name__ == "__main__":
    main()
