"""Tests of pdserve/entrypoints/."""
