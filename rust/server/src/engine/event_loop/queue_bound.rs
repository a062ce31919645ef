//! The queue bound of the engine loop's `submit` (--max-queued-requests), and what a request
//! displaced from a full queue under priority scheduling is told.

use super::*;

impl EngineLoop {
    /// Whether a new request finds the queue full. `max_queued_requests` is the engine's share
    /// of --max-running-requests + --max-queued-requests (lib.rs). With priority scheduling
    /// this is the only bound (the HTTP gate is off), so it counts running requests too: the
    /// queue is full at --max-queued-requests waiting once every slot runs, and a burst into an
    /// idle engine is not refused before the scheduler admits it. Without, it is a backstop
    /// behind the HTTP gate, as before.
    pub(super) fn queue_full(&self) -> bool {
        let stats = self.scheduler.stats();
        let held = match self.scheduler.config().enable_priority_scheduling {
            true => stats.running + stats.waiting,
            false => stats.waiting,
        };
        held >= self.options.max_queued_requests
    }

    pub(super) fn queue_full_message(&self) -> String {
        match self.scheduler.config().enable_priority_scheduling {
            true => "server overloaded: the queue is full and no waiting request is less urgent \
                     than this one; retry later"
                .into(),
            false => format!(
                "server overloaded: {} requests already waiting",
                self.options.max_queued_requests
            ),
        }
    }

    /// A waiting request a more urgent one displaced (`Scheduler::displace_for`, which freed
    /// it): its client gets a 429.
    pub(super) fn end_displaced(&mut self, id: RequestId) {
        self.grammars.remove(id);
        if let Some(live) = self.requests.remove(&id) {
            self.count_abort();
            let _ = live.events.send(EngineEvent::Error {
                message: "server overloaded: the queue is full and a more urgent request \
                          displaced this one; retry later"
                    .into(),
                kind: EngineErrorKind::Overloaded,
            });
        }
    }
}
