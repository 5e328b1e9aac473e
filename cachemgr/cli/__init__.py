"""The cachemgr command line: a flat click group. Commands parse, call the library, print.

Errors raised below this layer are CachemgrError subclasses; `main` turns each into one line on
stderr and the exit code of its class (an ambiguous key also lists its candidates). Nothing heavy
is imported at module level: `stats` on the embedded default must answer in well under 0.2 s,
and no inspection command may import torch.

Shell completion is click's: `cachemgr completion bash` prints the script to source.
"""

from __future__ import annotations

import errno
import importlib
import os
import sys
import warnings

import click

from cachemgr import __version__
from cachemgr.cli.common import App
from cachemgr.errors import CachemgrError, DatabaseError
from cachemgr.index.store import AmbiguousKey

# Each command's module (under cachemgr.cli), imported when that command runs or help lists them:
# `stats` loads the inspection commands alone (on a GPU host's sandboxed file system every module
# imported cost about a millisecond of a start-up that must stay under 0.2 s).
COMMAND_MODULES = {
    **dict.fromkeys(("scan", "stats", "ls", "show"), "inspect"),
    **dict.fromkeys(("evict", "purge", "pin", "unpin"), "evict"),
    **dict.fromkeys(("daemon", "config"), "daemon"),
    **dict.fromkeys(("shapes", "prewarm", "export", "import"), "prewarm"),
    **dict.fromkeys(("diff", "explain"), "explain"),
    **dict.fromkeys(("fleet", "remote"), "fleet"),
    "check": "check",
}


