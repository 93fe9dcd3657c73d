"""`mmpipe <command> [Hydra flags] [key=value ...]`: every command is a Hydra app.

`main` takes the command off the command line and hands the rest to `hydra.main`, so each
command has Hydra's whole surface: `--help` (the command's keys and examples, the config
groups), `--cfg job|hydra|all`, `--package`, `--resolve`, `--info`, `--hydra-help`,
`-m/--multirun` sweeps (jobs one after another, each in its own directory), `--config-dir DIR`
(a user config folder that wins over the shipped one), the override grammar (`+key=`,
`++key=`, `~key`), and `.hydra/` in every run directory. The configs ship inside the package
(top-level conf/, the package mmpipe.conf, found as pkg://mmpipe.conf) and are composed onto the structured schema of
mmpipe/schema.py. With schema.py and overrides.py this is the only code that sees Hydra: the
composed config becomes a validated RunConfig here, before any directory or process is made.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from mmpipe.commands import (
    COMMANDS,
    Command,
    Invocation,
    checkpoint_command,
    demo_command,
    eval_command,
    export_command,
    usage,
)
from mmpipe.config import RunConfig, run_config_from_dict
from mmpipe.overrides import check_overrides, explain
from mmpipe.paths import CONF_DIR, shell_word

_active: Command | None = None
"""The command of the Hydra app now running (read by its help text and CheckBeforeRun)."""


class ConfigRejected(BaseException):
    """Carries a config error out of CheckBeforeRun: Hydra turns an Exception raised in a
    callback into a warning and runs the job anyway; a BaseException passes through."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


class CommandFailed(Exception):
    """A command returned a non-zero exit status (it has said why)."""

    def __init__(self, code: int):
        super().__init__(f"exit status {code}")
        self.code = code


MACHINE_COMMANDS = ("train", "plan", "bench", "profile")
"""The commands whose start-up says what was fitted to the machine (layout, hardware=auto)."""


