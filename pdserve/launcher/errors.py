"""The error of ``pdserve up`` that it reports in one line before (or instead of) starting
anything."""


class LaunchError(Exception):
    """A configuration problem found before any child starts (bad ports, bad options)."""
