//! The hierarchical cache (host tier under the radix tree): eviction demotes cached prefixes
//! to host slots, a match through them loads them back, a full host tier evicts for real, and
//! every page of both tiers comes back. The fake worker mirrors both tiers and runs the plan's
//! copies, so a missing or misordered copy changes a request's tokens.

mod common;

use common::*;
use tokenspeed_engine::{
    copy_kind, EvictionPolicy, PagePool, RadixCache, SchedulerConfig, WritePolicy,
};

fn hicache(num_pages: u32, host_pages: u32, write: WritePolicy) -> SchedulerConfig {
    SchedulerConfig {
        num_host_pages: host_pages,
        hicache_write_policy: write,
        ..config(num_pages, 4)
    }
}

const POLICIES: [WritePolicy; 2] = [WritePolicy::WriteThrough, WritePolicy::WriteBack];

/// Runs `prompts` one at a time (so each one's pages pressure the ones before), each checked
/// against the fake model run without any cache.
fn run_each(h: &mut Harness, first_id: u64, prompts: &[Vec<u32>]) {
    for (i, p) in prompts.iter().enumerate() {
        let id = first_id + i as u64;
        h.submit(request(id, p.clone(), 3));
        h.run(500);
        assert_eq!(h.tokens(id), reference(p, 3), "request {id}: same tokens");
    }
}

fn copies_of(h: &Harness, kind: u8) -> usize {
    h.plans
        .iter()
        .flat_map(|p| &p.copies)
        .filter(|c| c.kind == kind)
        .count()
}

#[test]
fn evicted_prefixes_move_to_the_host_and_come_back_on_a_hit() {
    for write in POLICIES {
        // 16 device pages of 4 tokens: one 40-token prompt (10 pages) at a time.
        let mut h = Harness::new(hicache(16, 64, write));
        let prompts: Vec<Vec<u32>> = (1..=3).map(|s| prompt(s, 40)).collect();
        run_each(&mut h, 1, &prompts);
        let s = h.sched.stats();
        assert!(
            s.host.used_pages >= 18,
            "{write:?}: two evicted prompts on the host: {s:?}"
        );
        assert!(s.host.writeback_pages >= 18, "{write:?}: {s:?}");
        assert_eq!(s.host.hit_tokens, 0, "no hit yet");

        // The first prompt again, longer: its 40 tokens (bar the last page) are on the host.
        let mut again = prompts[0].clone();
        again.extend([7, 7, 7, 7, 7]);
        run_each(&mut h, 10, &[again]);
        let s = h.sched.stats();
        assert_eq!(
            s.host.hit_tokens, 40,
            "{write:?}: the whole prefix loaded: {s:?}"
        );
        assert_eq!(s.host.load_pages, 10, "{write:?}");
        assert_eq!(
            h.last_output(10u64).cached_tokens,
            40,
            "{write:?}: reported as cached"
        );
        assert_eq!(copies_of(&h, copy_kind::LOAD), 10);
        assert!(copies_of(&h, copy_kind::WRITEBACK) >= 18);
        h.assert_no_leak();
    }
}

#[test]
fn write_through_copies_at_insert_and_write_back_only_at_eviction() {
    let mut through = Harness::new(hicache(64, 64, WritePolicy::WriteThrough));
    let mut back = Harness::new(hicache(64, 64, WritePolicy::WriteBack));
    for h in [&mut through, &mut back] {
        run_each(h, 1, &[prompt(1, 40)]);
    }
    // The device pool is large: nothing is evicted, so write-back never copies.
    assert!(through.sched.stats().host.writeback_pages >= 10);
    assert_eq!(back.sched.stats().host.writeback_pages, 0);
    through.assert_no_leak();
    back.assert_no_leak();
}

#[test]
fn a_full_host_tier_evicts_for_real_and_leaks_nothing() {
    for write in POLICIES {
        // The host holds two 10-page prompts; six rounds of five prompts cycle through it.
        let mut h = Harness::new(hicache(16, 24, write));
        let prompts: Vec<Vec<u32>> = (1..=5).map(|s| prompt(s, 40)).collect();
        for round in 0..6u64 {
            run_each(&mut h, 100 * (round + 1), &prompts);
            let s = h.sched.stats();
            assert!(s.host.used_pages <= s.host.total_pages, "{s:?}");
        }
        let s = h.sched.stats();
        assert_eq!(s.host.total_pages, 24);
        assert!(
            s.host.writeback_pages > 24,
            "{write:?}: the host tier turned over: {s:?}"
        );
        h.assert_no_leak();
    }
}

