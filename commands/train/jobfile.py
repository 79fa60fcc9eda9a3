"""`--config FILE.toml`: a job's flags in a TOML file, one section per group of
--help and one key per flag, so a long run is a file to keep beside its results
rather than a command line to copy.

The file becomes command-line tokens placed before the real ones: argparse then
converts and checks its values exactly as it checks flags (types, choices, every
later check of bamboo-train), and a flag given on the command line wins because
argparse keeps the last value. A repeatable flag (action='append') given on the
command line replaces the file's list instead of extending it. Which section
holds which flag is read off the parser's argument groups, so the file and
--help cannot drift apart. Mistakes in the file are one line and exit status 2,
through the parser's own error().
"""
from __future__ import annotations

import argparse
import sys
from typing import NamedTuple

try:
    import tomllib
except ImportError:  # Python 3.10: the project runs there, only --config needs 3.11
    tomllib = None

LAUNCH = "launch"  # bamboo-launch's own section: one file serves both commands, bamboo-train skips it


class FileArgs(NamedTuple):
    """A file's flags as tokens, and how many values each repeatable flag got from
    it (they come first in the parsed list, so the command line's can replace them)."""
    argv: list[str]
    appended: dict[str, int]


def add_section(parser: argparse.ArgumentParser, section: str, title: str, formerly: dict | None = None):
    """An argument group whose flags a job file gives under [section]: the help's
    grouping and the file's sections are one declaration. `formerly`: key -> the
    section an older file may still give it in."""
    group = parser.add_argument_group(title, f"in a --config file: [{section}]")
    group.section, group.formerly = section, formerly or {}
    return group


def key_of(action: argparse.Action) -> str:
    """The flag's long name without dashes, '-' written '_': --model-config is model_config."""
    return max(action.option_strings, key=len).lstrip("-").replace("-", "_")


def sections(parser: argparse.ArgumentParser) -> dict[str, dict[str, argparse.Action]]:
    """Each section's keys and the flag each names, read off the parser's groups."""
    return {group.section: {key_of(a): a for a in group._group_actions}
            for group in parser._action_groups if getattr(group, "section", None)}


def accepted(parser: argparse.ArgumentParser) -> dict[str, dict[str, argparse.Action]]:
    """sections(), with each key also where an older file may give it."""
    known = sections(parser)
    for group in parser._action_groups:
        for key, old in getattr(group, "formerly", {}).items():
            known[old] = {**known[old], key: known[group.section][key]}
    return known


def where(parser: argparse.ArgumentParser) -> dict[str, str]:
    """'[section] key' by long flag: how a later check names a flag the file gave."""
    return {max(a.option_strings, key=len): f"[{section}] {key}"
            for section, keys in sections(parser).items() for key, a in keys.items()}


def config_path(argv: list[str]) -> str | None:
    """--config's value in `argv`, found before the real parse so the file's errors
    come first (even with --help) and its tokens can go in front. A probe parser
    resolves abbreviations as the real one does; a malformed --config is left to
    the real parse to report."""
    probe = _Probe(add_help=False)
    probe.add_argument("--config")
    try:
        return probe.parse_known_args(argv)[0].config
    except _NoValue:
        return None


class _NoValue(Exception):
    pass


