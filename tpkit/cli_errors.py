"""How the `tpkit` command reports failure: one or two lines on stderr and an exit code, no traceback.

tpkit's own errors (`tpkit.errors.TpkitError`: what is wrong and the fix) exit with their code (2);
usage errors name the flag, the value, the expected type or the nearest flag (exit 2; typer's own copy
of click is caught, not only click's); Ctrl-C says a rerun finishes the work (130); anything else is
one line (exit 1). `--debug` anywhere on the command line shows the traceback instead. `--threads N`
anywhere caps this process's CPU threads.
"""

from __future__ import annotations

import difflib
import errno
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from tpkit import layout
from tpkit.errors import TpkitError


def _click_exceptions() -> tuple:
    """Typer ships its own copy of click (typer._click): its usage errors are not click's classes."""
    import click

    import typer.exceptions

    mods = [click.exceptions, typer.exceptions]
    try:
        from typer._click import exceptions as typer_click

        mods.append(typer_click)
    except ImportError:
        pass
    return mods


def run(app, argv: list[str]) -> None:
    """Run the Typer `app` on `argv` and exit with its code, errors translated (see the module docstring)."""
    argv = list(argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    argv = take_threads(argv)
    mods = _click_exceptions()

    def classes(name: str) -> tuple:
        return tuple({getattr(m, name) for m in mods if isinstance(getattr(m, name, None), type)})

    help_shown, usage, clicked = classes("NoArgsIsHelpError"), classes("UsageError"), classes("ClickException")
    exited, aborted = classes("Exit"), classes("Abort")

    try:
        code = app(args=argv, prog_name="tpkit", standalone_mode=False)  # typer.Exit(n) comes back as n
        if isinstance(code, int) and code:
            sys.exit(code)
    except TpkitError as e:
        if debug:
            raise
        error(str(e))
        sys.exit(e.exit_code)
    except help_shown as e:  # bare `tpkit` or `tpkit eval`: the help (typer may have printed it already)
        text = e.format_message()
        if text.strip():
            print(text)
        sys.exit(0)
    except exited as e:
        sys.exit(e.exit_code)
    except usage as e:
        if debug:
            raise
        error(usage_message(e, argv))
        sys.exit(2)
    except clicked as e:
        if debug:
            raise
        error(e.format_message())
        sys.exit(e.exit_code or 1)
    except (*aborted, KeyboardInterrupt):
        error("interrupted; rerun the same command to finish (finished files are kept)")
        sys.exit(130)
    except OSError as e:
        if debug:
            raise
        message, code = os_message(e, argv)
        error(message)
        sys.exit(code)
    except Exception as e:
        if debug:
            raise
        error(f"{type(e).__name__}: {e}".splitlines()[0][:300] + "\n  (rerun with --debug for the traceback)")
        sys.exit(1)


NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
RERUN = "rerun the same command to continue: what is finished is kept"


def os_message(e: OSError, argv: list[str]) -> tuple[str, int]:
    """A file-system error in tpkit's voice: what happened where (the file, else the --out folder), and the
    fix; and the exit code (2 for a mistyped path, as for other bad input; 1 for the machine's state). Every stage writes each file under a temporary name and renames it into place, so a rerun
    after the cause is fixed continues (`tpkit run` says what a round needs: run.disk_full)."""
    out = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--out"), None)
    where = e.filename or out or "the output folder"
    if e.errno in layout.DISK_FULL:
        free = layout.free_bytes(Path(where))
        room = f" ({layout.human_bytes(free)} free there)" if free is not None else ""
        return (f"{e.strerror or 'no space left on the device'}: {where}{room}\n"
                f"  fix: free space there or pass --out on a bigger disk (`tpkit doctor RECIPE` estimates what a "
                f"run writes), then {RERUN}"), 1
    blocking = layout.file_on_the_way(Path(out or where)) if e.errno in (errno.ENOTDIR, errno.EEXIST) else None
    if blocking is not None:  # --out runs/x/y where runs/x is a file: a mistyped path, not a disk problem
        return (f"{blocking} is a file, not a folder, so {out or where} cannot be written under it\n"
                f"  fix: pass an --out whose parent folders are folders, or move {blocking} away"), 2
    if e.errno in NOT_WRITABLE:
        return (f"{e.strerror or 'cannot write'}: {where}\n"
                f"  fix: pass an --out folder you can write to (or make it writable), then {RERUN}"), 1
    return (f"{type(e).__name__}: {e}".splitlines()[0][:300] + f"\n  fix: check {where}, then {RERUN} "
            "(--debug for the traceback)"), 1


def usage_message(e, argv: list[str]) -> str:
    """A usage error in tpkit's voice: what was wrong with which flag, the expected value, the fix."""
    ctx = getattr(e, "ctx", None)
    command = ctx.command_path if ctx is not None else \
        "tpkit" + (f" {argv[0]}" if argv and not argv[0].startswith("-") else "")
    fix = f"  fix: see `{command} --help`"
    param = getattr(e, "param", None)
    kind = type(e).__name__
    if kind == "NoSuchOption":
        name = getattr(e, "option_name", "") or ""
        known = [o for p in (ctx.command.params if ctx is not None else []) for o in getattr(p, "opts", [])
                 if o.startswith("-")] + ["--help"]
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
        return f"no such option {name}" + (f" (did you mean {near[0]}?)" if near else "") + "\n" + fix
    if kind == "MissingParameter":
        what = "option" if param is not None and getattr(param, "param_type_name", "") == "option" else "argument"
        names = "/".join(param.opts) if param is not None else ""
        if what == "argument" and param is not None:
            names = (getattr(param, "metavar", None) or param.name.upper())
        return f"missing {what} {names}\n" + fix
    if param is not None and getattr(param, "opts", None):
        flag = param.opts[0]
        given = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a in param.opts), None)
        default = getattr(param, "default", None)
        example = f"e.g. {flag} {' '.join(map(str, default)) if isinstance(default, (tuple, list)) else default}" \
            if default not in (None, "", [], ()) and not isinstance(default, bool) else ""
        msg = getattr(e, "message", str(e))
        return (f"{flag}{f' {given!r}' if given is not None else ''}: {msg[:1].lower() + msg[1:]}\n"
                f"  fix: {example + ' (' if example else ''}see `{command} --help`{')' if example else ''}")
    text = e.format_message() if hasattr(e, "format_message") else str(e)
    return f"{text[:1].lower() + text[1:]}\n" + fix


def take_threads(argv: list[str]) -> list[str]:
    """`--threads N` anywhere on the command line: CPU threads of this process (TPKIT_THREADS), e.g.
    1 each for two runs side by side on 2 cores. Default: the cores divided by the local processes."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--threads" or a.startswith("--threads="):
            value = a.partition("=")[2] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in a else 2
            if not value.isdigit() or int(value) < 1:
                error(f"--threads {value!r} is not a positive integer\n  fix: e.g. --threads 1 for each of two runs on 2 cores")
                sys.exit(2)
            os.environ["TPKIT_THREADS"] = value
            continue
        out.append(a)
        i += 1
    return out


def error(text: str) -> None:
    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(text)}", highlight=False)
