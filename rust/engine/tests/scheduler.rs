//! Scheduler behaviour, specified scenario by scenario against a fake worker.

mod common;

use common::{config, prompt, reference, request, Harness};
use tokenspeed_engine::{
    FinishReason, Request, RequestId, SchedulePolicy, Scheduler, StepResult, SubmitError,
};

#[test]
fn chunked_prefill_splits_a_long_prompt_across_steps_within_the_budget() {
    let mut h = Harness::new(tokenspeed_engine::SchedulerConfig {
        chunked_prefill_size: 8,
        ..config(64, 4)
    });
    h.submit(request(1, prompt(1, 20), 3));
    h.run(20);

    let chunks: Vec<(u32, u32, bool)> = h.plans[..3]
        .iter()
        .map(|p| {
            (
                p.scheduled[0].start_pos,
                p.scheduled[0].tokens.len() as u32,
                p.scheduled[0].sample,
            )
        })
        .collect();
    assert_eq!(chunks, vec![(0, 8, false), (8, 8, false), (16, 4, true)]);
    assert!(
        h.plans.iter().all(|p| p.num_tokens() <= 8),
        "budget respected every step"
    );
    assert_eq!(h.tokens(1), reference(&prompt(1, 20), 3));
    assert_eq!(h.finish_reason(1), Some(FinishReason::Length));
}

#[test]
fn prefill_chunks_share_the_budget_with_running_decodes() {
    let mut h = Harness::new(tokenspeed_engine::SchedulerConfig {
        chunked_prefill_size: 10,
        ..config(64, 1)
    });
    h.submit(request(1, prompt(1, 4), 20));
    h.step(); // request 1 prefilled; decodes from now on
    h.submit(request(2, prompt(2, 30), 2));
    h.step();
    let plan = &h.plans[1];
    assert_eq!(plan.scheduled.len(), 2);
    assert_eq!(
        (
            plan.scheduled[0].tokens.len() as u32,
            plan.scheduled[1].tokens.len() as u32
        ),
        (1, 9)
    );
    h.run(100);
    assert!(h.plans.iter().all(|p| p.num_tokens() <= 10));
    assert_eq!(h.tokens(2), reference(&prompt(2, 30), 2));
}

#[test]
fn running_requests_decode_together_one_token_each() {
    let mut h = Harness::new(config(256, 2));
    for id in 0..10 {
        h.submit(request(id, prompt(id as u32, 5), 6));
    }
    h.run(50);
    let decode_steps: Vec<_> = h
        .plans
        .iter()
        .filter(|p| !p.scheduled.is_empty() && p.is_pure_decode())
        .collect();
    assert_eq!(
        decode_steps.len(),
        5,
        "one prefill step, then 5 decode steps"
    );
    assert!(decode_steps.iter().all(|p| p.scheduled.len() == 10));
    for id in 0..10 {
        assert_eq!(h.tokens(id), reference(&prompt(id as u32, 5), 6));
    }
    h.assert_no_leak();
}

#[test]
fn max_running_requests_caps_slots_and_freed_slots_are_reused() {
    let mut h = Harness::new(tokenspeed_engine::SchedulerConfig {
        max_running_requests: 3,
        ..config(256, 1)
    });
    for id in 0..5 {
        // Request 0 finishes first, freeing its slot for request 3.
        h.submit(request(
            id,
            prompt(id as u32, 4),
            if id == 0 { 1 } else { 4 },
        ));
    }
    h.step();
    assert_eq!(
        h.sched.stats().running,
        2,
        "request 0 finished on its first token"
    );
    assert_eq!(h.plans[0].new_requests.len(), 3);
    h.step();
    let reuse = &h.plans[1];
    assert_eq!(
        reuse.finished.iter().map(|f| f.slot).collect::<Vec<_>>(),
        vec![0]
    );
    assert_eq!(reuse.new_requests.len(), 1);
    assert_eq!(
        reuse.new_requests[0].slot, 0,
        "the freed slot is reused in the same plan"
    );
    h.run(50);
    for plan in &h.plans {
        assert!(plan.scheduled.len() <= 3);
        assert!(plan.scheduled.iter().all(|r| r.slot < 3));
    }
    assert_eq!(h.outputs.len(), 5);
}

