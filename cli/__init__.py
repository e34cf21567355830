"""The typer command layer of shardckpt (installed as ``shardckpt.cli``). Thin: parse, call, print."""
