//! Priority scheduling: with `enable_priority_scheduling` waiting requests are admitted by
//! `Request::priority` (larger first, or smaller first with `schedule_low_priority_values_first`),
//! in arrival order within a priority; off, priorities change nothing.

mod common;

use common::{config, prompt, reference, request, Harness};
use tokenspeed_engine::{Request, RequestId, SchedulePolicy, SchedulerConfig};

fn prioritized(id: u64, priority: i64) -> Request {
    Request {
        priority,
        ..request(id, prompt(id as u32, 6), 2)
    }
}

/// One slot, request 0 holding it while the others queue with `priorities` (ids 1..): the
/// order in which the queued ones are admitted. Every request must finish with the fake
/// model's tokens.
fn admission_order(cfg: SchedulerConfig, priorities: &[i64]) -> Vec<u64> {
    let mut h = Harness::new(SchedulerConfig {
        max_running_requests: 1,
        ..cfg
    });
    h.submit(prioritized(0, 0));
    h.step();
    assert_eq!(h.sched.take_admitted(), vec![RequestId::from(0)]);
    for (i, &p) in priorities.iter().enumerate() {
        h.submit(prioritized(i as u64 + 1, p));
    }
    let mut order = Vec::new();
    for _ in 0..200 {
        let progressed = h.step();
        order.extend(h.sched.take_admitted().into_iter().map(|id| id.uuid as u64));
        if !progressed {
            break;
        }
    }
    assert!(h.sched.is_idle(), "every request finished");
    for id in 0..=priorities.len() as u64 {
        assert_eq!(
            h.tokens(id),
            reference(&prompt(id as u32, 6), 2),
            "request {id}"
        );
    }
    h.assert_no_leak();
    order
}

fn with_priority(low_values_first: bool) -> SchedulerConfig {
    SchedulerConfig {
        enable_priority_scheduling: true,
        schedule_low_priority_values_first: low_values_first,
        ..config(256, 1)
    }
}

#[test]
fn larger_priority_values_are_admitted_first_and_ties_keep_arrival_order() {
    let order = admission_order(with_priority(false), &[0, 5, 1, 5, -3, 1]);
    assert_eq!(order, vec![2, 4, 3, 6, 1, 5]);
}

#[test]
fn low_priority_values_first_reverses_the_ranking_not_the_ties() {
    let order = admission_order(with_priority(true), &[0, 5, 1, 5, -3, 1]);
    assert_eq!(order, vec![5, 1, 3, 6, 2, 4]);
}

#[test]
fn priorities_change_nothing_when_priority_scheduling_is_off() {
    let order = admission_order(config(256, 1), &[0, 5, 1, 5, -3, 1]);
    assert_eq!(order, vec![1, 2, 3, 4, 5, 6]);
}

#[test]
fn a_late_urgent_request_overtakes_a_queued_flood() {
    let flood = vec![0; 30];
    let mut priorities = flood.clone();
    priorities.push(10);
    let order = admission_order(with_priority(false), &priorities);
    assert_eq!(order[0], 31, "the urgent request takes the first free slot");
    assert_eq!(
        &order[1..],
        (1..=30).collect::<Vec<u64>>(),
        "the flood stays FCFS"
    );
}

#[test]
fn priority_ranks_before_the_longest_prefix_and_lpm_orders_within_a_priority() {
    let mut h = Harness::new(SchedulerConfig {
        max_running_requests: 1,
        schedule_policy: SchedulePolicy::Lpm,
        ..with_priority(false)
    });
    let shared = prompt(7, 16);
    h.submit(request(1, shared.clone(), 1));
    h.run(20);
    h.sched.take_admitted();
    h.submit(prioritized(9, 0)); // holds the slot while the rest queue
    h.step();
    let hit = |id: u64, priority: i64| Request {
        priority,
        ..request(id, [shared.clone(), vec![id as u32]].concat(), 1)
    };
    h.submit(prioritized(2, 0)); // miss, low
    h.submit(hit(3, 0)); // hit, low
    h.submit(prioritized(4, 1)); // miss, high
    h.submit(hit(5, 1)); // hit, high
    let mut order = Vec::new();
    for _ in 0..100 {
        let progressed = h.step();
        order.extend(h.sched.take_admitted().into_iter().map(|id| id.uuid as u64));
        if !progressed {
            break;
        }
    }
    assert_eq!(order, vec![9, 5, 4, 3, 2]);
}
