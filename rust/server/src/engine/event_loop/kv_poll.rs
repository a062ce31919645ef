//! A PD decode server's requests parked until their prompt's KV arrives (the scheduler's
//! `kv_wait.rs`): the engine loop learns of arrivals from step results, polls for them when it
//! has nothing else to run, and fails a request whose KV does not come in time.

use super::*;

/// How long an engine with only parked requests waits (for a command) between polls.
const KV_POLL: Duration = Duration::from_millis(5);
/// A parked request whose KV has not arrived this long after it was submitted fails. With
/// SGLang's router this covers the prefill server's queue and prefill too.
pub(crate) const KV_WAIT: Duration = Duration::from_secs(30);

impl EngineLoop {
    /// Nothing runnable and nothing in flight: waits for a command rather than spin. With
    /// requests parked for their KV, only for `KV_POLL`, then sends a plan that runs nothing:
    /// its result carries the transfers that arrived. False when a command stops the loop.
    pub(super) fn wait_idle(&mut self) -> bool {
        if self.scheduler.awaiting_kv().next().is_none() {
            return !matches!(self.wait_for_command(), Waited::Stop);
        }
        match self.commands.recv_timeout(KV_POLL) {
            Ok(cmd) => {
                self.mark();
                return self.handle(cmd);
            }
            Err(RecvTimeoutError::Disconnected) => return false,
            Err(RecvTimeoutError::Timeout) => self.mark(),
        }
        if !self.paused && !self.op_in_flight() {
            if let Some(plan) = self.scheduler.poll_kv() {
                if let Err(e) = self.send(plan) {
                    self.fail_all(&e);
                }
            }
        }
        true
    }

    /// Fails the parked requests submitted more than `KV_WAIT` ago (their pages: none held).
    pub(super) fn expire_kv_waits(&mut self) {
        let late: Vec<RequestId> = self
            .scheduler
            .awaiting_kv()
            .filter(|id| {
                self.requests
                    .get(id)
                    .is_some_and(|live| live.submitted.elapsed() > KV_WAIT)
            })
            .collect();
        for id in late {
            let message = format!(
                "KV transfer for this request did not arrive from the prefill server within \
                 {}s (bootstrap_room of request {id})",
                KV_WAIT.as_secs()
            );
            if let Some(out) = self.scheduler.fail_waiting(id, message) {
                self.route(out);
            }
        }
    }
}
