//! Scheduler properties over random workloads: every request completes with the tokens an
//! uncached run gives, pages are conserved at every step, and nothing leaks at the end.
//! Every workload runs twice: one plan at a time, and with two plans in flight (overlap).

mod common;

use common::{reference, request, Harness};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use tokenspeed_engine::{EvictionPolicy, SchedulePolicy, SchedulerConfig, WritePolicy};

#[derive(Debug, Clone)]
struct Workload {
    config: SchedulerConfig,
    requests: Vec<Spec>,
    /// Steps that lose one sampled token on the way back.
    lose_samples_at: Vec<u64>,
}

#[derive(Debug, Clone)]
struct Spec {
    prompt: Vec<u32>,
    max_new: u32,
    /// Step at which it is submitted.
    at: usize,
    /// Step at which it is aborted, if any.
    abort: Option<usize>,
    /// The stop token is the one the fake model generates at this index, if any.
    stop_at: Option<usize>,
}

impl Spec {
    fn request(&self, id: u64) -> tokenspeed_engine::Request {
        let mut r = request(id, self.prompt.clone(), self.max_new);
        if let Some(k) = self.stop_at {
            r.stop_token_ids = vec![self.reference()[k]];
        }
        r
    }

    fn reference(&self) -> Vec<u32> {
        reference(&self.prompt, self.max_new)
    }

    /// The tokens it must produce: the fake model's, up to and including the stop token.
    fn expected(&self) -> Vec<u32> {
        let mut want = self.reference();
        if let Some(k) = self.stop_at {
            let stop = want[k];
            let first = want.iter().position(|&t| t == stop).unwrap_or(k);
            want.truncate(first + 1);
        }
        want
    }
}

fn workload() -> impl Strategy<Value = Workload> {
    (
        prop::sample::select(vec![1u32, 2, 4]),
        12u32..40,
        1u32..6,
        2u32..24,
        any::<bool>(),
        any::<bool>(),
        // The host tier: none, or 1-2x the device pool; write-back or through; LRU or LFU;
        // a storage tier below it of none, or 1-2x the device pool; extend graphs or none.
        (
            0u32..3,
            any::<bool>(),
            any::<bool>(),
            0u32..3,
            any::<bool>(),
        ),
    )
        .prop_flat_map(
            |(page_size, num_pages, max_running, budget, lpm, cache, host)| {
                let (host_scale, write_back, lfu, storage_scale, graphs) = host;
                let config = SchedulerConfig {
                    page_size,
                    num_pages,
                    max_running_requests: max_running,
                    chunked_prefill_size: budget,
                    max_prefill_tokens: 1024,
                    max_mixed_prefill_tokens: 0,
                    max_mixed_step_ms: 0.0,
                    schedule_policy: if lpm {
                        SchedulePolicy::Lpm
                    } else {
                        SchedulePolicy::Fcfs
                    },
                    enable_priority_scheduling: false,
                    schedule_low_priority_values_first: false,
                    priority_scheduling_preemption_threshold: 10,
                    disable_radix_cache: !cache,
                    speculative_algorithm: None,
                    speculative_num_draft_tokens: None,
                    speculative_ngram_min_match_window_size: 1,
                    speculative_ngram_max_match_window_size: 12,
                    speculative_disable_by_batch_size: 0,
                    speculative_break_even_accept_length: 0.0,
                    speculative_break_even_per_request: 0.0,
                    speculative_probe_interval: 64,
                    context_length: 1024,
                    radix_eviction_policy: if lfu {
                        EvictionPolicy::Lfu
                    } else {
                        EvictionPolicy::Lru
                    },
                    num_host_pages: host_scale * num_pages,
                    hicache_write_policy: if write_back {
                        WritePolicy::WriteBack
                    } else {
                        WritePolicy::WriteThrough
                    },
                    num_storage_pages: storage_scale * num_pages,
                    extend_graph_tokens: if graphs {
                        vec![4, 8, 16, 24]
                    } else {
                        Vec::new()
                    },
                    num_swa_pages: 0,
                    swa_window: 0,
                };
                // Prompts drawn from a few stems so that prefixes are shared.
                let one = (
                    0u32..3,
                    0usize..10,
                    prop::collection::vec(0u32..50, 1..8),
                    1u32..12,
                    0usize..20,
                    prop::option::weighted(0.15, 0usize..30),
                    prop::option::weighted(0.3, 0usize..12),
                )
                    .prop_map(
                        |(stem, stem_len, tail, max_new, at, abort, stop)| {
                            let head: Vec<u32> =
                                (0..stem_len as u32).map(|i| stem * 100 + i).collect();
                            Spec {
                                prompt: [head, tail].concat(),
                                max_new,
                                at,
                                abort: abort.map(|a| at + a),
                                stop_at: stop.filter(|&k| k < max_new as usize),
                            }
                        },
                    );
                (
                    Just(config),
                    prop::collection::vec(one, 1..12),
                    prop::option::weighted(0.3, prop::collection::vec(0u64..60, 1..4)),
                )
            },
        )
        .prop_map(|(config, requests, lose)| Workload {
            config,
            requests,
            lose_samples_at: lose.unwrap_or_default(),
        })
        .prop_filter("every request fits in the pool", |w| {
            w.requests.iter().all(|r| {
                let kv = r.prompt.len() as u32 + r.max_new - 1;
                kv.div_ceil(w.config.page_size) <= w.config.num_pages
            })
        })
}

/// Runs `w` to completion and checks it.
fn check(w: &Workload, overlap: bool) -> Result<(), TestCaseError> {
    let mut h = Harness::with_overlap(w.config.clone(), overlap);
    h.lose_samples_at = w.lose_samples_at.clone();
    let mut aborted = Vec::new();
    let mut steps = 0;
    loop {
        for (id, r) in w.requests.iter().enumerate() {
            if r.at == steps {
                h.submit(r.request(id as u64));
            }
            if r.abort == Some(steps) && h.sched.abort((id as u64).into()) {
                aborted.push(id as u64);
            }
        }
        let stepped = h.step();
        let s = h.sched.stats();
        prop_assert_eq!(s.free_pages + s.used_pages + s.cached_pages, s.total_pages);
        prop_assert!(s.evictable_pages <= s.cached_pages);
        prop_assert!(s.running <= w.config.max_running_requests as usize);
        steps += 1;
        let all_submitted = w.requests.iter().all(|r| r.at < steps);
        if !stepped && all_submitted && h.sched.is_idle() {
            break;
        }
        prop_assert!(steps < 5_000, "no progress: deadlock or livelock");
    }
    for (id, r) in w.requests.iter().enumerate() {
        let id = id as u64;
        let want = r.expected();
        let got = h.tokens(id);
        if aborted.contains(&id) {
            prop_assert_eq!(&want[..got.len()], got.as_slice());
        } else {
            prop_assert_eq!(got, want, "request {} (overlap {})", id, overlap);
        }
    }
    h.assert_no_leak();
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    #[test]
    fn random_workloads_complete_exactly_and_leak_nothing(w in workload()) {
        check(&w, false)?;
        check(&w, true)?;
    }
}
