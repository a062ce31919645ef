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

// Priority preemption (`priority_scheduling_preemption_threshold`, `preemption.rs`).

fn long(id: u64, priority: i64, max_new_tokens: u32) -> Request {
    Request {
        priority,
        ..request(id, prompt(id as u32, 10), max_new_tokens)
    }
}

/// `max_running` slots filled by low-priority requests 1..=max_running (priority 0, 30 tokens
/// each), decoding a few steps; then request 99 arrives with `urgent_priority`. Returns the
/// harness after every request finished, checked against the fake model and for leaks, and
/// how many steps after its arrival request 99 was admitted.
fn flood_then_urgent(
    cfg: SchedulerConfig,
    max_running: u32,
    urgent_priority: i64,
    overlap: bool,
) -> (Harness, usize) {
    let mut h = Harness::with_overlap(
        SchedulerConfig {
            max_running_requests: max_running,
            ..cfg
        },
        overlap,
    );
    for id in 1..=u64::from(max_running) {
        h.submit(long(id, 0, 30));
    }
    for _ in 0..6 {
        h.step();
    }
    h.sched.take_admitted();
    h.submit(long(99, urgent_priority, 4));
    let mut waited = None;
    for n in 0..500 {
        let progressed = h.step();
        if waited.is_none() && h.sched.take_admitted().contains(&RequestId::from(99)) {
            waited = Some(n);
        }
        if !progressed {
            break;
        }
    }
    assert!(h.sched.is_idle(), "every request finished");
    for id in 1..=u64::from(max_running) {
        assert_eq!(
            h.tokens(id),
            reference(&prompt(id as u32, 10), 30),
            "request {id}"
        );
    }
    assert_eq!(h.tokens(99), reference(&prompt(99, 10), 4));
    h.assert_no_leak();
    (h, waited.expect("request 99 admitted"))
}

/// Whether some admission started past position 0 although no two prompts share a prefix:
/// only a retracted request finding its own KV in the prefix cache does.
fn a_readmission_reused_its_kv(h: &Harness) -> bool {
    h.plans.iter().any(|plan| {
        plan.new_requests.iter().any(|new| {
            plan.scheduled
                .iter()
                .any(|s| s.slot == new.slot && s.start_pos > 0)
        })
    })
}

#[test]
fn an_urgent_request_preempts_the_latest_low_priority_one_which_resumes_exactly() {
    for overlap in [false, true] {
        let (h, waited) = flood_then_urgent(with_priority(false), 2, 20, overlap);
        assert_eq!(waited, 0, "admitted in the first step after it arrived");
        assert_eq!(
            h.sched.stats().retractions,
            1,
            "one victim is enough for one slot"
        );
        assert!(
            a_readmission_reused_its_kv(&h),
            "the victim resumed from its cached KV"
        );
    }
}

#[test]
fn the_latest_admitted_of_the_least_urgent_gives_way() {
    // Slots: 1 (priority 0), 2 (priority -5), 3 (priority 0); the urgent one needs one slot.
    let mut h = Harness::new(SchedulerConfig {
        max_running_requests: 3,
        ..with_priority(false)
    });
    h.submit(long(1, 0, 30));
    h.submit(long(2, -5, 30));
    h.submit(long(3, 0, 30));
    for _ in 0..4 {
        h.step();
    }
    h.submit(long(99, 20, 4));
    h.step();
    assert_eq!(h.sched.stats().retractions, 1);
    assert_eq!(h.sched.stats().waiting, 1);
    // Request 2 (least urgent) is the one back in the queue: it alone has not progressed.
    h.step();
    let before: Vec<usize> = (1..=3).map(|id| h.tokens(id).len()).collect();
    h.step();
    let after: Vec<usize> = (1..=3).map(|id| h.tokens(id).len()).collect();
    assert!(
        after[0] > before[0] && after[2] > before[2],
        "1 and 3 keep decoding"
    );
    assert_eq!(after[1], before[1], "2 was preempted");
    h.run(500);
    assert_eq!(h.tokens(2), reference(&prompt(2, 10), 30));
    h.assert_no_leak();
}

