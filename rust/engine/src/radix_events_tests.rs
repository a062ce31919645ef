//! KV event tests: the event stream of insert / evict / flush / host-tier sequences, replayed
//! into a router's view (a set of block hashes), always equals the tree's device contents.

use std::collections::HashSet;

use proptest::prelude::*;

use super::*;

fn cache(pages: u32, page_size: usize) -> (PagePool, RadixCache) {
    let pool = PagePool::new(pages);
    let mut cache = RadixCache::new(pool.clone(), page_size, true);
    cache.enable_events();
    (pool, cache)
}

/// Inserts `tokens` in namespace `ns` as a request would: match, lock, allocate, insert, unlock.
fn insert(pool: &PagePool, cache: &mut RadixCache, ns: u32, tokens: &[u32]) -> bool {
    let m = cache.match_prefix_in(ns, tokens);
    cache.lock(m.node);
    let need = tokens.len() / cache.page_size() - m.pages.len();
    if pool.free_count() < need {
        cache.evict(need - pool.free_count());
    }
    let Some(own) = pool.alloc(need) else {
        cache.unlock(m.node);
        return false;
    };
    cache.insert_in(ns, tokens, own);
    cache.unlock(m.node);
    true
}

/// What a router knows after applying `events` to `view`.
fn apply(view: &mut HashSet<u64>, events: &[KvEvent]) {
    for e in events {
        match e {
            KvEvent::Stored { block_hashes, .. } => view.extend(block_hashes),
            KvEvent::Removed { block_hashes } => {
                for h in block_hashes {
                    assert!(view.remove(h), "removed a block never stored: {h}");
                }
            }
            KvEvent::AllCleared => view.clear(),
        }
    }
}

/// The block hashes of the tree's device pages, each checked against the chain recomputed
/// from the tokens on its path.
fn device_hashes(cache: &RadixCache) -> HashSet<u64> {
    let ps = cache.page_size;
    let mut all = HashSet::new();
    for (i, node) in cache.nodes.iter().enumerate().skip(1) {
        let Some(node) = node else { continue };
        let mut path = vec![NodeId(i as u32)];
        while let Some(p) = cache.node(*path.last().unwrap()).parent {
            path.push(p);
        }
        let tokens: Vec<u32> = path
            .iter()
            .rev()
            .flat_map(|&n| cache.node(n).key.clone())
            .collect();
        let mut parent = None;
        let chain: Vec<u64> = tokens
            .chunks(ps)
            .map(|page| {
                parent = Some(block_hash(parent, node.ns, page));
                parent.unwrap()
            })
            .collect();
        assert_eq!(
            node.hashes,
            chain[chain.len() - node.hashes.len()..],
            "node {i}"
        );
        assert_eq!(
            node.hashes.len() * ps,
            node.key.len(),
            "node {i}: one hash per page"
        );
        if !node.pages.is_empty() {
            all.extend(&node.hashes);
        }
    }
    all
}

#[test]
fn stored_events_chain_hashes_page_by_page() {
    let (pool, mut cache) = cache(16, 2);
    insert(&pool, &mut cache, 0, &[1, 2, 3, 4, 5]);
    let h1 = block_hash(None, 0, &[1, 2]);
    let h2 = block_hash(Some(h1), 0, &[3, 4]);
    let stored = KvEvent::Stored {
        block_hashes: vec![h1, h2],
        parent_block_hash: None,
        token_ids: vec![1, 2, 3, 4],
        block_size: 2,
        lora_id: None,
    };
    assert_eq!(cache.take_events(), vec![stored]);
    // A branch off the first page: the split leaves hashes alone, the new page chains on h1.
    insert(&pool, &mut cache, 0, &[1, 2, 9, 9]);
    let h3 = block_hash(Some(h1), 0, &[9, 9]);
    let branch = KvEvent::Stored {
        block_hashes: vec![h3],
        parent_block_hash: Some(h1),
        token_ids: vec![9, 9],
        block_size: 2,
        lora_id: None,
    };
    assert_eq!(cache.take_events(), vec![branch]);
    // Tokens already cached: nothing new.
    insert(&pool, &mut cache, 0, &[1, 2, 3, 4]);
    assert_eq!(cache.take_events(), vec![]);
    assert_eq!(device_hashes(&cache), HashSet::from([h1, h2, h3]));
    assert!(h1 < 1 << 63 && h2 < 1 << 63, "hashes fit an i64");
}

#[test]
fn a_lora_namespace_hashes_apart_and_names_its_adapter() {
    let (pool, mut cache) = cache(16, 2);
    insert(&pool, &mut cache, 0, &[1, 2]);
    insert(&pool, &mut cache, 7, &[1, 2]);
    let events = cache.take_events();
    let [KvEvent::Stored {
        block_hashes: base,
        lora_id: None,
        ..
    }, KvEvent::Stored {
        block_hashes: lora,
        lora_id: Some(7),
        ..
    }] = events.as_slice()
    else {
        panic!("two stored events, base then adapter 7: {events:?}");
    };
    assert_ne!(base, lora);
}

