"""The offline tools: reshard, consolidate, diff, clean, inspect, estimate, synth, and their torchrun form. No torch."""