class _Probe(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise _NoValue(message)


def load(parser: argparse.ArgumentParser, path: str) -> dict:
    """The file's tables; a missing file, bad TOML or an old Python is one line, status 2."""
    if tomllib is None:
        parser.error("--config needs Python 3.11+ (tomllib); give the flags on the command line")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        parser.error(f"--config {path!r}: cannot read it ({e.strerror})")
    except ValueError as e:  # TOMLDecodeError, or bytes that are not UTF-8
        parser.error(f"--config {path!r}: not valid TOML: {' '.join(str(e).split())}")


def to_argv(parser: argparse.ArgumentParser, path: str, doc: dict) -> FileArgs:
    """Every section and key of `doc` as the parser's tokens, each type checked;
    anything the parser has no flag for is refused, naming where it is."""
    known = accepted(parser)
    argv, appended, seen = [], {}, set()
    for section, table in doc.items():
        if not isinstance(table, dict):
            _misplaced(parser, path, None, section)
        if section not in known:
            parser.error(f"{path}: unknown section [{section}] (expected one of "
                         f"{', '.join(f'[{s}]' for s in known)})")
        for key, value in table.items():
            action = known[section].get(key.replace("-", "_")) or _misplaced(parser, path, section, key)
            if action.dest in seen:
                parser.error(f"{path}: [{section}] {key}: given twice")
            seen.add(action.dest)
            tokens = _tokens(action, value)
            if isinstance(tokens, str):
                parser.error(f"{path}: [{section}] {key}: {tokens}")
            argv += tokens
            if isinstance(action, argparse._AppendAction):
                appended[action.dest] = len(value)
    return FileArgs(argv, appended)


def _misplaced(parser, path: str, section: str | None, key: str):
    """An unknown key's error (`section` None: a key above every section), naming
    the section it belongs in when it is a flag of another one."""
    home = [s for s, keys in sections(parser).items() if key.replace("-", "_") in keys]
    where = f" (it belongs in [{home[0]}])" if home else ""
    if section is None:
        parser.error(f"{path}: {key}: a key outside any section{where}")
    parser.error(f"{path}: [{section}] {key}: not a key of [{section}]{where}")


def _tokens(action: argparse.Action, value) -> list[str] | str:
    """The tokens a flag's TOML value stands for, or what is wrong with its type."""
    flag = max(action.option_strings, key=len)
    if action.nargs == 0:  # store_true
        if not isinstance(value, bool):
            return f"expected true or false, got {value!r}"
        return [flag] if value else []
    if isinstance(action, argparse._AppendAction) or action.nargs not in (None, "?"):
        return _array(action, flag, value)
    wrong = _wrong(action, value)
    return wrong or [f"{flag}={value}"]


def _array(action: argparse.Action, flag: str, value) -> list[str] | str:
    """A repeatable flag (one token pair per item) or a flag of several values."""
    if not isinstance(value, list):
        return f"expected an array, got {value!r}"
    if isinstance(action.nargs, int) and len(value) != action.nargs:
        return f"expected an array of {action.nargs} values, got {value!r}"
    wrong = next(filter(None, (_wrong(action, v) for v in value)), None)
    if wrong:
        return wrong
    if isinstance(action, argparse._AppendAction):
        return [f"{flag}={v}" for v in value]
    return [flag, *map(str, value)] if value else []


# what a value may be, by the flag's type: argparse converts its text (a float flag takes 1 as 1.0)
_KINDS = {int: ((int,), "an integer"), float: ((int, float), "a number"), None: ((str,), "a string"),
          str: ((str,), "a string")}


def _wrong(action: argparse.Action, value) -> str | None:
    """What is wrong with one value for the flag's type and choices, if anything.
    argparse checks the tokens again: this only names the key where it is wrong."""
    kinds, name = _KINDS.get(action.type, ((str, int, float), "a string or a number"))
    if isinstance(value, bool) or not isinstance(value, kinds):  # TOML's true is no integer
        return f"expected {name}, got {value!r}"
    if action.choices is not None and value not in action.choices:
        return f"{value!r} is not one of {', '.join(map(repr, action.choices))}"
    return None


def read(parser: argparse.ArgumentParser, path: str, skip: tuple[str, ...] = (LAUNCH,)) -> FileArgs:
    """The file at `path` as the parser's tokens, leaving out the sections in `skip`."""
    doc = load(parser, path)
    return to_argv(parser, path, {section: table for section, table in doc.items() if section not in skip})


def command_line_wins(args: argparse.Namespace, file: FileArgs) -> argparse.Namespace:
    """A repeatable flag given on the command line replaces the file's list: the
    file's values are the first ones parsed, so they are dropped from the front."""
    for dest, count in file.appended.items():
        given = getattr(args, dest)
        if given is not None and len(given) > count:
            setattr(args, dest, given[count:])
    return args


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None,
               file: FileArgs | None = None) -> argparse.Namespace:
    """The parser's namespace from --config's file (or `file`, already read) and
    then `argv`, the command line winning."""
    argv = list(sys.argv[1:] if argv is None else argv)
    path = config_path(argv)
    if file is None:
        file = read(parser, path) if path is not None else FileArgs([], {})
    return command_line_wins(parser.parse_args([*file.argv, *argv]), file)
