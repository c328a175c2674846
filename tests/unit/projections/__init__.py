"""Unit tests of `projections`."""
