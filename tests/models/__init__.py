"""Tests of pdserve/models/."""
