"""The pdserve test suite."""
