"""What the stages share: the run's context (`context.PathFactory`: the config unpacked once, the
store, tokenizer, router, shards and path models), the corpus and its features (`documents`), what
each stage's artifacts were made from and the drift check (`fingerprints`), and a run published in
its store (`published`). No command lives here: `dipaco.stages` holds one file per command.
"""
