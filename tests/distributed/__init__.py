"""Tests of pdserve/distributed/."""
