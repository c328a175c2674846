"""The operator console: an HTTP API and a server-rendered web console over the stack.

Holds: the ASGI app (FastAPI, served by uvicorn), its authentication (operators' argon2 password
hashes, bearer tokens for services, signed session cookies, CSRF), problem details, the live feed
(Server-Sent Events from the questions topic), templates and static files.
May import: `schemas`, `session_model`, `projections`, `producers`, `processors`.
"""
