//! Speculative decoding in the scheduler: NGRAM drafts ride in the plan after the last known
//! token, the (fake) worker verifies them, and the output is exactly what plain decoding
//! produces: same tokens, same endings (stop ids, `max_tokens` inside an accepted run), the
//! KV of rejected drafts rewritten before it is read, no page leaked. The fake model here
//! copies text (what n-gram drafts are for), with deviations so that some drafts fail.

mod common;

use common::{config, request, Harness};
use tokenspeed_engine::{
    FinishReason, Request, SamplingParams, Scheduler, SchedulerConfig, LAST_SAMPLED,
};

/// Copies the token 5 back, except at every 7th position (a deviation drafts cannot predict).
fn copy_model(seq: &[u32]) -> u32 {
    let n = seq.len();
    if n.is_multiple_of(7) {
        50_000 + n as u32
    } else {
        seq[n - 5]
    }
}

fn reference(prompt: &[u32], max_new: u32, stop: Option<u32>) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    for _ in 0..max_new {
        let t = copy_model(&seq);
        seq.push(t);
        if Some(t) == stop {
            break;
        }
    }
    seq.split_off(prompt.len())
}

fn spec_config(k: u32, page_size: u32) -> SchedulerConfig {
    SchedulerConfig {
        speculative_algorithm: Some("NGRAM".into()),
        speculative_num_draft_tokens: Some(k),
        speculative_ngram_min_match_window_size: 1,
        speculative_ngram_max_match_window_size: 4,
        ..config(256, page_size)
    }
}

fn harness(cfg: SchedulerConfig, overlap: bool) -> Harness {
    let mut h = Harness::with_overlap(cfg, overlap);
    h.worker.model = copy_model;
    h
}

fn prompt(seed: u32) -> Vec<u32> {
    (0..12).map(|i| seed * 100 + i % 5).collect()
}

#[test]
fn same_tokens_as_plain_decoding_and_drafts_accepted() {
    for (k, page_size, overlap) in [(4, 1, false), (3, 4, false), (6, 16, false), (4, 4, true)] {
        let mut h = harness(spec_config(k, page_size), overlap);
        for id in 1..=3u64 {
            h.submit(request(id, prompt(id as u32), 40 + id as u32));
        }
        h.run(400);
        for id in 1..=3u64 {
            let want = reference(&prompt(id as u32), 40 + id as u32, None);
            assert_eq!(
                h.tokens(id),
                want,
                "k={k} page_size={page_size} overlap={overlap}"
            );
            assert_eq!(h.finish_reason(id), Some(FinishReason::Length));
        }
        // With overlap too: while speculating nothing is planned behind a step in flight
        // (`Scheduler::spec_paused`), so requests draft from known tokens as without it.
        let s = h.sched.stats();
        assert_eq!(s.spec_ahead_steps, 0, "never paused: {s:?}");
        assert!(
            s.spec_draft_tokens > 0 && s.spec_accepted_tokens > 0,
            "{s:?}"
        );
        assert!(
            s.spec_accepted_tokens < s.spec_draft_tokens,
            "some drafts rejected: {s:?}"
        );
        assert!(s.avg_spec_accept_length() > 1.5, "{s:?}");
        // Plain decoding takes 43 steps for the longest request alone.
        assert!(h.plans.len() < 40, "{} plans", h.plans.len());
        h.assert_no_leak();
    }
}

#[test]
fn max_tokens_and_stop_ids_cut_inside_an_accepted_run() {
    for max_new in [1, 2, 3, 5, 8, 13] {
        let mut h = harness(spec_config(6, 1), false);
        h.submit(request(1, prompt(1), max_new));
        h.run(100);
        assert_eq!(
            h.tokens(1),
            reference(&prompt(1), max_new, None),
            "max_new={max_new}"
        );
        assert_eq!(h.finish_reason(1), Some(FinishReason::Length));
        h.assert_no_leak();
    }
    // A stop id in the middle of a copied run (token 102 is copied over and over).
    let stop = 102;
    let mut h = harness(spec_config(6, 1), false);
    h.submit(Request {
        stop_token_ids: vec![stop],
        ..request(1, prompt(1), 40)
    });
    h.run(100);
    let want = reference(&prompt(1), 40, Some(stop));
    assert_eq!(h.tokens(1), want);
    assert_eq!(want.last(), Some(&stop));
    assert_eq!(h.finish_reason(1), Some(FinishReason::Stop));
    h.assert_no_leak();
}

#[test]
fn no_drafts_for_penalties_min_tokens_or_forbidden_requests() {
    let mut h = harness(spec_config(4, 1), false);
    let penalized = SamplingParams {
        presence_penalty: 0.5,
        ..SamplingParams::greedy()
    };
    h.submit(Request {
        sampling: penalized,
        ..request(1, prompt(1), 20)
    });
    h.submit(Request {
        min_new_tokens: 3,
        ..request(2, prompt(2), 20)
    });
    h.submit(request(3, prompt(3), 20));
    h.sched.forbid_drafts(3u64.into());
    h.run(200);
    for id in 1..=3u64 {
        assert_eq!(h.tokens(id), reference(&prompt(id as u32), 20, None));
    }
    assert!(h
        .plans
        .iter()
        .all(|p| p.scheduled.iter().all(|r| r.num_draft_tokens == 0)));
    assert_eq!(h.sched.stats().spec_draft_tokens, 0);
}

