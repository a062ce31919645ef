//! Pooling requests (embeddings, scores): prefill-only. The whole prompt runs in one step from
//! its first token, the step's event carries the pooled vector, and the request ends right
//! there (`FinishReason::Pooled`) with its pages freed, never cached.

mod common;

use common::{config, prompt, request, Harness};
use tokenspeed_engine::{
    FinishReason, Request, RequestEvent, SamplingParams, StepResult, SubmitError,
};

fn pooling(id: u64, prompt: Vec<u32>) -> Request {
    Request {
        sampling: SamplingParams {
            pooling: true,
            ..SamplingParams::greedy()
        },
        ..request(id, prompt, 1)
    }
}

/// What a pooling worker answers: per scheduled request, a vector naming its slot.
fn pooled_result(plan: &tokenspeed_engine::Plan) -> StepResult {
    StepResult {
        step_id: plan.step_id,
        events: plan
            .scheduled
            .iter()
            .map(|s| RequestEvent {
                slot: s.slot,
                pooled: vec![s.slot as f32, 0.5, -1.0],
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

#[test]
fn pooling_requests_run_their_whole_prompt_in_one_step_and_end_with_the_vector() {
    let mut h = Harness::new(config(64, 4));
    // A generation request computes (and caches) the same prompt first: pooling must not
    // start from that prefix.
    let p = prompt(1, 10);
    h.submit(request(9, p.clone(), 2));
    h.run(50);
    h.submit(pooling(1, p));
    h.submit(pooling(2, prompt(2, 7)));
    let plan = h.sched.schedule().expect("a plan");
    assert_eq!(plan.scheduled.len(), 2, "both batched in one step");
    for s in &plan.scheduled {
        assert_eq!(s.start_pos, 0, "uncached");
        assert!(s.sample, "the prompt's last token is in the step");
    }
    assert_eq!(plan.num_tokens(), 17);
    assert!(plan.new_requests.iter().all(|n| n.pooling));
    let outs = h.sched.advance(&pooled_result(&plan));
    assert_eq!(outs.len(), 2);
    for out in &outs {
        assert_eq!(out.finished, Some(FinishReason::Pooled));
        assert!(out.tokens.is_empty());
        assert_eq!(out.pooled.len(), 3);
        assert_eq!(out.completion_tokens, 0);
    }
    // Their slots leave in the next plan; nothing more is scheduled for them.
    let next = h.sched.schedule().expect("the finished slots");
    assert!(next.scheduled.is_empty());
    assert_eq!(next.finished.len(), 2);
    h.sched.advance(&StepResult {
        step_id: next.step_id,
        ..Default::default()
    });
    assert_eq!(h.sched.finished_count(FinishReason::Pooled), 2);
    assert!(h.sched.is_idle());
    h.assert_no_leak();
}

#[test]
fn a_pooling_prompt_waits_for_a_step_with_room_instead_of_being_chunked() {
    let mut h = Harness::new(config(64, 4)); // 64 prompt tokens a step
    h.submit(pooling(1, prompt(1, 40)));
    h.submit(pooling(2, prompt(2, 40)));
    let first = h.sched.schedule().expect("a plan");
    assert_eq!(first.scheduled.len(), 1);
    assert_eq!(first.num_tokens(), 40);
    h.sched.advance(&pooled_result(&first));
    let second = h.sched.schedule().expect("a plan");
    assert_eq!(second.scheduled.len(), 1);
    assert_eq!(second.num_tokens(), 40);
}

#[test]
fn a_pooling_prompt_longer_than_a_step_is_refused() {
    let mut h = Harness::new(config(64, 4));
    let err = h.sched.submit(pooling(1, prompt(1, 65))).unwrap_err();
    assert!(
        matches!(err, SubmitError::PoolingPromptTooLong { .. }),
        "{err}"
    );
}

#[test]
fn a_missing_vector_is_an_error_not_a_hang() {
    let mut h = Harness::new(config(64, 4));
    h.submit(pooling(1, prompt(1, 5)));
    let plan = h.sched.schedule().expect("a plan");
    let outs = h.sched.advance(&StepResult {
        step_id: plan.step_id,
        events: vec![RequestEvent {
            slot: plan.scheduled[0].slot,
            ..Default::default()
        }],
        ..Default::default()
    });
    assert_eq!(outs[0].finished, Some(FinishReason::Error));
    assert!(outs[0].error.is_some());
}
