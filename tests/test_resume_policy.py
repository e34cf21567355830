"""The one resume policy (:func:`shardckpt.checkpoint.resume_policy.resume_newest`) over tiers
that say what each attempt gives: the order candidates are tried in, the weights-only last
resort, what is put aside with why, and the error past damaged checkpoints. One process: every
agreement is the single-process case."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

import shardckpt.checkpoint.collective as collective
from shardckpt.checkpoint.resume_policy import (
    DAMAGED, LACKING, LOADED, PASSED, Candidate, Outcome, resume_newest,
)
from shardckpt.checkpoint.tiers import LocalTier
from shardckpt.errors import IntegrityError


class Scripted:
    """A tier whose steps give the outcomes given (``(step, last_resort) -> status``)."""

    def __init__(self, name: str, outcomes: dict[tuple[int, bool], str], tried: list) -> None:
        self.name, self.outcomes, self.tried = name, outcomes, tried
        self.aside: list[tuple[int, dict[int, str]]] = []

    @property
    def where(self) -> str:
        return f"the {self.name} tier"

    def survey(self) -> str:
        return f"{self.name} seen"

    def candidates(self, surveyed: list) -> list[Candidate]:
        assert surveyed == [f"{self.name} seen"]  # one process: this rank's part alone
        steps = sorted({s for s, _ in self.outcomes}, reverse=True)
        return [Candidate(s, self.name, f"{self.name}/step-{s}") for s in steps]

    def attempt(self, candidate: Candidate, last_resort: bool) -> Outcome:
        self.tried.append((candidate.tier, candidate.step, last_resort))
        status = self.outcomes[(candidate.step, last_resort)]
        return Outcome(status, "" if status == LOADED else f"{status} at {candidate.step}")

    def newer_than(self, above: int) -> bool:
        return any(s > above for s, _ in self.outcomes)

    def put_aside(self, above: int, why: Mapping[int, str]) -> None:
        self.aside.append((above, dict(why)))


def test_newest_first_earlier_tier_first_at_equal_steps_and_why_per_tier() -> None:
    tried: list = []
    local = Scripted("local", {(5, False): PASSED, (3, False): LOADED}, tried)
    durable = Scripted("durable", {(5, False): DAMAGED, (4, False): LACKING}, tried)
    got = resume_newest([local, durable])
    assert tried == [("local", 5, False), ("durable", 5, False), ("durable", 4, False),
                     ("local", 3, False)]
    assert got.step == 3 and got.candidate is not None and got.candidate.tier == "local"
    assert local.aside == [(3, {5: "passed at 5"})]
    assert durable.aside == [(3, {5: "damaged at 5", 4: "lacking at 4"})]


def test_weights_only_last_resort_newest_first_past_one_that_fails() -> None:
    tried: list = []
    durable = Scripted("durable", {(4, False): LACKING, (4, True): DAMAGED,
                                   (3, False): LACKING, (3, True): LOADED}, tried)
    got = resume_newest([durable])
    assert tried == [("durable", 4, False), ("durable", 3, False), ("durable", 4, True),
                     ("durable", 3, True)]
    assert got.step == 3 and durable.aside == [(3, {4: "damaged at 4"})]


def test_past_damaged_ones_and_none_loads_an_error_and_nothing_put_aside() -> None:
    durable = Scripted("durable", {(2, False): DAMAGED, (1, False): PASSED}, [])
    with pytest.raises(IntegrityError, match="1 failed their checksums: durable/step-2"):
        resume_newest([durable])
    assert durable.aside == []


def test_nothing_usable_is_a_fresh_start_and_the_rest_is_put_aside() -> None:
    durable = Scripted("durable", {(2, False): PASSED}, [])
    got = resume_newest([durable])
    assert got.candidate is None and got.step == 0
    assert durable.aside == [(0, {2: "passed at 2"})]


def test_the_newest_loading_puts_nothing_aside_in_no_round(monkeypatch) -> None:
    """Where no tier's survey saw a step newer than the one loaded, there is no put-aside round;
    where one tier did, every tier puts aside in that one round."""
    rounds: list[str] = []
    real = collective._agree
    monkeypatch.setattr(collective, "_agree",
                        lambda fn, what, *a: rounds.append(what) or real(fn, what, *a))
    local = Scripted("local", {(4, False): LOADED}, [])
    durable = Scripted("durable", {(3, False): LOADED}, [])
    assert resume_newest([local, durable]).step == 4
    assert local.aside == durable.aside == [] and rounds == ["survey of the local tier and the durable tier"]
    rounds.clear()
    durable = Scripted("durable", {(5, False): PASSED}, [])
    assert resume_newest([local, durable]).step == 4
    assert local.aside == [(4, {})] and durable.aside == [(4, {5: "passed at 5"})]
    assert [w.split(" of ")[0] for w in rounds] == ["survey", "putting aside the steps newer than 4"]


def test_a_resume_from_the_local_tier_takes_one_round_per_need(tmp_path, monkeypatch) -> None:
    """Every agreement is a round of every rank on the way back to training: the survey of both
    tiers is one; the manifest's round gives what each rank's model loads directly, so what
    each rank reads follows with no round; an intact node fetches nothing (no round for it);
    each rank's per-rank state is read in the load's round; and with nothing newer than the
    step loaded, nothing is put aside (no round). The manifest itself goes to each rank once
    (a broadcast), never in the agreement's reports, which an all-gather pads to the longest:
    at 1024 ranks a 7 MB manifest would be 7 GB on every rank."""
    import os

    from shardckpt.training.checkpointer import Checkpointer

    run, tier, engine = _saved_local_step(tmp_path)
    ckpt = Checkpointer(run, engine, local=tier, durable_every=10 ** 9)
    rounds: list[list] = []
    real, exchange, broadcast = collective._agree, collective._exchange, collective.broadcast_bytes
    monkeypatch.setattr(collective, "_agree",
                        lambda fn, what, *a: rounds.append([what]) or real(fn, what, *a))
    monkeypatch.setattr(collective, "_exchange",
                        lambda report, group: rounds[-1].append(len(report)) or exchange(report, group))
    sent: list[int] = []
    monkeypatch.setattr(collective, "broadcast_bytes",
                        lambda data, src=0, group=None: sent.append(len(data or b"")) or broadcast(data, src, group))
    assert ckpt.resume() == 3 and ckpt.last_resume["tier"] == "local"
    ckpt.close()
    kinds = [w.split(" of ")[0].split(" from ")[0] for w, _ in rounds]
    assert kinds == ["survey", "read", "load"], rounds
    manifest = os.path.getsize(tmp_path / "node0" / "step-00000003" / "manifest.json")
    assert sent == [manifest], (sent, manifest)
    assert rounds[1][1] < manifest / 4, (rounds, manifest)  # the manifest's round: no manifest in it


def test_a_manifest_broadcast_that_differs_from_the_reported_digest_is_refused(tmp_path, monkeypatch) -> None:
    """The broadcast is not signed; the digest the holder reported in the agreement (signed
    under a job secret) is what the bytes received must match."""
    from shardckpt.training.checkpointer import Checkpointer

    run, tier, engine = _saved_local_step(tmp_path)
    ckpt = Checkpointer(run, engine, local=tier, durable_every=10 ** 9)
    monkeypatch.setattr(collective, "broadcast_bytes",
                        lambda data, src=0, group=None: data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(IntegrityError, match=r"manifest.json \(from rank 0\): the bytes received do not "
                                             "match the digest rank 0 reported"):
        ckpt.resume()
    ckpt.close()


def _saved_local_step(tmp_path):
    """A one-process run with local step 3 saved: (run directory, tier, engine)."""
    import torch

    from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups
    from shardckpt.runtime.mesh import ProcessMesh
    from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM
    from shardckpt.training.checkpointer import Checkpointer

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    engine = ZeroEngine(LlamaForCausalLM(cfg), policy=LLAMA_POLICY, process_mesh=ProcessMesh.single())
    ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-2)
    tier = LocalTier(path=str(tmp_path / "node{node}"), every=1)
    run = str(tmp_path / "run")
    saver = Checkpointer(run, engine, local=tier, durable_every=10 ** 9)
    saver.save(3)
    saver.close()
    return run, tier, engine