#[test]
fn drafts_only_where_pages_allow_and_the_radix_cache_holds_verified_tokens() {
    // A tight pool: drafts shrink to the pages left; a second request with the same prompt
    // then reads the first one's cached pages (a garbage draft there would change its output).
    let cfg = SchedulerConfig {
        num_pages: 20,
        ..spec_config(8, 4)
    };
    let mut h = harness(cfg, false);
    h.submit(request(1, prompt(1), 50));
    h.run(200);
    h.submit(request(2, [prompt(1), h.tokens(1)].concat(), 10));
    h.run(200);
    let full = [prompt(1), h.tokens(1)].concat();
    assert_eq!(h.tokens(1), reference(&prompt(1), 50, None));
    assert_eq!(h.tokens(2), reference(&full, 10, None));
    assert!(
        h.last_output(2).cached_tokens > 0,
        "the prefix came from the cache"
    );
    h.assert_no_leak();
}

/// EAGLE-3 and NEXTN (DeepSeek's MTP layer): the worker proposes each request's drafts in its
/// result (a draft head ran after the step) and the scheduler verifies them in the next step,
/// through NGRAM's path: the same tokens whatever the drafts, and right drafts shorten the run.
#[test]
fn worker_drafts_are_verified_next_step() {
    for algorithm in ["EAGLE3", "NEXTN"] {
        worker_drafts_are_verified_for(algorithm);
    }
}

fn worker_drafts_are_verified_for(algorithm: &str) {
    let eagle = |k| SchedulerConfig {
        speculative_algorithm: Some(algorithm.into()),
        ..spec_config(k, 4)
    };
    assert!(eagle(3).worker_drafts());
    fn wrong(_: &[u32]) -> u32 {
        7
    }
    let mut plans = Vec::new();
    for (right, drafter) in [(true, copy_model as fn(&[u32]) -> u32), (false, wrong)] {
        let mut h = harness(eagle(3), false);
        h.worker.drafter = Some((drafter, 3));
        h.submit(request(1, prompt(1), 40));
        h.run(200);
        assert_eq!(h.tokens(1), reference(&prompt(1), 40, None));
        assert_eq!(h.finish_reason(1), Some(FinishReason::Length));
        let s = h.sched.stats();
        assert!(s.spec_draft_tokens > 0, "{s:?}");
        if right {
            assert_eq!(s.spec_accepted_tokens, s.spec_draft_tokens, "{s:?}");
        } else {
            assert_eq!(s.spec_accepted_tokens, 0, "{s:?}");
        }
        h.assert_no_leak();
        plans.push(h.plans.len());
    }
    // Right drafts: 4 tokens per step (40 tokens: 1 prefill + 10 verify steps at most).
    assert!(plans[0] <= 12, "{plans:?}");
    assert!(plans[1] >= 40, "{plans:?}");
}

/// The speculation gate in the scheduler (`spec_gate.rs`): with `disable_by_batch_size` 2 and
/// three requests of different lengths, steps of two or more decodes verify nothing and ask
/// the worker for no drafts; once one request is left speculation comes back; the tokens are
/// plain decoding's throughout, for NGRAM and a worker-side drafter.
#[test]
fn batch_rule_turns_speculation_off_and_back_on_exactly() {
    for algorithm in ["NGRAM", "EAGLE3"] {
        let cfg = SchedulerConfig {
            speculative_algorithm: Some(algorithm.into()),
            speculative_disable_by_batch_size: 2,
            ..spec_config(3, 4)
        };
        let mut h = harness(cfg, false);
        if algorithm == "EAGLE3" {
            h.worker.drafter = Some((copy_model, 3));
        }
        let lens = [10u32, 14, 60];
        for (id, n) in (1..=3u64).zip(lens) {
            h.submit(request(id, prompt(id as u32), n));
        }
        h.run(400);
        for (id, n) in (1..=3u64).zip(lens) {
            assert_eq!(
                h.tokens(id),
                reference(&prompt(id as u32), n, None),
                "{algorithm}"
            );
        }
        let mut saw = (false, false);
        for p in &h.plans {
            let decodes: Vec<_> = p.scheduled.iter().filter(|r| r.sample).collect();
            if decodes.len() >= 2 {
                // A prompt's last chunk in the first step, before any request ran, may still
                // ask for drafts (the gate decides on the running batch).
                let plain = |r: &&_| {
                    let r: &tokenspeed_engine::plan::ScheduledRequest = r;
                    r.num_draft_tokens == 0 && (r.pause_drafts || r.tokens.len() > 1)
                };
                assert!(decodes.iter().all(plain), "{algorithm}: step {}", p.step_id);
                saw.0 = true;
            } else if decodes.len() == 1 && decodes[0].num_draft_tokens > 0 {
                assert!(!decodes[0].pause_drafts);
                saw.1 = true;
            }
        }
        assert_eq!(
            saw,
            (true, true),
            "{algorithm}: off while batched, back on alone"
        );
        let s = h.sched.stats();
        assert!(s.spec_off_steps > 0 && s.spec_enabled, "{s:?}");
        assert!(s.spec_accepted_tokens > 0, "{s:?}");
        h.assert_no_leak();
    }
}

