//! The radix cache's host tier (HiCache): demotion of evicted nodes to host slots, loading
//! them back on a match, and eviction of the host tier itself.
//!
//! A node lives on the device (device pages, maybe a host copy too) or on the host only; a
//! device node's ancestors are on the device, so a match walks device nodes, then host ones.
//! Every copy is queued in one list in the order the tree decided it: a device page freed by a
//! demotion may be handed out again in the same step, and a host slot freed by host eviction
//! may be written again, so the worker must run them in order, before the step's forward.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use serde::{Deserialize, Serialize};

use super::{NodeId, RadixCache};
use crate::pages::PagePool;
use crate::plan::{copy_kind, CopyOp};

/// When device KV is copied to the host tier (`--hicache-write-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WritePolicy {
    /// As soon as a node is cached: eviction then only frees device pages.
    #[default]
    WriteThrough,
    /// Only when a node is evicted from the device.
    WriteBack,
}

/// A host-eviction candidate, smallest first: (0 for a device node's copy, 1 for a host-only
/// leaf; the eviction policy's key; the node).
type HostRank = Reverse<(u8, (u64, u64), u32)>;

/// The host tier's state.
pub(super) struct HostTier {
    pub(super) pool: PagePool,
    write: WritePolicy,
    /// Host slots owned by nodes.
    pub(super) cached: usize,
    /// Copies decided since the last `take_copies`, in order.
    pub(super) copies: Vec<CopyOp>,
    stats: HostStats,
}

impl HostTier {
    pub(super) fn new(pool: PagePool, write: WritePolicy) -> Self {
        HostTier {
            pool,
            write,
            cached: 0,
            copies: Vec::new(),
            stats: HostStats::default(),
        }
    }
}

/// The host tier in numbers (all zero without one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct HostStats {
    /// Host slots (pages) of the host pool.
    pub total_pages: usize,
    /// Host slots holding a cached node's KV.
    pub used_pages: usize,
    /// Prefix tokens matched on the host and loaded back instead of recomputed, so far.
    pub hit_tokens: u64,
    /// Pages copied host -> device so far.
    pub load_pages: u64,
    /// Pages copied device -> host so far.
    pub writeback_pages: u64,
}

impl RadixCache {
    /// The host tier's numbers.
    pub fn host_stats(&self) -> HostStats {
        self.host
            .as_ref()
            .map_or_else(HostStats::default, |t| HostStats {
                total_pages: t.pool.total(),
                used_pages: t.pool.used_count(),
                ..t.stats
            })
    }

    /// The copies decided since the last call, in the order the worker must run them.
    pub fn take_copies(&mut self) -> Vec<CopyOp> {
        self.host
            .as_mut()
            .map(|t| std::mem::take(&mut t.copies))
            .unwrap_or_default()
    }

    /// Loads the host-only nodes at the end of a matched `path` back into device pages, top
    /// down, while device pages can be found (evicting others). Returns how many were loaded.
    pub(super) fn load_path(&mut self, path: &[NodeId]) -> usize {
        let (Some(first), Some(&end)) = (
            path.iter().position(|&n| self.node(n).pages.is_empty()),
            path.last(),
        ) else {
            return 0;
        };
        // Locked, the path survives the evictions that make room for it.
        self.lock(end);
        let mut loaded = 0;
        for &id in &path[first..] {
            let n = self.edge_pages(id);
            let free = self.pool.free_count();
            if free < n {
                self.evict(n - free);
            }
            let Some(dev) = self.pool.alloc(n) else {
                break;
            };
            let ps = self.page_size;
            let slots = self.node(id).host.as_ref().map(|h| h.ids().to_vec());
            let Some(tier) = self.host.as_mut() else {
                break;
            };
            for (&src, &dst) in slots.iter().flatten().zip(dev.ids()) {
                tier.copies.push(CopyOp {
                    src,
                    dst,
                    kind: copy_kind::LOAD,
                    key: 0,
                });
            }
            tier.stats.load_pages += n as u64;
            tier.stats.hit_tokens += (n * ps) as u64;
            self.attach_device(id, dev);
            loaded += 1;
        }
        self.unlock(end);
        loaded
    }