#[test]
fn no_preemption_within_the_threshold_or_without_priority_scheduling() {
    // A gap of exactly the threshold (10) is not enough: the urgent request waits for a slot.
    let (h, waited) = flood_then_urgent(with_priority(false), 2, 10, false);
    assert_eq!(h.sched.stats().retractions, 0);
    assert!(
        waited > 10,
        "waited for a request to finish ({waited} steps)"
    );
    let (h, waited) = flood_then_urgent(config(256, 1), 2, 20, false);
    assert_eq!(h.sched.stats().retractions, 0);
    assert!(waited > 10);
    // A threshold of 0 lets any higher priority preempt.
    let (h, waited) = flood_then_urgent(
        SchedulerConfig {
            priority_scheduling_preemption_threshold: 0,
            ..with_priority(false)
        },
        2,
        1,
        false,
    );
    assert_eq!((h.sched.stats().retractions, waited), (1, 0));
}

#[test]
fn low_values_first_preempts_for_the_smaller_number() {
    let (h, waited) = flood_then_urgent(with_priority(true), 2, -20, true);
    assert_eq!((h.sched.stats().retractions, waited), (1, 0));
    let (h, _) = flood_then_urgent(with_priority(true), 2, 20, false);
    assert_eq!(
        h.sched.stats().retractions,
        0,
        "20 is the least urgent there"
    );
}

#[test]
fn an_urgent_request_short_of_pages_preempts_as_many_as_it_needs() {
    // Slots to spare, pages not: 4 low requests of 10 + 30 tokens fill most of 160 one-token
    // pages; the urgent one needs its 60-token prompt and growth.
    let mut h = Harness::new(SchedulerConfig {
        max_running_requests: 8,
        num_pages: 160,
        ..with_priority(false)
    });
    for id in 1..=4 {
        h.submit(long(id, 0, 30));
    }
    for _ in 0..25 {
        h.step();
    }
    assert_eq!(h.sched.stats().running, 4);
    h.sched.take_admitted();
    h.submit(Request {
        priority: 20,
        ..request(99, prompt(99, 60), 8)
    });
    h.step();
    let retracted = h.sched.stats().retractions;
    // Each holds 34 pages with 4 more reserved; 24 are free; 66 are needed: two must go.
    assert_eq!(retracted, 2, "as many as needed");
    assert_eq!(h.sched.take_admitted(), vec![RequestId::from(99)]);
    h.run(500);
    for id in 1..=4 {
        assert_eq!(
            h.tokens(id),
            reference(&prompt(id as u32, 10), 30),
            "request {id}"
        );
    }
    assert_eq!(h.tokens(99), reference(&prompt(99, 60), 8));
    h.assert_no_leak();
}

#[test]
fn nothing_is_retracted_when_the_eligible_victims_cannot_make_room() {
    // Request 1 (priority 50, outranking the urgent one) holds most pages; retracting the
    // low-priority request 2 would not make room for request 99, so neither is touched.
    let mut h = Harness::new(SchedulerConfig {
        max_running_requests: 8,
        num_pages: 120,
        ..with_priority(false)
    });
    h.submit(Request {
        priority: 50,
        ..request(1, prompt(1, 60), 30)
    });
    h.submit(long(2, 0, 10));
    for _ in 0..5 {
        h.step();
    }
    h.submit(Request {
        priority: 20,
        ..request(99, prompt(99, 60), 8)
    });
    h.step();
    assert_eq!(h.sched.stats().retractions, 0);
    assert_eq!(h.sched.stats().waiting, 1);
    h.run(500);
    assert_eq!(h.tokens(99), reference(&prompt(99, 60), 8));
    h.assert_no_leak();
}
