"""``torchrun --nproc_per_node=N -m spmdrl.train recipe=<name or path/to/recipe.yaml> [key=value ...]``

Every rank runs this same program. It composes the typed config (configs/config.yaml, the selected
recipe YAML, then the command-line overrides), imports the recipe the config's ``entry`` names (a shipped
recipe, spmdrl.recipes.<entry>, or a Python file: spmdrl.config_loader.import_entry) and runs its
``main(cfg)``. Any rank's failure ends the whole job. ``--help`` lists the recipes; ``--cfg job`` prints
the composed config and exits (marking the data files and model that are missing, which it does not
need); ``--check`` checks the config and what it points at, and what an RL recipe's start checks
(spmdrl.preflight, spmdrl.preflight_start), without torchrun and exits 0 or 2 (spmdrl.config_exit says
what each exit code means). A launched rank runs the same checks first.

Module-level imports stay light (no torch), so that --help answers at once.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from spmdrl.config_exit import EXIT_CONFIG_ERROR, exit_config_error
from spmdrl.errors import ConfigError
from spmdrl.gc_heap import freeze_startup_heap, pause_collection, skip_exit_collection

if TYPE_CHECKING:
    from spmdrl.config import Config
    from spmdrl.rl.plan import Roles

__all__ = [
    "EXIT_CONFIG_ERROR",
    "exit_config_error",
    "main",
    "parse_config",
    "run_entry",
    "run_recipe",
    "usage",
]


# A segfault in an extension (a kernel, the engine) would otherwise show only "exit -11": print every
# thread's Python stack on SIGSEGV / SIGFPE / SIGABRT / SIGBUS / SIGILL first.
faulthandler.enable(all_threads=True)

_USAGE = """\
usage: torchrun --nproc_per_node=N -m spmdrl.train recipe=<name | path/to/recipe.yaml> [key=value ...]
       python -m spmdrl.train recipe=<...> [key=value ...] --cfg job    print the composed config, exit
       python -m spmdrl.train recipe=<...> [key=value ...] --check      check it before launching, exit
       python -m spmdrl.train --help                                     this text

Shipped recipes (recipe=<name>: configs/recipe/<name>.yaml):
{recipes}