/// Caches prompt `shared`, then queues a miss and a hit; returns which was admitted first.
fn first_admitted(policy: SchedulePolicy) -> RequestId {
    let mut h = Harness::new(tokenspeed_engine::SchedulerConfig {
        max_running_requests: 1,
        schedule_policy: policy,
        ..config(256, 4)
    });
    let shared = prompt(7, 16);
    h.submit(request(1, shared.clone(), 1));
    h.run(10);
    h.submit(request(2, prompt(8, 16), 1)); // miss, arrived first
    h.submit(request(3, [shared, vec![1, 2, 3]].concat(), 1)); // hit
    h.step();
    let admitted: Vec<RequestId> = h
        .outputs
        .keys()
        .copied()
        .filter(|&id| id != 1.into())
        .collect();
    assert_eq!(admitted.len(), 1, "one slot, so one admission");
    h.run(10);
    admitted[0]
}

#[test]
fn fcfs_admits_in_arrival_order() {
    assert_eq!(first_admitted(SchedulePolicy::Fcfs), 2.into());
}

#[test]
fn lpm_admits_the_longest_cached_prefix_first() {
    assert_eq!(first_admitted(SchedulePolicy::Lpm), 3.into());
}

#[test]
fn prefix_hit_reuses_cached_pages_and_reports_cached_tokens() {
    let mut h = Harness::new(config(64, 4));
    let shared = prompt(3, 16);
    h.submit(request(1, shared.clone(), 2));
    h.run(10);
    let first_pages = h.plans[0].page_tables[0].pages[..4].to_vec();

    let second = [shared.clone(), vec![5, 6]].concat();
    h.submit(request(2, second.clone(), 2));
    h.step();
    let plan = h.plans.last().expect("a plan");
    assert_eq!(
        plan.page_tables[0].pages[..4],
        first_pages[..],
        "cached pages come first"
    );
    assert_eq!(plan.scheduled[0].start_pos, 16);
    assert_eq!(
        plan.scheduled[0].tokens,
        vec![5, 6],
        "only the uncached tail is computed"
    );
    h.run(10);
    assert_eq!(h.last_output(2).cached_tokens, 16);
    assert_eq!(h.last_output(2).prompt_tokens, 18);
    assert_eq!(
        h.tokens(2),
        reference(&second, 2),
        "the cached KV is the right KV"
    );
    h.assert_no_leak();
}

#[test]
fn a_fully_cached_prompt_still_computes_its_last_token() {
    let mut h = Harness::new(config(64, 4));
    h.submit(request(1, prompt(3, 16), 1));
    h.run(10);
    h.submit(request(2, prompt(3, 16), 1));
    h.run(10);
    let plan = h
        .plans
        .iter()
        .rev()
        .find(|p| !p.new_requests.is_empty())
        .expect("admitted");
    // 15 tokens are matchable, whole pages only: 12 cached, the last 4 recomputed.
    assert_eq!(
        (
            plan.scheduled[0].start_pos,
            plan.scheduled[0].tokens.len() as u32
        ),
        (12, 4)
    );
    assert_eq!(h.tokens(2), h.tokens(1));
}

#[test]
fn disabled_radix_cache_never_reports_hits() {
    let mut h = Harness::new(tokenspeed_engine::SchedulerConfig {
        disable_radix_cache: true,
        speculative_algorithm: None,
        speculative_num_draft_tokens: None,
        speculative_ngram_min_match_window_size: 1,
        speculative_ngram_max_match_window_size: 12,
        ..config(64, 4)
    });
    h.submit(request(1, prompt(3, 16), 2));
    h.run(10);
    assert_eq!(h.sched.stats().cached_pages, 0);
    h.submit(request(2, prompt(3, 17), 2));
    h.run(10);
    assert_eq!(h.last_output(2).cached_tokens, 0);
    h.assert_no_leak();
}

