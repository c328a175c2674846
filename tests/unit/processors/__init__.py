"""Unit tests of `processors`."""
