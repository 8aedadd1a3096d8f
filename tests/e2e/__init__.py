"""Tests of pdserve/e2e/."""
