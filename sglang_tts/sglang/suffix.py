"""The suffix proposer: SGLang's own NGRAM corpus (C++, a trie with per-request match state) asked
for chains of the drafter's length.

What goes in: each request's prompt at its prefill (the whole prompt, so that an answer copying
any part of it matches) and, every round, the tail of every live request's output (so requests
draft from each other's answers, as SGLang's NGRAM does). Breadth 1: a chain per request. When
the trie offers more than one branch (its deepest match ran short and a shallower one filled the
rest) only the first chain is kept: the verify shape is the drafter's chain.

Host lists only; inserts run on the corpus's own C++ thread, and each lookup first waits for them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus

# Tokens of context the trie matches on (SGLang's NGRAM default depth) and its node capacity: 500K nodes
# (half SGLang's NGRAM default; 90 MB allocated, up to about 0.9 GB once full, as SGLang's 1M nodes
# measured 1.8 GB in a scheduler) hold every n-gram of about 28K tokens of fresh text; the least
# recently used go first.
MAX_TRIE_DEPTH = 18
CAPACITY = 500_000


def first_chain(tokens: np.ndarray, mask: np.ndarray, n: int) -> list[int]:
    """The drafted chain (root excluded) of one request's NGRAM result: tokens [n], mask [n * n]
    (mask[i, j]: node j is an ancestor of node i, or i itself). Node i + 1 extends the chain while
    its parent is node i; padding and other branches hang from earlier nodes."""
    m = mask.reshape(n, n)
    chain: list[int] = []
    for i in range(1, n):
        if not m[i, i - 1] or m[i, :i].sum() != i:  # parent is not i - 1 (or not every earlier node)
            break
        chain.append(int(tokens[i]))
    return chain


class SuffixProposer:
    def __init__(self, steps: int, max_trie_depth: int = MAX_TRIE_DEPTH, capacity: int = CAPACITY) -> None:
        self.steps = steps
        self.depth = max_trie_depth
        self.corpus = NgramCorpus(
            max_trie_depth=max_trie_depth,
            min_bfs_breadth=1,
            max_bfs_breadth=1,
            draft_token_num=steps + 1,
            match_type="BFS",
            capacity=capacity,
        )
        self._live: set[str] = set()

    def add_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        """Prompts of a prefill batch (host token lists): every n-gram of them enters the trie."""
        batch = [list(p) for p in prompts if len(p) > 1]
        if batch:
            self.corpus.batch_put(batch)

    def propose(
        self, request_ids: Sequence[str], tails: Sequence[Sequence[int]], lengths: Sequence[int]
    ) -> list[list[int]]:
        """Per request, the chain (0..steps tokens) that follows its context, given as its last tokens
        (`tails`, at least `max_trie_depth` of them when the context is that long) and its length."""
        tails = [list(t[-self.depth :]) for t in tails]
        self.corpus.synchronize()
        tokens, mask = self.corpus.batch_get(list(request_ids), tails, list(lengths))
        n = self.steps + 1
        tokens = np.asarray(tokens).reshape(len(tails), n)
        mask = np.asarray(mask).reshape(len(tails), n * n)
        self._live.update(request_ids)
        return [first_chain(tokens[i], mask[i], n) for i in range(len(tails))]

    def observe(self, tails: Sequence[Sequence[int]]) -> None:
        """After a round: the requests' context tails enter the trie (their newest n-grams)."""
        tails = [list(t[-self.depth :]) for t in tails if len(t) > 1]
        if tails:
            self.corpus.batch_put(tails)

    def reset(self) -> None:
        self.corpus.reset()
        self._live.clear()

    def forget(self, request_ids: Sequence[str]) -> None:
        """Finished requests: their match state goes (their tokens stay in the trie, LRU-bounded)."""
        gone = [rid for rid in request_ids if rid in self._live]
        if gone:
            self.corpus.erase_match_state(gone)
            self._live.difference_update(gone)
