"""Argparse value validators and the parser class shared by every command line (``serve``,
``proxy``, ``up``, ``chat``, ``bench``).

Each function takes the option's text and returns the typed value, or raises
:class:`argparse.ArgumentTypeError`, which argparse turns into ``prog: error: ...`` and exit
code 2. :class:`Parser` prints a one-line usage before that error instead of the whole usage
block. Torch-free, so the CLI entry points stay fast to start.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors print one short usage line and the error (exit code 2),
    ``usage: PROG [options] (see PROG --help)``, rather than the whole usage block (``--help``
    still shows everything)."""

    def error(self, message: str) -> NoReturn:
        """Print the short usage and ``PROG: error: MESSAGE`` to stderr; exit with code 2."""
        self.exit(2, f"usage: {self.prog} [options] (see {self.prog} --help)\n"
                     f"{self.prog}: error: {message}\n")

    def fail(self, message: str) -> NoReturn:
        """Print ``PROG: error: MESSAGE`` alone to stderr and exit with code 2: for options that
        parsed but do not fit together (the usage line would not help)."""
        self.exit(2, f"{self.prog}: error: {message}\n")


#: A word that is a negative number (a value, e.g. of ``--decode-dp -1``, not an option).
NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")

# Size suffixes: binary (KiB, MiB, GiB, TiB) and decimal (K/KB, M/MB, G/GB, T/TB), any case.
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6,
    "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20,
    "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """Parses a byte count such as ``2GiB``, ``512MiB``, ``1.5G``, ``1e9`` or ``4096``.

    Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (K, KB, M, MB, G, GB,
    T, TB) powers of 1000.

    Returns:
        The size in bytes.

    Raises:
        argparse.ArgumentTypeError: not a positive size.
    """
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: use bytes or a number with a suffix such as 512MiB, 2GiB, 4G")
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def _int_at_least(text: str, low: int, what: str) -> int:
    """``text`` as an integer >= ``low`` (``what`` names the values allowed in the message)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid integer {text!r}: the value must be {what}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low} ({what}), got {text}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1.

    Raises:
        argparse.ArgumentTypeError: not an integer, or below 1.
    """
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """An integer >= 0.

    Raises:
        argparse.ArgumentTypeError: not an integer, or negative.
    """
    return _int_at_least(text, 0, "an integer >= 0")


def _finite_float(text: str) -> float:
    """``text`` as a finite number (``nan``, ``inf`` and ``-inf`` are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, GiB, ... for the options that use it).

    Raises:
        argparse.ArgumentTypeError: not a number, not finite, or not above 0.
    """
    value = _finite_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (seconds, for the options that use it).

    Raises:
        argparse.ArgumentTypeError: not a number, not finite, or negative.
    """
    value = _finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def writable_dir(text: str) -> str:
    """A directory this process can create files in: an existing writable one, or one that can
    be created (it is created at start-up).

    The check tries it: a temporary file in an existing directory, else creating the
    directory (and its missing parents), which are removed again right away.

    Raises:
        argparse.ArgumentTypeError: an empty path, a path through a file, no write access, or a
            directory that cannot be created (e.g. under ``/proc`` or ``/sys``).
    """
    if not text:
        raise argparse.ArgumentTypeError("an empty directory path")
    path = os.path.abspath(text)
    missing: list[str] = []  # the directories to create, deepest first
    probe = path
    while not os.path.exists(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        if probe == path:
            raise argparse.ArgumentTypeError(f"{text} is not a directory")
        raise argparse.ArgumentTypeError(f"{text}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: {probe} is not writable")
    try:
        if missing:
            os.makedirs(path, exist_ok=True)
        else:
            with tempfile.TemporaryFile(dir=path):
                pass
    except OSError as e:
        action = "cannot be created" if missing else "is not writable"
        raise argparse.ArgumentTypeError(f"{text} {action} ({e.strerror or e})") from None
    finally:
        for created in missing:
            try:
                os.rmdir(created)
            except OSError:
                pass
    return text


def fraction(text: str) -> float:
    """A number in (0, 1], e.g. a share of GPU memory.

    Raises:
        argparse.ArgumentTypeError: not a number, or outside (0, 1].
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def _port_in(text: str, lowest: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: not an integer") from None
    if not lowest <= value <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {value}: must be {lowest}..65535")
    return value


def port(text: str) -> int:
    """A TCP port to connect to, 1..65535.

    Raises:
        argparse.ArgumentTypeError: not an integer, or out of range.
    """
    return _port_in(text, 1)


def bind_port(text: str) -> int:
    """A TCP port to listen on, 0..65535 (0 = any free port, chosen by the system).

    Raises:
        argparse.ArgumentTypeError: not an integer, or out of range.
    """
    return _port_in(text, 0)


def port_list(text: str) -> list[int]:
    """Ports separated by commas and/or spaces, e.g. ``8100,8101``; each 1..65535.

    Raises:
        argparse.ArgumentTypeError: a word that is not a port.
    """
    try:
        return [port(p) for p in text.replace(",", " ").split()]
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"not a list of ports: {text!r} ({exc})") from None
