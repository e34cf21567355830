"""One count parser and one size parser for every option that takes one (estimate, synth, the
size options of reshard, consolidate and the importers): the same forms, the same error text."""

from __future__ import annotations

import pytest

from shardckpt.errors import ConfigError
from shardckpt.format.quantities import QuantityError, parse_count, parse_size
from testing.cli import cli


@pytest.mark.parametrize("text,value", [
    ("1_000_000", 1_000_000), ("1e6", 1_000_000), ("2.5e9", 2_500_000_000), ("7B", 7 * 10**9),
    ("7.5G", 7_500_000_000), ("125m", 125_000_000), ("350K", 350_000), ("1.2T", 1_200_000_000_000),
    (" 42 ", 42), ("123456789012345678901", 123456789012345678901), (".5k", 500),
])
def test_counts(text: str, value: int) -> None:
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["2GiB", "2GB", "1MiB", "5KB"])
def test_counts_refuse_size_units(text: str) -> None:
    with pytest.raises(QuantityError, match="is a size unit; counts take K, M, B/G or T"):
        parse_count(text)


@pytest.mark.parametrize("text", ["", "abc", "0", "-5", "0.1", "7.5X", "1e999", "B", "1__0", "_1",
                                  "1e6e6", "nan", "inf", "1" * 5000])
def test_counts_refuse(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_count(text, "--params")
    assert str(info.value).startswith("--params ")


@pytest.mark.parametrize("text,value", [
    ("64", 64), ("64B", 64), ("2KB", 2000), ("2KiB", 2048), ("1.5MB", 1_500_000), ("1Gi", 1 << 30),
    ("1e9", 10**9), ("5g", 5 * 10**9), ("1_048_576", 1 << 20),
])
def test_sizes(text: str, value: int) -> None:
    assert parse_size(text, "--buffer") == value


@pytest.mark.parametrize("text", ["64 parsecs", "7B!", "0", "-1", "1e99"])
def test_sizes_refuse(text: str) -> None:
    with pytest.raises(QuantityError):
        parse_size(text, "--buffer")


def test_estimate_and_synth_read_counts_alike(tmp_path) -> None:
    est = cli("estimate", "--params", "1_000_000", "--ranks", "2", "--json")
    assert est.exit_code == 0, est.output
    syn = cli("synth", str(tmp_path / "c"), "--params", "1_000_000", "--ranks", "2", "--json")
    assert syn.exit_code == 0, syn.output
    errors = []
    for cmd in (["estimate", "--params", "2GiB", "--ranks", "2"],
                ["synth", str(tmp_path / "d"), "--params", "2GiB", "--ranks", "2"]):
        r = cli(*cmd)
        assert r.exit_code == 2, r.output
        errors.append(r.stderr.strip().splitlines())
    assert all(len(e) == 1 for e in errors)
    assert errors[0] == errors[1] == ["error: --params 2GiB: 'gib' is a size unit; counts take K, "
                                      "M, B/G or T"], errors
    assert not (tmp_path / "d").exists()