#[test]
fn page_pressure_retracts_the_youngest_and_every_request_still_completes() {
    // 8 requests each needing up to 6 pages of 4 tokens share 16 pages: decode must retract.
    let mut h = Harness::new(config(16, 4));
    let reqs: Vec<Request> = (0..8)
        .map(|id| request(id, prompt(id as u32, 6), 18))
        .collect();
    for r in &reqs {
        h.submit(r.clone());
    }
    h.run(2_000);
    let released: usize = h
        .plans
        .iter()
        .map(|p| p.finished.iter().map(|f| f.slot).collect::<Vec<_>>().len())
        .sum();
    assert!(
        released > reqs.len(),
        "some requests were retracted and readmitted"
    );
    // Every retraction released a slot that was later readmitted (and released again).
    assert_eq!(
        h.sched.stats().retractions,
        (released - reqs.len()) as u64,
        "the retraction count matches the extra releases"
    );
    for r in &reqs {
        assert_eq!(
            h.tokens(r.id),
            reference(&r.prompt, 18),
            "request {} recomputed exactly",
            r.id
        );
        assert_eq!(
            h.last_output(r.id).completion_tokens,
            18,
            "generated tokens counted once"
        );
        assert_eq!(h.finish_reason(r.id), Some(FinishReason::Length));
    }
    h.assert_no_leak();
}

#[test]
fn a_request_larger_than_the_pool_is_rejected_at_submit() {
    let mut s = Scheduler::new(config(4, 4)).expect("valid");
    let err = s.submit(request(1, prompt(1, 10), 8)).unwrap_err();
    assert_eq!(
        err,
        SubmitError::ExceedsKvPool {
            id: 1.into(),
            tokens: 17,
            pages_needed: 5,
            total_pages: 4
        }
    );
    // Exactly the pool: 16 tokens of KV (the last sampled token needs none).
    assert!(s.submit(request(2, prompt(1, 10), 7)).is_ok());
}

#[test]
fn submit_rejects_bad_requests_with_context() {
    let mut s = Scheduler::new(tokenspeed_engine::SchedulerConfig {
        context_length: 32,
        ..config(64, 4)
    })
    .expect("valid");
    assert_eq!(
        s.submit(request(1, vec![], 4)),
        Err(SubmitError::EmptyPrompt { id: 1.into() })
    );
    assert_eq!(
        s.submit(request(1, vec![1], 0)),
        Err(SubmitError::ZeroMaxNewTokens { id: 1.into() })
    );
    let too_long = s.submit(request(1, prompt(1, 30), 3)).unwrap_err();
    assert!(too_long.to_string().contains("30 tokens"), "{too_long}");
    assert!(matches!(
        too_long,
        SubmitError::ContextTooLong {
            max_context_len: 32,
            ..
        }
    ));
    s.submit(request(1, vec![1], 1)).expect("valid");
    assert_eq!(
        s.submit(request(1, vec![1], 1)),
        Err(SubmitError::DuplicateId { id: 1.into() })
    );
}

#[test]
fn abort_frees_slot_and_pages_of_waiting_and_running_requests() {
    let mut h = Harness::new(tokenspeed_engine::SchedulerConfig {
        max_running_requests: 1,
        ..config(64, 4)
    });
    h.submit(request(1, prompt(1, 10), 50));
    h.submit(request(2, prompt(2, 10), 50));
    h.step();
    assert!(h.sched.abort(2.into()), "waiting request aborted");
    assert!(h.sched.abort(1.into()), "running request aborted");
    assert!(!h.sched.abort(1.into()), "second abort is a no-op");
    let stats = h.sched.stats();
    assert_eq!((stats.running, stats.waiting, stats.used_pages), (0, 0, 0));
    let plan = h.sched.schedule().expect("the freed slot must be reported");
    assert_eq!(
        plan.finished.iter().map(|f| f.slot).collect::<Vec<_>>(),
        vec![0]
    );
    assert!(plan.scheduled.is_empty());
    let result = h.worker.execute(&plan);
    assert!(h.sched.advance(&result).is_empty());
    assert!(h.sched.is_idle());
    h.assert_no_leak();
}

#[test]
fn results_for_a_request_aborted_in_flight_are_ignored() {
    let mut h = Harness::new(config(64, 4));
    h.submit(request(1, prompt(1, 6), 5));
    h.submit(request(2, prompt(2, 6), 5));
    let plan = h.sched.schedule().expect("plan");
    let result = h.worker.execute(&plan);
    assert!(h.sched.abort(1.into()));
    let outs = h.sched.advance(&result);
    assert_eq!(
        outs.iter().map(|o| o.id).collect::<Vec<_>>(),
        vec![2.into()]
    );
    h.outputs.entry(2.into()).or_default().extend(outs);
    h.run(20);
    assert_eq!(h.tokens(2), reference(&prompt(2, 6), 5));
    h.assert_no_leak();
}

