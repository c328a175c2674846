"""The local stack and the helpers that run things against it.

`stack.py` starts Kafka and Redis (a standalone script, standard library only). `harness.py` finds
or starts that stack and starts, watches and stops child processes; `host.py` measures what the
machine and its processes use. The benchmark harness (`bench/`) and the integration tests share
them. Nothing here imports the product: only the standard library, redis and kafka-python.
"""
