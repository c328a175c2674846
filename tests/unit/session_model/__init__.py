"""Unit tests of `session_model`."""
