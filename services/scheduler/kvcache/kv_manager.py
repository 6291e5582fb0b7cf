"""Who owns which KV slots: allocation with eviction, prefix matching, and releasing a request.

The only place that moves slots between the pool, the radix cache and a request, so the accounting
rule holds in one file: pool free + cache + request-owned slots == pool size, at every step. A request
on a LoRA adapter matches and caches only in its adapter's namespace of the tree (req.lora_uid).
"""

from __future__ import annotations

import torch

from services.scheduler.core import prompt_logprobs
from services.scheduler.core.req import Req
from services.scheduler.kvcache.memory_pool import ReqToTokenPool, TokenToKVPool
from services.scheduler.kvcache.radix_cache import RadixCache


class KVManager:
    def __init__(self, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool, tree: RadixCache) -> None:
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.tree = tree

    @property
    def size(self) -> int:
        return self.kv_pool.size

    def available(self) -> int:
        """Slots an allocation can get: free now plus evictable from the cache."""
        return self.kv_pool.available_size() + self.tree.evictable_size()

    def used_tokens(self) -> int:
        """Slots held by requests or by locked cache prefixes."""
        return self.kv_pool.size - self.available()

    def alloc(self, n: int) -> torch.Tensor | None:
        """[n] int64 slots, evicting cached prefixes if needed; None (nothing taken) if impossible."""
        short = n - self.kv_pool.available_size()
        if short > 0:
            self.tree.evict(short)
        return self.kv_pool.alloc(n)

    def match(self, req: Req) -> int:
        """Look up the cached prefix of a waiting request (not locked yet). Returns its length."""
        # Leave the last token uncached: its logits are what the prefill is for; and every position
        # whose logits score a prompt token asked for (prompt_logprobs.py).
        cap = prompt_logprobs.cache_cap(req)
        indices, node = self.tree.match_prefix(req.fill_ids[:-1] if cap is None else req.fill_ids[:cap], req.lora_uid)
        req.prefix_indices, req.last_node = indices, node
        return int(indices.numel())

    def begin(self, req: Req) -> bool:
        """Give a newly scheduled request a row and its cached prefix; False if no row is free."""
        row = self.req_pool.alloc()
        if row is None:
            return False
        req.req_pool_idx = row
        self.tree.inc_lock_ref(req.last_node)
        prefix = req.prefix_indices
        if prefix is not None and prefix.numel():
            self.req_pool.req_to_token[row, : prefix.numel()] = prefix
        req.kv_len = 0 if prefix is None else int(prefix.numel())
        return True

    def cache_prefix(self, req: Req, end: int | None = None) -> None:
        """Share what a running request has prefilled through the radix cache now, not at finish.

        Requests arriving while it still decodes (the same system prompt, the other samples of n > 1)
        then reuse its prompt. Tokens someone else cached meanwhile are deduplicated: the row points at
        the cached slots and ours go back to the pool. The request's lock moves to the deeper node.
        end: cache only its first `end` tokens (default kv_len): with overlap scheduling, the KV the
        forwards that have run wrote, not what a forward in flight is still writing.
        """
        row = req.req_pool_idx
        n = req.kv_len if end is None else min(end, req.kv_len)
        if row is None or self.tree.disable or n == 0:
            return
        n_prefix = 0 if req.prefix_indices is None else int(req.prefix_indices.numel())
        if n <= n_prefix:
            return
        ids = (req.origin_input_ids + req.output_ids)[:n]
        slots = self.req_pool.req_to_token[row, :n].clone()  # [n] int64
        already = self.tree.insert(ids, slots, req.lora_uid)
        if already > n_prefix:
            self.kv_pool.free(slots[n_prefix:already])
        indices, node = self.tree.match_prefix(ids, req.lora_uid)  # [n] canonical slots, node covers all of ids
        self.req_pool.req_to_token[row, :n] = indices
        self.tree.inc_lock_ref(node)
        self.tree.dec_lock_ref(req.last_node)
        req.prefix_indices, req.last_node = indices, node

    def release(self, req: Req, cache: bool = True) -> None:
        """Give back a request's KV: into the radix cache (finish, retract) or straight to the pool (abort)."""
        row = req.req_pool_idx
        if row is None:
            return
        n_prefix = 0 if req.prefix_indices is None else int(req.prefix_indices.numel())
        slots = self.req_pool.req_to_token[row, : req.kv_len].clone()  # [kv_len] int64
        if cache and req.kv_len > 0 and not self.tree.disable:
            ids = (req.origin_input_ids + req.output_ids)[: req.kv_len]
            already = self.tree.insert(ids, slots, req.lora_uid)
            # Tokens someone else cached meanwhile: our copies of them are duplicates.
            if already > n_prefix:
                self.kv_pool.free(slots[n_prefix:already])
        else:
            self.kv_pool.free(slots[n_prefix:])
        self.tree.dec_lock_ref(req.last_node)
        self.req_pool.free(row)
        req.req_pool_idx = None
        req.last_node = None

    def flush(self) -> None:
        """Drop the whole prefix cache (callers ensure nothing is running)."""
        slots = self.tree.all_slots()
        self.tree.reset()
        self.kv_pool.free(slots)