#[test]
fn eviction_reports_removed_blocks() {
    let (pool, mut cache) = cache(4, 2);
    let mut view = HashSet::new();
    insert(&pool, &mut cache, 0, &[1, 2, 3, 4]);
    insert(&pool, &mut cache, 0, &[5, 6, 7, 8]);
    apply(&mut view, &cache.take_events());
    assert_eq!(view.len(), 4);
    // The pool is full: a third prompt evicts the least recently used one.
    insert(&pool, &mut cache, 0, &[9, 9]);
    let events = cache.take_events();
    assert!(matches!(events[0], KvEvent::Removed { .. }), "{events:?}");
    apply(&mut view, &events);
    assert_eq!(view, device_hashes(&cache));
    assert_eq!(view.len(), cache.cached_pages());
}

#[test]
fn flush_of_the_whole_tree_is_all_cleared_else_removals() {
    let (pool, mut cache) = cache(16, 2);
    insert(&pool, &mut cache, 0, &[1, 2, 3, 4]);
    insert(&pool, &mut cache, 0, &[5, 6]);
    let mut view = HashSet::new();
    apply(&mut view, &cache.take_events());
    // A running request holds [5, 6]: the flush leaves it, so only removals are reported.
    let held = cache.match_prefix(&[5, 6]);
    cache.lock(held.node);
    cache.flush();
    let events = cache.take_events();
    assert!(
        events.iter().all(|e| matches!(e, KvEvent::Removed { .. })),
        "{events:?}"
    );
    apply(&mut view, &events);
    assert_eq!(view, device_hashes(&cache));
    assert_eq!(view.len(), 1);
    cache.unlock(held.node);
    cache.flush();
    assert_eq!(cache.take_events(), vec![KvEvent::AllCleared]);
    // An empty tree flushed still says so (a consumer that missed events resets).
    cache.flush();
    assert_eq!(cache.take_events(), vec![KvEvent::AllCleared]);
}

#[test]
fn host_demotion_is_a_removal_and_loading_back_a_store() {
    let pool = PagePool::new(2);
    let mut cache = RadixCache::new(pool.clone(), 2, true)
        .with_host(PagePool::new(8), WritePolicy::WriteThrough);
    cache.enable_events();
    insert(&pool, &mut cache, 0, &[1, 2, 3, 4]);
    let first = cache.take_events();
    let KvEvent::Stored { block_hashes, .. } = &first[0] else {
        panic!("{first:?}");
    };
    let stored = block_hashes.clone();
    insert(&pool, &mut cache, 0, &[5, 6, 7, 8]); // demotes [1..4] to the host
    let events = cache.take_events();
    assert!(events.contains(&KvEvent::Removed {
        block_hashes: stored.clone()
    }));
    let m = cache.match_prefix(&[1, 2, 3, 4]); // loads it back, demoting [5..8]
    assert_eq!(m.len, 4);
    let back = cache.take_events();
    assert!(
        back.iter()
            .any(|e| matches!(e, KvEvent::Stored { block_hashes, .. } if *block_hashes == stored)),
        "{back:?}"
    );
    let mut view = HashSet::new();
    apply(&mut view, &first);
    apply(&mut view, &events);
    apply(&mut view, &back);
    assert_eq!(view, device_hashes(&cache));
}

#[test]
fn events_off_records_nothing() {
    let pool = PagePool::new(8);
    let mut cache = RadixCache::new(pool.clone(), 2, true);
    insert(&pool, &mut cache, 0, &[1, 2, 3, 4]);
    cache.flush();
    assert_eq!(cache.take_events(), vec![]);
    assert!(cache.nodes.iter().flatten().all(|n| n.hashes.is_empty()));
}

#[derive(Debug, Clone)]
enum Op {
    Insert(u32, Vec<u32>),
    Match(Vec<u32>),
    Evict(usize),
    Flush,
}

fn op() -> impl Strategy<Value = Op> {
    let tokens = prop::collection::vec(0u32..3, 0..12);
    prop_oneof![
        5 => (0u32..2, tokens.clone()).prop_map(|(ns, t)| Op::Insert(ns, t)),
        2 => tokens.prop_map(Op::Match),
        2 => (0usize..6).prop_map(Op::Evict),
        1 => Just(Op::Flush),
    ]
}

proptest! {
    #[test]
    fn the_event_stream_replays_to_the_device_contents(
        page_size in prop::sample::select(vec![1usize, 2, 4]),
        total in 4u32..24,
        host in prop::option::of(2u32..16),
        ops in prop::collection::vec(op(), 1..50),
    ) {
        let pool = PagePool::new(total);
        let mut cache = RadixCache::new(pool.clone(), page_size, true);
        if let Some(h) = host {
            cache = cache.with_host(PagePool::new(h), WritePolicy::WriteBack);
        }
        cache.enable_events();
        let mut view = HashSet::new();
        for op in ops {
            match op {
                Op::Insert(ns, tokens) => {
                    insert(&pool, &mut cache, ns, &tokens);
                }
                Op::Match(tokens) => {
                    cache.match_prefix(&tokens);
                }
                Op::Evict(n) => {
                    cache.evict(n);
                }
                Op::Flush => {
                    cache.flush();
                }
            }
            apply(&mut view, &cache.take_events());
            prop_assert_eq!(&view, &device_hashes(&cache));
            prop_assert_eq!(view.len(), cache.cached_pages());
            cache.check_invariants().map_err(TestCaseError::fail)?;
        }
    }
}