#[test]
fn a_missing_sample_makes_the_request_recompute_its_last_position() {
    let mut h = Harness::new(config(64, 4));
    h.submit(request(1, prompt(1, 6), 3));
    let plan = h.sched.schedule().expect("plan");
    h.worker.execute(&plan);
    let outs = h.sched.advance(&StepResult {
        step_id: plan.step_id,
        ..Default::default()
    });
    assert!(outs.is_empty());
    let retry = h.sched.schedule().expect("retry plan");
    assert_eq!(
        (
            retry.scheduled[0].start_pos,
            retry.scheduled[0].tokens.len() as u32
        ),
        (5, 1)
    );
}

#[test]
fn eos_stops_unless_ignore_eos_but_user_stop_ids_always_stop() {
    let p = prompt(4, 5);
    let expected = reference(&p, 10);
    let (eos, stop) = (expected[2], expected[4]);
    let mut h = Harness::new(config(64, 4));
    h.submit(Request {
        eos_token_ids: vec![eos],
        ..request(1, p.clone(), 10)
    });
    h.submit(Request {
        eos_token_ids: vec![eos],
        ignore_eos: true,
        ..request(2, p.clone(), 10)
    });
    h.submit(Request {
        eos_token_ids: vec![eos],
        stop_token_ids: vec![stop],
        ignore_eos: true,
        ..request(3, p.clone(), 10)
    });
    h.submit(Request {
        eos_token_ids: vec![eos],
        min_new_tokens: 4,
        ..request(4, p, 10)
    });
    h.run(30);
    assert_eq!(
        h.tokens(1),
        expected[..3],
        "the stop token is the last output"
    );
    assert_eq!(h.finish_reason(1), Some(FinishReason::Stop));
    assert_eq!(h.tokens(2), expected, "ignore_eos runs to max_new_tokens");
    assert_eq!(h.finish_reason(2), Some(FinishReason::Length));
    assert_eq!(
        h.tokens(3),
        expected[..5],
        "a user's stop id stops despite ignore_eos"
    );
    assert_eq!(h.finish_reason(3), Some(FinishReason::Stop));
    assert!(
        h.tokens(4).len() >= 4,
        "min_new_tokens suppresses an early stop"
    );
    h.assert_no_leak();
}

#[test]
fn min_new_tokens_sends_the_stop_ids_for_the_worker_to_mask() {
    let mut h = Harness::new(config(64, 4));
    h.submit(Request {
        eos_token_ids: vec![7],
        stop_token_ids: vec![9],
        min_new_tokens: 3,
        ..request(1, prompt(5, 5), 6)
    });
    h.submit(Request {
        eos_token_ids: vec![7],
        ..request(2, prompt(6, 5), 6)
    });
    h.step();
    let new = &h.plans[0].new_requests;
    assert_eq!(
        (new[0].min_tokens, new[0].stop_ids.clone()),
        (3, vec![9, 7])
    );
    assert_eq!((new[1].min_tokens, new[1].stop_ids.clone()), (0, vec![]));
}

#[test]
fn penalized_requests_are_fed_their_whole_prompt_despite_the_cache() {
    // The worker's penalty history is the tokens it is fed: a cached prefix would drop them.
    let mut h = Harness::new(config(256, 4));
    let p = prompt(4, 40);
    h.submit(request(1, p.clone(), 2));
    h.run(100);
    let mut penalized = request(2, p.clone(), 2);
    penalized.sampling.repetition_penalty = 1.3;
    h.submit(penalized);
    let mut plain = request(3, p.clone(), 2);
    plain.sampling.repetition_penalty = 1.0;
    h.submit(plain);
    h.run(100);
    assert_eq!(
        h.last_output(2).cached_tokens,
        0,
        "penalized: fed every prompt token"
    );
    assert!(
        h.last_output(3).cached_tokens > 0,
        "unpenalized: served from the cache"
    );
    assert_eq!(h.tokens(2), reference(&p, 2));
    h.assert_no_leak();
}

