"""What every command's parser shares: a bad flag is one line and status 2, never
the usage block with a traceback's worth of text around it."""
from __future__ import annotations

import argparse
import sys


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)
