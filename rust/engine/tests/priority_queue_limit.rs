//! `Scheduler::displace_for`: with priority scheduling, a newcomer to a full queue
//! (`--max-queued-requests`) takes the place of the least urgent waiting request when it is
//! strictly more urgent; among equals the latest arrival goes. The one displaced leaves the
//! scheduler as an abort, its resources freed; the rest are served as usual.

mod common;

use common::{config, prompt, reference, request, Harness};
use tokenspeed_engine::{FinishReason, Request, SchedulerConfig};

fn prioritized(id: u64, priority: i64) -> Request {
    Request {
        priority,
        ..request(id, prompt(id as u32, 6), 2)
    }
}

/// One slot held by request 0 while requests 1.. wait with `priorities`.
fn queue(cfg: SchedulerConfig, priorities: &[i64]) -> Harness {
    let mut h = Harness::new(SchedulerConfig {
        max_running_requests: 1,
        ..cfg
    });
    h.submit(prioritized(0, 0));
    h.step();
    for (i, &p) in priorities.iter().enumerate() {
        h.submit(prioritized(i as u64 + 1, p));
    }
    assert_eq!(h.sched.stats().waiting, priorities.len());
    h
}

/// The id `newcomer` (priority `p`) displaces, if any; when it does, it is queued in its place.
fn arrive(h: &mut Harness, id: u64, p: i64) -> Option<u64> {
    let newcomer = prioritized(id, p);
    let gone = h.sched.displace_for(&newcomer).map(|f| {
        assert_eq!(f.reason, FinishReason::Abort);
        f.id.uuid as u64
    });
    if gone.is_some() {
        h.submit(newcomer);
    }
    gone
}

/// Runs everything left to the end: each request still in the scheduler gets the fake model's
/// tokens, no displaced one got any, and no page leaks.
fn drain(mut h: Harness, served: &[u64], displaced: &[u64]) {
    h.run(500);
    assert!(h.sched.is_idle(), "every request finished");
    for &id in served {
        assert_eq!(
            h.tokens(id),
            reference(&prompt(id as u32, 6), 2),
            "request {id}"
        );
    }
    for &id in displaced {
        assert!(h.tokens(id).is_empty(), "displaced request {id} ran");
    }
    assert_eq!(
        h.sched.finished_count(FinishReason::Abort),
        displaced.len() as u64
    );
    h.assert_no_leak();
}

fn with_priority(low_values_first: bool) -> SchedulerConfig {
    SchedulerConfig {
        enable_priority_scheduling: true,
        schedule_low_priority_values_first: low_values_first,
        ..config(256, 1)
    }
}

#[test]
fn a_more_urgent_newcomer_displaces_the_latest_of_the_least_urgent() {
    let mut h = queue(with_priority(false), &[0, 5, 0, 5]);
    assert_eq!(
        arrive(&mut h, 10, 1),
        Some(3),
        "latest of the priority-0 ones"
    );
    assert_eq!(arrive(&mut h, 11, 0), None, "an equal does not displace");
    assert_eq!(
        arrive(&mut h, 12, -1),
        None,
        "a less urgent one does not either"
    );
    assert_eq!(arrive(&mut h, 13, 6), Some(1), "the last priority-0 one");
    assert_eq!(
        arrive(&mut h, 14, 6),
        Some(10),
        "then the priority-1 newcomer"
    );
    assert_eq!(
        h.sched.stats().waiting,
        4,
        "each displacement keeps the queue's length"
    );
    drain(h, &[0, 2, 4, 13, 14], &[1, 3, 10]);
}

#[test]
fn low_priority_values_first_reverses_who_is_least_urgent() {
    let mut h = queue(with_priority(true), &[0, 5, 0, 5]);
    assert_eq!(
        arrive(&mut h, 10, 1),
        Some(4),
        "latest of the priority-5 ones"
    );
    assert_eq!(arrive(&mut h, 11, 5), None, "an equal does not displace");
    assert_eq!(arrive(&mut h, 12, 9), None, "a larger value is less urgent");
    assert_eq!(arrive(&mut h, 13, -3), Some(2));
    drain(h, &[0, 1, 3, 10, 13], &[2, 4]);
}

#[test]
fn nothing_is_displaced_without_priority_scheduling_or_a_queue() {
    let mut h = queue(config(256, 1), &[0, 0]);
    assert_eq!(arrive(&mut h, 10, 100), None, "priority scheduling off");
    drain(h, &[0, 1, 2], &[]);

    let mut h = Harness::new(with_priority(false));
    assert_eq!(arrive(&mut h, 10, 100), None, "nothing waits");
    assert!(h.sched.is_idle());
}
