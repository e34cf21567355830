"""The on-disk format: layout math, the manifest and its codec, chunked tensors, safetensors headers, and the
estimator's arithmetic (memory and traffic per rank). Pure; no I/O."""
