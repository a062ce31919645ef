//! The front end's commands as the engine loop carries them out: submit (with its queue bound,
//! `queue_bound.rs`), abort, a stop string matched, the router's prefix query, flush, LoRA pins, pause,
//! worker operations and shutdown.

use super::*;

impl EngineLoop {
    /// Returns false on shutdown.
    pub(super) fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit {
                id,
                request,
                constraint,
                events,
                stop,
                trace,
            } => {
                if self.submit(id, *request, events, stop, trace) {
                    if let Some(c) = constraint {
                        // A grammar's mask changes token by token: no drafts to verify.
                        self.scheduler.forbid_drafts(id);
                        self.grammars.insert(id, c);
                    }
                }
            }
            Command::Abort { id } => {
                self.grammars.remove(id);
                if self.requests.remove(&id).is_some() {
                    self.scheduler.finish(id, FinishReason::Abort);
                    self.count_abort();
                }
            }
            Command::StopMatched { id } => {
                if let Some(live) = self.requests.remove(&id) {
                    self.end_stopped(id, live);
                }
            }
            Command::PrefixLen {
                lora_id,
                tokens,
                reply,
            } => {
                let _ = reply.send(self.scheduler.cached_prefix_len(lora_id, &tokens));
            }
            Command::FlushCache { reply } => {
                let flushed = self.scheduler.flush_cache();
                // Publish first: the caller may read the stats as soon as it has the reply.
                self.publish_stats(0, 0);
                let _ = reply.send(flushed);
            }
            Command::PinAdapters { pins } => self.scheduler.pin_adapters(pins),
            Command::AbortAll { message } => {
                self.grammars.clear();
                for (id, live) in self.requests.drain() {
                    self.scheduler.finish(id, FinishReason::Abort);
                    self.metrics.count_finished("abort");
                    let _ = live.events.send(EngineEvent::Error {
                        message: message.clone(),
                        kind: EngineErrorKind::Unavailable,
                    });
                }
            }
            Command::SetPaused { paused, reply } => {
                self.paused = paused;
                let _ = reply.send(());
            }
            Command::WorkerOp { op, reply } => self.accept_op(op, reply),
            Command::Shutdown => return false,
        }
        true
    }

    /// Queues a request; false (and an error event sent) when refused.
    fn submit(
        &mut self,
        id: RequestId,
        req: Request,
        events: tokio_mpsc::UnboundedSender<EngineEvent>,
        stop: StopSignal,
        trace: Option<crate::otel::RequestTrace>,
    ) -> bool {
        let reject = |message: String, kind| {
            let _ = events.send(EngineEvent::Error { message, kind });
            false
        };
        if !self.healthy.load(Ordering::Acquire) {
            return reject(
                "the model worker is not running".into(),
                EngineErrorKind::Unavailable,
            );
        }
        if self.queue_full() {
            // With priority scheduling a more urgent newcomer takes the least urgent waiting
            // request's place (a submit refused after this is a bug the front end's checks
            // rule out, so the displacement is not undone).
            match self.scheduler.displace_for(&req) {
                Some(gone) => self.end_displaced(gone.id),
                None => return reject(self.queue_full_message(), EngineErrorKind::Overloaded),
            }
        }
        let prompt_tokens = req.prompt.len() as u32;
        match self.scheduler.submit(req) {
            Ok(()) => {
                self.last_submit = Some(Instant::now());
                self.requests.insert(
                    id,
                    LiveRequest {
                        events,
                        submitted: Instant::now(),
                        admitted: None,
                        first_token: None,
                        last_token: None,
                        prompt_tokens,
                        stop,
                        trace: trace.map(super::trace::EngineSpans::new),
                    },
                );
                true
            }
            Err(e) => reject(e.to_string(), EngineErrorKind::BadRequest),
        }
    }
}
