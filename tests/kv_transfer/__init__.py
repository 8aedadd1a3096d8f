"""Tests of pdserve/kv_transfer/."""
