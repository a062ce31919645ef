//! Radix cache tests: examples of each operation, then proptest against a flat model.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use proptest::prelude::*;

use super::*;

fn cache(pages: u32, page_size: usize) -> (PagePool, RadixCache) {
    let pool = PagePool::new(pages);
    let cache = RadixCache::new(pool.clone(), page_size, true);
    (pool, cache)
}

/// Inserts `tokens` as a request would: match, lock, allocate the rest, insert, unlock.
fn insert_fresh(pool: &PagePool, cache: &mut RadixCache, tokens: &[u32]) -> usize {
    let m = cache.match_prefix(tokens);
    cache.lock(m.node);
    let need = tokens.len() / cache.page_size() - m.pages.len();
    let own = pool.alloc(need).expect("test pool is large enough");
    let dup = cache.insert(tokens, own);
    cache.unlock(m.node);
    dup
}

#[test]
fn namespaces_never_share_a_prefix() {
    let (pool, mut cache) = cache(16, 2);
    insert_fresh(&pool, &mut cache, &[1, 2, 3, 4]);
    // Adapter 7 sees none of the base model's KV; after its own insert, only its own.
    assert_eq!(cache.match_prefix_in(7, &[1, 2, 3, 4, 5]).len, 0);
    assert_eq!(cache.peek_prefix_len_in(7, &[1, 2, 3, 4, 5]), 0);
    let own = pool.alloc(2).expect("pages");
    assert_eq!(cache.insert_in(7, &[1, 2, 3, 4], own), 0);
    let base = cache.match_prefix(&[1, 2, 3, 4, 5]);
    let lora = cache.match_prefix_in(7, &[1, 2, 9, 9]);
    assert_eq!((base.len, lora.len), (4, 2));
    assert!(
        base.pages.iter().all(|p| !lora.pages.contains(p)),
        "distinct KV pages"
    );
    assert_eq!(cache.match_prefix_in(8, &[1, 2, 3, 4, 5]).len, 0);
    cache.check_invariants().expect("consistent");
    cache.flush();
    assert_eq!(pool.free_count(), 16, "every namespace's pages come back");
}

#[test]
fn match_returns_the_longest_page_aligned_prefix() {
    let (pool, mut cache) = cache(16, 2);
    insert_fresh(&pool, &mut cache, &[1, 2, 3, 4, 5, 6]);
    let m = cache.match_prefix(&[1, 2, 3, 4, 9, 9]);
    assert_eq!(m.len, 4);
    assert_eq!(m.pages, vec![0, 1]);
    // A partial page never matches: [1, 2, 3] shares 3 tokens but only one full page.
    assert_eq!(cache.match_prefix(&[1, 2, 3]).len, 2);
    assert_eq!(cache.match_prefix(&[7, 7]).len, 0);
    cache.check_invariants().expect("consistent");
}

#[test]
fn inserting_a_cached_prefix_frees_the_duplicate_pages() {
    let (pool, mut cache) = cache(16, 1);
    insert_fresh(&pool, &mut cache, &[1, 2, 3]);
    // A second request computed [1, 2, 3, 4] itself (no lock on a prefix): 3 pages are duplicates.
    let own = pool.alloc(4).expect("free");
    let dup = cache.insert(&[1, 2, 3, 4], own);
    assert_eq!(dup, 3);
    assert_eq!(cache.cached_pages(), 4);
    assert_eq!(pool.free_count(), 12);
    cache.check_invariants().expect("consistent");
}

#[test]
fn split_keeps_a_locked_node_valid_and_locked() {
    let (pool, mut cache) = cache(16, 1);
    insert_fresh(&pool, &mut cache, &[1, 2, 3, 4]);
    let m = cache.match_prefix(&[1, 2, 3, 4]);
    cache.lock(m.node);
    // Diverging at token 3 splits the locked edge [1, 2, 3, 4] into [1, 2] + [3, 4].
    insert_fresh(&pool, &mut cache, &[1, 2, 9]);
    assert_eq!(cache.evictable_pages(), 1, "only the [9] leaf is unlocked");
    assert_eq!(cache.flush(), 1);
    assert_eq!(cache.match_prefix(&[1, 2, 3, 4]).pages, m.pages);
    cache.unlock(m.node);
    assert_eq!(cache.evictable_pages(), 4);
    cache.check_invariants().expect("consistent");
}

#[test]
fn eviction_takes_least_recently_used_leaves_first() {
    let (pool, mut cache) = cache(16, 1);
    insert_fresh(&pool, &mut cache, &[1, 1]);
    insert_fresh(&pool, &mut cache, &[2, 2]);
    cache.match_prefix(&[1, 1]); // [1, 1] is now the most recent
    assert_eq!(cache.evict(1), 2);
    assert_eq!(cache.peek_prefix_len(&[2, 2]), 0);
    assert_eq!(cache.peek_prefix_len(&[1, 1]), 2);
}

#[test]
fn disabled_cache_matches_nothing_and_frees_inserted_pages() {
    let pool = PagePool::new(8);
    let mut cache = RadixCache::new(pool.clone(), 1, false);
    let own = pool.alloc(3).expect("free");
    cache.insert(&[1, 2, 3], own);
    assert_eq!(cache.cached_pages(), 0);
    assert_eq!(pool.free_count(), 8);
    assert_eq!(cache.match_prefix(&[1, 2, 3]).len, 0);
}

