"""How pseudo-gradients travel: one list of codec names and one interface, below `optim` and `store`.

`registry` (the names, `compression.codec`'s allowed values, with each one's file suffix; no torch, so the
config reads it), `codec` (`Codec`: encode, decode, the byte count, the suffix), `compress` (int8 / int4 /
top-k + zstd, one frame per module), `sparse` (the top-k format), `feedback` (error feedback: what is sent
and what residual remains). Imports torch, zstandard and safetensors, and nothing of dipaco above it.
"""
