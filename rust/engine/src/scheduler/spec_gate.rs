//! Turning speculative decoding off where it does not pay, and back on where it does.
//!
//! A speculative step costs more than a plain decode step (issue 32, one H200, Llama-3.1-8B,
//! EAGLE-3 chain of 3: ~8.2 ms vs 4.65 ms at batch 1) and the ratio grows with the batch, so
//! speculation pays only while each verifying request-step yields enough tokens. Two rules,
//! decided once per step before it is built (`SpecGate::decide`):
//!
//! - the batch rule: with `speculative_disable_by_batch_size` B > 0, a step of B or more
//!   decoding requests is a plain step;
//! - the acceptance rule: a running average of the tokens each verifying request-step produced
//!   (accepted drafts + 1) is kept from the results (`observe`); once it falls below the
//!   break-even `base + per_request * batch` (`speculative_break_even_accept_length`,
//!   `speculative_break_even_per_request`; base 0 turns the rule off) speculation pauses, and
//!   every `speculative_probe_interval` plain steps it is tried again for `PROBE_STEPS` steps
//!   (a draft head drafts after the first and the second verifies those drafts); a probe whose
//!   acceptance reaches the break-even turns it back on.
//!
//! Plain steps verify nothing and tell the worker not to chain drafts after them
//! (`ScheduledRequest::pause_drafts`); a draft head still writes its KV for the step's new
//! tokens so that drafting can resume exactly. Pure state: no clock, no randomness.

use super::SchedulerConfig;

/// Weight of one step's acceptance in the running average.
const AVG_WEIGHT: f64 = 0.25;
/// Verifying steps observed before the acceptance rule may pause speculation.
const MIN_SAMPLES: u32 = 4;
/// Steps a probe runs speculatively: a draft head needs one to draft and one to verify.
pub(crate) const PROBE_STEPS: u32 = 2;

/// What one step does with speculation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecMode {
    /// Drafts (NGRAM's lookup, the worker's proposals) are verified in this step.
    pub verify: bool,
    /// The worker's draft head chains drafts after this step (else it only writes its KV).
    pub draft_after: bool,
}

impl SpecMode {
    pub const ON: SpecMode = SpecMode {
        verify: true,
        draft_after: true,
    };
    pub const OFF: SpecMode = SpecMode {
        verify: false,
        draft_after: false,
    };
}

/// The rules' state (see the module doc).
#[derive(Debug, Clone)]
pub struct SpecGate {
    disable_by_batch_size: u32,
    base: f64,
    per_request: f64,
    probe_interval: u32,
    /// Running average of tokens per verifying request-step (None: nothing observed yet).
    avg: Option<f64>,
    /// Verifying steps observed while on (the acceptance rule waits for `MIN_SAMPLES`).
    samples: u32,
    /// The acceptance rule paused speculation.
    paused: bool,
    /// Plain steps since the pause or the last probe.
    waited: u32,
    /// Probe steps still to run; `fresh`: the probe's first observation replaces the average.
    probing: u32,
    fresh: bool,
    /// Decoding steps that ran without speculation, and whether the latest one ran with it.
    off_steps: u64,
    on: bool,
    /// The latest step planned with speculation (verifying or drafting after it): no step may
    /// be planned behind it while it is in flight (`Scheduler::spec_paused`).
    on_step: Option<u64>,
    /// Steps planned one step ahead (behind a step in flight) while speculation was paused.
    ahead_steps: u64,
}

impl SpecGate {
    pub fn new(c: &SchedulerConfig) -> Self {
        SpecGate {
            disable_by_batch_size: c.speculative_disable_by_batch_size,
            base: c.speculative_break_even_accept_length,
            per_request: c.speculative_break_even_per_request,
            probe_interval: c.speculative_probe_interval.max(1),
            avg: None,
            samples: 0,
            paused: false,
            waited: 0,
            probing: 0,
            fresh: false,
            off_steps: 0,
            on: true,
            on_step: None,
            ahead_steps: 0,
        }
    }

    /// The acceptance length speculation must reach to pay at `batch` decoding requests.
    pub fn break_even(&self, batch: usize) -> f64 {
        self.base + self.per_request * batch as f64
    }

    /// The mode of the next step, which decodes `batch` requests (0: none decode, nothing
    /// changes).
    pub fn decide(&mut self, batch: usize) -> SpecMode {
        if batch == 0 {
            return if self.on { SpecMode::ON } else { SpecMode::OFF };
        }
        let mode = self.mode(batch);
        self.on = mode.verify;
        if !mode.verify {
            self.off_steps += 1;
        }
        mode
    }

    /// The mode `decide(batch)` would return now, deciding nothing (the state is unchanged).
    pub fn peek(&self, batch: usize) -> SpecMode {
        let cap = self.disable_by_batch_size as usize;
        let on = if batch == 0 {
            self.on
        } else if cap > 0 && batch >= cap {
            false
        } else {
            !self.paused || self.probing > 0 || self.waited + 1 >= self.probe_interval
        };
        if on {
            SpecMode::ON
        } else {
            SpecMode::OFF
        }
    }

    /// Step `step_id` was planned in `mode`; `ahead`: behind a step still in flight.
    pub fn planned(&mut self, step_id: u64, mode: SpecMode, ahead: bool) {
        if mode != SpecMode::OFF {
            self.on_step = Some(step_id);
        } else if ahead {
            self.ahead_steps += 1;
        }
    }

    /// The latest step planned with speculation.
    pub fn on_step(&self) -> Option<u64> {
        self.on_step
    }

    /// Steps planned one step ahead while speculation was paused.
    pub fn ahead_steps(&self) -> u64 {
        self.ahead_steps
    }

    fn mode(&mut self, batch: usize) -> SpecMode {
        // The rule is `peek`'s; here only its counters advance.
        let mode = self.peek(batch);
        let capped = self.disable_by_batch_size > 0 && batch >= self.disable_by_batch_size as usize;
        if self.paused && !capped {
            if self.probing > 0 {
                self.probing -= 1;
            } else {
                self.waited += 1;
                if self.waited >= self.probe_interval {
                    self.waited = 0;
                    self.probing = PROBE_STEPS - 1;
                    self.fresh = true;
                }
            }
        }
        mode
    }

    /// A step's verifying request-steps produced `accept_len` tokens each on average (accepted
    /// drafts + 1) in a step of `batch` sampling requests.
    pub fn observe(&mut self, accept_len: f64, batch: usize) {
        if self.base <= 0.0 || !accept_len.is_finite() {
            return;
        }
        let avg = match self.avg {
            Some(a) if !(self.paused && self.fresh) => a + AVG_WEIGHT * (accept_len - a),
            _ => accept_len,
        };
        self.avg = Some(avg);
        self.fresh = false;
        let pays = avg >= self.break_even(batch);
        if self.paused {
            if pays {
                (self.paused, self.probing, self.waited) = (false, 0, 0);
            }
            return;
        }
        self.samples = self.samples.saturating_add(1);
        if self.samples >= MIN_SAMPLES && !pays {
            (self.paused, self.probing, self.waited) = (true, 0, 0);
        }
    }

    /// Whether the latest decoding step ran with speculation.
    pub fn is_on(&self) -> bool {
        self.on
    }

    /// Decoding steps that ran without speculation so far.
    pub fn off_steps(&self) -> u64 {
        self.off_steps
    }
}

#[cfg(test)]
#[path = "spec_gate_tests.rs"]
mod tests;
