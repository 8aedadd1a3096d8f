"""Tests of pdserve/utils/."""
