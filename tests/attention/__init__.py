"""Tests of pdserve/attention/."""
