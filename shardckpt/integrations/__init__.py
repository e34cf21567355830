"""Glue for the training frameworks users already run: each module plugs shardckpt's storage,
commit, checksums and retention into one framework's own checkpoint hooks, from the user's side
(no patching). Each imports its framework lazily; none is needed by the rest of the package."""
