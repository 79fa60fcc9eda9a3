"""What every command's parser shares: a bad flag is one line and status 2, never
the usage block with a traceback's worth of text around it; and --help shows each
flag's default."""
from __future__ import annotations

import argparse
import sys


class DefaultsHelp(argparse.HelpFormatter):
    """Each flag's help ends with its default, unless it says it already (the word
    "default") or there is none worth saying (unset, off, empty)."""

    def _get_help_string(self, action) -> str:
        text, value = action.help or "", action.default
        if (not action.option_strings or value is None or value is False or value is argparse.SUPPRESS
                or value in ("", [], ()) or "default" in text):
            return text
        shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
        return f"{text} (default {shown.replace('%', '%%')})".lstrip()


class OneLineParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelp)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)
