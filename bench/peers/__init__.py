"""The peers of the projector figure (`bench/figures/peers.py`): the same pure fold run inside the
stream processors a Python team would pick instead, each as a process of its own.

`common` holds what both share (admission and fold as the worker does them, the state's encoding,
the report the harness reads); `quix_peer` is a Quix Streams application with its RocksDB state
store, `faust_peer` a Faust agent with a Table.
"""
