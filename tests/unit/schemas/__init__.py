"""Unit tests of `schemas`."""
