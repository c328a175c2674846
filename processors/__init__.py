"""The long-running processes: the Faust projector worker, the scheduler, replay and their sinks.

Holds: `worker` (decode → fold → commit → publish, the async shell of `session_model.cycle`),
`app` and `batch_consumer` (the Faust app feeding it batches), `scheduler` and `scheduler_app`
(expiry and compaction events), `timer`, `timer_feed`, `timer_link`, `timer_process` and
`priority` (the worker's timer process that closes answer windows), `replay` (rebuilding
projections from the topic), `sinks`, `ports` (what the processes exchange), `metrics`,
`histogram`, `running` and `faust_process` (process lifecycle), `settings` (`WorkerSettings`).
May import: `schemas`, `session_model`, `projections`, `producers`.
"""
