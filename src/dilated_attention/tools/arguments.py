"""argparse pieces shared by the command-line commands: the parser and its types."""

from __future__ import annotations

import argparse
import difflib
import math
import os
import sys

from ..ops.validation import MAX_POSITION, SEED_LIMIT


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors take one line, and that reports an
    unknown option or command before anything else, with the closest known one
    (argparse alone would first report the missing command: for ``--verison``, "the
    following arguments are required: command"). Its subcommands are parsers of this
    class too."""

    def error(self, message: str):
        """One line, as every other refusal of the command line (the usage is on
        ``--help``); without a command, the usage that lists them first."""
        if message.endswith("required: command"):
            self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        self._refuse_unknown(args)
        return super().parse_known_args(args, namespace)

    def _refuse_unknown(self, args: list[str]) -> None:
        """Exit with a usage error at the first option this parser does not know (or,
        with subcommands, at an unknown command); the arguments after a command are
        its parser's."""
        commands = next((a.choices for a in self._actions if isinstance(a, argparse._SubParsersAction)), None)
        options = list(self._option_string_actions)
        for arg in args:
            if arg == "--":
                return
            if _is_option(arg):
                name = arg.split("=", 1)[0]
                if not any(option == name or (name.startswith("--") and option.startswith(name)) for option in options):
                    self.error(f"unrecognized option {name}{_closest(name, options)}")
            elif commands is not None:
                if arg not in commands:
                    self.error(f"unknown command {arg!r}{_closest(arg, commands)} (commands: {', '.join(commands)})")
                return


def _is_option(arg: str) -> bool:
    """Whether argparse reads ``arg`` as an option: it starts with ``-`` and is not ``-``
    alone, a negative number or text with spaces."""
    if not arg.startswith("-") or arg == "-" or " " in arg:
        return False
    try:
        float(arg)
    except ValueError:
        return True
    return False


def _closest(name: str, known) -> str:
    """``": did you mean X?"`` for the known name closest to ``name``, or ``""``."""
    match = difflib.get_close_matches(name, list(known), n=1)
    return f": did you mean {match[0]}?" if match else ""


def number(kind, low: float, inclusive: bool = True, several: bool = False):
    """An argparse type: a finite ``kind`` (``int`` or ``float``) ``>= low`` (``> low``
    unless ``inclusive``). ``several``: for an option of several values, whose error
    for a value it cannot read says that values are separated by spaces."""
    bound = f"{'>=' if inclusive else '>'} {low}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            hint = ""
            if several:
                hint = (
                    f" (separate several values with spaces: {text.replace(',', ' ')})"
                    if "," in text
                    else " (several values are separated by spaces)"
                )
            raise argparse.ArgumentTypeError(
                f"must be {'an int' if kind is int else 'a number'} {bound}, got {text!r}{hint}"
            ) from None
        if not math.isfinite(value) or not (value >= low if inclusive else value > low):
            what = "" if kind is int else "a number "
            raise argparse.ArgumentTypeError(f"must be {what}{bound}, got {text}")
        return value

    return parse


positive_int = number(int, 1)
positive_ints = number(int, 1, several=True)
positive_float = number(float, 0, inclusive=False)


def position(text: str) -> int:
    """An argparse type: a position (tokens already seen), from 1 to 2**62 (the most a
    cache takes: positions are int64), one of several separated by spaces."""
    value = positive_ints(text)
    if value > MAX_POSITION:
        raise argparse.ArgumentTypeError(f"must be at most 2**62 (positions are int64), got {text}")
    return value


# Dense steps decode-bench times per position: they are spread over the dilated
# cache's span, at most this many positions (decode_benchmark.MAX_SPAN).
MAX_DENSE_STEPS = 65536


def dense_steps(text: str) -> int:
    """An argparse type: ``decode-bench --dense-steps``, from 1 to :data:`MAX_DENSE_STEPS`."""
    value = positive_int(text)
    if value > MAX_DENSE_STEPS:
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_DENSE_STEPS} (the steps are spread over at most that many positions), got {text}"
        )
    return value


def seed(text: str) -> int:
    """An argparse type: a seed, an int in ``[0, 2**63)`` (what every torch generator accepts)."""
    value = number(int, 0)(text)
    if value >= SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"must be below 2**63, got {text}")
    return value


# CPU threads a command takes at most: more than the CPUs is allowed (oversubscription),
# far more crashes torch.set_num_threads' thread pool (100,000 did).
MAX_THREADS = 4096


def threads(text: str) -> int:
    """An argparse type: a number of CPU threads, from 1 to :data:`MAX_THREADS`."""
    value = positive_int(text)
    if value > MAX_THREADS:
        cpus = os.cpu_count() or 1
        raise argparse.ArgumentTypeError(f"must be at most {MAX_THREADS} (this machine has {cpus} CPUs), got {text}")
    return value
