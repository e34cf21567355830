"""The synthetic corpus and per-rank batches: reproducible, world-size independent, resumable."""

from __future__ import annotations

import pytest
import torch

from shardckpt.errors import ConfigError
from shardckpt.runtime.data import SyntheticCorpus, TokenBatches


def test_corpus_is_a_pure_function_of_seed_and_index():
    a, b = SyntheticCorpus(128, seed=3), SyntheticCorpus(128, seed=3)
    assert a.words == b.words and len(set(a.words)) == 128 and a.words[0] == "."
    assert (a.sample(17, 40) == b.sample(17, 40)).all()
    assert not (a.sample(17, 40) == a.sample(18, 40)).all()
    assert not (a.sample(17, 40) == SyntheticCorpus(128, seed=4).sample(17, 40)).all()
    s = a.sample(5, 300)
    assert s.min() >= 0 and s.max() < 128


def test_text_round_trips_through_encode():
    corpus = SyntheticCorpus(200, seed=1)
    text = corpus.text(2, 50)
    assert isinstance(text, str) and len(text.split()) > 10
    assert corpus.encode(text) == corpus.sample(2, 50).tolist()
    with pytest.raises(ConfigError, match="not a word"):
        corpus.encode("xyzzy")


def test_a_global_batch_is_the_same_for_any_world_size():
    corpus = SyntheticCorpus(64)
    one = TokenBatches(corpus, seq_len=8, micro_batch=4)
    two = [TokenBatches(corpus, seq_len=8, micro_batch=2, rank=r, world_size=2) for r in range(2)]
    for step in range(3):
        assert torch.equal(one.batch(step), torch.cat([b.batch(step) for b in two]))
    assert one.batch(0).dtype == torch.int64 and one.batch(0).shape == (4, 8)


def test_position_resumes_from_state_dict():
    corpus = SyntheticCorpus(64)
    it = TokenBatches(corpus, seq_len=8, micro_batch=2, rank=1, world_size=2)
    next(it), next(it)
    state = it.state_dict()
    assert state["samples_seen"] == 8
    resumed = TokenBatches(corpus, seq_len=8, micro_batch=4)  # other world size, same global batch
    resumed.load_state_dict(state)
    assert resumed.step == 2
    with pytest.raises(ConfigError, match="global batch"):
        TokenBatches(corpus, seq_len=8, micro_batch=3).load_state_dict(state)
