"""Format-core commands: synth, inspect, verify."""
