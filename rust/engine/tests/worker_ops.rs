//! Operations on the worker group (`WorkerOp`): with admission held, running requests finish
//! while queued ones wait; the op's plan goes out alone, numbered in step order, only once no
//! request holds a slot; dropping the cache then leaves queued requests intact.

mod common;

use common::{config, prompt, reference, request, Harness};
use tokenspeed_engine::{op_kind, StepResult, WorkerOp};

fn op() -> WorkerOp {
    WorkerOp {
        kind: op_kind::UPDATE_WEIGHTS,
        args: br#"{"model_path": "/x"}"#.to_vec(),
    }
}

#[test]
fn an_op_waits_for_running_requests_and_queued_ones_run_after_it() {
    let mut h = Harness::new(config(256, 4));
    h.submit(request(1, prompt(1, 10), 6));
    h.step();
    h.sched.hold_admission(true);
    h.submit(request(2, prompt(2, 10), 6));
    assert!(h.sched.op_plan(op()).is_none(), "request 1 holds a slot");
    for _ in 0..20 {
        h.step();
    }
    assert_eq!(
        h.tokens(1),
        reference(&prompt(1, 10), 6),
        "running requests finish"
    );
    assert!(h.tokens(2).is_empty(), "queued ones are not admitted");
    assert!(h.sched.stats().cached_pages > 0);
    let plan = h.sched.op_plan(op()).expect("nothing runs");
    assert_eq!(plan.ops, vec![op()]);
    assert!(plan.scheduled.is_empty() && plan.new_requests.is_empty());
    assert_eq!(plan.step_id, h.plans.last().map_or(0, |p| p.step_id + 1));
    assert!(h
        .sched
        .advance(&StepResult {
            step_id: plan.step_id,
            ..Default::default()
        })
        .is_empty());
    assert!(
        h.sched.drop_cache(),
        "no request runs: queued ones hold no pages"
    );
    assert_eq!(h.sched.stats().cached_pages, 0);
    h.sched.hold_admission(false);
    // The harness's worker must see step ids in order: it skipped the op's step.
    h.worker = common::FakeWorker::new(h.sched.config());
    h.run(50);
    assert_eq!(h.tokens(2), reference(&prompt(2, 10), 6));
    h.assert_no_leak();
}
