"""Synthetic text that needs no download: a seeded corpus and per-rank token batches.

:class:`SyntheticCorpus` is a Markov chain over generated pseudo-words: every word has a few fixed
successors with Zipf weights, so a language model has something to learn and the loss falls
visibly within a few hundred steps. Word ids are token ids (``0`` ends a sentence), so no tokenizer
is needed; :meth:`SyntheticCorpus.text` and :meth:`SyntheticCorpus.encode` convert to and from text.

Sample ``i`` depends only on ``(seed, i)``. :class:`TokenBatches` indexes samples globally, so a
global batch is the same whatever the world size that reads it (resuming on another world size
continues with the same data).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Iterator, Mapping

import numpy as np
import torch

from shardckpt.errors import ConfigError

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "ch", "sh", "th")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")
EOS = 0


class SyntheticCorpus:
    """A reproducible corpus of ``vocab_size`` words (id 0 is ``"."``, the end of a sentence)."""

    def __init__(self, vocab_size: int = 1024, seed: int = 0, branching: int = 4) -> None:
        if vocab_size < 2 or branching < 1:
            raise ConfigError(f"vocab_size must be >= 2 and branching >= 1; got {vocab_size}, "
                              f"{branching}")
        self.vocab_size, self.seed, self.branching = vocab_size, seed, branching
        rng = np.random.default_rng([seed, 0x5EED])
        syllables = [o + v for o in _ONSETS for v in _VOWELS]
        words: dict[str, None] = {}
        while len(words) < vocab_size - 1:
            n = int(rng.integers(1, 4))
            words.setdefault("".join(syllables[int(i)] for i in rng.integers(0, len(syllables), n)))
        self.words: tuple[str, ...] = (".",) + tuple(words)
        self._ids = {w: i for i, w in enumerate(self.words)}
        self.successors = rng.integers(0, vocab_size, size=(vocab_size, branching))
        weights = 1.0 / np.arange(1, branching + 1)
        self._cdf = np.cumsum(weights / weights.sum())

    def sample(self, index: int, length: int) -> np.ndarray:
        """Tokens of sample ``index`` (int64, ``length`` long); a pure function of (seed, index)."""
        rng = np.random.default_rng([self.seed, 1, index])
        out = np.empty(length, dtype=np.int64)
        token = int(rng.integers(1, self.vocab_size))
        picks = np.searchsorted(self._cdf, rng.random(length), side="right")
        for t in range(length):
            out[t] = token
            token = int(self.successors[token, min(int(picks[t]), self.branching - 1)])
        return out

    def text(self, index: int, length: int = 64) -> str:
        return self.decode(self.sample(index, length).tolist())

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids).replace(" .", ".")

    def encode(self, text: str) -> list[int]:
        """Word ids of ``text`` as written by :meth:`decode`; unknown words raise ``ConfigError``."""
        ids = []
        for word in text.replace(".", " . ").split():
            if word not in self._ids:
                raise ConfigError(f"{word!r} is not a word of this corpus (seed {self.seed})")
            ids.append(self._ids[word])
        return ids


@dataclass
class TokenBatches:
    """This rank's micro-batches: global step ``i`` reads samples ``[i*G, (i+1)*G)``,
    ``G = micro_batch * world_size``, and rank ``r`` the ``r``-th ``micro_batch`` of them.

    Each batch is ``[micro_batch, seq_len]`` int64 token ids (use them as labels too; the loss
    shifts). ``state_dict()`` / ``load_state_dict()`` carry the position (samples seen).
    """

    corpus: SyntheticCorpus
    seq_len: int
    micro_batch: int
    rank: int = 0
    world_size: int = 1
    step: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size or self.seq_len < 2 or self.micro_batch < 1:
            raise ConfigError(f"invalid batches: rank {self.rank} of {self.world_size}, seq_len "
                              f"{self.seq_len}, micro_batch {self.micro_batch}")

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.world_size

    def batch(self, step: int, rank: int | None = None) -> torch.Tensor:
        """The micro-batch of ``rank`` (default: this rank) at global step ``step``."""
        r = self.rank if rank is None else rank
        first = step * self.global_batch + r * self.micro_batch
        rows = [self.corpus.sample(first + j, self.seq_len) for j in range(self.micro_batch)]
        return torch.from_numpy(np.stack(rows))

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"samples_seen": self.step * self.global_batch, "seed": self.corpus.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        seen = int(state["samples_seen"])
        if seen % self.global_batch:
            raise ConfigError(f"{seen} samples seen is not a whole number of global batches of "
                              f"{self.global_batch}; resume with the same global batch size")
        self.step = seen // self.global_batch