def _name_the_accelerator() -> None:
    """On a machine with no GPU, tell DeepSpeed it runs on the CPU (DS_ACCELERATOR=cpu, unless
    the user set it), so that the commands that import it here (checkpoint info, export, eval)
    print no `Setting accelerator to CPU ... we were unable to detect it` warning. The GPUs are
    counted through the driver (mmpipe.machine): torch is not imported for it."""
    if "DS_ACCELERATOR" not in os.environ:
        from mmpipe.machine import detect

        if not detect().gpus:
            os.environ["DS_ACCELERATOR"] = "cpu"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The deepspeed launcher inserts --local_rank=N; ranks come from the environment instead.
    argv = [a for a in argv if not a.startswith(("--local_rank", "--local-rank"))]
    if not argv or argv[0] in ("-h", "--help", "help"):
        return _run(None, ["--help"])
    if argv[0] == "--version":
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"mmpipe {version('mmpipe')}")
        except PackageNotFoundError:
            print("mmpipe (not installed: running from a source folder)")
        return 0
    name, args = argv[0], argv[1:]
    _name_the_accelerator()
    if name == "export":
        return export_command(args)
    if name == "eval":
        return eval_command(args)
    if name == "checkpoint":
        return checkpoint_command(args)
    if name == "demo-checkpoints":
        return demo_command(args)
    if name not in COMMANDS:
        hint = " (a command comes first: mmpipe train --cfg job)" if name.startswith("-") else ""
        print(f"mmpipe: {shell_word(name)} is not a command{hint}; use one of {', '.join(COMMANDS)}\n"
              f"{usage()}", file=sys.stderr)
        return 2
    overrides: list[str] = []
    try:
        if name == "report":
            args = _run_dirs_as_override(args)
        parsed = _parse(f"mmpipe {name}", args)
        overrides = parsed.overrides
        check_overrides(overrides, command=name)
        runs = not (parsed.help or parsed.hydra_help or parsed.cfg or parsed.info or parsed.shell_completion)
        if runs and name in ("train", "bench") and os.environ.get("RANK", "0") == "0":
            print(f"mmpipe {name}: composing and checking the config", flush=True)
        return _run(COMMANDS[name], args)
    except CommandFailed as failed:
        return failed.code
    except KeyboardInterrupt:
        print(f"mmpipe {name}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as done:  # argparse has said what is wrong with a flag
        return done.code if isinstance(done.code, int) else 2
    except Exception as err:  # noqa: BLE001 - one clean line for config and input errors
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        if isinstance(err, (HydraException, OmegaConfBaseException)):
            msg = explain(err, overrides, command=name)
        elif isinstance(err, (ValueError, FileNotFoundError)):
            msg = " ".join(str(err).split())
        else:
            raise
        print(f"mmpipe {name}: error: {msg}", file=sys.stderr)
        return 2


def load(overrides: list[str], *, job: str = "mmpipe") -> RunConfig:
    """The RunConfig `mmpipe <command> OVERRIDES` would run with (Hydra's compose API; for tests
    and notebooks; `hydra.searchpath=[DIR]` stands for `--config-dir DIR`). Raises what the
    command line reports."""
    from hydra import compose, initialize
    from hydra.core.global_hydra import GlobalHydra

    register()
    GlobalHydra.instance().clear()
    with initialize(config_path=None, version_base="1.3", job_name=job):
        cfg = compose(config_name=PRIMARY, overrides=[_packaged_last(o) for o in overrides], return_hydra_config=True)
    return run_config(cfg, run_dir=str(cfg.hydra.run.dir), overrides=overrides,
                      sources=cfg.hydra.runtime.config_sources)


def run_config(cfg: Any, *, run_dir: str, overrides: Sequence[str] = (), sources: Sequence[Any] = ()) -> RunConfig:
    """A composed config (with or without its `hydra` node) as a validated RunConfig, what it
    leaves to the machine fitted to the one torch sees (config.fit_machine). `overrides`: the
    command line's, for the hardware keys set on top of hardware=auto; `sources`: Hydra's config
    sources, so that hardware=auto finds a preset in the user's --config-dir first, as
    `hardware=NAME` would."""
    from omegaconf import OmegaConf

    from mmpipe.config import AUTO_HARDWARE

    task = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    plain = OmegaConf.to_container(task, resolve=True, throw_on_missing=False)
    parallel = plain.get("parallel") or {}
    asks = (plain.get("hardware") or {}).get("name") == AUTO_HARDWARE or None in (parallel.get("pp"),
                                                                                  parallel.get("dp"))
    machine = None
    if asks:  # torch is imported only when a default is left to the machine
        from mmpipe.machine import detect

        machine = detect()
    keys = [o.lstrip("+~").partition("=")[0] for o in overrides]
    hardware_set = [k.removeprefix("hardware.") for k in keys if k.startswith("hardware.")]
    folders = [Path(src.path) / "hardware" for src in sources if src.schema == "file"]
    return run_config_from_dict(plain, run_dir=run_dir, machine=machine,  # type: ignore[arg-type]
                                hardware_set=hardware_set, presets=(*folders, CONF_DIR / "hardware"))


class CheckBeforeRun(Callback):
    """Validates the config of the run, or of every job of a sweep, before Hydra makes a
    directory, so a mistake is one line and nothing is left behind (conf/config.yaml names it)."""

    def on_run_start(self, config: Any, **_: Any) -> None:
        from mmpipe.runtime.preflight import check_run_dir

        try:
            _check(config, run_dir=str(config.hydra.run.dir))
            check_run_dir(str(config.hydra.run.dir))  # Hydra makes it next: say so if it cannot
        except Exception as err:  # noqa: BLE001 - main() decides what is a user error
            raise ConfigRejected(err) from err

    def on_multirun_start(self, config: Any, **_: Any) -> None:
        from hydra.core.global_hydra import GlobalHydra

        from mmpipe.runtime.preflight import check_run_dir

        try:
            jobs = _sweep_jobs(config)
        except Exception as err:  # noqa: BLE001 - main() decides what is a user error
            raise ConfigRejected(err) from err
        if jobs is None:  # another sweeper plans the jobs: each is checked when it starts
            return
        loader = GlobalHydra.instance().config_loader()
        for job in jobs:
            try:
                _check(loader.load_sweep_config(config, list(job)), run_dir=str(config.hydra.sweep.dir))
            except (ValueError, FileNotFoundError) as err:
                raise ConfigRejected(ValueError(f"job {' '.join(map(shell_word, job))}: {err}")) from err
            except Exception as err:  # noqa: BLE001
                raise ConfigRejected(err) from err
        try:
            check_run_dir(str(config.hydra.sweep.dir))
        except Exception as err:  # noqa: BLE001
            raise ConfigRejected(err) from err
        name = _active.name if _active else "mmpipe"
        print(f"mmpipe {name}: {len(jobs)} jobs, one after another, each in its own directory under "
              f"{config.hydra.sweep.dir}", flush=True)


def _check(config: Any, *, run_dir: str) -> None:
    hc = config.hydra if "hydra" in config else None
    rc = run_config(config, run_dir=run_dir, overrides=list(hc.overrides.task) if hc else (),
                    sources=hc.runtime.config_sources if hc else ())
    if _active is not None and _active.check is not None:
        _active.check(rc)


def _sweep_jobs(config: Any) -> list[list[str]] | None:
    """The override list of every job of a basic sweep (Hydra's BasicSweeper: the cartesian
    product of the comma-separated values), or None under another sweeper."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    if not str(OmegaConf.select(config, "hydra.sweeper._target_", default="")).endswith("BasicSweeper"):
        return None
    params = OmegaConf.select(config, "hydra.sweeper.params", default=None) or {}
    lines = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
    choices: dict[str, list[str]] = {}
    for o in OverridesParser.create().parse_overrides(lines):
        key = o.get_key_element()
        choices[key] = ([f"{key}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
                        else [f"{key}={o.get_value_element_as_str()}"])
    return [list(job) for job in itertools.product(*choices.values())]


def _run(command: Command | None, args: list[str]) -> int:
    """Run `mmpipe <command> ARGS` as a Hydra app; return the exit status."""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    global _active
    register()
    codes: list[int] = []

    def app(cfg: Any) -> None:
        if command is None:  # only `--help` runs without a command, and it runs no job
            return
        hc = HydraConfig.get()
        rc = run_config(cfg, run_dir=hc.runtime.output_dir, overrides=hc.overrides.task,
                        sources=hc.runtime.config_sources)
        if command.name in MACHINE_COMMANDS and os.environ.get("RANK", "0") == "0":
            for note in rc.machine_notes:  # what was fitted to this machine (config.fit_machine)
                print(f"mmpipe {command.name}: {note}", flush=True)
        inv = Invocation(overrides=tuple(hc.overrides.task), search_path=tuple(
            f"{s.schema}://{s.path}" for s in hc.runtime.config_sources
            if s.provider not in ("hydra", "schema") and f"{s.schema}://{s.path}" != PACKAGED))
        if hc.mode == RunMode.MULTIRUN:
            print(f"mmpipe {command.name}: job {hc.job.num}: {' '.join(map(shell_word, inv.overrides))}", flush=True)
        code = command.run(rc, inv)
        codes.append(code)
        if code == 130:  # interrupted: stop a sweep too
            raise KeyboardInterrupt
        if code and hc.mode == RunMode.MULTIRUN:
            print(f"mmpipe {command.name}: job {hc.job.num} failed (exit status {code}); the sweep goes on",
                  file=sys.stderr, flush=True)
        if code:
            raise CommandFailed(code)

    # Hydra gives a task function defined in a package a main config path (here pkg://mmpipe, the
    # package itself), searched before --config-dir; one it takes for a script's gets none. mmpipe
    # wants none: its configs come from the search path after the user's (see PRIMARY).
    app.__module__ = "__main__"
    hydra_app = hydra.main(version_base="1.3", config_path=None, config_name=PRIMARY)(app)
    name = f"mmpipe {command.name}" if command else "mmpipe"
    given = set(_parse(name, args).overrides)
    args = [_packaged_last(a) if a in given else a for a in args]
    saved = sys.argv, os.environ.get("HYDRA_FULL_ERROR")
    root = logging.getLogger()
    root_state = root.level, list(root.handlers)  # --info adds a handler to the root logger
    # Hydra prints its errors with a traceback hint and exits; with HYDRA_FULL_ERROR it raises
    # them, and main() says them in one line.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    sys.argv = [name, *args]  # what hydra.main reads (and names the program after)
    _active = command
    try:
        hydra_app()
    except ConfigRejected as rejected:
        raise rejected.error from None
    except SystemExit as done:  # --help, --hydra-help and argparse errors end this way
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        _active = None
        root.setLevel(root_state[0])
        root.handlers[:] = root_state[1]
        sys.argv = saved[0]
        if saved[1] is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = saved[1]
    return max(codes, default=0)


PACKAGED = "pkg://mmpipe.conf"
"""Where Hydra finds the shipped configs."""
PRIMARY = "mmpipe"
"""The primary config, in Hydra's ConfigStore: the shipped conf/config.yaml (or a user's config.yaml),
with the shipped configs on the search path. There is no main config path: the search path is
--config-dir, then hydra.searchpath, then the shipped configs, so a user's configs win over
mmpipe's (with a main path, Hydra would put the shipped ones first)."""


