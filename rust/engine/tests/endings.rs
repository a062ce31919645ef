//! Every way a request ends goes through `Scheduler::finish(id, reason)`: the reason is
//! recorded once, the slot is reported finished in the next plan, and every page comes back.
//! Synthetic token ids (the fake model of `common`).

mod common;

use common::{config, prompt, reference, request, Harness};
use tokenspeed_engine::plan::event_error;
use tokenspeed_engine::{FinishReason, Finished, Request, RequestId};

/// Runs until request `id` has `n` generated tokens.
fn decode_until(h: &mut Harness, id: u64, n: usize) {
    for _ in 0..100 {
        if h.tokens(id).len() >= n {
            return;
        }
        h.step();
    }
    panic!("request {id} did not reach {n} tokens");
}

/// The request ended for `reason` and only for it, its slot left in a plan, and no page leaked.
fn assert_ended_once(h: &mut Harness, reason: FinishReason) {
    h.run(100);
    for r in [
        FinishReason::Stop,
        FinishReason::Length,
        FinishReason::StopString,
        FinishReason::Complete,
        FinishReason::Abort,
        FinishReason::Error,
    ] {
        let want = u64::from(r == reason);
        assert_eq!(
            h.sched.finished_count(r),
            want,
            "{r:?} while ending by {reason:?}"
        );
    }
    assert!(h.sched.is_idle());
    h.assert_no_leak();
}

#[test]
fn a_stop_token_ends_the_request_with_stop() {
    let mut h = Harness::new(config(64, 4));
    let p = prompt(1, 6);
    let stop = reference(&p, 5)[2];
    h.submit(Request {
        stop_token_ids: vec![stop],
        ..request(1, p.clone(), 5)
    });
    h.run(100);
    assert_eq!(h.finish_reason(1), Some(FinishReason::Stop));
    assert_eq!(h.tokens(1), reference(&p, 3));
    assert_ended_once(&mut h, FinishReason::Stop);
}

#[test]
fn max_new_tokens_ends_the_request_with_length() {
    let mut h = Harness::new(config(64, 4));
    h.submit(request(1, prompt(1, 6), 4));
    h.run(100);
    assert_eq!(h.finish_reason(1), Some(FinishReason::Length));
    assert_eq!(h.tokens(1).len(), 4);
    assert_ended_once(&mut h, FinishReason::Length);
}

/// A front-end ending (stop string, completed grammar) of a decoding request: `finish` records
/// it with the tokens generated so far, the slot is freed, and a second report does nothing.
fn front_end_ending(reason: FinishReason) {
    let mut h = Harness::new(config(64, 4));
    h.submit(request(1, prompt(1, 6), 20));
    h.submit(request(2, prompt(2, 6), 3));
    decode_until(&mut h, 1, 2);
    let generated = h.tokens(1).len() as u32;
    assert_eq!(
        h.sched.finish(RequestId::from(1), reason),
        Some(Finished {
            id: 1.into(),
            reason,
            completion_tokens: generated,
            preemptions: 0,
        })
    );
    assert_eq!(
        h.sched.finish(RequestId::from(1), reason),
        None,
        "ends once"
    );
    let next = h.sched.schedule().expect("the other request still runs");
    assert!(
        !next.finished.is_empty(),
        "the freed slot is in the next plan"
    );
    let result = h.worker.execute(&next);
    for out in h.sched.advance(&result) {
        assert_ne!(out.id, RequestId::from(1), "no output after the ending");
        h.record(out);
    }
    h.plans.push(next);
    h.run(100);
    assert_eq!(h.tokens(1).len() as u32, generated);
    assert_eq!(h.finish_reason(2), Some(FinishReason::Length));
    assert_eq!(h.sched.finished_count(reason), 1);
    assert_eq!(h.sched.finished_count(FinishReason::Length), 1);
    h.assert_no_leak();
}

#[test]
fn a_matched_stop_string_ends_the_request_in_the_scheduler() {
    front_end_ending(FinishReason::StopString);
}

#[test]
fn a_completed_grammar_ends_the_request_in_the_scheduler() {
    front_end_ending(FinishReason::Complete);
}

#[test]
fn abort_ends_a_waiting_or_a_running_request() {
    let mut h = Harness::new(config(64, 4));
    h.submit(request(1, prompt(1, 6), 20));
    decode_until(&mut h, 1, 1);
    h.submit(request(2, prompt(2, 6), 20)); // waiting: never scheduled
    assert!(h.sched.abort(2.into()));
    assert!(h.sched.abort(1.into()));
    assert!(!h.sched.abort(1.into()), "an unknown id");
    h.run(100);
    assert_eq!(h.sched.finished_count(FinishReason::Abort), 2);
    assert!(!h.outputs.contains_key(&RequestId::from(2)));
    h.assert_no_leak();
}

#[test]
fn a_worker_error_ends_the_request_with_error_in_its_last_output() {
    let mut h = Harness::new(config(64, 4));
    h.submit(request(1, prompt(1, 6), 20));
    let plan = h.sched.schedule().expect("a plan");
    let mut result = h.worker.execute(&plan);
    h.plans.push(plan);
    let event = result.events.first_mut().expect("the request sampled");
    event.error = event_error::FAILED;
    event.tokens.clear();
    event.logprobs.clear();
    let outs = h.sched.advance(&result);
    assert_eq!(outs.len(), 1);
    assert_eq!(outs[0].finished, Some(FinishReason::Error));
    assert!(outs[0].error.is_some());
    assert_ended_once(&mut h, FinishReason::Error);
}
