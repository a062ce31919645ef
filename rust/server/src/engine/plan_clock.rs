//! When to plan the next step under overlap scheduling (`--schedule-lead-ms`).
//!
//! With two plans in flight the engine plans step N+1 as soon as step N starts, so a request
//! that arrives while N runs waits for N and for N+1 before its prefill: ~1.5 steps on average.
//! With a lead, the engine plans N+1 only `lead` before N is expected to end, and requests that
//! arrive before then join N+1. N's end is predicted only for decode-only steps, whose run time
//! is steady (the shortest of the recent ones: a guess that errs early plans early, which costs
//! nothing but the waiting it would have saved); a step with prompt tokens is followed at once.
//! The lead must cover the worker's launch of N+1 (its host time), or the GPU waits for it.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Decode run times kept for the estimate.
const RECENT: usize = 8;

#[derive(Debug)]
pub(crate) struct PlanClock {
    lead: Option<Duration>,
    /// Plans in flight, oldest first: step id, when sent, decode-only.
    sent: VecDeque<(u64, Instant, bool)>,
    last_result: Option<Instant>,
    /// Run times of recent decode-only steps (the gap between their result and the previous
    /// one, for steps queued behind the previous one), newest last.
    recent: VecDeque<Duration>,
}

impl PlanClock {
    /// `lead`: None plans as soon as a plan may be in flight (the default behaviour).
    pub(crate) fn new(lead: Option<Duration>) -> Self {
        PlanClock {
            lead,
            sent: VecDeque::new(),
            last_result: None,
            recent: VecDeque::with_capacity(RECENT),
        }
    }

    pub(crate) fn on_sent(&mut self, step: u64, at: Instant, decode_only: bool) {
        self.sent.push_back((step, at, decode_only));
    }

    /// Step `step`'s result arrived `at` (earlier steps without a result are forgotten).
    pub(crate) fn on_result(&mut self, step: u64, at: Instant) {
        while let Some((id, sent_at, decode_only)) = self.sent.pop_front() {
            if id != step {
                continue;
            }
            if let Some(prev) = self.last_result {
                // Sent before the previous step ended: the GPU ran it right after that one.
                if decode_only && sent_at <= prev {
                    if self.recent.len() == RECENT {
                        self.recent.pop_front();
                    }
                    self.recent.push_back(at.saturating_duration_since(prev));
                }
            }
            break;
        }
        self.last_result = Some(at);
    }

    /// Every plan in flight is gone (the worker group failed).
    pub(crate) fn clear(&mut self) {
        self.sent.clear();
        self.last_result = None;
    }

    /// When to plan the next step: None for now; Some(t) to wait until t while the one plan in
    /// flight, a decode-only step, runs.
    pub(crate) fn plan_at(&self) -> Option<Instant> {
        let lead = self.lead?;
        let (_, sent_at, decode_only) = *self.sent.front()?;
        if self.sent.len() != 1 || !decode_only {
            return None;
        }
        let estimate = self.recent.iter().min()?;
        // It started when the previous step ended, or when it was sent if that was later.
        let started = self.last_result.map_or(sent_at, |r| r.max(sent_at));
        (started + *estimate).checked_sub(lead)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// Steps 1..=n of `step` ms each, every one sent while the previous ran (at its start).
    fn steady(clock: &mut PlanClock, t0: Instant, n: u64, step: u64) -> Instant {
        clock.on_sent(1, t0, true);
        for i in 1..=n {
            let end = t0 + MS * (step * i) as u32;
            clock.on_sent(i + 1, end - MS * step as u32 + MS, true);
            clock.on_result(i, end);
        }
        t0 + MS * (step * n) as u32
    }

    #[test]
    fn plans_lead_before_the_running_decode_step_ends() {
        let t0 = Instant::now();
        let mut clock = PlanClock::new(Some(3 * MS));
        let last = steady(&mut clock, t0, 4, 10);
        // step 5 runs from `last` for ~10 ms: plan step 6 at last + 10 - 3
        assert_eq!(clock.plan_at(), Some(last + 7 * MS));
    }

    #[test]
    fn no_lead_no_estimate_or_a_prompt_step_plans_at_once() {
        let t0 = Instant::now();
        let mut off = PlanClock::new(None);
        steady(&mut off, t0, 4, 10);
        assert_eq!(off.plan_at(), None);

        let mut fresh = PlanClock::new(Some(3 * MS));
        fresh.on_sent(1, t0, true);
        assert_eq!(fresh.plan_at(), None, "no decode step timed yet");

        let mut clock = PlanClock::new(Some(3 * MS));
        let last = steady(&mut clock, t0, 4, 10);
        clock.on_result(5, last + 10 * MS);
        clock.on_sent(6, last + 11 * MS, false); // a step with prompt tokens runs
        assert_eq!(clock.plan_at(), None);
    }

    #[test]
    fn two_in_flight_or_none_plans_at_once() {
        let t0 = Instant::now();
        let mut clock = PlanClock::new(Some(3 * MS));
        let last = steady(&mut clock, t0, 4, 10);
        clock.on_sent(6, last + MS, true);
        assert_eq!(
            clock.plan_at(),
            None,
            "two in flight: the caller waits for a result"
        );
        clock.on_result(5, last + 10 * MS);
        clock.on_result(6, last + 20 * MS);
        assert_eq!(clock.plan_at(), None, "nothing in flight");
    }

    #[test]
    fn the_estimate_is_the_shortest_recent_decode_and_ignores_unqueued_steps() {
        let t0 = Instant::now();
        let mut clock = PlanClock::new(Some(2 * MS));
        let last = steady(&mut clock, t0, 3, 12);
        // step 4: 9 ms; step 5 sent after step 4's result (the pipeline had drained): its
        // 50 ms gap is idle time, not a run time, and is not kept.
        clock.on_result(4, last + 9 * MS);
        clock.on_sent(5, last + 9 * MS + MS, true);
        clock.on_result(5, last + 59 * MS);
        clock.on_sent(6, last + 60 * MS, true);
        // step 6 started when sent (after the last result): 60 + 9 - 2
        assert_eq!(clock.plan_at(), Some(last + 67 * MS));
    }

    #[test]
    fn a_sent_step_without_its_result_is_forgotten_with_the_older_ones() {
        let t0 = Instant::now();
        let mut clock = PlanClock::new(Some(MS));
        clock.on_sent(1, t0, true);
        clock.on_sent(2, t0, true);
        clock.on_result(2, t0 + 5 * MS); // the worker skipped step 1
        assert!(clock.sent.is_empty());
        clock.clear();
        assert_eq!(clock.last_result, None);
    }
}
