"""The operator console: an HTTP API and a server-rendered web console over the stack.

Holds: `app` (`create_app(deps, settings)`, the ASGI app: FastAPI, served by uvicorn), `runtime`
(`ConsoleDeps`, what a running app holds), `settings` (`WebConsoleSettings`), `auth` (operators'
argon2id password hashes, bearer tokens for services, signed session cookies, CSRF tokens),
`guards` (who is calling, CSRF on writes), `problems` (RFC 9457 problem details), `live` (the
Server-Sent Events feed of question changes), `api` (the JSON API), `pages` (the HTML pages),
`inputs` (the limits both apply to an act's input), `service` (the reads and acts both share),
`views` and `charts` (presenters), templates and static files.
May import: `schemas`, `session_model`, `projections`, `producers`, `processors`.
"""