    /// Moves an evictable device node to the host (copying it there unless it has a copy
    /// already), or drops it with its subtree if the host has no room. Returns the device
    /// pages freed.
    pub(super) fn demote(&mut self, id: NodeId) -> usize {
        if self.node(id).host.is_none() && !self.backup(id) {
            return self.remove_subtree(id);
        }
        let empty = self.pool.empty();
        let dev = std::mem::replace(&mut self.node_mut(id).pages, empty);
        self.cached_pages -= dev.len();
        if self.events.is_some() {
            let hashes = self.node(id).hashes.clone();
            self.on_removed(&hashes);
        }
        dev.len()
    }

    /// With `write_through`: copies a just-cached node to the host right away, so that its
    /// eviction later costs no copy.
    pub(super) fn write_through(&mut self, id: NodeId) {
        if self
            .host
            .as_ref()
            .is_some_and(|t| t.write == WritePolicy::WriteThrough)
        {
            self.backup(id);
        }
    }

    /// Gives a device node a host copy (evicting host nodes for room). False if none fits.
    fn backup(&mut self, id: NodeId) -> bool {
        let n = self.edge_pages(id);
        let Some(free) = self.host.as_ref().map(|t| t.pool.free_count()) else {
            return false;
        };
        if free < n {
            self.evict_host(n - free);
        }
        let Some(slots) = self.host.as_ref().and_then(|t| t.pool.alloc(n)) else {
            return false;
        };
        let dev = self.node(id).pages.ids().to_vec();
        let Some(tier) = self.host.as_mut() else {
            return false;
        };
        for (&src, &dst) in dev.iter().zip(slots.ids()) {
            tier.copies.push(CopyOp {
                src,
                dst,
                kind: copy_kind::WRITEBACK,
                key: 0,
            });
        }
        tier.stats.writeback_pages += n as u64;
        tier.cached += n;
        self.node_mut(id).host = Some(slots);
        true
    }

    /// Frees at least `n` host slots (fewer if not enough are evictable): first the host
    /// copies of device nodes (nothing is lost), then host-only leaves, each in policy order.
    pub(super) fn evict_host(&mut self, n: usize) {
        let mut heap: BinaryHeap<HostRank> = (1..self.nodes.len() as u32)
            .map(NodeId)
            .filter_map(|id| self.host_candidate(id))
            .collect();
        let mut freed = 0;
        while freed < n {
            let Some(Reverse((_, _, id))) = heap.pop() else {
                break;
            };
            let id = NodeId(id);
            if self.host_candidate(id).is_none() {
                continue; // changed since it was queued
            }
            let node = self.node(id);
            let (parent, len) = (node.parent, node.host.as_ref().map_or(0, |h| h.len()));
            freed += len;
            if node.pages.is_empty() {
                self.store_node(id);
                self.remove_subtree(id);
                if let Some(c) = parent.and_then(|p| self.host_candidate(p)) {
                    heap.push(c);
                }
            } else {
                self.node_mut(id).host = None;
                if let Some(tier) = self.host.as_mut() {
                    tier.cached -= len;
                }
            }
        }
    }

    /// A node whose host slots `evict_host` may free, with its rank (smallest goes first).
    fn host_candidate(&self, id: NodeId) -> Option<HostRank> {
        let n = self.nodes.get(id.0 as usize)?.as_ref()?;
        if id == NodeId::ROOT || n.lock > 0 || n.host.is_none() {
            return None;
        }
        let tier = if !n.pages.is_empty() {
            0
        } else if n.children.is_empty() {
            1
        } else {
            return None;
        };
        Some(Reverse((tier, self.evict_key(n), id.0)))
    }
}
