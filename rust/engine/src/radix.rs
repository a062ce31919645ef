//! The radix prefix cache: a tree over token ids, one edge page-aligned, whose nodes own KV pages.
//!
//! Only full pages are cached: a node's key is a multiple of `page_size` tokens and it holds one
//! page per `page_size` tokens. A request that reuses a prefix *locks* the node it matched; locks
//! count on the node and all its ancestors, so an unlocked node has an unlocked subtree and
//! eviction (LRU over unlocked leaves) never touches a page a running request reads. Time is a
//! logical tick bumped on every match and insert: nothing here reads a clock.
//!
//! Keys live in *namespaces*: KV computed under one LoRA adapter is not KV of another, so
//! the root's children are keyed by (namespace, first page) and a lookup in namespace `ns`
//! only ever walks nodes inserted in `ns` (0: the base model; the plain methods use it).
//!
//! With a host tier (`with_host`, `--enable-hierarchical-cache`) eviction *demotes* a node
//! instead of dropping it: its KV is copied to host slots and its device pages freed; a later
//! match through it loads it back (`radix_host.rs`). The copies are queued in order
//! (`take_copies`) and ride in the next plan, which the worker runs before its forward. Below
//! the host tier a storage tier may keep what the host drops (`radix_storage.rs`).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use serde::{Deserialize, Serialize};

use crate::pages::{PagePool, Pages};

/// Which unlocked cached node goes first when pages are needed (`--radix-eviction-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EvictionPolicy {
    /// Least recently used first.
    #[default]
    Lru,
    /// Least frequently hit first, ties by recency.
    Lfu,
}

/// A node of the tree. Valid as long as the node is locked (or until the next mutation if not).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NodeId(u32);

impl NodeId {
    /// The root: holds no tokens. Locking it is a no-op, so "no match" needs no special case.
    pub const ROOT: NodeId = NodeId(0);
}

/// The result of `match_prefix`: the longest cached page-aligned prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Matched tokens; a multiple of `page_size`.
    pub len: usize,
    /// One page per `page_size` matched tokens, in order. Owned by the tree: valid while `node`
    /// is locked.
    pub pages: Vec<u32>,
    /// The node ending exactly at `len` (the tree is split there if needed); lock it to keep
    /// the pages.
    pub node: NodeId,
}

struct Node {
    parent: Option<NodeId>,
    /// Children keyed by the first page of their edge: siblings differ within their first page.
    children: HashMap<Vec<u32>, NodeId>,
    /// Tokens on the edge from the parent; a multiple of `page_size`.
    key: Vec<u32>,
    /// One device page per `page_size` tokens of `key`; empty while the node lives on the host
    /// only (then `host` holds it, and so do all its descendants).
    pages: Pages,
    /// Its copy in host slots (host tier only): one slot per page of `key`.
    host: Option<Pages>,
    /// Matches through this node (`EvictionPolicy::Lfu`).
    hits: u64,
    /// Requests using this node or a descendant.
    lock: u32,
    last_access: u64,
    /// The namespace of the subtree (`match_prefix_in`); the root's is 0 and unused.
    ns: u32,
    /// One block hash per page of `key` while KV events are on (`radix_events.rs`); empty
    /// otherwise.
    hashes: Vec<u64>,
}

/// The prefix cache. With `enabled == false` it caches nothing (`--disable-radix-cache`):
/// matches are empty and inserted pages go straight back to the pool.
pub struct RadixCache {
    pool: PagePool,
    page_size: usize,
    enabled: bool,
    /// Arena of nodes; `None` marks a reusable id.
    nodes: Vec<Option<Node>>,
    vacant: Vec<u32>,
    tick: u64,
    cached_pages: usize,
    /// Pages of nodes with `lock > 0`.
    locked_pages: usize,
    policy: EvictionPolicy,
    /// The host tier, when on.
    host: Option<host::HostTier>,
    /// KV events recorded since the last `take_events`; None: events off.
    events: Option<Vec<events::KvEvent>>,
    /// The storage tier, when on.
    storage: Option<storage::StorageTier>,
}

