//! When a request's tokens end it: the one owner of the token-level stop rules (stop token
//! ids, EOS, `min_new_tokens`, `max_new_tokens`), and of what the worker must know of them.
//!
//! Stop *strings* need text, which only the server's detokenizer has: it ends a request on a
//! matched string through the engine (`Scheduler::abort`), after every token rule here had
//! its say on the same tokens.

use super::{FinishReason, Request, Sequence};
use crate::plan::SamplingParams;

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
