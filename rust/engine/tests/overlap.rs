//! One-step-ahead ("overlap") scheduling: the harness keeps two plans in flight, as the engine
//! does, so the scheduler plans step N+1 before it has seen step N's sampled tokens.

mod common;

use common::{config, prompt, reference, request, Harness};
use tokenspeed_engine::{FinishReason, Plan, Request, SchedulePolicy, StepResult, LAST_SAMPLED};

fn placeholders(plan: &Plan) -> usize {
    plan.scheduled
        .iter()
        .flat_map(|r| &r.tokens)
        .filter(|&&t| t == LAST_SAMPLED)
        .count()
}

/// Runs `reqs` to completion in one mode; returns the harness.
fn run(reqs: &[Request], overlap: bool, cfg: tokenspeed_engine::SchedulerConfig) -> Harness {
    let mut h = Harness::with_overlap(cfg, overlap);
    for r in reqs {
        h.submit(r.clone());
    }
    h.run(5_000);
    h
}

#[test]
fn decodes_feed_the_token_in_flight_and_give_the_same_tokens() {
    let reqs: Vec<Request> = (0..6)
        .map(|id| request(id, prompt(id as u32, 5 + id as usize), 12))
        .collect();
    let mut plain = run(&reqs, false, config(256, 2));
    let mut ahead = run(&reqs, true, config(256, 2));
    for r in &reqs {
        assert_eq!(
            ahead.tokens(r.id),
            reference(&r.prompt, 12),
            "request {}",
            r.id
        );
        assert_eq!(ahead.tokens(r.id), plain.tokens(r.id));
        assert_eq!(ahead.finish_reason(r.id), Some(FinishReason::Length));
    }
    // One prefill step, then every step decodes all six from the token still in flight.
    let decode_plans: Vec<&Plan> = ahead.plans[1..]
        .iter()
        .filter(|p| !p.scheduled.is_empty())
        .collect();
    assert_eq!(
        decode_plans.len(),
        11,
        "12 tokens: 1 from the prefill, 11 decodes"
    );
    assert!(decode_plans
        .iter()
        .all(|p| p.scheduled.len() == 6 && placeholders(p) == 6));
    assert_eq!(
        plain.plans.iter().map(placeholders).sum::<usize>(),
        0,
        "one plan at a time never needs a placeholder"
    );
    plain.assert_no_leak();
    ahead.assert_no_leak();
}

#[test]
fn prefill_chunks_follow_each_other_without_waiting_for_results() {
    let mut h = Harness::with_overlap(
        tokenspeed_engine::SchedulerConfig {
            chunked_prefill_size: 8,
            ..config(64, 4)
        },
        true,
    );
    h.submit(request(1, prompt(1, 20), 3));
    h.run(20);
    let steps: Vec<(u32, u32, bool, Vec<u32>)> = h
        .plans
        .iter()
        .filter_map(|p| p.scheduled.first())
        .map(|r| {
            let ids = if r.tokens.len() == 1 {
                r.tokens.clone()
            } else {
                vec![]
            };
            (r.start_pos, r.tokens.len() as u32, r.sample, ids)
        })
        .collect();
    assert_eq!(
        steps,
        vec![
            (0, 8, false, vec![]),
            (8, 8, false, vec![]),
            (16, 4, true, vec![]),
            (20, 1, true, vec![LAST_SAMPLED]),
            (21, 1, true, vec![LAST_SAMPLED]),
        ],
        "the last token (the third) is never fed"
    );
    assert_eq!(h.tokens(1), reference(&prompt(1, 20), 3));
    h.assert_no_leak();
}

