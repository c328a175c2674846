"""The benchmark harness: `python -m bench.run [--quick] [--only NAME,...]`.

See docs/PERFORMANCE.md.
"""