/// The acceptance rule: a drafter that is always wrong pauses speculation after a few verify
/// steps; it is retried every `speculative_probe_interval` plain steps; the tokens are exact.
#[test]
fn low_acceptance_pauses_speculation_and_probes_it() {
    fn wrong(_: &[u32]) -> u32 {
        7
    }
    let cfg = SchedulerConfig {
        speculative_algorithm: Some("EAGLE3".into()),
        speculative_break_even_accept_length: 1.7,
        speculative_break_even_per_request: 0.04,
        speculative_probe_interval: 8,
        ..spec_config(3, 4)
    };
    let mut h = harness(cfg, false);
    h.worker.drafter = Some((wrong, 3));
    h.submit(request(1, prompt(1), 80));
    h.run(400);
    assert_eq!(h.tokens(1), reference(&prompt(1), 80, None));
    let s = h.sched.stats();
    // 4 verify steps before the pause, then a probe (draft, verify) per 7 plain steps.
    assert!(s.spec_verify_steps < 16, "{s:?}");
    assert!(s.spec_off_steps > 50, "{s:?}");
    assert!(!s.spec_enabled, "{s:?}");
    h.assert_no_leak();
}

/// Overlap scheduling while the gate has speculation paused: with a step in flight the
/// scheduler plans the next one ahead (`LAST_SAMPLED` decodes, no drafts, the worker told not
/// to draft) only while `spec_paused()`; a step that speculates (a probe, or speculation on)
/// is never planned behind a step in flight: `schedule()` gives nothing until the engine has
/// received it. Tokens are plain decoding's, for NGRAM and a worker-side drafter.
#[test]
fn paused_speculation_overlaps_and_drains_before_speculating() {
    fn wrong(_: &[u32]) -> u32 {
        7
    }
    for algorithm in ["EAGLE3", "NGRAM"] {
        let cfg = SchedulerConfig {
            speculative_algorithm: Some(algorithm.into()),
            speculative_break_even_accept_length: if algorithm == "NGRAM" { 3.9 } else { 1.7 },
            speculative_break_even_per_request: 0.04,
            speculative_probe_interval: 6,
            ..spec_config(3, 4)
        };
        let mut h = harness(cfg, true);
        h.worker.drafter = (algorithm == "EAGLE3").then_some((wrong as fn(&[u32]) -> u32, 3));
        for id in 1..=2u64 {
            h.submit(request(id, prompt(id as u32), 70 + 10 * id as u32));
        }
        let (mut ahead, mut refused) = (0, 0);
        for _ in 0..1000 {
            if h.sched.is_idle() && h.in_flight.is_empty() {
                break;
            }
            let in_flight = !h.in_flight.is_empty();
            let paused = h.sched.spec_paused();
            let plan = h.sched.schedule();
            if let Some(plan) = plan {
                if in_flight {
                    assert!(paused, "{algorithm}: planned ahead while speculating");
                    for r in &plan.scheduled {
                        assert!(
                            r.pause_drafts && r.num_draft_tokens == 0,
                            "{algorithm}: {r:?}"
                        );
                    }
                    ahead += plan
                        .scheduled
                        .iter()
                        .filter(|r| r.tokens == [LAST_SAMPLED])
                        .count();
                }
                let result = h.worker.execute(&plan);
                h.in_flight.push_back(result);
                h.plans.push(plan);
                if h.in_flight.len() < 2 {
                    continue;
                }
            } else if in_flight {
                refused += usize::from(!paused);
            }
            h.advance_oldest();
        }
        assert!(h.sched.is_idle(), "{algorithm}: not done");
        for id in 1..=2u64 {
            let n = 70 + 10 * id as u32;
            assert_eq!(
                h.tokens(id),
                reference(&prompt(id as u32), n, None),
                "{algorithm}"
            );
        }
        let s = h.sched.stats();
        // Mostly paused and overlapped; probes (and the first steps) drained the pipeline.
        assert!(
            ahead > 40 && refused > 3,
            "{algorithm}: {ahead} {refused} {s:?}"
        );
        assert!(
            s.spec_ahead_steps > 20 && s.spec_verify_steps > 0,
            "{algorithm}: {s:?}"
        );
        h.assert_no_leak();
    }
}

/// Only NGRAM is drafted by the scheduler; an algorithm none of the three is refused when the
/// scheduler is built (the launcher refuses it first).
#[test]
fn only_known_algorithms_build_a_scheduler() {
    assert!(!spec_config(3, 4).worker_drafts());
    let other = SchedulerConfig {
        speculative_algorithm: Some("STANDALONE".into()),
        ..spec_config(3, 4)
    };
    assert!(!other.worker_drafts());
    assert!(Scheduler::new(other).is_err());
}
