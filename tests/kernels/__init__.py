"""Tests of pdserve/kernels/."""
