"""The read model: session projections in Redis (and in memory), used by processes and readers.

Holds: `redis_store` (the sync and asyncio stores), `requests` (every Redis round trip, built
once, with a sync and an async executor), `scripts` and `lua/*.lua` (the Lua scripts, loaded once),
`layout` (where a session's data lives in Redis), `codec` (state and timeline encodings), `keys`
(the one place that names Redis keys), `indexes` (due work and counters), `analytics` (readers of
the counters), `redis_client`, `memory` (the in-memory store), `sign_outs` (the console's
signed-out sessions, shared by its replicas) and `projector` (the synchronous shell of
`session_model.cycle`).
May import: `schemas`, `session_model`.
"""
