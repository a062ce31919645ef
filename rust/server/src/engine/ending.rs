//! How requests end on the engine thread, other than by their next token. Every ending is
//! `Scheduler::finish(id, reason)` (the scheduler frees the slot and pages and records the
//! reason); this side only routes what it learned there: a stop string the front end matched,
//! a failed request (alone), or every request at once when the worker group or the engine
//! thread itself fails. Finished requests' metrics are recorded in `record_finish`.

use std::sync::atomic::Ordering;
use std::time::Instant;

use tokenspeed_engine::scheduler::FinishReason;
use tokenspeed_engine::StepResult;

use super::event_loop::{EngineLoop, LiveRequest};
use super::*;
use crate::metrics::RequestTimes;

impl EngineLoop {
    /// Ends one request with an error (its slot and pages freed); the others go on.
    /// Ends a request whose grammar matcher failed, as a 400: the matcher fails only on what
    /// that request's grammar demands of this vocabulary (e.g. a byte no token holds, which
    /// llguidance cannot write: llguidance#138). Every other request goes on.
    pub(super) fn fail_request(&mut self, id: RequestId, message: String) {
        self.grammars.remove(id);
        self.scheduler.finish(id, FinishReason::Error);
        if let Some(live) = self.requests.remove(&id) {
            tracing::warn!(id = %id, %message, "request failed");
            self.metrics.count_finished("error");
            let _ = live.events.send(EngineEvent::Error {
                message,
                kind: EngineErrorKind::BadRequest,
            });
        }
    }

    /// Every request that finishes (not aborted, not failed) ends here, whichever rule ended
    /// it: a stop token, the length, a completed grammar (all three decided by the scheduler or
    /// the grammar on this thread) or a stop string (found by the front end in the detokenized
    /// text, `Command::StopMatched`).
    pub(super) fn record_finish(
        &self,
        live: LiveRequest,
        reason: FinishReason,
        generated: u32,
        preemptions: u32,
    ) {
        let now = Instant::now();
        let admitted = live.admitted.unwrap_or(live.submitted);
        let first = live.first_token.unwrap_or(now);
        self.metrics.observe_finished(&RequestTimes {
            queued: admitted - live.submitted,
            prefill: first.saturating_duration_since(admitted),
            decode: now.saturating_duration_since(first),
            e2e: now - live.submitted,
            prompt_tokens: live.prompt_tokens,
            generation_tokens: generated,
            finished_reason: reason.api_name(),
            preemptions,
        });
    }

    /// Ends a request a stop string finished (the front end matched it, `StopSignal`): the
    /// scheduler finishes it as `StopString` (slot freed, computed prefix cached). Usage counts
    /// the tokens up to the match, which only the front end knows.
    pub(super) fn end_stopped(&mut self, id: RequestId, live: LiveRequest) {
        self.grammars.remove(id);
        let finished = self.scheduler.finish(id, FinishReason::StopString);
        let reason = finished.map_or(FinishReason::StopString, |f| f.reason);
        let preemptions = finished.map_or(0, |f| f.preemptions);
        let generated = live.stop.get().unwrap_or(0);
        self.record_finish(live, reason, generated, preemptions);
    }

    pub(super) fn count_abort(&self) {
        self.metrics.count_finished("abort");
    }

    /// The engine thread panicked (a bug): /health fails, every request in flight ends with an
    /// error, and so does every later one, until shutdown. The scheduler is not touched again:
    /// its state may be what the panic left half-changed.
    pub(super) fn after_panic(&mut self, message: String) {
        self.healthy.store(false, Ordering::Release);
        tracing::error!(%message, "the engine thread panicked; failing all requests");
        self.lifeline
            .fail(format!("the engine thread panicked: {message}"));
        let error = |m: &str| EngineEvent::Error {
            message: format!("the engine failed: {m}"),
            kind: EngineErrorKind::Unavailable,
        };
        for (_, live) in self.requests.drain() {
            let _ = live.events.send(error(&message));
        }
        while let Ok(cmd) = self.commands.recv() {
            match cmd {
                Command::Submit { events, .. } => {
                    let _ = events.send(error(&message));
                }
                Command::FlushCache { reply } => {
                    let _ = reply.send(false);
                }
                Command::Abort { .. }
                | Command::StopMatched { .. }
                | Command::AbortAll { .. }
                | Command::PrefixLen { .. }
                | Command::PinAdapters { .. }
                | Command::SetPaused { .. }
                | Command::WorkerOp { .. } => {}
                Command::Shutdown => return,
            }
        }
    }

    /// The worker group is gone: every request ends with an error and /health fails.
    pub(super) fn fail_all(&mut self, error: &LinkError) {
        self.grammars.clear();
        if self.healthy.swap(false, Ordering::AcqRel) {
            tracing::error!(%error, "worker group failed; failing all requests");
            self.lifeline
                .fail(format!("the model worker failed: {error}"));
        }
        for (id, live) in self.requests.drain() {
            self.scheduler.finish(id, FinishReason::Error);
            let _ = live.events.send(EngineEvent::Error {
                message: format!("the model worker failed: {error}"),
                kind: EngineErrorKind::Unavailable,
            });
        }
        // No result will come for the plans in flight: close them in the scheduler too (every
        // request is aborted, so answering them with nothing changes nothing else).
        if let Some(last) = self.in_flight.back().map(|p| p.step_id) {
            self.scheduler.advance(&StepResult {
                step_id: last,
                ..Default::default()
            });
        }
        self.in_flight.clear();
        // Dropping its reply channel answers a pending worker operation: the engine stopped.
        self.pending_op = None;
        self.plan_clock.clear();
        self.prefill_sent.clear();
        self.publish_stats(0, 0);
    }
}
