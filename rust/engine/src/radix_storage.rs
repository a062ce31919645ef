//! The radix cache's storage tier (HiCache's third tier, `--hicache-storage-backend`): a page
//! dropped from the host tier is stored under its block hash (the KV-event hash: the same tokens
//! after the same prefix in the same namespace hash the same), and a match that runs out of tree
//! goes on through the store: the pages found there are fetched into host slots and join the
//! tree as a host-only node, which the host tier then loads like any other.
//!
//! The tree keeps the index of what the store holds (bounded by the worker's capacity, least
//! recently used dropped first) and decides every store, fetch and drop; they ride in the
//! plan's ordered copy list (`copy_kind::STORE`, `FETCH`, `DROP`) and the worker runs them with
//! its backend (python/tokenspeed/layers/kv_storage.py). The index starts empty: pages a store
//! kept from an earlier run are not known, and are overwritten when stored again.

use std::collections::{BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

use super::{block_hash, NodeId, RadixCache};
use crate::plan::{copy_kind, CopyOp};

/// The storage tier's index: what the store holds, by key, and its use order.
pub(super) struct StorageTier {
    capacity: usize,
    /// Key → the tick it was last stored or fetched.
    used: HashMap<u64, u64>,
    /// (tick, key), least recently used first.
    order: BTreeSet<(u64, u64)>,
    stats: StorageStats,
}

/// The storage tier in numbers (all zero without one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StorageStats {
    /// Pages the store may hold.
    pub total_pages: usize,
    /// Pages it holds.
    pub used_pages: usize,
    /// Prefix tokens matched in the store and fetched instead of recomputed, so far.
    pub hit_tokens: u64,
    /// Pages stored (host -> store) so far.
    pub store_pages: u64,
    /// Pages fetched (store -> host) so far.
    pub fetch_pages: u64,
}

impl StorageStats {
    /// The totals of two replicas' tiers.
    pub fn plus(&self, o: &StorageStats) -> StorageStats {
        StorageStats {
            total_pages: self.total_pages + o.total_pages,
            used_pages: self.used_pages + o.used_pages,
            hit_tokens: self.hit_tokens + o.hit_tokens,
            store_pages: self.store_pages + o.store_pages,
            fetch_pages: self.fetch_pages + o.fetch_pages,
        }
    }
}

impl StorageTier {
    fn touch(&mut self, key: u64, tick: u64) {
        if let Some(old) = self.used.insert(key, tick) {
            self.order.remove(&(old, key));
        }
        self.order.insert((tick, key));
    }
}

/// A key as the plan carries it (the bits of the hash).
fn wire(key: u64) -> i64 {
    key as i64
}

impl RadixCache {
    /// Adds a storage tier of `capacity` pages below the host tier (which it needs).
    pub fn with_storage(mut self, capacity: usize) -> Self {
        if self.host.is_some() && capacity > 0 {
            self.storage = Some(StorageTier {
                capacity,
                used: HashMap::new(),
                order: BTreeSet::new(),
                stats: StorageStats::default(),
            });
        }
        self
    }

    /// The storage tier's numbers.
    pub fn storage_stats(&self) -> StorageStats {
        self.storage
            .as_ref()
            .map_or_else(StorageStats::default, |s| StorageStats {
                total_pages: s.capacity,
                used_pages: s.used.len(),
                ..s.stats
            })
    }

    /// Whether pages need block hashes: for KV events or as storage keys.
    pub(super) fn hashes_needed(&self) -> bool {
        self.events.is_some() || self.storage.is_some()
    }

    /// Stores the pages of host-only node `id`, about to leave the host tier, that the store
    /// does not hold yet (dropping its least recently used pages for room).
    pub(super) fn store_node(&mut self, id: NodeId) {
        let tick = self.tick;
        let node = self.node(id);
        let Some(slots) = node.host.as_ref().map(|h| h.ids().to_vec()) else {
            return;
        };
        let keys = node.hashes.clone();
        let (Some(store), Some(host)) = (self.storage.as_mut(), self.host.as_mut()) else {
            return;
        };
        for (&slot, &key) in slots.iter().zip(&keys) {
            if store.used.contains_key(&key) {
                store.touch(key, tick);
                continue;
            }
            if store.used.len() >= store.capacity {
                // Pages used by this step (a fetch being made room for) are never dropped.
                let Some((t, old)) = store.order.first().copied().filter(|&(t, _)| t < tick) else {
                    break;
                };
                store.order.remove(&(t, old));
                store.used.remove(&old);
                host.copies.push(CopyOp {
                    src: 0,
                    dst: 0,
                    kind: copy_kind::DROP,
                    key: wire(old),
                });
            }
            host.copies.push(CopyOp {
                src: slot,
                dst: 0,
                kind: copy_kind::STORE,
                key: wire(key),
            });
            store.touch(key, tick);
            store.stats.store_pages += 1;
        }
    }

