//! Grammar-constrained requests inside the engine loop: each one's matcher, the token masks a
//! plan carries, and what each step's sampled tokens do to the matchers.
//!
//! Lockstep: a constrained request's mask for step N+1 depends on the token step N samples, so
//! it is never scheduled one step ahead (`Request::lockstep`): its next step is planned after
//! result N arrived, with the mask computed right then and sent inside the plan. Requests
//! without a grammar keep one-step-ahead scheduling around it in the same batches. The cost is
//! the host round trip between a constrained request's steps (measured in benches/RESULTS.md);
//! the mask itself takes tens of microseconds (`rust/structured/benches/mask.rs`).

use std::collections::HashMap;

use tokenspeed_engine::{Plan, TokenMask};
use tokenspeed_structured::Matcher;

use super::Constraint;

struct Constrained {
    matcher: Matcher,
    /// Reasoning still runs (unconstrained) until this token is sampled.
    starts_after: Option<u32>,
}

/// What one step's tokens did to a constrained request.
#[derive(Debug, PartialEq)]
pub(super) enum Verdict {
    Continue,
    /// The grammar is complete: only eos could follow; the request ends now ("stop").
    Complete,
    /// The matcher refused a token or failed: the request ends with this error.
    Failed(String),
}

#[derive(Default)]
pub(super) struct Grammars {
    by_id: HashMap<u64, Constrained>,
    mask_words: usize,
}

impl Grammars {
    pub(super) fn new(mask_words: usize) -> Self {
        Grammars {
            by_id: HashMap::new(),
            mask_words,
        }
    }

    pub(super) fn insert(&mut self, id: u64, c: Constraint) {
        self.by_id.insert(
            id,
            Constrained {
                matcher: c.grammar.matcher(),
                starts_after: c.starts_after,
            },
        );
    }

    pub(super) fn remove(&mut self, id: u64) {
        self.by_id.remove(&id);
    }

    pub(super) fn clear(&mut self) {
        self.by_id.clear();
    }

    pub(super) fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// Adds a mask row to `plan` for every constrained request it samples for (past its
    /// reasoning). `planned`: the plan's (id, slot, samples) rows. Returns the requests whose
    /// matcher failed: the caller ends them (their step runs unmasked and is discarded).
    pub(super) fn attach_masks(
        &mut self,
        plan: &mut Plan,
        planned: impl Iterator<Item = (u64, u32, bool)>,
    ) -> Vec<(u64, String)> {
        let mut failed = Vec::new();
        for (id, slot, sample) in planned {
            let Some(c) = self.by_id.get_mut(&id) else {
                continue;
            };
            if !sample || c.starts_after.is_some() {
                continue;
            }
            let mut allowed = vec![0u32; self.mask_words];
            match c.matcher.fill_next_token_bitmask(&mut allowed) {
                Ok(()) => plan.masks.push(TokenMask { slot, allowed }),
                Err(e) => failed.push((id, e.to_string())),
            }
        }
        failed
    }

    /// Feeds a request's newly accepted tokens to its matcher.
    pub(super) fn advance(&mut self, id: u64, tokens: &[u32]) -> Verdict {
        let Some(c) = self.by_id.get_mut(&id) else {
            return Verdict::Continue;
        };
        for &token in tokens {
            if let Some(end) = c.starts_after {
                if token == end {
                    c.starts_after = None;
                }
                continue;
            }
            if c.matcher.is_finished() {
                break; // a token past the end (eos): the request ends with it
            }
            if let Err(e) = c.matcher.consume_token(token) {
                return Verdict::Failed(e.to_string());
            }
        }
        if c.starts_after.is_none() && c.matcher.is_finished() {
            Verdict::Complete
        } else {
            Verdict::Continue
        }
    }
}
