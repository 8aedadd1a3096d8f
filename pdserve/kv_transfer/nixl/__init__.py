"""NIXL connector: ``scheduler`` (which blocks move) and ``worker`` (moves them, composing the
parts of this package); README.md in this folder is the reading path."""
