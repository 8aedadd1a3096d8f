"""Tests of pdserve/commands/."""
