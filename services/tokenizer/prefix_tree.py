"""An approximate prefix tree of token ids per scheduler, for cache-aware routing.

Like SGLang's router (cache_aware policy): the tokenizer cannot see a scheduler's radix cache, so it
remembers what it sent where. Each node is one token; `tenants` maps each scheduler whose prompts
passed through the node to the tick it was last used. Rules:
- the tree holds at most `max_tokens` (node, tenant) pairs; past that the least recently used
  leaves are evicted per tenant, down to 90% so that eviction is amortized;
- a node with no tenant left is removed, so every node in the tree has at least one tenant;
- it is a hint, never a truth: the scheduler may have evicted the prefix already.
"""

from __future__ import annotations

import heapq
import itertools
from typing import NamedTuple


class _Node:
    __slots__ = ("token", "parent", "children", "tenants")

    def __init__(self, token: int, parent: _Node | None) -> None:
        self.token = token
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.tenants: dict[str, int] = {}


class PrefixMatch(NamedTuple):
    length: int  # matched tokens
    tenant: str | None  # scheduler holding the longest match (most recently used on ties)


class PrefixTree:
    def __init__(self, max_tokens: int = 200_000) -> None:
        self.max_tokens = max_tokens
        self.root = _Node(-1, None)
        self.tenant_size: dict[str, int] = {}
        self._tick = itertools.count(1)

    @property
    def size(self) -> int:
        return sum(self.tenant_size.values())

    def insert(self, ids: list[int], tenant: str) -> None:
        tick = next(self._tick)
        node = self.root
        for t in ids:
            child = node.children.get(t)
            if child is None:
                child = node.children[t] = _Node(t, node)
            if tenant not in child.tenants:
                self.tenant_size[tenant] = self.tenant_size.get(tenant, 0) + 1
            child.tenants[tenant] = tick
            node = child
        if self.size > self.max_tokens:
            self.evict(int(self.max_tokens * 0.9))

    def match(self, ids: list[int], tenants: set[str] | None = None) -> PrefixMatch:
        """Longest prefix of `ids` held by any of `tenants` (all when None)."""
        node, length, best = self.root, 0, None
        for t in ids:
            child = node.children.get(t)
            if child is None:
                break
            held = {k: v for k, v in child.tenants.items() if tenants is None or k in tenants}
            if not held:
                break
            node, length = child, length + 1
            best = max(held, key=held.__getitem__)
        return PrefixMatch(length, best)

    def remove_tenant(self, tenant: str) -> None:
        """Forget a scheduler (it restarted, so its cache is empty)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.tenants.pop(tenant, None) is not None:
                stack.extend(node.children.values())
                if not node.tenants:
                    self._unlink(node)
        self.tenant_size.pop(tenant, None)

    def evict(self, target: int) -> None:
        """Drop least recently used (leaf, tenant) pairs until the size is at most `target`."""
        heap: list[tuple[int, int, _Node, str]] = []
        seq = itertools.count()
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for tenant, tick in node.tenants.items():
                if not any(tenant in c.tenants for c in node.children.values()):
                    heap.append((tick, next(seq), node, tenant))
        heapq.heapify(heap)
        size = self.size
        while size > target and heap:
            _, _, node, tenant = heapq.heappop(heap)
            if node.tenants.pop(tenant, None) is None:
                continue
            self.tenant_size[tenant] -= 1
            size -= 1
            parent = node.parent
            if not node.tenants:
                self._unlink(node)
            if (parent is not None and parent is not self.root and tenant in parent.tenants
                    and not any(tenant in c.tenants for c in parent.children.values())):
                heapq.heappush(heap, (parent.tenants[tenant], next(seq), parent, tenant))

    def _unlink(self, node: _Node) -> None:
        if node.parent is not None and node.parent.children.get(node.token) is node:
            del node.parent.children[node.token]

    def check(self) -> None:
        """Integrity check for tests: sizes add up and no node is tenantless."""
        counts: dict[str, int] = {}
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            assert node.tenants, "tenantless node"
            for tenant in node.tenants:
                counts[tenant] = counts.get(tenant, 0) + 1
            stack.extend(node.children.values())
        assert counts == {k: v for k, v in self.tenant_size.items() if v}, (counts, self.tenant_size)