def _packaged_last(line: str) -> str:
    """An override as given, but a user's hydra.searchpath, which replaces the primary config's,
    keeps the shipped configs, after the user's folders."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    o = OverridesParser.create().parse_override(line)
    if o.key_or_group != "hydra.searchpath" or o.is_delete():
        return line
    paths = [*(o.value() or []), PACKAGED]
    return "hydra.searchpath=[" + ",".join("'" + p.replace("\\", "\\\\").replace("'", "\\'") + "'" for p in paths) + "]"


def _parse(name: str, args: list[str]) -> Any:
    """Hydra's own reading of the command line (the parser hydra.main uses), named after the command."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()
    parser.prog = name
    return parser.parse_args(args)


_VALUE_FLAGS = ("--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                "--config-dir", "-cd", "--experimental-rerun")


def _run_dirs_as_override(args: list[str]) -> list[str]:
    """`mmpipe report DIR [DIR ...]`: the words that are neither flags nor overrides become
    report.runs=[...] (Hydra-quoted), in their place."""
    dirs, out, after_flag = [], [], False
    for a in args:
        if after_flag or a.startswith("-") or "=" in a:
            out.append(a)
            after_flag = a in _VALUE_FLAGS
            continue
        if not dirs:
            out.append("")  # where the override goes
        dirs.append(a)
    if not dirs:
        return args
    quoted = ",".join("'" + d.replace("\\", "\\\\").replace("'", "\\'") + "'" for d in dirs)
    return [a if a != "" else f"report.runs=[{quoted}]" for a in out]


def register() -> None:
    """The schema and mmpipe's help in Hydra's ConfigStore, and the help's resolver (idempotent)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from mmpipe import schema
    from mmpipe.help import render_help

    schema.register()
    cs = ConfigStore.instance()
    cs.store(name=PRIMARY, node={"defaults": ["config", "_self_"], "hydra": {"searchpath": [PACKAGED]}})
    cs.store(group="hydra/help", name="mmpipe",
             node={"app_name": "mmpipe", "header": "", "footer": "", "template": "${mmpipe.help:}"})
    OmegaConf.register_new_resolver("mmpipe.help", lambda *, _root_: render_help(_active, _root_), replace=True)


if __name__ == "__main__":
    sys.exit(main())
