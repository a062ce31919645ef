//! Reconciling a step's results: accepted tokens extend the sequences, computed positions
//! catch up with what is known, finished requests give their pages back (to the cache).

use std::collections::HashMap;

use super::{finish, Expected, FinishReason, Phase, RequestId, RequestOutput, Scheduler};
use super::{RESERVE_RATIO_EMA, RESERVE_RATIO_MIN};
use crate::plan::{event_error, RequestEvent, StepResult};

impl Scheduler {
    /// Applies a step's events. Events for requests aborted since the plan are ignored.
    pub fn advance(&mut self, result: &StepResult) -> Vec<RequestOutput> {
        let mut outputs = self.note_kv(result);
        // Steps are answered in order; an older unanswered step counts as answered with nothing.
        while self
            .in_flight
            .front()
            .is_some_and(|(step_id, _)| *step_id <= result.step_id)
        {
            let Some((step_id, expected)) = self.in_flight.pop_front() else {
                break;
            };
            let events: HashMap<u32, &RequestEvent> = if step_id == result.step_id {
                result.events.iter().map(|ev| (ev.slot, ev)).collect()
            } else {
                HashMap::new()
            };
            let before = self.spec;
            for e in &expected {
                if let Some(out) = self.apply(e, events.get(&e.slot).copied()) {
                    outputs.push(out);
                }
            }
            self.observe_acceptance(before, &expected);
        }
        outputs
    }

    /// Feeds the step's acceptance (tokens per verifying request-step) to the speculation gate.
    fn observe_acceptance(&mut self, before: super::SpecCounts, expected: &[Expected]) {
        let steps = self.spec.steps - before.steps;
        if steps == 0 {
            return;
        }
        let accepted = self.spec.accepted - before.accepted;
        let batch = expected.iter().filter(|e| e.sample).count();
        self.gate
            .observe((accepted + steps) as f64 / steps as f64, batch);
    }

    /// Applies one expected result; returns the output if the request got tokens or failed.
    ///
    /// Catch-up: a sampling step fed the last known token (and reserved KV for its drafts);
    /// once its accepted tokens are known, the KV of positions `< known - 1` is valid and
    /// anything computed past that was for rejected drafts, so `computed` comes back to it.
    /// A later step already in flight was planned assuming exactly one token (a placeholder
    /// decode); if that assumption failed, its KV is wrong and the request recomputes.
    fn apply(&mut self, e: &Expected, event: Option<&RequestEvent>) -> Option<RequestOutput> {
        let seq = self.requests.get_mut(&e.id)?;
        let pooling = seq.req.sampling.pooling;
        // A step planned for an earlier admission (retracted since) is stale.
        let a = seq
            .active_mut()
            .filter(|a| a.epoch == e.epoch && a.slot == e.slot)?;
        a.in_flight = a.in_flight.saturating_sub(1);
        if let Some(ev) = event.filter(|ev| ev.error != event_error::NONE) {
            let out = seq.output(Vec::new(), ev, None);
            let message = match ev.error {
                event_error::GRAMMAR => "structured output failed: the worker's grammar \
                                         backend could not enforce this request's grammar"
                    .to_string(),
                code => format!("the model worker failed this request (error {code})"),
            };
            self.finish(e.id, FinishReason::Error);
            return Some(RequestOutput {
                error: Some(message),
                finished: Some(FinishReason::Error),
                ..out
            });
        }
        if e.sample && pooling {
            return self.finish_pooled(e.id, event);
        }
        if !e.sample {
            // A prompt chunk: only its prompt logprobs, if the request asked for them.
            return event
                .filter(|ev| !ev.prompt_logprobs.is_empty())
                .map(|ev| seq.output(Vec::new(), ev, None));
        }
        let accepted: &[u32] = event.map_or(&[], |ev| &ev.tokens);
        if e.drafts > 0 && event.is_some() {
            // Counted as the worker verified them, before an ending trims the run.
            self.spec.steps += 1;
            self.spec.drafted += u64::from(e.drafts);
            self.spec.accepted += accepted.len().saturating_sub(1).min(e.drafts as usize) as u64;
        }
        // A later step in flight (a placeholder decode) fed "the one token this step samples".
        let later_planned_wrong = a.in_flight > 0 && accepted.len() != 1;
        let (keep, finished) = finish::accept(&seq.req, seq.completion_tokens(), accepted);
        seq.tokens.extend_from_slice(&accepted[..keep]);
        // The worker's drafts continue the accepted tokens; a trimmed run ends the request.
        seq.proposed = event.map_or_else(Vec::new, |ev| ev.draft_tokens.clone());
        let known = seq.tokens.len();
        let a = seq.active_mut()?;
        if a.in_flight == 0 {
            a.computed = a.computed.min(known - 1);
        }
        let out = match event {
            Some(ev) if keep > 0 => {
                if let Phase::Prefilling(_) = seq.phase {
                    if let Phase::Prefilling(a) = std::mem::replace(&mut seq.phase, Phase::Waiting)
                    {
                        seq.phase = Phase::Decoding(a);
                    }
                    self.cache_prompt(e.id);
                }
                let seq = self.requests.get_mut(&e.id)?;
                Some(seq.output(accepted[..keep].to_vec(), ev, finished))
            }
            _ => None,
        };
        if let Some(reason) = finished {
            let seq = self.requests.get(&e.id)?;
            let used = seq.completion_tokens() as f64 / f64::from(seq.req.max_new_tokens.max(1));
            self.reserve_ratio = ((1.0 - RESERVE_RATIO_EMA) * self.reserve_ratio
                + RESERVE_RATIO_EMA * used)
                .clamp(RESERVE_RATIO_MIN, 1.0);
            self.finish(e.id, reason);
        } else if later_planned_wrong {
            // That step's KV is wrong: recompute from the known tokens (kept above).
            self.retract(e.id);
        }
        out
    }

