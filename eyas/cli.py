"""The `eyas` command line. Each subcommand is a thin typer wrapper owned by its recipe module; `eyas run` is
wired here, because its --dry-run prints what `eyas plan` prints and the plan recipe reads the run's stages."""

from __future__ import annotations

import sys

import typer

from eyas.recipes import bundle, evaluate, export, extract, plan, prepare, regenerate, run, train
from eyas.utils.io import EyasError, as_os_error, os_error_line
from eyas.utils.schema import cli_command

app = typer.Typer(
    name="eyas",
    help="Train draft models for speculative decoding (EAGLE-3, DFlash, P-EAGLE, DSpark): prepare -> extract -> "
         "train -> export -> eval, or all of them from one config with `eyas run CONFIG`. Targets are named as "
         "`smollm2` (the embedded default), a local folder, a GGUF file or a Hugging Face id.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)

app.command("prepare", help=prepare.__doc__)(prepare.cli)
app.command("regenerate", help=regenerate.__doc__)(regenerate.cli)
app.command("extract", help=extract.__doc__)(extract.cli)
app.command("train", help=train.__doc__)(train.cli)
app.command("export", help=export.__doc__)(export.cli)
app.command("eval", help=evaluate.__doc__)(evaluate.cli)


def _run(o: run.RunOptions) -> None:
    if o.dry_run:
        plan.show_plan(o.config, refuse=True)
    else:
        run.run_command(o)


app.command("run", help=run.__doc__)(cli_command(run.RunOptions, _run))
app.command("plan", help=plan.__doc__)(plan.cli)
app.command("bundle", help=bundle.__doc__)(bundle.cli)


def main() -> None:
    try:
        app()
    except EyasError as e:
        typer.secho(f"eyas: error: {e}", fg=typer.colors.RED, err=True)
        sys.exit(e.exit_code)
    except Exception as e:  # a disk that fills or turns read-only mid-run: one line, not a traceback
        err = as_os_error(e)
        if err is None:
            raise
        typer.secho(f"eyas: error: {os_error_line(err)}", fg=typer.colors.RED, err=True)
        sys.exit(EyasError.exit_code)


if __name__ == "__main__":
    main()
