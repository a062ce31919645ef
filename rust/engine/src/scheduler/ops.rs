//! Operations on the worker group (`WorkerOp`: new weights from disk). One runs alone in its
//! plan, with no request holding a slot: the engine holds admission (`hold_admission`), lets the
//! running requests finish, then plans the op (`op_plan`). Queued requests hold no pages, so
//! they simply wait; after new weights the cached KV means nothing and is dropped
//! (`drop_cache`) before they run.

use super::Scheduler;
use crate::plan::{Plan, WorkerOp};

impl Scheduler {
    /// Stops (or resumes) admitting waiting requests; running ones go on.
    pub fn hold_admission(&mut self, held: bool) {
        self.admission_held = held;
    }

    /// Whether a request holds a worker slot.
    pub fn has_running(&self) -> bool {
        !self.running.is_empty()
    }

    /// The plan carrying `op` alone, numbered in step order; None while a request holds a
    /// slot. Its result comes back through `advance`
    /// like any step's.
    pub fn op_plan(&mut self, op: WorkerOp) -> Option<Plan> {
        if !self.running.is_empty() {
            return None;
        }
        // Slots released meanwhile are reported by the next step's plan: this one is the op's
        // alone, so the worker need not apply anything else with it.
        let plan = Plan {
            step_id: self.next_step,
            ops: vec![op],
            ..Default::default()
        };
        self.next_step += 1;
        self.in_flight.push_back((plan.step_id, Vec::new()));
        Some(plan)
    }

    /// Drops every cached prefix while no request runs (queued ones hold no pages): the KV
    /// was computed by weights that are gone. False while a request holds a slot.
    pub fn drop_cache(&mut self) -> bool {
        if !self.running.is_empty() {
            return false;
        }
        self.cache.flush();
        true
    }
}
