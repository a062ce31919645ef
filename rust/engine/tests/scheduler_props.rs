//! Scheduler properties over random workloads: every request completes with the tokens an
//! uncached run gives, pages are conserved at every step, and nothing leaks at the end.

mod common;

use common::{reference, request, Harness};
use proptest::prelude::*;
use tokenspeed_engine::{SchedulePolicy, SchedulerConfig};

#[derive(Debug, Clone)]
struct Workload {
    config: SchedulerConfig,
    /// (prompt, max_new_tokens, step at which it is submitted, aborted at that step if Some)
    requests: Vec<(Vec<u32>, u32, usize, Option<usize>)>,
}

fn workload() -> impl Strategy<Value = Workload> {
    (
        prop::sample::select(vec![1u32, 2, 4]),
        12u32..40,
        1u32..6,
        2u32..24,
        any::<bool>(),
        any::<bool>(),
    )
        .prop_flat_map(|(page_size, num_pages, max_running, budget, lpm, cache)| {
            let config = SchedulerConfig {
                page_size,
                num_pages,
                max_running_requests: max_running,
                chunked_prefill_size: budget,
                max_prefill_tokens: 1024,
                policy: if lpm {
                    SchedulePolicy::Lpm
                } else {
                    SchedulePolicy::Fcfs
                },
                enable_radix_cache: cache,
                max_context_len: 1024,
            };
            // Prompts drawn from a few stems so that prefixes are shared.
            let one = (
                0u32..3,
                0usize..10,
                prop::collection::vec(0u32..50, 1..8),
                1u32..12,
                0usize..20,
                prop::option::weighted(0.15, 0usize..30),
            )
                .prop_map(|(stem, stem_len, tail, max_new, at, abort)| {
                    let head: Vec<u32> = (0..stem_len as u32).map(|i| stem * 100 + i).collect();
                    ([head, tail].concat(), max_new, at, abort.map(|a| at + a))
                });
            (Just(config), prop::collection::vec(one, 1..12))
        })
        .prop_map(|(config, requests)| Workload { config, requests })
        .prop_filter("every request fits in the pool", |w| {
            w.requests.iter().all(|(p, n, _, _)| {
                let kv = p.len() as u32 + n - 1;
                kv.div_ceil(w.config.page_size) <= w.config.num_pages
            })
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    #[test]
    fn random_workloads_complete_exactly_and_leak_nothing(w in workload()) {
        let mut h = Harness::new(w.config.clone());
        let mut aborted = Vec::new();
        let mut steps = 0;
        loop {
            for (id, (prompt, max_new, at, abort)) in w.requests.iter().enumerate() {
                if *at == steps {
                    h.submit(request(id as u64, prompt.clone(), *max_new));
                }
                if *abort == Some(steps) && h.sched.abort(id as u64) {
                    aborted.push(id as u64);
                }
            }
            let stepped = h.step();
            let s = h.sched.stats();
            prop_assert_eq!(s.free_pages + s.used_pages + s.cached_pages, s.total_pages);
            prop_assert!(s.evictable_pages <= s.cached_pages);
            prop_assert!(s.running <= w.config.max_running_requests as usize);
            steps += 1;
            let all_submitted = w.requests.iter().all(|r| r.2 < steps);
            if !stepped && all_submitted && h.sched.is_idle() {
                break;
            }
            prop_assert!(steps < 5_000, "no progress: deadlock or livelock");
        }
        for (id, (prompt, max_new, _, _)) in w.requests.iter().enumerate() {
            let id = id as u64;
            let want = reference(prompt, *max_new);
            let got = h.tokens(id);
            if aborted.contains(&id) {
                prop_assert_eq!(&want[..got.len()], got.as_slice());
            } else {
                prop_assert_eq!(got, want, "request {}", id);
            }
        }
        h.assert_no_leak();
    }
}