#[test]
fn prompt_logprobs_cover_every_prompt_token_once_uncached_and_chunked() {
    for overlap in [false, true] {
        let mut h = Harness::with_overlap(config(256, 4), overlap);
        let p = prompt(3, 150);
        // Cache the prompt first: the logprobs request must still compute all of it.
        h.submit(request(1, p.clone(), 2));
        h.run(100);
        let mut req = request(2, p.clone(), 3);
        req.sampling.prompt_logprobs = true;
        h.submit(req);
        h.run(100);
        let outs = &h.outputs[&2.into()];
        let got: Vec<f32> = outs
            .iter()
            .flat_map(|o| o.prompt_logprobs.iter().copied())
            .collect();
        let want: Vec<f32> = (1..150).map(|pos| -(pos as f32)).collect();
        assert_eq!(got, want, "overlap {overlap}");
        assert!(
            outs.len() > 3,
            "the 150-token prompt runs in 64-token chunks"
        );
        assert_eq!(h.tokens(2), reference(&p, 3), "overlap {overlap}");
        assert_eq!(h.last_output(2).cached_tokens, 0);
        h.assert_no_leak();
    }
}

#[test]
fn accepts_zero_one_and_three_tokens_for_different_requests_in_one_step() {
    for overlap in [false, true] {
        let mut h = Harness::with_overlap(config(256, 4), overlap);
        for id in 1..=3 {
            h.submit(request(id, prompt(id as u32 + 10, 6), 12));
        }
        // Admitted in one step into slots 0, 1, 2: slot 0 returns nothing at the first sampling
        // step, slot 1 one token each step, slot 2 three tokens each step.
        h.worker.accept.insert(0, 1);
        h.worker.accept.insert(2, 3);
        h.lose_samples_at.push(0);
        h.run(200);
        for id in 1..=3 {
            let p = prompt(id as u32 + 10, 6);
            assert_eq!(
                h.tokens(id),
                reference(&p, 12),
                "request {id}, overlap {overlap}"
            );
            assert_eq!(h.finish_reason(id), Some(FinishReason::Length));
        }
        let multi = h.outputs[&3.into()]
            .iter()
            .filter(|o| o.tokens.len() == 3)
            .count();
        assert!(multi > 0, "request 3 got several tokens in one output");
        h.assert_no_leak();
    }
}

#[test]
fn length_finish_reports_usage() {
    let mut h = Harness::new(config(64, 4));
    h.submit(request(1, prompt(1, 7), 4));
    h.run(10);
    let outs = &h.outputs[&1.into()];
    assert_eq!(outs.len(), 4);
    assert!(outs[..3].iter().all(|o| o.finished.is_none()));
    let last = h.last_output(1);
    assert_eq!(last.finished, Some(FinishReason::Length));
    assert_eq!(
        (
            last.prompt_tokens,
            last.completion_tokens,
            last.cached_tokens
        ),
        (7, 4, 0)
    );
}

#[test]
fn flush_cache_is_refused_while_requests_run() {
    let mut h = Harness::new(config(64, 4));
    h.submit(request(1, prompt(1, 9), 2));
    assert!(!h.sched.flush_cache());
    h.run(10);
    assert!(
        h.sched.stats().cached_pages > 0,
        "finished requests leave their prefix cached"
    );
    h.assert_no_leak();
}

#[test]
fn many_requests_with_shared_prefixes_and_pressure_leave_no_leak() {
    let mut h = Harness::new(tokenspeed_engine::SchedulerConfig {
        max_running_requests: 6,
        chunked_prefill_size: 16,
        schedule_policy: SchedulePolicy::Lpm,
        ..config(24, 2)
    });
    let base = prompt(9, 12);
    let reqs: Vec<Request> = (0..20u64)
        .map(|id| {
            let tail = prompt(id as u32 + 20, (id % 5) as usize + 1);
            let head = &base[..(id as usize % 4) * 3];
            request(id, [head, &tail].concat(), 8 + (id % 7) as u32)
        })
        .collect();
    for r in &reqs {
        h.submit(r.clone());
    }
    h.run(5_000);
    for r in &reqs {
        assert_eq!(
            h.tokens(r.id),
            reference(&r.prompt, r.max_new_tokens),
            "request {}",
            r.id
        );
    }
    h.assert_no_leak();
}