#[test]
fn a_stop_token_seen_one_step_late_ends_the_request_with_no_extra_token() {
    let p = prompt(4, 5);
    let expected = reference(&p, 10);
    let stop = expected[2];
    let mut h = Harness::with_overlap(config(64, 4), true);
    h.submit(Request {
        stop_token_ids: vec![stop],
        ..request(1, p, 10)
    });
    h.run(30);
    assert_eq!(
        h.tokens(1),
        expected[..3],
        "the stop token is the last output"
    );
    assert_eq!(h.finish_reason(1), Some(FinishReason::Stop));
    assert_eq!(h.last_output(1).completion_tokens, 3);
    // The decode of the stop token was already planned when it came back: one wasted step.
    let fed: Vec<u32> = h
        .plans
        .iter()
        .flat_map(|p| p.scheduled.iter().map(|r| r.start_pos))
        .collect();
    assert_eq!(
        fed,
        vec![0, 5, 6, 7],
        "prefill, then decodes of tokens 1, 2 and 3 (wasted)"
    );
    h.assert_no_leak();
}

#[test]
fn no_placeholder_is_planned_for_a_token_past_max_new_tokens() {
    for max_new in 1..6 {
        let p = prompt(2, 7);
        let mut h = Harness::with_overlap(config(64, 4), true);
        h.submit(request(1, p.clone(), max_new));
        h.run(30);
        assert_eq!(h.tokens(1), reference(&p, max_new));
        let last = h
            .plans
            .iter()
            .flat_map(|p| &p.scheduled)
            .map(|r| r.start_pos + r.tokens.len() as u32)
            .max();
        assert_eq!(
            last,
            Some(7 + max_new - 1),
            "the last sampled token is never fed (max_new_tokens {max_new})"
        );
        h.assert_no_leak();
    }
}

#[test]
fn aborting_a_request_with_steps_in_flight_drops_their_results_and_frees_its_pages() {
    let mut h = Harness::with_overlap(config(64, 4), true);
    h.submit(request(1, prompt(1, 6), 20));
    h.submit(request(2, prompt(2, 6), 20));
    for _ in 0..4 {
        h.step();
    }
    assert_eq!(h.in_flight.len(), 1, "a plan is in flight between steps");
    let before = h.tokens(1).len();
    assert!(h.sched.abort(1.into()));
    h.run(100);
    assert_eq!(
        h.tokens(1).len(),
        before,
        "nothing delivered after the abort"
    );
    assert_eq!(h.tokens(1), reference(&prompt(1, 6), 20)[..before]);
    assert_eq!(h.tokens(2), reference(&prompt(2, 6), 20));
    h.assert_no_leak();
}

#[test]
fn page_pressure_retracts_requests_with_steps_in_flight_and_all_complete_exactly() {
    // As the one-plan-at-a-time test: 8 requests of up to 6 pages share 16 pages.
    let reqs: Vec<Request> = (0..8)
        .map(|id| request(id, prompt(id as u32, 6), 18))
        .collect();
    let mut h = run(&reqs, true, config(16, 4));
    let released: usize = h
        .plans
        .iter()
        .map(|p| p.finished.iter().map(|f| f.slot).collect::<Vec<_>>().len())
        .sum();
    assert!(released > reqs.len(), "some requests were retracted");
    for r in &reqs {
        assert_eq!(h.tokens(r.id), reference(&r.prompt, 18), "request {}", r.id);
        assert_eq!(h.finish_reason(r.id), Some(FinishReason::Length));
    }
    h.assert_no_leak();
}

#[test]
fn shared_prefixes_under_pressure_give_the_same_tokens_as_one_plan_at_a_time() {
    let cfg = tokenspeed_engine::SchedulerConfig {
        max_running_requests: 6,
        chunked_prefill_size: 16,
        schedule_policy: SchedulePolicy::Lpm,
        ..config(24, 2)
    };
    let base = prompt(9, 12);
    let reqs: Vec<Request> = (0..20u64)
        .map(|id| {
            let tail = prompt(id as u32 + 20, (id % 5) as usize + 1);
            let head = &base[..(id as usize % 4) * 3];
            let mut r = request(id, [head, &tail].concat(), 8 + (id % 7) as u32);
            if id % 3 == 0 {
                // Some stop early (one step late, with overlap).
                r.stop_token_ids = vec![reference(&r.prompt, r.max_new_tokens)[2]];
            }
            r
        })
        .collect();
    let mut plain = run(&reqs, false, cfg.clone());
    let mut ahead = run(&reqs, true, cfg);
    for r in &reqs {
        assert_eq!(ahead.tokens(r.id), plain.tokens(r.id), "request {}", r.id);
        assert_eq!(ahead.finish_reason(r.id), plain.finish_reason(r.id));
    }
    plain.assert_no_leak();
    ahead.assert_no_leak();
}

