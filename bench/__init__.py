"""The benchmark harness: `python -m bench.run [--quick] [--only NAME,...]` (docs/PERFORMANCE.md).

May import: every package of the product, and `deploy` for the stack and process helpers.
"""
