"""The application layer: the CLI, the demo, and the wiring of settings into adapters.

Holds: `cli` and `stats_cli` (commands), `wiring` (the only module that composes settings into
real adapters), `failures` (the one CLI error handler), `settings` (all settings, as the CLI reads
them), `demo`, `fleet` and `render`.
May import: every package of the product.
"""