/// A request between admission and finish: it holds a lock and its own pages.
struct Held {
    tokens: Vec<u32>,
    node: NodeId,
    prefix_pages: Vec<u32>,
    own: Pages,
}

#[derive(Debug, Clone)]
enum Op {
    Admit(Vec<u32>),
    Finish(usize),
    Match(Vec<u32>),
    Evict(usize),
    Flush,
}

fn op() -> impl Strategy<Value = Op> {
    // A tiny alphabet so that sequences share prefixes often.
    let tokens = prop::collection::vec(0u32..3, 0..12);
    prop_oneof![
        4 => tokens.clone().prop_map(Op::Admit),
        3 => (0usize..8).prop_map(Op::Finish),
        3 => tokens.prop_map(Op::Match),
        2 => (0usize..8).prop_map(Op::Evict),
        1 => Just(Op::Flush),
    ]
}

/// The model: every cached page-aligned prefix and the page holding its last page.
type Model = HashMap<Vec<u32>, u32>;

fn model_match(model: &Model, tokens: &[u32], ps: usize) -> (usize, Vec<u32>) {
    let mut pages = Vec::new();
    for k in 1..=tokens.len() / ps {
        match model.get(&tokens[..k * ps]) {
            Some(&p) => pages.push(p),
            None => break,
        }
    }
    (pages.len() * ps, pages)
}

proptest! {
    #[test]
    fn random_operations_keep_the_cache_consistent(
        page_size in prop::sample::select(vec![1usize, 2, 4]),
        total in 8u32..40,
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let (pool, mut cache) = cache(total, page_size);
        let mut model = Model::new();
        let mut held: Vec<Held> = Vec::new();
        for op in ops {
            match op {
                Op::Admit(tokens) => {
                    let m = cache.match_prefix(&tokens);
                    cache.lock(m.node);
                    let need = tokens.len() / page_size - m.pages.len();
                    if pool.free_count() < need {
                        cache.evict(need - pool.free_count());
                        model.retain(|_, page| !pool.is_free(*page));
                    }
                    match pool.alloc(need) {
                        Some(own) => held.push(Held { tokens, node: m.node, prefix_pages: m.pages, own }),
                        None => cache.unlock(m.node),
                    }
                }
                Op::Finish(i) if i < held.len() => {
                    let h = held.remove(i);
                    let n = h.tokens.len() / page_size;
                    let mut expected_dup = 0;
                    for k in h.prefix_pages.len()..n {
                        let prefix = h.tokens[..(k + 1) * page_size].to_vec();
                        match model.entry(prefix) {
                            Entry::Occupied(_) => expected_dup += 1,
                            Entry::Vacant(e) => {
                                e.insert(h.own.ids()[k - h.prefix_pages.len()]);
                            }
                        }
                    }
                    prop_assert_eq!(cache.insert(&h.tokens, h.own), expected_dup);
                    cache.unlock(h.node);
                }
                Op::Finish(_) => {}
                Op::Match(tokens) => {
                    let m = cache.match_prefix(&tokens);
                    let (len, pages) = model_match(&model, &tokens, page_size);
                    prop_assert_eq!(m.len, len, "longest cached page-aligned prefix");
                    prop_assert_eq!(m.pages, pages);
                }
                Op::Evict(n) => {
                    let before = cache.evictable_pages();
                    let freed = cache.evict(n);
                    prop_assert!(freed >= n.min(before));
                    model.retain(|_, page| !pool.is_free(*page));
                }
                Op::Flush => {
                    cache.flush();
                    model.retain(|_, page| !pool.is_free(*page));
                    let locked: usize = cache.cached_pages() - cache.evictable_pages();
                    prop_assert_eq!(cache.cached_pages(), locked, "flush leaves only locked pages");
                }
            }
            cache.check_invariants().map_err(TestCaseError::fail)?;
            // Conservation: every page is free, cached, or held by exactly one request.
            let held_pages: usize = held.iter().map(|h| h.own.len()).sum();
            prop_assert_eq!(pool.free_count() + cache.cached_pages() + held_pages, total as usize);
            prop_assert_eq!(cache.cached_pages(), model.len());
            // The model is prefix-closed, as a tree is.
            for key in model.keys() {
                prop_assert!(key.len() == page_size || model.contains_key(&key[..key.len() - page_size]));
            }
            // Locked prefixes survive any eviction: their pages are still the tree's.
            for h in &held {
                prop_assert!(h.prefix_pages.iter().all(|&p| !pool.is_free(p)));
                let (len, pages) = model_match(&model, &h.tokens, page_size);
                prop_assert!(len >= h.prefix_pages.len() * page_size);
                prop_assert_eq!(&pages[..h.prefix_pages.len()], h.prefix_pages.as_slice());
            }
        }
        for h in held.drain(..) {
            cache.unlock(h.node);
        }
        cache.flush();
        prop_assert_eq!(pool.free_count(), total as usize, "nothing leaks once all is released");
    }
}