#[test]
fn shared_prefixes_survive_many_interleaved_requests_with_overlap() {
    for write in POLICIES {
        // Multi-turn: 6 conversations whose histories grow; 3 requests in flight at a time, a
        // device pool that holds a fraction of the histories, overlap scheduling on.
        let mut h = Harness::with_overlap(hicache(48, 96, write), true);
        let mut histories: Vec<Vec<u32>> = (1..=6).map(|s| prompt(s, 24)).collect();
        let mut id = 0u64;
        for turn in 0..4u32 {
            for batch in histories.chunks_mut(3) {
                let ids: Vec<u64> = batch
                    .iter()
                    .map(|_| {
                        id += 1;
                        id
                    })
                    .collect();
                for (conv, &rid) in batch.iter().zip(&ids) {
                    h.submit(request(rid, conv.clone(), 4));
                }
                h.run(1000);
                for (conv, &rid) in batch.iter_mut().zip(&ids) {
                    let want = reference(conv, 4);
                    assert_eq!(h.tokens(rid), want, "{write:?} turn {turn}: request {rid}");
                    conv.extend(want);
                    conv.extend((0..6).map(|i| 50_000 + turn * 10 + i));
                }
            }
        }
        let s = h.sched.stats();
        assert!(
            s.host.hit_tokens > 0,
            "{write:?}: histories found on the host: {s:?}"
        );
        h.assert_no_leak();
    }
}

#[test]
fn off_by_default_no_host_tier_and_no_copies() {
    let mut h = Harness::new(config(16, 4));
    let prompts: Vec<Vec<u32>> = (1..=4).map(|s| prompt(s, 40)).collect();
    run_each(&mut h, 1, &prompts);
    run_each(&mut h, 10, &prompts[..1]);
    assert!(
        h.plans.iter().all(|p| p.copies.is_empty()),
        "no copies planned"
    );
    assert_eq!(h.sched.stats().host, Default::default());
    h.assert_no_leak();
}

/// Inserts `tokens` as a request would: match, lock, allocate the rest, insert, unlock.
fn insert(pool: &PagePool, cache: &mut RadixCache, tokens: &[u32]) {
    let m = cache.match_prefix(tokens);
    cache.lock(m.node);
    let own = pool.alloc(tokens.len() - m.pages.len()).expect("pages");
    cache.insert(tokens, own);
    cache.unlock(m.node);
}

#[test]
fn lfu_evicts_the_least_hit_prefix_and_lru_the_oldest() {
    for (policy, survivor) in [(EvictionPolicy::Lru, 2), (EvictionPolicy::Lfu, 1)] {
        let pool = PagePool::new(8);
        let mut cache = RadixCache::new(pool.clone(), 1, true).with_policy(policy);
        insert(&pool, &mut cache, &[1, 1, 1]);
        for _ in 0..3 {
            cache.match_prefix(&[1, 1, 1]); // hit often, long ago
        }
        insert(&pool, &mut cache, &[2, 2, 2]); // hit never, recently
        assert_eq!(cache.evict(3), 3);
        let kept = [1u32, 2].map(|t| cache.peek_prefix_len(&[t, t, t]));
        let expect = if survivor == 1 { [3, 0] } else { [0, 3] };
        assert_eq!(kept, expect, "{policy:?}");
        cache.check_invariants().expect("consistent");
    }
}

#[test]
fn radix_demotion_keeps_tokens_and_host_eviction_drops_them() {
    let pool = PagePool::new(6);
    let host = PagePool::new(3);
    let mut cache =
        RadixCache::new(pool.clone(), 1, true).with_host(host.clone(), WritePolicy::WriteBack);
    insert(&pool, &mut cache, &[1, 2, 3]);
    assert_eq!(cache.evict(3), 3, "demoted: device pages freed");
    assert_eq!((pool.free_count(), host.free_count()), (6, 0));
    assert_eq!(
        cache.peek_prefix_len(&[1, 2, 3, 4]),
        3,
        "tokens kept on the host"
    );
    let wb: Vec<_> = cache.take_copies();
    assert_eq!(wb.len(), 3);
    assert!(wb.iter().all(|c| c.kind == copy_kind::WRITEBACK));
    cache.check_invariants().expect("consistent");

    // A hit loads it back; a second prefix then pushes the first out of the host.
    let m = cache.match_prefix(&[1, 2, 3, 4]);
    assert_eq!((m.len, m.pages.len(), pool.free_count()), (3, 3, 3));
    assert_eq!(cache.host_stats().hit_tokens, 3);
    insert(&pool, &mut cache, &[9, 9, 9]);
    assert_eq!(cache.evict(6), 6, "both demoted or dropped");
    cache.check_invariants().expect("consistent");
    assert_eq!(host.used_count(), 3, "the host holds one prefix");
    let on_host = [1u32, 9].map(|t| {
        cache.peek_prefix_len(&[t, if t == 1 { 2 } else { 9 }, if t == 1 { 3 } else { 9 }])
    });
    assert_eq!(
        on_host.iter().sum::<usize>(),
        3,
        "one of them survives: {on_host:?}"
    );
    cache.flush();
    assert_eq!((pool.free_count(), host.free_count()), (6, 3));
    cache.check_invariants().expect("consistent");
}
