"""Unit tests of `producers`."""
