//! How requests end. `Scheduler::finish(id, reason)` is the one place a request leaves the
//! scheduler, whatever ended it: a stop token or the length (decided here, `accept`, when a
//! step's tokens come back), a stop string (the front end matches text and reports it), a
//! completed grammar (the server's matcher reports it), an abort, or an error. Its pages go
//! back there (to the radix cache) and the reason is recorded in the scheduler's stats.
//!
//! Also the token-level stop rules (stop token ids, EOS, `min_new_tokens`,
//! `max_new_tokens`) and what the worker must know of them.

use super::{FinishReason, Finished, Phase, Request, RequestId, Scheduler, Sequence};
use crate::plan::SamplingParams;

impl Scheduler {
    /// Ends request `id` for `reason`, wherever it is (waiting, running, retracted): its slot
    /// is reported free in the next plan and its pages go back (the computed prefix to the
    /// radix cache). Returns the record of the ending; None for an unknown (or already
    /// finished) id, so an ending reported twice (a stop string matched as the last token
    /// also hit the length) counts once.
    pub fn finish(&mut self, id: RequestId, reason: FinishReason) -> Option<Finished> {
        let mut seq = self.requests.remove(&id)?;
        self.waiting.retain(|&w| w != id);
        self.unpark(id);
        self.running.retain(|&r| r != id);
        if let Phase::Prefilling(active) | Phase::Decoding(active) =
            std::mem::replace(&mut seq.phase, Phase::Finished)
        {
            // A pooling request's KV is no prefix to reuse (an encoder's is bidirectional):
            // its pages are freed, not cached.
            let cacheable: &[u32] = if seq.req.sampling.pooling {
                &[]
            } else {
                &seq.tokens
            };
            self.release(cacheable, active);
        }
        let slot = self.finished_by_reason.entry(reason).or_insert(0);
        *slot += 1;
        Some(Finished {
            id,
            reason,
            completion_tokens: seq.completion_tokens() as u32,
            preemptions: seq.retractions,
        })
    }

    /// How many requests ended for `reason` so far.
    pub fn finished_count(&self, reason: FinishReason) -> u64 {
        self.finished_by_reason.get(&reason).copied().unwrap_or(0)
    }
}

/// Of `accepted` tokens following `completion_before` generated ones, how many the request
/// keeps, and whether the last kept one finishes it. Tokens after a stop are dropped (with
/// speculative decoding several may arrive at once).
pub(super) fn accept(
    req: &Request,
    completion_before: usize,
    accepted: &[u32],
) -> (usize, Option<FinishReason>) {
    let max = req.max_new_tokens as usize;
    for (i, &token) in accepted.iter().enumerate() {
        let completion = completion_before + i + 1;
        if completion >= req.min_new_tokens as usize && is_stop(req, token) {
            return (i + 1, Some(FinishReason::Stop));
        }
        if completion >= max {
            return (i + 1, Some(FinishReason::Length));
        }
    }
    (accepted.len(), None)
}

/// A user's stop token ids always stop (also with `ignore_eos`, as in vLLM); the model's EOS
/// ids only without `ignore_eos`.
fn is_stop(req: &Request, token: u32) -> bool {
    req.stop_token_ids.contains(&token) || (!req.ignore_eos && req.eos_token_ids.contains(&token))
}

impl Sequence {
    /// The sampling parameters the worker gets when this request enters `slot`: stop ids
    /// travel only while `min_new_tokens` is not reached, for the worker to mask them.
    pub(super) fn worker_params(&self, slot: u32) -> SamplingParams {
        let min_tokens =
            (self.req.min_new_tokens as usize).saturating_sub(self.completion_tokens()) as u32;
        let stop_ids = if min_tokens == 0 {
            Vec::new()
        } else {
            let eos = (!self.req.ignore_eos).then_some(&self.req.eos_token_ids);
            self.req
                .stop_token_ids
                .iter()
                .chain(eos.into_iter().flatten())
                .copied()
                .collect()
        };
        SamplingParams {
            slot,
            min_tokens,
            stop_ids,
            // Reported once: a request re-admitted after its first token does not repeat them.
            prompt_logprobs: self.req.sampling.prompt_logprobs && self.completion_tokens() == 0,
            ..self.req.sampling.clone()
        }
    }
}
