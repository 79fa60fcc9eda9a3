"""Every command's --help: each flag has a help line, which shows its default
whenever it has one worth saying."""
import argparse

import pytest

from agents.agent import build_parser as agent
from cloud.launch import build_parser as launch
from commands.chaos.chaos import build_parser as chaos
from commands.data.tokenize import build_parser as data
from commands.status.status import parser as status
from commands.train.flags import build_parser as train
from sim.command import build_parser as sim
from sim.replay import build_parser as replay


def parsers():
    """Each command's parser, and bamboo-launch's subcommands'."""
    found = [train(), sim(), chaos(), data(), status(), agent(), replay()]
    top = launch()
    subs = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return found + [top, *subs.choices.values()]


def shown(value) -> str | None:
    """How the help shows a default; None when there is none to show."""
    if value is None or value is False or value in ("", [], ()) or value is argparse.SUPPRESS:
        return None
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


@pytest.mark.parametrize("parser", parsers(), ids=lambda p: p.prog)
def test_every_flag_has_a_help_line_that_shows_its_default(parser):
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        text = formatter._expand_help(action) if action.help else ""
        assert text.strip(), f"{parser.prog} {action.option_strings[0]} has no help line"
        default = shown(action.default)
        if default is not None:
            assert "default" in text and (default in text or "(default" not in text), \
                f"{parser.prog} {action.option_strings[0]}: {text!r} does not show {default!r}"


def test_a_help_line_shows_the_flag_s_own_default():
    """Not a restatement: the default a parse gives is the one --help prints."""
    parser = train()
    text = parser.format_help()
    for flag, value in (("--seq", "32"), ("--lr", "0.001"), ("--iterations", "10"), ("--precision", "fp32"),
                        ("--betas", "0.9 0.999")):
        dest = flag[2:].replace("-", "_")
        assert shown(getattr(parser.parse_args([]), dest)) == value
        assert f"(default {value})" in " ".join(text.split()), flag
