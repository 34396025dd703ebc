"""Which KV-cache blocks belong to which request: fixed-size blocks, block tables and,
with prefix caching on, which full blocks hold which token prefix (the memory itself
is model/kv_cache.py's PagedKVCache)."""
from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np
import xxhash


class CacheFullError(RuntimeError):
    """No free block left: the scheduler should have asked can_allocate first."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = False):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.ref = np.zeros(num_blocks, dtype=np.int32)
        self.tables: dict[str, list[int]] = {}
        # prefix cache: chained hash of a full block's tokens -> block, and back
        self.by_hash: dict[int, int] = {}
        self.hash_of: dict[int, int] = {}
        self.origin: dict[int, tuple[str, int]] = {}  # cached block -> (request that wrote it, first position)
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but still cached, LRU first
        self.hits = 0  # prompt tokens served from the prefix cache

    # -- capacity -------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    def blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)

    def can_allocate(self, request_id: str, length: int) -> bool:
        have = len(self.tables.get(request_id, ()))
        return self.blocks_for(length) - have <= self.num_free

    def allocate(self, request_id: str, length: int) -> None:
        """Make the request's table cover positions [0, length)."""
        table = self.tables.setdefault(request_id, [])
        need = self.blocks_for(length) - len(table)
        if need > self.num_free:
            raise CacheFullError(f"need {need} blocks, {self.num_free} free")
        for _ in range(need):
            table.append(self._take_block())

    def _take_block(self) -> int:
        if self.free_ids:
            b = self.free_ids.popleft()
        else:  # evict the least recently used cached prefix block
            b, _ = self.evictable.popitem(last=False)
            del self.by_hash[self.hash_of.pop(b)]
            del self.origin[b]
        self.ref[b] = 1
        return b

    def free(self, request_id: str) -> None:
        for b in self.tables.pop(request_id, ()):
            self.ref[b] -= 1
            assert self.ref[b] >= 0
            if self.ref[b] == 0:
                if b in self.hash_of:
                    self.evictable[b] = None
                else:
                    self.free_ids.append(b)

    def slots(self, request_id: str, start: int, end: int) -> np.ndarray:
        """Flat pool indices of positions [start, end) of a request."""
        table = np.asarray(self.tables[request_id], dtype=np.int64)
        pos = np.arange(start, end)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).astype(np.int32)

    @property
    def in_use(self) -> int:
        return int((self.ref > 0).sum())

    # -- prefix cache ------------------------------------------------------------
    def _chain(self, tokens, n_blocks: int) -> list[int]:
        hashes, h = [], 0
        bs = self.block_size
        for i in range(n_blocks):
            block = np.asarray(tokens[i * bs : (i + 1) * bs], dtype=np.int64).tobytes()
            h = xxhash.xxh3_64_intdigest(block, seed=h & 0xFFFFFFFFFFFFFFFF)
            hashes.append(h)
        return hashes

    def match_prefix(self, request_id: str, prompt) -> int:
        """Attach cached blocks of the prompt's longest cached prefix; return its length.

        At least the last prompt token is always left to compute (its logits
        give the first generated token).
        """
        if not self.prefix_caching:
            return 0
        full = (len(prompt) - 1) // self.block_size
        table = self.tables.setdefault(request_id, [])
        assert not table, "match_prefix must come before allocate"
        for h in self._chain(prompt, full):
            b = self.by_hash.get(h)
            if b is None:
                break
            if self.ref[b] == 0:
                self.evictable.pop(b, None)
            self.ref[b] += 1
            table.append(b)
        matched = len(table) * self.block_size
        self.hits += matched
        return matched

    def register_prefix(self, request_id: str, tokens, num_computed: int) -> None:
        """Publish the request's full blocks whose K/V are computed from `tokens`."""
        if not self.prefix_caching:
            return
        table = self.tables.get(request_id, [])
        full = min(num_computed // self.block_size, len(table))
        for i, h in enumerate(self._chain(tokens, full)):
            b = table[i]
            if b in self.hash_of or h in self.by_hash:
                continue
            self.by_hash[h] = b
            self.hash_of[b] = h
            self.origin[b] = (request_id, i * self.block_size)
