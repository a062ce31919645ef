//! KV cache events for cache-aware routers (`--kv-events-config`): what entered and left the
//! radix cache's *device* tier, one block per page, as vLLM and SGLang report theirs.
//!
//! The tree only records events into a buffer (`take_events`); the server's engine loop drains
//! it after each step and publishes it (`tokenspeed-server`'s `kv_events.rs`). Off (the
//! default), the buffer is `None` and every hook returns at its first line.
//!
//! A block's hash is a chain: FNV-1a 64 over the parent block's hash (or, for a prompt's
//! first page, the namespace: 0 or the LoRA adapter's id) and the page's token ids, little
//! endian, with the top bit cleared so the value fits both an i64 and a u64 decoder. The same
//! page after the same prefix hashes the same in every process and across restarts; node
//! splits do not change it (hashes are per page, not per node).
//!
//! Tiers: only device pages count, since a router asks where a prefix is *ready*. With a host
//! tier, demoting a node to host slots is a `Removed`, and loading it back a `Stored` with the
//! same hashes.

use super::{NodeId, RadixCache};

/// One change of the device tier's contents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Pages (one hash each, in order) became cached after the block `parent_block_hash`
    /// (None: at the start of a prompt).
    Stored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        /// All the blocks' tokens, `block_size` per block.
        token_ids: Vec<u32>,
        block_size: usize,
        /// The LoRA adapter's id (the tree's namespace); None for the base model.
        lora_id: Option<u32>,
    },
    /// These blocks are no longer cached on the device.
    Removed { block_hashes: Vec<u64> },
    /// The whole cache was dropped (a flush that left the tree empty).
    AllCleared,
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// The hash of a page of `tokens` after the block `parent` (None: the first page of a prompt
/// in namespace `ns`).
pub fn block_hash(parent: Option<u64>, ns: u32, tokens: &[u32]) -> u64 {
    let mut h = FNV_OFFSET;
    let mut feed = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(FNV_PRIME);
        }
    };
    feed(&[u8::from(parent.is_some())]);
    feed(&parent.unwrap_or(u64::from(ns)).to_le_bytes());
    for t in tokens {
        feed(&t.to_le_bytes());
    }
    h & (i64::MAX as u64)
}

impl RadixCache {
    /// Records KV events from now on. Call before anything is cached (a node inserted earlier
    /// has no hashes to report).
    pub fn enable_events(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    /// The events recorded since the last call, in order (empty when events are off).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The last block hash on the path to `id` (None for the root).
    pub(super) fn tail_hash(&self, id: NodeId) -> Option<u64> {
        (id != NodeId::ROOT)
            .then(|| self.node(id).hashes.last().copied())
            .flatten()
    }

    /// A node just added with device pages: computes its block hashes and records them.
    pub(super) fn on_added(&mut self, id: NodeId) {
        if !self.hashes_needed() {
            return;
        }
        let node = self.node(id);
        let mut parent = node.parent.and_then(|p| self.tail_hash(p));
        let ns = node.ns;
        let hashes: Vec<u64> = node
            .key
            .chunks(self.page_size)
            .map(|page| {
                let h = block_hash(parent, ns, page);
                parent = Some(h);
                h
            })
            .collect();
        self.node_mut(id).hashes = hashes;
        self.on_stored(id);
    }

    /// A node's pages entered the device tier (added, or loaded back from the host).
    pub(super) fn on_stored(&mut self, id: NodeId) {
        if self.events.is_none() {
            return;
        }
        let node = self.node(id);
        let event = KvEvent::Stored {
            block_hashes: node.hashes.clone(),
            parent_block_hash: node.parent.and_then(|p| self.tail_hash(p)),
            token_ids: node.key.clone(),
            block_size: self.page_size,
            lora_id: (node.ns != 0).then_some(node.ns),
        };
        self.events.get_or_insert_with(Vec::new).push(event);
    }

    /// Blocks `hashes` left the device tier.
    pub(super) fn on_removed(&mut self, hashes: &[u64]) {
        if let Some(events) = self.events.as_mut().filter(|_| !hashes.is_empty()) {
            events.push(KvEvent::Removed {
                block_hashes: hashes.to_vec(),
            });
        }
    }

    /// After a flush that recorded events from index `from` on: when the tree is now empty,
    /// one `AllCleared` stands for them.
    pub(super) fn on_flushed(&mut self, from: usize) {
        let empty = self.nodes.iter().skip(1).all(Option::is_none);
        if let Some(events) = self.events.as_mut().filter(|_| empty) {
            events.truncate(from);
            events.push(KvEvent::AllCleared);
        }
    }

    /// Events recorded so far (the index `on_flushed` takes).
    pub(super) fn events_len(&self) -> usize {
        self.events.as_ref().map_or(0, Vec::len)
    }
}