#[test]
fn a_follow_up_turn_reuses_the_previous_prompt_and_output() {
    let mut h = Harness::new(config(64, 1));
    let turn1 = prompt(5, 6);
    h.submit(request(1, turn1.clone(), 4));
    h.run(10);
    // The chat history: prompt, answer, new user tokens. Every computed position is cached;
    // the answer's last token was never fed to the model, so it is not.
    let turn2 = [turn1, h.tokens(1), vec![7, 8]].concat();
    h.submit(request(2, turn2.clone(), 3));
    h.run(10);
    assert_eq!(h.last_output(2).cached_tokens, 9);
    assert_eq!(h.tokens(2), reference(&turn2, 3));
    h.assert_no_leak();
}

#[test]
fn a_prompt_is_cached_once_prefilled_while_its_request_still_decodes() {
    let mut h = Harness::new(config(64, 4));
    let shared = prompt(7, 16);
    h.submit(request(1, [shared.clone(), vec![1]].concat(), 50));
    h.step(); // prefill of request 1; it now decodes for a long while
    h.step();
    let second = [shared.clone(), vec![2, 3]].concat();
    h.submit(request(2, second.clone(), 3));
    for _ in 0..6 {
        h.step();
    }
    assert_eq!(
        h.last_output(2).cached_tokens,
        16,
        "the shared prefix came from the still-running request"
    );
    assert_eq!(
        h.tokens(2),
        reference(&second, 3),
        "the shared KV is the right KV"
    );
    h.run(100);
    assert_eq!(
        h.tokens(1),
        reference(&[shared, vec![1]].concat(), 50),
        "the first request is unharmed by sharing its pages"
    );
    h.assert_no_leak();
}

#[test]
fn duplicate_prompts_prefilled_together_converge_on_one_cached_copy() {
    // Both prefill in the same step (no hit possible); the second to be cached finds the
    // first's pages in the tree, frees its own, and must read the tree's from then on.
    let mut h = Harness::new(config(64, 4));
    let p = prompt(9, 12);
    h.submit(request(1, [p.clone(), vec![1]].concat(), 20));
    h.submit(request(2, [p.clone(), vec![1]].concat(), 20));
    h.run(100);
    let expected = reference(&[p, vec![1]].concat(), 20);
    assert_eq!(h.tokens(1), expected);
    assert_eq!(h.tokens(2), expected);
    h.assert_no_leak();
}

#[test]
fn admission_keeps_pages_back_for_what_running_requests_will_generate() {
    // 32 pages of 4 tokens. A decodes for up to 100 tokens; B's prompt would fit in the free
    // pages now, but together they would run out mid-decode and thrash, so B waits.
    let mut h = Harness::new(config(32, 4));
    h.submit(request(1, prompt(1, 8), 100));
    h.step();
    h.submit(request(2, prompt(2, 20), 80));
    for _ in 0..5 {
        h.step();
    }
    assert!(
        h.plans
            .iter()
            .all(|p| p.new_requests.len() <= 1 && p.scheduled.len() == 1),
        "the second request is held back while the first decodes"
    );
    h.run(1_000);
    assert_eq!(h.tokens(1), reference(&prompt(1, 8), 100));
    assert_eq!(h.tokens(2), reference(&prompt(2, 20), 80));
    h.assert_no_leak();
}

#[test]
fn requests_that_ignore_eos_are_admitted_with_room_to_finish() {
    // 10 requests of 8 + 32 tokens (10 pages each) share 64 pages. They run to max_new_tokens,
    // so admission reserves all of it: nobody is retracted, every slot is released once.
    let mut h = Harness::new(config(64, 4));
    let reqs: Vec<Request> = (0..10)
        .map(|id| Request {
            ignore_eos: true,
            ..request(id, prompt(id as u32, 8), 32)
        })
        .collect();
    for r in &reqs {
        h.submit(r.clone());
    }
    h.run(2_000);
    let released: usize = h
        .plans
        .iter()
        .map(|p| p.finished.iter().map(|f| f.slot).collect::<Vec<_>>().len())
        .sum();
    assert_eq!(released, reqs.len(), "no request was retracted");
    assert_eq!(h.sched.stats().retractions, 0);
    for r in &reqs {
        assert_eq!(h.tokens(r.id), reference(&r.prompt, 32));
    }
    h.assert_no_leak();
}