    /// A pooling request's prompt ran: it ends with the pooled vector its event carries
    /// (prefill-only, so this is its only output).
    fn finish_pooled(
        &mut self,
        id: RequestId,
        event: Option<&RequestEvent>,
    ) -> Option<RequestOutput> {
        let seq = self.requests.get(&id)?;
        let out = match event.filter(|ev| !ev.pooled.is_empty()) {
            Some(ev) => RequestOutput {
                finished: Some(FinishReason::Pooled),
                ..seq.output(Vec::new(), ev, None)
            },
            None => RequestOutput {
                error: Some(
                    "the model worker returned no pooled vector for this request \
                             (is the server started with --is-embedding?)"
                        .to_string(),
                ),
                finished: Some(FinishReason::Error),
                ..seq.output(Vec::new(), &RequestEvent::default(), None)
            },
        };
        self.finish(id, out.finished.unwrap_or(FinishReason::Error));
        Some(out)
    }

    /// Puts a request's freshly prefilled full pages into the radix tree while it keeps decoding,
    /// so requests arriving meanwhile with the same prefix (a shared system prompt) hit the cache
    /// without waiting for this one to finish. The request then holds them through a lock.
    fn cache_prompt(&mut self, id: RequestId) {
        if self.config.disable_radix_cache || self.hybrid() {
            return;
        }
        let ps = self.config.page_size as usize;
        let Some(seq) = self.requests.get_mut(&id) else {
            return;
        };
        let Some(a) = (match &mut seq.phase {
            Phase::Prefilling(a) | Phase::Decoding(a) => Some(a),
            _ => None,
        }) else {
            return;
        };
        // A placeholder's position may be computed already; its token is known only now.
        let full = a.computed.min(seq.tokens.len()) / ps;
        let cached = a.prefix_pages.len();
        if full <= cached || a.own.len() < full - cached {
            return;
        }
        let rest = a.own.split_off(full - cached);
        let to_tree = std::mem::replace(&mut a.own, rest);
        let ours = to_tree.ids().to_vec();
        let tokens = &seq.tokens[..full * ps];
        self.cache.insert_in(a.ns, tokens, to_tree);
        let m = self.cache.match_prefix_in(a.ns, tokens);
        debug_assert_eq!(
            m.len,
            full * ps,
            "a just-inserted prefix must match in full"
        );
        self.cache.lock(m.node);
        self.cache.unlock(a.prefix_node);
        let held: Vec<u32> = a.prefix_pages.iter().chain(&ours).copied().collect();
        if m.pages != held {
            // Another request cached the same tokens first: ours were freed as duplicates,
            // so the slot must read the tree's pages from its next step on.
            a.pending_table = Some(m.pages.clone());
        }
        a.prefix_node = m.node;
        a.prefix_pages = m.pages;
    }
}
