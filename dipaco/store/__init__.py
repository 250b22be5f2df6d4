"""The only medium between the coordinator and the islands, and the only code that knows its file names.

`module_store` (module versions, outer state, commit point, atomic reads and writes over fsspec),
`records` (the typed, versioned protocol records: task, heartbeat, result metadata, round manifest,
round stats), `board` (the files holding them: tasks, heartbeats, results, inner states),
`retention` (every deletion), `compress` (int8 / int4 + zstd pseudo-gradients), `publish` (the run's
config, tokenizer and shards as content-addressed objects), `cache` (a machine's verified cache of them),
`errors` (`StoreError`, retries of transient failures).
Imports `dipaco.config` only.
"""
