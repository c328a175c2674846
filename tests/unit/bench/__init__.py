"""Unit tests of `bench`."""
