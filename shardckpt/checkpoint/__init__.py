"""One checkpoint as files: writing, reading, verifying, tensor pieces, run directories. No torch."""
