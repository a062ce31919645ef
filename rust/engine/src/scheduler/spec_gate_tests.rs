//! The speculation gate on synthetic acceptance: batch rule, pause, probes, resumption.

use super::{SpecGate, SpecMode, MIN_SAMPLES, PROBE_STEPS};
use crate::scheduler::SchedulerConfig;

fn gate(cap: u32, base: f64, per_request: f64, interval: u32) -> SpecGate {
    let c = SchedulerConfig {
        speculative_disable_by_batch_size: cap,
        speculative_break_even_accept_length: base,
        speculative_break_even_per_request: per_request,
        speculative_probe_interval: interval,
        ..SchedulerConfig::small(4, 64, 8, 256)
    };
    SpecGate::new(&c)
}

#[test]
fn batch_rule_turns_steps_plain_at_and_above_the_threshold() {
    let mut g = gate(3, 0.0, 0.0, 8);
    assert_eq!(g.decide(1), SpecMode::ON);
    assert_eq!(g.decide(2), SpecMode::ON);
    assert_eq!(g.decide(3), SpecMode::OFF);
    assert!(!g.is_on());
    assert_eq!(g.decide(7), SpecMode::OFF);
    assert_eq!(g.decide(0), SpecMode::OFF, "no decodes: nothing changes");
    assert_eq!(g.decide(2), SpecMode::ON);
    assert!(g.is_on());
    assert_eq!(g.off_steps(), 2);
}

#[test]
fn no_rule_keeps_speculation_on_whatever_the_acceptance() {
    let mut g = gate(0, 0.0, 0.0, 8);
    for _ in 0..50 {
        g.observe(1.0, 64);
        assert_eq!(g.decide(64), SpecMode::ON);
    }
    assert_eq!(g.off_steps(), 0);
}

#[test]
fn break_even_grows_with_the_batch() {
    let g = gate(0, 1.7, 0.04, 8);
    assert!((g.break_even(1) - 1.74).abs() < 1e-9);
    assert!((g.break_even(16) - 2.34).abs() < 1e-9);
}

/// Low acceptance pauses after `MIN_SAMPLES` verifying steps; a probe of `PROBE_STEPS` runs every
/// `interval` plain steps; a probe that pays turns speculation back on.
#[test]
fn acceptance_rule_pauses_probes_and_resumes() {
    let interval = 5;
    let mut g = gate(0, 1.7, 0.04, interval);
    for _ in 0..MIN_SAMPLES - 1 {
        assert_eq!(g.decide(4), SpecMode::ON);
        g.observe(1.0, 4);
    }
    assert_eq!(g.decide(4), SpecMode::ON);
    g.observe(1.0, 4); // the 4th sample: below 1.86
    let mut modes = Vec::new();
    for _ in 0..2 * (interval + PROBE_STEPS - 1) {
        let m = g.decide(4);
        if m.verify {
            g.observe(1.2, 4); // probes still lose
        }
        modes.push(m.verify);
    }
    let probe: Vec<bool> = (0..interval + PROBE_STEPS - 1)
        .map(|i| i + 1 >= interval)
        .collect();
    assert_eq!(modes, [probe.clone(), probe].concat());
    assert_eq!(g.off_steps(), 2 * u64::from(interval - 1));
    // The text turns predictable: the next probe's first verify reaches the break-even.
    let mut on_at = None;
    for i in 0..interval + PROBE_STEPS {
        if g.decide(4).verify {
            g.observe(3.5, 4);
            on_at.get_or_insert(i);
        }
    }
    assert_eq!(on_at, Some(interval - 1));
    for _ in 0..20 {
        assert_eq!(g.decide(4), SpecMode::ON);
        g.observe(3.5, 4);
    }
}

#[test]
fn the_same_acceptance_pays_at_a_small_batch_and_not_at_a_large_one() {
    let run = |batch: usize| {
        let mut g = gate(0, 1.7, 0.04, 100);
        for _ in 0..10 {
            if g.decide(batch).verify {
                g.observe(2.0, batch);
            }
        }
        g.is_on()
    };
    assert!(run(4)); // break-even 1.86
    assert!(!run(16)); // break-even 2.34
}

#[test]
fn the_batch_rule_overrides_a_probe_and_a_paying_acceptance() {
    let mut g = gate(8, 1.7, 0.04, 1);
    for _ in 0..10 {
        assert_eq!(g.decide(8), SpecMode::OFF);
        g.observe(4.0, 8); // nothing verified in practice; even so the cap holds
    }
    assert_eq!(g.decide(7), SpecMode::ON);
}

/// `peek` (the engine's depth, `Scheduler::spec_paused`) says what the next `decide` does,
/// through pauses, probes, resumption and the batch rule, and changes nothing.
#[test]
fn peek_foretells_decide() {
    let mut g = gate(6, 1.7, 0.04, 3);
    for i in 0..200u32 {
        let batch = [1, 2, 0, 7, 3][i as usize % 5];
        let seen = g.peek(batch);
        assert_eq!(g.peek(batch), seen, "peeking twice changes nothing");
        let mode = g.decide(batch);
        assert_eq!(seen, mode, "step {i}, batch {batch}");
        if mode.verify {
            // Mostly below the break-even, now and then well above it.
            g.observe(if i % 37 < 4 { 3.5 } else { 1.0 }, batch);
        }
    }
    assert!(g.off_steps() > 50, "{}", g.off_steps());
}
