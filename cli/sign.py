"""`shardckpt sign`: sign a committed checkpoint's manifest with an Ed25519 key."""

from __future__ import annotations

import typer

from .app import app
from .common import StorageOptionArg, checkpoint_location, echo, guarded, parse_storage_options


@app.command()
@guarded
def sign(
    ckpt: str = typer.Argument(..., help="Checkpoint or run directory (path or fsspec URL)."),
    key: str = typer.Option(..., "--key", help="Ed25519 private key file (OpenSSH or PEM)."),
    storage_option: list[str] | None = StorageOptionArg,
) -> None:
    """Record every file's digest (BLAKE3, or SHA-256 where the manifest records those) and sign
    the manifest (each file read once)."""
    from shardckpt.format.signing import SigningKey
    from shardckpt.checkpoint.trust import signing_key
    from shardckpt.tools.sign import sign_checkpoint

    from shardckpt.tools.consolidate_sign import is_consolidation, sign_consolidation

    opts = parse_storage_options(storage_option)
    signer = signing_key(key)
    assert isinstance(signer, SigningKey)
    if is_consolidation(ckpt, opts):  # Hugging Face output: its provenance file is signed
        echo(f"signed: {ckpt}: consolidation, key {sign_consolidation(ckpt, signer, opts)}")
        return
    where = checkpoint_location(ckpt, opts)
    m = sign_checkpoint(where.url, signer, opts)
    echo(f"signed: {where.url}: {len(m.files)} files, key {signer.public.key_id}")