class LazyGroup(click.Group):
    """click's lazily loading group: a command's module is imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMAND_MODULES})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in COMMAND_MODULES and name not in self.commands:
            for command in importlib.import_module(f"cachemgr.cli.{COMMAND_MODULES[name]}").COMMANDS:
                self.add_command(command)
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--cache-dir",
    metavar="DIR",
    help="Inductor cache to manage. Default: $CACHEMGR_CACHE_DIR, else $TORCHINDUCTOR_CACHE_DIR, "
    "else <tmpdir>/torchinductor_<user>.",
)
@click.option(
    "--db",
    metavar="URL",
    help="Index database. Default: $CACHEMGR_DB, else sqlite under $STATE_DIRECTORY or "
    "$XDG_STATE_HOME/cachemgr/. PostgreSQL: postgresql+psycopg://user@host/db.",
)
@click.option("--host", metavar="NAME", help="Host name recorded in the index (default: this host's name).")
@click.option(
    "--config",
    "config_file",
    metavar="FILE",
    type=click.Path(dir_okay=False),
    help="TOML config file. Default: $CACHEMGR_CONFIG, else /etc/cachemgr/config.toml if present; /dev/null for none.",
)
@click.version_option(__version__, "-V", "--version")
@click.pass_context
def cli(ctx: click.Context, cache_dir: str | None, db: str | None, host: str | None, config_file: str | None) -> None:
    """Keep TorchInductor's compile cache indexed, bounded and warm.

    \b
    Example:
        cachemgr scan                      # index the cache
        cachemgr stats                     # what is in it
        cachemgr ls --kind fxgraph --sort cost --limit 10
        cachemgr show fgv4ud3t             # one entry in full, by its short key
    """
    ctx.obj = App(config_file, {"cache_dir": cache_dir, "db": db, "host": host})


SHELLS = ("bash", "zsh", "fish")
COMPLETE_VAR = "_CACHEMGR_COMPLETE"


@click.command()
@click.argument("shell", type=click.Choice(SHELLS))
def completion(shell: str) -> None:
    """Print the shell completion script (commands, options, and the index's keys).

    \b
    Example:
        eval "$(cachemgr completion bash)"          # in ~/.bashrc
        cachemgr completion fish > ~/.config/fish/completions/cachemgr.fish
    """
    from click.shell_completion import get_completion_class

    cls = get_completion_class(shell)
    assert cls is not None
    click.echo(cls(cli, {}, "cachemgr", COMPLETE_VAR).source())


cli.add_command(completion)


def _say_ambiguous(e: AmbiguousKey) -> None:
    """The candidates of an ambiguous key, as git lists them: short key, kind, size, what it is."""
    from cachemgr.cli.common import Col, human_size, render_table, terminal_width

    click.echo("cachemgr: the candidates are:", err=True)
    rows = [
        (e.shorts.get(c.key, c.key), c.kind, human_size(c.bytes), c.signature or c.graph_key or "")
        for c in e.candidates
    ]
    width = terminal_width()
    for line in render_table(
        [Col(""), Col(""), Col("", True), Col("", cut=True)], rows, None if width is None else width - 2
    )[1:]:
        click.echo("  " + line, err=True)
    if e.more:
        click.echo("  ...", err=True)


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """A library's warning (SQLAlchemy ignoring a URL's ?mode=ro) as one line, not a source excerpt."""
    text = " ".join(str(message).split()).split(" (Background on this warning", 1)[0]
    return f"cachemgr: warning: {text}\n"


def _short_of(e: BaseException) -> str | None:
    """What the system ran out of, for a failure that is no bug: memory, descriptors, processes
    (`ulimit -v`, `-n`, `-u`, or a host short of them)."""
    if isinstance(e, MemoryError):
        return "memory"
    if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE):
        return "file descriptors (ulimit -n)"
    if isinstance(e, OSError) and e.errno in (errno.EAGAIN, errno.ENOMEM):
        return f"memory or processes ({e.strerror})"
    if isinstance(e, RuntimeError) and "can't start new thread" in str(e):
        return "threads (ulimit -u, or memory)"
    return None


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the group, funnel every error into one line and an exit code."""
    if os.environ.get(COMPLETE_VAR):
        from click.shell_completion import shell_complete

        sys.exit(shell_complete(cli, {}, "cachemgr", COMPLETE_VAR, os.environ[COMPLETE_VAR]))
    warnings.formatwarning = _one_line_warning
    app: App | None = None
    try:
        with cli.make_context("cachemgr", list(sys.argv[1:] if argv is None else argv)) as ctx:
            app = ctx.obj
            cli.invoke(ctx)
        code = 0
    except click.exceptions.Exit as e:
        code = e.exit_code
    except click.exceptions.NoArgsIsHelpError as e:  # bare `cachemgr` (or a group): its help, not an error
        click.echo(e.format_message())
        code = 0
    except click.ClickException as e:
        click.echo(f"cachemgr: error: {_one_line(e.format_message())}", err=True)
        code = e.exit_code
    except click.exceptions.Abort:
        click.echo("cachemgr: aborted", err=True)
        code = 130
    except KeyboardInterrupt:
        click.echo("cachemgr: interrupted", err=True)
        code = 130
    except CachemgrError as e:
        click.echo(f"cachemgr: error: {_one_line(str(e))}", err=True)
        if isinstance(e, AmbiguousKey):
            _say_ambiguous(e)
        code = e.exit_code
    except BrokenPipeError:
        code = 0
    except Exception as e:  # the one boundary where a bug becomes a message
        if os.environ.get("CACHEMGR_DEBUG"):
            raise
        # the index failed mid-command (full, ...): SQLAlchemy's errors, or its drivers' (cachemgr.index.dbapi)
        if type(e).__module__.startswith(("sqlalchemy.", "sqlite3", "psycopg")):
            orig = str(getattr(e, "orig", None) or e).strip()
            click.echo(
                f"cachemgr: error: index database: {_one_line(orig.splitlines()[0]) if orig else type(e).__name__}",
                err=True,
            )
            code = DatabaseError.exit_code
        elif _short_of(e):
            click.echo(f"cachemgr: error: out of {_short_of(e)}", err=True)
            code = 1
        else:
            click.echo(
                f"cachemgr: internal error: {type(e).__name__}: {_one_line(str(e))} "
                "(set CACHEMGR_DEBUG=1 for a traceback)",
                err=True,
            )
            code = 70
    finally:
        if app is not None:
            app.close()
    sys.exit(code)


def _one_line(message: str) -> str:
    """An error as the one line the exit codes promise: a database error can quote a statement's
    text, newlines and all (a damaged index named a column by its SQL), and a message can quote
    what a hostile file, server or setting holds (an escape sequence is shown, never sent)."""
    from cachemgr.cli.common import clean

    return clean(" ".join(message.split()) if "\n" in message or "\r" in message else message)
