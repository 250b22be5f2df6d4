"""The only medium between the coordinator and the islands, and the only code that knows its file names.

`module_store` (module versions, outer state, the commit point; over `files`: fsspec, atomic writes,
listings; `checksums`: each version's checksums.json), `traffic` (every byte through a store client counted
by direction and kind), `ledger` (each process's published counts and their totals), `run_state` (version 0, the committed round and
record, whether the run is finished), `goodput` (applied tokens over the islands' failure-free capacity), `records` (the typed, versioned protocol records: task,
heartbeat, result metadata, round manifest, round stats), `board` (the files holding them: tasks,
heartbeats through `heartbeat_files`, results, inner states), `retention` (every deletion), `lease` (the coordinator's lease),
`publish` (the run's config, tokenizer and shards as
content-addressed objects), `cache` (a machine's verified cache of them), `errors` (`StoreError`, retries
of transient failures). Pseudo-gradients are encoded by `dipaco.codec`. Imports `dipaco.config` and
`dipaco.codec` only.
"""