Overrides (Hydra's grammar; each key, its type and default: the sections spmdrl/config.py lists):
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
  --cfg job             print the composed, validated config (what the run saves as config.yaml) and exit;
                        it prints before the data files or model exist, with what is missing as
                        "# missing: ..." comments after it
  --check               check the config (reward.fn's signature too), the data files (they exist, are
                        readable, have rows and the prompt column) and the model paths (a hub id: the hub
                        has it) in this one process (no torchrun, no model); for an RL recipe also the
                        reward's columns (reward_model.ground_truth), reward.fn for each data_source, the
                        installed vLLM's release and the plan on WORLD_SIZE where set; print one line
                        and exit: 0 fine, 2 a configuration or data error (run it before torchrun, which
                        exits 1 on any worker's failure and would retry a typo under --max-restarts)
  --world-size N        with --check or --cfg job: also plan an RL recipe's job on N ranks (placement,
                        per-rank batches, steps) and print it; a job that does not fit N ranks exits 2
                        (without it or WORLD_SIZE, --check's line says the plan was not checked)

A misspelled key or a wrong type fails at once, naming the valid keys. Exit codes: 0 done, 1 a failure while
running, 2 a configuration or data error (torchrun turns any failure into 1). docs/configuration.md has the
details; docs/forking.md walks through forking a recipe."""


def usage() -> str:
    from spmdrl.config_loader import recipe_summaries

    summaries = recipe_summaries()
    width = max(map(len, summaries), default=0)
    return _USAGE.format(recipes="\n".join(f"  {n:<{width}}  {s}" for n, s in summaries.items()))


def parse_config(argv: list[str], *, import_entry: bool = True) -> Config:
    """The config, its data files and model paths checked (spmdrl.preflight), or a clean exit 2 with the
    message (reported once for the job, not once per rank: spmdrl.config_exit).

    ``--help`` prints :func:`usage` and exits 0; ``--cfg job`` prints the config and exits 0; ``--check``
    prints one line and exits 0 when everything is fine. With ``--world-size N`` either also prints the RL
    recipe's plan on N ranks (spmdrl/rl/plan.py; under ``--cfg job`` as YAML comments)."""
    from spmdrl.config_loader import load_config, to_yaml
    from spmdrl.data.parquet import DataError
    from spmdrl.preflight import check_inputs, missing_inputs
    from spmdrl.preflight_start import launched_world_size

    if "--help" in argv or "-h" in argv:
        print(usage())
        sys.exit(0)
    check_only = "--check" in argv
    argv = [a for a in argv if a != "--check"]
    argv, print_cfg = _pop_cfg_flag(argv)
    argv, world_size = _pop_world_size(argv, check_only or print_cfg)
    try:
        cfg = load_config(argv, import_entry_module=import_entry)
    except (ConfigError, DataError) as e:
        exit_config_error(str(e), "data" if isinstance(e, DataError) else "config")
    missing: list[str] = []
    roles = _recipe_roles(cfg.entry, import_entry)
    try:
        # An RL recipe's start checks run here too, on the world size it runs on where known.
        checked = check_inputs(cfg, roles=roles, world=launched_world_size(world_size))
    except (ConfigError, DataError) as e:
        # --cfg job prints the config before its data and model exist, marking what is missing.
        missing = missing_inputs(cfg) if print_cfg and not check_only else []
        if not missing:
            exit_config_error(str(e), "data" if isinstance(e, DataError) else "config")
    if check_only:
        # Exits 2 if the job does not fit the ranks.
        plan = _plan_lines(cfg, roles, world_size) if world_size is not None else []
        # An RL recipe's names its data sources; an environment's rubric is the reward (env.source).
        if not any(c.startswith(("reward.fn=", "verifiers:")) for c in checked):
            checked.append(f"reward.fn={cfg.reward.fn}")
        print(f"spmdrl: config ok: recipe {cfg.name} (entry {cfg.entry}); {'; '.join(checked)}")
        print("\n".join(plan), end="\n" if plan else "")
        sys.exit(0)
    if print_cfg:
        plan = _plan_lines(cfg, roles, world_size) if world_size is not None and not missing else []
        if os.environ.get("RANK", "0") == "0":
            print(to_yaml(cfg), end="")
            print("".join(f"# {line.removeprefix('spmdrl: ')}\n" for line in plan), end="")
            print("".join(f"# missing: {line}\n" for line in missing), end="")
        sys.exit(0)
    return cfg


def _recipe_roles(entry: str, imported: bool) -> Roles | None:
    """The RL roles the recipe's module declares (its ``ROLES``; None: not an RL recipe). ``imported``:
    load_config imported the entry; otherwise the recipe is the running script (run_recipe)."""
    from spmdrl.config_loader import import_entry
    from spmdrl.rl.plan import Roles

    module = import_entry(entry) if imported else sys.modules.get("__main__")
    roles = getattr(module, "ROLES", None)
    return roles if isinstance(roles, Roles) else None


def _pop_option(argv: list[str], names: tuple[str, ...]) -> tuple[list[str], str | None]:
    """``argv`` without the option ``names`` (``--name value`` or ``--name=value``), and its value (None
    when absent; "" when it ends the line without one)."""
    rest, value, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in names:
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in arg else 2
            continue
        rest.append(arg)
        i += 1
    return rest, value


def _pop_world_size(argv: list[str], planned: bool) -> tuple[list[str], int | None]:
    """``argv`` without ``--world-size N`` (``--check``'s and ``--cfg job``'s: plan the job on N ranks),
    and N."""
    rest, value = _pop_option(argv, ("--world-size",))
    if value is None:
        return rest, None
    if not value.isdigit() or int(value) < 1:
        exit_config_error(f"--world-size {value!r}: give the number of ranks, e.g. --world-size 8")
    if not planned:
        exit_config_error(
            "--world-size goes with --check or --cfg job (a launched job's world size is torchrun's)"
        )
    return rest, int(value)


def _plan_lines(cfg: Config, roles: Roles | None, world_size: int) -> list[str]:
    """The RL recipe's plan on ``world_size`` ranks (``roles``: its module's ROLES), or why there is none; a
    clean exit 2 when the job does not fit them."""
    from spmdrl.models.tiny import default_cache_dir
    from spmdrl.rl.plan import describe_plan

    if roles is None:
        return [
            f"spmdrl: no RL plan: entry {cfg.entry} declares no ROLES (an RL recipe's roles, spmdrl.rl.plan)"
        ]
    try:
        return describe_plan(cfg, roles, world_size, default_cache_dir(cfg.model.cache_dir))
    except ConfigError as e:
        exit_config_error(f"on {world_size} ranks: {e}")


def _pop_cfg_flag(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` without Hydra's ``--cfg job`` (or ``--cfg=job``, ``-c job``), and whether it was there."""
    rest, value = _pop_option(argv, ("--cfg", "-c"))
    if value is not None and value != "job":
        exit_config_error(f"--cfg {value}: spmdrl prints only the job's config: --cfg job")
    return rest, value is not None


def run_recipe(recipe_main: Callable[[Config], None], argv: list[str] | None = None) -> None:
    """Parses the command line and runs ``recipe_main(cfg)``; what a recipe file's ``__main__`` calls
    (``torchrun my_grpo.py recipe=...``). The recipe is the running script, so ``entry`` is not imported."""
    from spmdrl.distributed.failure import run_or_die

    pause_collection()
    cfg = parse_config(sys.argv[1:] if argv is None else argv, import_entry=False)
    freeze_startup_heap()  # the recipe (the running script) and everything it imports are loaded
    run_or_die(lambda: _run(recipe_main, cfg))


def _run(recipe_main: Callable[[Config], None], cfg: Config) -> None:
    import torch.distributed as dist

    recipe_main(cfg)
    if dist.is_initialized():
        dist.destroy_process_group()
    skip_exit_collection()


def main(argv: list[str] | None = None) -> None:
    pause_collection()
    run_entry(parse_config(sys.argv[1:] if argv is None else argv))


def run_entry(cfg: Config) -> None:
    """Runs the recipe ``cfg.entry`` names: :func:`main` after its :func:`parse_config`, for a launcher
    that checks or installs something between the two (spmdrl.testing.latency_tail)."""
    from spmdrl.config_loader import import_entry
    from spmdrl.distributed.failure import run_or_die

    try:
        recipe = import_entry(cfg.entry)  # load_config imported it already: this returns the same module
    except ConfigError as e:
        exit_config_error(str(e))
    freeze_startup_heap()  # the recipe and everything it imports are loaded (spmdrl.gc_heap)
    run_or_die(lambda: _run(recipe.main, cfg))


if __name__ == "__main__":
    main()