    /// Goes on from `path`'s end (where the tree's match of `tokens[..len]` stopped) through
    /// the store: the full pages it holds next are fetched into host slots as a new host-only
    /// child, appended to `path`.
    pub(super) fn match_storage(
        &mut self,
        ns: u32,
        tokens: &[u32],
        len: usize,
        path: &mut Vec<NodeId>,
    ) {
        if self.storage.is_none() {
            return; // every match comes here: nothing to do without a tier
        }
        let ps = self.page_size;
        let end = path.last().copied().unwrap_or(NodeId::ROOT);
        let mut parent = self.tail_hash(end);
        let Some(store) = self.storage.as_mut() else {
            return;
        };
        if end != NodeId::ROOT && parent.is_none() {
            return; // a node without hashes (cached before the tier existed): no chain
        }
        let mut keys = Vec::new();
        for page in tokens[len..tokens.len() / ps * ps].chunks(ps) {
            let key = block_hash(parent, ns, page);
            if !store.used.contains_key(&key) {
                break;
            }
            keys.push(key);
            parent = Some(key);
        }
        if keys.is_empty() {
            return;
        }
        // In use now: room made for them below drops other pages.
        for &key in &keys {
            store.touch(key, self.tick);
        }
        // Locked, the path survives the host evictions that make room.
        self.lock(end);
        let free = self.host.as_ref().map_or(0, |h| h.pool.free_count());
        if free < keys.len() {
            self.evict_host(keys.len() - free);
        }
        let slots = self.host.as_ref().and_then(|h| h.pool.alloc(keys.len()));
        self.unlock(end);
        let Some(slots) = slots else {
            return;
        };
        let (Some(store), Some(host)) = (self.storage.as_mut(), self.host.as_mut()) else {
            return;
        };
        for (&slot, &key) in slots.ids().iter().zip(&keys) {
            host.copies.push(CopyOp {
                src: 0,
                dst: slot,
                kind: copy_kind::FETCH,
                key: wire(key),
            });
        }
        let n = keys.len();
        store.stats.fetch_pages += n as u64;
        store.stats.hit_tokens += (n * ps) as u64;
        host.cached += n;
        let key = tokens[len..len + n * ps].to_vec();
        let id = self.add_child(ns, end, key, self.pool.empty());
        let node = self.node_mut(id);
        node.host = Some(slots);
        node.hashes = keys;
        path.push(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pages::PagePool;
    use crate::radix::WritePolicy;

    /// Caches `tokens` as a request would (its pages allocated, evicting if needed).
    fn cache_prompt(cache: &mut RadixCache, pool: &PagePool, tokens: &[u32]) {
        let m = cache.match_prefix(tokens);
        cache.lock(m.node);
        let need = tokens.len() / 2 - m.pages.len();
        if pool.free_count() < need {
            cache.evict(need - pool.free_count());
        }
        let own = pool.alloc(need).expect("room after eviction");
        cache.insert(tokens, own);
        cache.unlock(m.node);
    }

    #[test]
    fn what_the_host_drops_is_stored_and_fetched_back_on_a_match() {
        // Device 4 pages, host 4 slots, storage 8 pages; 2 tokens a page.
        let pool = PagePool::new(4);
        let mut cache = RadixCache::new(pool.clone(), 2, true)
            .with_host(PagePool::new(4), WritePolicy::WriteBack)
            .with_storage(8);
        let first = [1, 2, 3, 4, 5, 6, 7, 8];
        cache_prompt(&mut cache, &pool, &first);
        cache_prompt(&mut cache, &pool, &[11, 12, 13, 14, 15, 16, 17, 18]);
        cache_prompt(&mut cache, &pool, &[21, 22, 23, 24, 25, 26, 27, 28]);
        let stored: Vec<CopyOp> = cache
            .take_copies()
            .into_iter()
            .filter(|c| c.kind == copy_kind::STORE)
            .collect();
        // The first prompt went device -> host -> store, under its pages' block hashes.
        let mut parent = None;
        let keys: Vec<i64> = first
            .chunks(2)
            .map(|page| {
                let h = block_hash(parent, 0, page);
                parent = Some(h);
                wire(h)
            })
            .collect();
        assert_eq!(stored.iter().map(|c| c.key).collect::<Vec<_>>(), keys);
        assert_eq!(cache.storage_stats().store_pages, 4);

        // A match finds it in the store: fetched into host slots, then loaded to the device.
        let m = cache.match_prefix(&[1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(m.len, 8);
        let copies = cache.take_copies();
        let fetched: Vec<&CopyOp> = copies
            .iter()
            .filter(|c| c.kind == copy_kind::FETCH)
            .collect();
        assert_eq!(fetched.iter().map(|c| c.key).collect::<Vec<_>>(), keys);
        for f in &fetched {
            let load = copies
                .iter()
                .position(|c| c.kind == copy_kind::LOAD && c.src == f.dst)
                .expect("each fetched slot is loaded");
            let fetch = copies.iter().position(|c| std::ptr::eq(c, *f));
            assert!(fetch < Some(load), "a slot is fetched before it is loaded");
        }
        let s = cache.storage_stats();
        assert_eq!((s.hit_tokens, s.fetch_pages), (8, 4));
        cache.check_invariants().expect("a consistent tree");
    }

    #[test]
    fn a_full_store_drops_its_least_recently_used_pages() {
        let pool = PagePool::new(2);
        let mut cache = RadixCache::new(pool.clone(), 2, true)
            .with_host(PagePool::new(2), WritePolicy::WriteBack)
            .with_storage(2);
        for p in 0..5u32 {
            cache_prompt(
                &mut cache,
                &pool,
                &[p * 10, p * 10 + 1, p * 10 + 2, p * 10 + 3],
            );
        }
        let copies = cache.take_copies();
        let (stores, drops) = copies.iter().fold((0, 0), |(s, d), c| match c.kind {
            copy_kind::STORE => (s + 1, d),
            copy_kind::DROP => (s, d + 1),
            _ => (s, d),
        });
        assert_eq!(cache.storage_stats().used_pages, 2);
        assert_eq!(stores - drops, 2, "{stores} stored, {drops} dropped");
        // The oldest prompt is gone from the store, the newest stored one is there.
        assert_eq!(cache.match_prefix(&[0, 1, 2, 3, 9]).len, 0);
    }
}
