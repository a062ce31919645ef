//! `--enable-trace` on the engine thread: a traced request's `queue`, `prefill_chunk` and
//! `decode` spans, built from timestamps the loop already keeps (submit, admission, each
//! step's send and result, first and last token) and recorded when the request leaves the
//! loop, however it ends. The scheduler stays a pure state machine: it knows nothing of this.
//! Off, `EngineOptions::trace` is false and no step looks at any of it.

use std::time::Instant;

use opentelemetry::KeyValue;
use tokenspeed_engine::Plan;

use super::event_loop::{EngineLoop, LiveRequest};
use crate::otel::RequestTrace;

/// A traced request's engine-side spans so far.
pub(crate) struct EngineSpans {
    trace: RequestTrace,
    chunks: Vec<PrefillChunk>,
}

/// A step that carried some of the request's prompt: from the plan's send to its result.
struct PrefillChunk {
    step: u64,
    tokens: u32,
    start_pos: u32,
    sent: Instant,
    done: Option<Instant>,
}

impl EngineSpans {
    pub(super) fn new(trace: RequestTrace) -> Box<EngineSpans> {
        Box::new(EngineSpans {
            trace,
            chunks: Vec::new(),
        })
    }
}

impl EngineLoop {
    /// Notes the prefill chunks of traced requests in a plan about to be sent (the scheduler's
    /// `last_planned` lists its requests in the plan's order).
    pub(super) fn trace_prefill_chunks(&mut self, plan: &Plan) {
        let sent = Instant::now();
        let mut traced = Vec::new();
        for ((id, slot, _), entry) in self.scheduler.last_planned().zip(&plan.scheduled) {
            let Some(live) = self.requests.get_mut(&id) else {
                continue;
            };
            let (Some(spans), true) = (live.trace.as_mut(), slot == entry.slot) else {
                continue;
            };
            // Admitted by the `schedule()` that made this plan (`note_admitted` stamps the
            // others after it): its queue span ends before its first chunk starts.
            live.admitted.get_or_insert(sent);
            if entry.start_pos < live.prompt_tokens {
                spans.chunks.push(PrefillChunk {
                    step: plan.step_id,
                    tokens: entry.tokens.len() as u32,
                    start_pos: entry.start_pos,
                    sent,
                    done: None,
                });
                traced.push(id);
            }
        }
        if !traced.is_empty() {
            self.traced_steps.insert(plan.step_id, traced);
        }
    }

    /// Ends the prefill chunks step `step` carried (its result came back at `at`).
    pub(super) fn trace_step_done(&mut self, step: u64, at: Instant) {
        if self.traced_steps.is_empty() {
            return;
        }
        // Steps the worker skipped leave entries behind: their chunks never end.
        self.traced_steps.retain(|&s, _| s >= step);
        for id in self.traced_steps.remove(&step).unwrap_or_default() {
            let chunks = self
                .requests
                .get_mut(&id)
                .and_then(|live| live.trace.as_mut())
                .map(|spans| spans.chunks.iter_mut().filter(|c| c.step == step));
            for chunk in chunks.into_iter().flatten() {
                chunk.done = Some(at);
            }
        }
    }
}

/// A request leaves the loop (finished, aborted, failed): its spans go to the exporter.
impl Drop for LiveRequest {
    fn drop(&mut self) {
        let Some(spans) = self.trace.take() else {
            return;
        };
        let trace = &spans.trace;
        if let Some(admitted) = self.admitted {
            let attrs = vec![KeyValue::new(
                "tokenspeed.prompt_tokens",
                i64::from(self.prompt_tokens),
            )];
            trace.span("queue", self.submitted, admitted, attrs);
        }
        for (index, chunk) in spans.chunks.iter().enumerate() {
            let Some(done) = chunk.done else { continue };
            let attrs = vec![
                KeyValue::new("tokenspeed.chunk.index", index as i64),
                KeyValue::new("tokenspeed.chunk.tokens", i64::from(chunk.tokens)),
                KeyValue::new("tokenspeed.chunk.start_pos", i64::from(chunk.start_pos)),
                KeyValue::new("tokenspeed.step", chunk.step as i64),
            ];
            trace.span("prefill_chunk", chunk.sent, done, attrs);
        }
        if let (Some(first), Some(last)) = (self.first_token, self.last_token) {
            trace.span("decode", first, last, Vec::new());
        }
    }
}
