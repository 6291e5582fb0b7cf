"""A radix tree over token ids whose values are KV pool slots (page size 1), as in SGLang.

Rules:
- A node with `lock_ref > 0` (or with a locked descendant: locking walks up to the root) is never
  evicted. Running requests lock the node that ends their matched prefix.
- `evict(n)` frees up to n tokens from unlocked leaves, least recently used first; evicting zero (or
  more than is evictable) is always safe.
- `evictable_size() + protected_size()` is the number of slots the tree holds; every slot it holds is
  allocated in the pool and held by no one else.
- `insert` returns how many leading tokens were already in the tree: the caller's slots for those
  tokens are duplicates and the caller frees them (except the ones it got from the tree itself).
- Every key lives in a namespace with its own root: 0 for the base model, a LoRA adapter's uid for
  requests on that adapter. The same tokens under two adapters have different KV, so nothing is
  ever shared across namespaces; `drop(namespace)` frees one whose adapter is gone.
"""

from __future__ import annotations

import heapq
import itertools
from typing import NamedTuple, cast

import torch

from services.scheduler.kvcache.memory_pool import TokenToKVPool

_clock = itertools.count()  # monotonic LRU stamps; cheaper than time.monotonic and never ties


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, parent: TreeNode | None = None, key: list[int] | None = None,
                 value: torch.Tensor | None = None) -> None:
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key: list[int] = key or []
        self.value = value          # [len(key)] int64 slots
        self.lock_ref = 0
        self.last_access = next(_clock)

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access < other.last_access


class MatchResult(NamedTuple):
    indices: torch.Tensor   # [P] int64 slots of the matched prefix
    last_node: TreeNode     # deepest matched node (lock it to keep the prefix)


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # fast path: C-level list compare
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class RadixCache:
    def __init__(self, pool: TokenToKVPool, device: torch.device | str = "cpu", disable: bool = False) -> None:
        self.pool = pool
        self.device = torch.device(device)
        self.disable = disable
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self.reset()

    def reset(self) -> None:
        """Forget everything (the caller frees the pool; used by flush with nothing running)."""
        self.roots: dict[int, TreeNode] = {}
        self.root = self._root(0)
        self._evictable = 0
        self._protected = 0

    def _root(self, namespace: int) -> TreeNode:
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = TreeNode()
            root.lock_ref = 1  # a root is never evicted
        return root

    # -- queries ---------------------------------------------------------------------------------

    def match_prefix(self, ids: list[int], namespace: int = 0) -> MatchResult:
        """Longest cached prefix of ids. Callers pass ids[:-1] so at least one token is computed."""
        if self.disable or not ids:
            return MatchResult(self._empty, self.root)
        node, values = self._root(namespace), cast(list[torch.Tensor], [])
        stamp = next(_clock)
        while ids:
            child = node.children.get(ids[0])
            if child is None:
                break
            child.last_access = stamp
            n = _common_len(child.key, ids)
            if n < len(child.key):
                child = self._split(child, n)
                assert child.value is not None  # _split gives the upper node a value
                values.append(child.value)
                node = child
                break
            assert child.value is not None  # only the root has no value
            values.append(child.value)
            node = child
            ids = ids[n:]
        if not values:
            return MatchResult(self._empty, node)
        return MatchResult(values[0] if len(values) == 1 else torch.cat(values), node)

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    # -- updates ---------------------------------------------------------------------------------

    def insert(self, ids: list[int], slots: torch.Tensor, namespace: int = 0) -> int:
        """Add ids -> slots ([len(ids)] int64). Returns the length of ids already present."""
        if self.disable or not ids:
            return 0
        node, done = self._root(namespace), 0
        stamp = next(_clock)
        while done < len(ids):
            rest = ids[done:]
            child = node.children.get(rest[0])
            if child is None:
                new = TreeNode(node, rest, slots[done:].clone())
                new.last_access = stamp
                node.children[rest[0]] = new
                self._evictable += len(rest)
                return done
            child.last_access = stamp
            n = _common_len(child.key, rest)
            if n < len(child.key):
                child = self._split(child, n)
            done += n
            node = child
        return done

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut child's key at n; returns the new upper node (which inherits child's lock)."""
        # child is never the root: the root has no value and no parent and is never split
        assert child.value is not None and child.parent is not None
        upper = TreeNode(child.parent, child.key[:n], child.value[:n])
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.children = {child.key[n]: child}
        child.parent.children[child.key[0]] = upper
        child.parent = upper
        child.key = child.key[n:]
        child.value = child.value[n:]
        return upper

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:  # up to its namespace's root
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            assert node.parent is not None  # only the root has no parent, and the walk stops there
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node.lock_ref -= 1
            assert node.parent is not None  # only the root has no parent, and the walk stops there
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots (if that many are evictable) from unlocked LRU leaves."""
        if num_tokens <= 0 or self._evictable == 0:
            return 0
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed, released = 0, cast(list[torch.Tensor], [])
        while freed < num_tokens and leaves:
            leaf = heapq.heappop(leaves)
            # leaves are non-root nodes: they have a value and a parent
            assert leaf.value is not None and leaf.parent is not None
            released.append(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        if released:
            self.pool.free(torch.cat(released))
        return freed

    def drop(self, namespace: int) -> int:
        """Free every cached token of a namespace (its adapter was unloaded: nothing can match it
        again) and forget its root; returns how many. Locked nodes (a request still using it) stay."""
        root = self.roots.get(namespace)
        if namespace == 0 or root is None:
            return 0
        freed = 0
        for child in list(root.children.values()):
            if child.lock_ref == 0:
                freed += self._free_subtree(child)
                del root.children[child.key[0]]
        if not root.children:
            del self.roots[namespace]
        return freed

    def _free_subtree(self, top: TreeNode) -> int:
        nodes, stack = [], [top]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        n = sum(len(x.key) for x in nodes)
        self._evictable -= n
        self.pool.free(torch.cat([cast(torch.Tensor, x.value) for x in nodes]))
        return n

    # -- integrity -------------------------------------------------------------------------------

    def _nodes(self) -> list[TreeNode]:
        out, stack = [], [c for root in self.roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def check(self) -> None:
        """Raise AssertionError if the tree's invariants do not hold (run it when idle or in tests)."""
        evictable = protected = 0
        seen: set[int] = set()
        for node in self._nodes():
            assert node.key, "empty non-root node"
            assert node.value is not None and node.value.numel() == len(node.key), "key/value length mismatch"
            assert node.parent is not None, "non-root node without a parent"
            assert node.parent.children.get(node.key[0]) is node, "child indexed under the wrong token"
            assert node.lock_ref >= 0, "negative lock_ref"
            if node.children:
                # A node's lock count is at least each child's (locks propagate to the root).
                assert all(node.lock_ref >= c.lock_ref for c in node.children.values()), "lock not propagated"
            slots = node.value.tolist()
            assert 0 not in slots, "slot 0 (padding) in the tree"
            assert seen.isdisjoint(slots), "a slot is held by two nodes"
            seen.update(slots)
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert evictable == self._evictable, f"evictable {self._evictable} != {evictable}"
        assert protected == self._protected, f"protected {self._protected} != {protected}"

    def all_slots(self) -> torch.Tensor:
        """Every slot the tree holds (for flush and for pool accounting in tests)."""
        values = cast(list[torch.Tensor], [n.value for n in self._nodes()])  # non-root nodes all have a value
        return torch.cat(values) if values else self._empty
