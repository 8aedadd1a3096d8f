"""Tests of pdserve/executor/."""
