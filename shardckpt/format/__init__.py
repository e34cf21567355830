"""The on-disk format: layout math, the manifest and its codec, chunked tensors, safetensors headers. Pure; no I/O."""
