"""Tests of pdserve/runner/."""
