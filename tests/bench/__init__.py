"""Tests of pdserve/bench/."""