impl RadixCache {
    pub fn new(pool: PagePool, page_size: usize, enabled: bool) -> Self {
        assert!(page_size > 0, "page_size must be positive");
        let root = Node {
            parent: None,
            children: HashMap::new(),
            key: Vec::new(),
            pages: pool.empty(),
            host: None,
            hits: 0,
            lock: 0,
            last_access: 0,
            ns: 0,
            hashes: Vec::new(),
        };
        RadixCache {
            pool,
            page_size,
            enabled,
            nodes: vec![Some(root)],
            vacant: Vec::new(),
            tick: 0,
            cached_pages: 0,
            locked_pages: 0,
            policy: EvictionPolicy::Lru,
            host: None,
            events: None,
            storage: None,
        }
    }

    /// Orders eviction by `policy` (LRU unless set).
    pub fn with_policy(mut self, policy: EvictionPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Adds a host tier of `host_pool`'s slots under the device pages.
    pub fn with_host(mut self, host_pool: PagePool, write: WritePolicy) -> Self {
        self.host = Some(host::HostTier::new(host_pool, write));
        self
    }

    /// Pages of a node's edge (whichever tier holds them).
    fn edge_pages(&self, id: NodeId) -> usize {
        self.node(id).key.len() / self.page_size
    }

    /// The eviction rank of a node under the policy: smallest goes first.
    fn evict_key(&self, n: &Node) -> (u64, u64) {
        match self.policy {
            EvictionPolicy::Lru => (0, n.last_access),
            EvictionPolicy::Lfu => (n.hits, n.last_access),
        }
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// Pages owned by the tree.
    pub fn cached_pages(&self) -> usize {
        self.cached_pages
    }

    /// Pages `evict` could free now: those of unlocked nodes.
    pub fn evictable_pages(&self) -> usize {
        self.cached_pages - self.locked_pages
    }

    /// Finds the longest cached page-aligned prefix of `tokens`, splitting the node it ends in
    /// so the returned node covers exactly the match, and marks the path as recently used.
    pub fn match_prefix(&mut self, tokens: &[u32]) -> PrefixMatch {
        self.match_prefix_in(0, tokens)
    }

    /// `match_prefix` in namespace `ns` (a LoRA adapter's id).
    pub fn match_prefix_in(&mut self, ns: u32, tokens: &[u32]) -> PrefixMatch {
        let mut found = PrefixMatch {
            len: 0,
            pages: Vec::new(),
            node: NodeId::ROOT,
        };
        if !self.enabled {
            return found;
        }
        self.tick += 1;
        let ps = self.page_size;
        let full = tokens.len() / ps * ps;
        let (mut len, mut path) = (0, Vec::new());
        while len < full {
            let parent = path.last().copied().unwrap_or(NodeId::ROOT);
            let Some(child) = self.child(ns, parent, &tokens[len..len + ps]) else {
                break;
            };
            let common = self.common_pages(child, &tokens[len..full]);
            let child = if common < self.edge_pages(child) {
                self.split(child, common)
            } else {
                child
            };
            let tick = self.tick;
            let node = self.node_mut(child);
            node.last_access = tick;
            node.hits += 1;
            len += common * ps;
            path.push(child);
        }
        self.match_storage(ns, tokens, len, &mut path);
        // Host-resident nodes end the path (a device node's ancestors are on the device).
        if let Some(first) = path.iter().position(|&n| self.node(n).pages.is_empty()) {
            let loaded = self.load_path(&path);
            path.truncate(first + loaded);
        }
        for &id in &path {
            let node = self.node(id);
            found.pages.extend_from_slice(node.pages.ids());
            found.len += node.key.len();
            found.node = id;
        }
        found
    }

    /// Length of the longest cached page-aligned prefix, without touching the tree (for ranking
    /// waiting requests and for a router asking which replica has a prefix).
    pub fn peek_prefix_len(&self, tokens: &[u32]) -> usize {
        self.peek_prefix_len_in(0, tokens)
    }

    /// `peek_prefix_len` in namespace `ns`.
    pub fn peek_prefix_len_in(&self, ns: u32, tokens: &[u32]) -> usize {
        if !self.enabled {
            return 0;
        }
        let ps = self.page_size;
        let full = tokens.len() / ps * ps;
        let (mut len, mut node) = (0, NodeId::ROOT);
        while len < full {
            let Some(child) = self.child(ns, node, &tokens[len..len + ps]) else {
                break;
            };
            let common = self.common_pages(child, &tokens[len..full]);
            len += common * ps;
            if common < self.edge_pages(child) {
                break;
            }
            node = child;
        }
        len
    }

    /// Pins `node` and its ancestors against eviction.
    pub fn lock(&mut self, node: NodeId) {
        let mut cur = Some(node);
        while let Some(id) = cur.filter(|&id| id != NodeId::ROOT) {
            let n = self.node_mut(id);
            n.lock += 1;
            let (first, pages, parent) = (n.lock == 1, n.pages.len(), n.parent);
            if first {
                self.locked_pages += pages;
            }
            cur = parent;
        }
    }

    /// Undoes one `lock(node)`.
    pub fn unlock(&mut self, node: NodeId) {
        let mut cur = Some(node);
        while let Some(id) = cur.filter(|&id| id != NodeId::ROOT) {
            let n = self.node_mut(id);
            debug_assert!(n.lock > 0, "unlock of an unlocked node");
            n.lock = n.lock.saturating_sub(1);
            let (last, pages, parent) = (n.lock == 0, n.pages.len(), n.parent);
            if last {
                self.locked_pages -= pages;
            }
            cur = parent;
        }
    }

    /// Caches the full pages of `tokens`. `pages` holds the *last* `pages.len()` pages of
    /// `tokens` (page-aligned part); the pages before them must already be in the tree, which
    /// holds when the caller locked the prefix it started from. Pages whose tokens the tree
    /// already has are dropped (freed) and counted in the return value. If the tree lacks a
    /// page in front of `pages` (a caller bug), nothing is inserted and `pages` are freed.
    pub fn insert(&mut self, tokens: &[u32], pages: Pages) -> usize {
        self.insert_in(0, tokens, pages)
    }

    /// `insert` in namespace `ns`.
    pub fn insert_in(&mut self, ns: u32, tokens: &[u32], mut pages: Pages) -> usize {
        if !self.enabled {
            return 0;
        }
        self.tick += 1;
        let ps = self.page_size;
        let n = tokens.len() / ps;
        if pages.len() > n {
            drop(pages.split_off(n));
        }
        let first_own = n - pages.len();
        let (mut pos, mut node, mut duplicates) = (0, NodeId::ROOT, 0);
        while pos < n {
            let Some(child) = self.child(ns, node, &tokens[pos * ps..(pos + 1) * ps]) else {
                break;
            };
            let common = self.common_pages(child, &tokens[pos * ps..n * ps]);
            let child = if common < self.edge_pages(child) {
                self.split(child, common)
            } else {
                child
            };
            let tick = self.tick;
            self.node_mut(child).last_access = tick;
            // Our pages for positions the tree has: duplicates, unless the node lives on the
            // host only and its parent on the device: then it adopts them (promoted for free).
            let ours = (pos + common).saturating_sub(pos.max(first_own));
            if ours > 0 {
                let rest = pages.split_off(ours);
                let mine = std::mem::replace(&mut pages, rest);
                let adopt = ours == common && self.on_device(node) && !self.on_device(child);
                if adopt {
                    self.attach_device(child, mine);
                } else {
                    duplicates += ours;
                }
            }
            pos += common;
            node = child;
        }
        if pos < first_own || !self.on_device(node) {
            return 0;
        }
        if !pages.is_empty() {
            let key = tokens[pos * ps..n * ps].to_vec();
            let id = self.add_child(ns, node, key, pages);
            self.on_added(id);
            self.write_through(id);
        }
        duplicates
    }

    /// Whether a node's KV is in device pages (the root counts as such).
    fn on_device(&self, id: NodeId) -> bool {
        id == NodeId::ROOT || !self.node(id).pages.is_empty()
    }

    /// Gives a host-only node device pages holding its KV.
    fn attach_device(&mut self, id: NodeId, pages: Pages) {
        let n = pages.len();
        let node = self.node_mut(id);
        node.pages = pages;
        let locked = node.lock > 0;
        self.cached_pages += n;
        if locked {
            self.locked_pages += n;
        }
        self.on_stored(id);
    }

    /// Frees at least `n` device pages from unlocked nodes in policy order (fewer if not
    /// enough are evictable): dropped, or with a host tier demoted to host slots. Returns the
    /// device pages freed.
    pub fn evict(&mut self, n: usize) -> usize {
        let mut heap: BinaryHeap<Reverse<((u64, u64), u32)>> = (1..self.nodes.len())
            .filter(|&i| self.device_evictable(NodeId(i as u32)))
            .map(|i| Reverse((self.evict_key(self.node(NodeId(i as u32))), i as u32)))
            .collect();
        let mut freed = 0;
        while freed < n {
            let Some(Reverse((_, id))) = heap.pop() else {
                break;
            };
            let id = NodeId(id);
            if !self.device_evictable(id) {
                continue; // changed since it was queued
            }
            let parent = self.node(id).parent;
            freed += if self.host.is_some() {
                self.demote(id)
            } else {
                self.remove_subtree(id)
            };
            if let Some(p) = parent.filter(|&p| self.device_evictable(p)) {
                heap.push(Reverse((self.evict_key(self.node(p)), p.0)));
            }
        }
        freed
    }

    /// An unlocked node holding device pages none of whose children does.
    fn device_evictable(&self, id: NodeId) -> bool {
        let Some(n) = self.nodes.get(id.0 as usize).and_then(Option::as_ref) else {
            return false;
        };
        id != NodeId::ROOT
            && n.lock == 0
            && !n.pages.is_empty()
            && n.children.values().all(|&c| self.node(c).pages.is_empty())
    }

    /// Removes an unlocked node and everything below it, in both tiers. Returns the device
    /// pages freed.
    fn remove_subtree(&mut self, id: NodeId) -> usize {
        let mut freed = 0;
        let mut stack = vec![id];
        while let Some(cur) = stack.pop() {
            let Some(node) = self.nodes[cur.0 as usize].take() else {
                continue;
            };
            self.vacant.push(cur.0);
            stack.extend(node.children.values().copied());
            freed += node.pages.len();
            self.cached_pages -= node.pages.len();
            if !node.pages.is_empty() {
                self.on_removed(&node.hashes);
            }
            if let (Some(h), Some(tier)) = (&node.host, &mut self.host) {
                tier.cached -= h.len();
            }
            if cur == id {
                if let Some(parent_id) = node.parent {
                    let first_page = child_key(parent_id, node.ns, &node.key[..self.page_size]);
                    self.node_mut(parent_id).children.remove(&first_page);
                }
            }
            // `node.pages` and `node.host` drop here: the pages go back to their pools.
        }
        freed
    }

    /// Drops every unlocked node, in both tiers. Returns the device pages freed.
    pub fn flush(&mut self) -> usize {
        let tops: Vec<NodeId> = (1..self.nodes.len() as u32)
            .map(NodeId)
            .filter(|&id| {
                self.nodes[id.0 as usize].as_ref().is_some_and(|n| {
                    n.lock == 0
                        && n.parent
                            .is_some_and(|p| p == NodeId::ROOT || self.node(p).lock > 0)
                })
            })
            .collect();
        let from = self.events_len();
        let freed = tops.into_iter().map(|id| self.remove_subtree(id)).sum();
        self.on_flushed(from);
        freed
    }

    fn node(&self, id: NodeId) -> &Node {
        self.nodes[id.0 as usize]
            .as_ref()
            .expect("NodeId refers to a live node")
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        self.nodes[id.0 as usize]
            .as_mut()
            .expect("NodeId refers to a live node")
    }

    fn child(&self, ns: u32, node: NodeId, first_page: &[u32]) -> Option<NodeId> {
        let children = &self.node(node).children;
        if node == NodeId::ROOT {
            children.get(&child_key(node, ns, first_page)).copied()
        } else {
            children.get(first_page).copied()
        }
    }

    /// Whole pages shared by `child`'s key and `tokens`.
    fn common_pages(&self, child: NodeId, tokens: &[u32]) -> usize {
        let key = &self.node(child).key;
        key.chunks(self.page_size)
            .zip(tokens.chunks_exact(self.page_size))
            .take_while(|(a, b)| a == b)
            .count()
    }

    /// Splits `id` after `at` pages (0 < at < its pages): a new node takes the front part and
    /// becomes `id`'s parent. `id` keeps its suffix, so a `NodeId` a request locked stays valid.
    fn split(&mut self, id: NodeId, at: usize) -> NodeId {
        let ps = self.page_size;
        let new_id = self.vacant_id();
        let child = self.node_mut(id);
        let tail_pages = child.pages.split_off(at);
        let front_pages = std::mem::replace(&mut child.pages, tail_pages);
        let tail_host = child.host.as_mut().map(|h| h.split_off(at));
        let front_host = std::mem::replace(&mut child.host, tail_host);
        let tail_key = child.key.split_off(at * ps);
        let front_key = std::mem::replace(&mut child.key, tail_key);
        let tail_hashes = child.hashes.split_off(at.min(child.hashes.len()));
        let front_hashes = std::mem::replace(&mut child.hashes, tail_hashes);
        let parent = child.parent.replace(new_id);
        let (lock, last_access, ns, hits) = (child.lock, child.last_access, child.ns, child.hits);
        let tail_first = child.key[..ps].to_vec();
        let front_first = parent.map(|p| child_key(p, ns, &front_key[..ps]));
        self.nodes[new_id.0 as usize] = Some(Node {
            parent,
            children: HashMap::from([(tail_first, id)]),
            key: front_key,
            pages: front_pages,
            host: front_host,
            hits,
            // Same lockers as the suffix: they hold the whole path, so `locked_pages` is unchanged.
            lock,
            last_access,
            ns,
            hashes: front_hashes,
        });
        if let (Some(parent), Some(front_first)) = (parent, front_first) {
            self.node_mut(parent).children.insert(front_first, new_id);
        }
        new_id
    }

    fn add_child(&mut self, ns: u32, parent: NodeId, key: Vec<u32>, pages: Pages) -> NodeId {
        let id = self.vacant_id();
        self.cached_pages += pages.len();
        let first = child_key(parent, ns, &key[..self.page_size]);
        self.nodes[id.0 as usize] = Some(Node {
            parent: Some(parent),
            children: HashMap::new(),
            key,
            pages,
            host: None,
            hits: 0,
            lock: 0,
            last_access: self.tick,
            ns,
            hashes: Vec::new(),
        });
        self.node_mut(parent).children.insert(first, id);
        id
    }

    fn vacant_id(&mut self) -> NodeId {
        match self.vacant.pop() {
            Some(id) => NodeId(id),
            None => {
                self.nodes.push(None);
                NodeId((self.nodes.len() - 1) as u32)
            }
        }
    }
}

/// The key of a child whose edge starts with `first_page` among `parent`'s children: under the
/// root the namespace leads it, elsewhere the page alone (a subtree has one namespace).
fn child_key(parent: NodeId, ns: u32, first_page: &[u32]) -> Vec<u32> {
    if parent == NodeId::ROOT {
        std::iter::once(ns)
            .chain(first_page.iter().copied())
            .collect()
    } else {
        first_page.to_vec()
    }
}

#[path = "radix_events.rs"]
mod events;
#[path = "radix_host.rs"]
mod host;
#[path = "radix_invariants.rs"]
mod invariants;
#[path = "radix_storage.rs"]
mod storage;
pub use events::{block_hash, KvEvent};
pub use host::{HostStats, WritePolicy};
pub use storage::StorageStats;

#[cfg(test)]
#[path = "radix_events_tests.rs"]
mod events_tests;
#[cfg(test)]
#[path = "radix_tests.rs"]
mod tests;