#[test]
fn duplicate_prompts_prefilled_together_converge_with_placeholders_in_flight() {
    let p = [prompt(9, 12), vec![1]].concat();
    let reqs = [request(1, p.clone(), 20), request(2, p.clone(), 20)];
    let mut h = run(&reqs, true, config(64, 4));
    assert_eq!(h.tokens(1), reference(&p, 20));
    assert_eq!(h.tokens(2), reference(&p, 20));
    h.assert_no_leak();
}

#[test]
fn a_missing_sample_with_a_placeholder_in_flight_retracts_and_ignores_the_stale_result() {
    let p = prompt(1, 6);
    let mut h = Harness::with_overlap(
        tokenspeed_engine::SchedulerConfig {
            max_running_requests: 1,
            ..config(64, 4)
        },
        true,
    );
    h.submit(request(1, p.clone(), 8));
    for _ in 0..3 {
        h.step();
    }
    let got = h.tokens(1).len();
    assert_eq!(got, 2, "prefill and one decode came back");
    // The next plan (a placeholder decode) is in flight; the one after is planned on top of it.
    let plan = h.sched.schedule().expect("a placeholder decode");
    assert_eq!(placeholders(&plan), 1);
    h.in_flight.push_back(h.worker.execute(&plan));
    h.plans.push(plan);
    // The older one comes back without the token: the placeholder after it read nothing valid.
    let mut lost = h.in_flight.pop_front().expect("in flight");
    lost.events.clear();
    assert!(h.sched.advance(&lost).is_empty());
    // The request goes back to the queue and is readmitted, in the same slot, in a new plan
    // while the stale placeholder's result is still to come.
    let readmit = h.sched.schedule().expect("readmission");
    assert_eq!(
        readmit.finished.iter().map(|f| f.slot).collect::<Vec<_>>(),
        vec![0]
    );
    assert_eq!(readmit.new_requests.len(), 1);
    assert_eq!(readmit.new_requests[0].slot, 0);
    h.in_flight.push_back(h.worker.execute(&readmit));
    h.plans.push(readmit);
    let stale = h.in_flight.pop_front().expect("in flight");
    assert_eq!(stale.events.len(), 1, "the worker did sample for slot 0");
    assert!(
        h.sched.advance(&stale).is_empty(),
        "a result planned for the earlier admission is stale"
    );
    h.run(100);
    assert_eq!(h.tokens(1), reference(&p, 8));
    assert_eq!(h.last_output(1).completion_tokens, 8);
    h.assert_no_leak();
}

#[test]
fn a_whole_step_result_lost_counts_as_answered_with_nothing() {
    let p = prompt(3, 5);
    let mut h = Harness::with_overlap(config(64, 4), true);
    h.submit(request(1, p.clone(), 6));
    for _ in 0..3 {
        h.step();
    }
    // Two plans in flight; the worker answers only the newer one.
    let plan = h.sched.schedule().expect("plan");
    h.in_flight.push_back(h.worker.execute(&plan));
    h.plans.push(plan);
    let _lost = h.in_flight.pop_front();
    let newer = h.in_flight.pop_front().expect("in flight");
    assert!(h.sched.advance(&newer).is_empty());
    let outs = h.sched.advance(&StepResult {
        step_id: newer.step_id,
        ..Default::default()
    });
    assert!(outs.is_empty(), "an answered step is not answered twice");
    h.run(100);
    assert_eq!(h.tokens(1), reference(&p, 6));
    h.assert_no_leak();
}
