//! Operations on the worker group (`WorkerOp`: `/update_weights_from_disk`,
//! `/release_memory_occupation`, `/resume_memory_occupation`): the engine holds admission, lets
//! the running requests finish, sends the op alone in a plan, and on its result drops the prefix
//! cache (its KV came from the old weights, or its pages were freed), admits again (not while
//! the memory is released) and replies. Queued requests wait meanwhile.

use tokenspeed_engine::{op_kind, OpOutcome, Plan, StepResult, WorkerOp};
use tokio::sync::oneshot;

use super::event_loop::EngineLoop;
use super::OpReply;

/// An operation accepted by the engine, waiting for the running requests or for its result.
pub(super) struct PendingOp {
    op: WorkerOp,
    reply: oneshot::Sender<OpReply>,
    /// Requests queued when it arrived (SGLang's `num_paused_requests`).
    queued: usize,
    /// The step that carries it, once sent.
    step: Option<u64>,
}

impl EngineLoop {
    /// Takes an operation (`Command::WorkerOp`), or refuses it at once.
    pub(super) fn accept_op(&mut self, op: WorkerOp, reply: oneshot::Sender<OpReply>) {
        let refuse = |message: &str| OpReply {
            ok: false,
            message: message.into(),
            queued: 0,
        };
        if self.pending_op.is_some() {
            let _ = reply.send(refuse("another worker operation is in progress"));
            return;
        }
        let released = self.memory_released;
        let refused = match op.kind {
            op_kind::RELEASE_MEMORY if released => Some("memory is already released"),
            op_kind::RESUME_MEMORY if !released => Some("memory is not released"),
            op_kind::UPDATE_WEIGHTS if released => {
                Some("memory is released: /resume_memory_occupation first")
            }
            _ => None,
        };
        if let Some(why) = refused {
            let _ = reply.send(refuse(why));
            return;
        }
        if self.paused && self.scheduler.has_running() {
            // Paused in place, they cannot finish: nothing would ever let the op run.
            let _ = reply.send(refuse(
                "generation is paused with requests in place: continue or abort them first",
            ));
            return;
        }
        self.scheduler.hold_admission(true);
        self.pending_op = Some(PendingOp {
            op,
            reply,
            queued: self.scheduler.stats().waiting,
            step: None,
        });
    }

    /// Whether an op was sent and its result is awaited: nothing else is planned meanwhile.
    pub(super) fn op_in_flight(&self) -> bool {
        self.pending_op.as_ref().is_some_and(|p| p.step.is_some())
    }

    /// The plan carrying the pending op, once nothing runs and nothing is in flight.
    pub(super) fn op_plan(&mut self) -> Option<Plan> {
        let pending = self.pending_op.as_mut().filter(|p| p.step.is_none())?;
        if !self.in_flight.is_empty() {
            return None;
        }
        let plan = self.scheduler.op_plan(pending.op.clone())?;
        pending.step = Some(plan.step_id);
        Some(plan)
    }

    /// The result of the op's plan: drop the cache after new weights, admit again, reply.
    pub(super) fn finish_op(&mut self, plan: &Plan, result: &StepResult) {
        let Some(pending) = self.pending_op.take_if(|p| p.step == Some(plan.step_id)) else {
            return;
        };
        let outcome = result.op_results.first().cloned().unwrap_or(OpOutcome {
            ok: false,
            message: b"the worker reported no outcome".to_vec(),
        });
        match pending.op.kind {
            // The cached KV came from the old weights, or is gone with the released pages.
            op_kind::UPDATE_WEIGHTS => {
                self.scheduler.drop_cache();
            }
            op_kind::RELEASE_MEMORY if outcome.ok => {
                self.scheduler.drop_cache();
                self.memory_released = true;
            }
            op_kind::RESUME_MEMORY if outcome.ok => self.memory_released = false,
            _ => {}
        }
        // While the memory is released nothing may run: queued requests wait for the resume.
        self.scheduler.hold_admission(self.memory_released);
        self.publish_stats(0, 0);
        let _ = pending.reply.send(OpReply {
            ok: outcome.ok,
            message: String::from_utf8_lossy(&outcome.message).into_owned(),
            queued: pending.queued,
        });
    }
}
