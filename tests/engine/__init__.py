"""Tests of pdserve/engine/."""
