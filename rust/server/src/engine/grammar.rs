//! Grammar-constrained requests inside the engine loop: each one's matcher, the token masks a
//! plan carries, and what each step's sampled tokens do to the matchers.
//!
//! Constrained requests keep one-step-ahead scheduling. A plan's mask row is computed when the
//! plan is built if the request's input token is known; if the input is the token still in
//! flight (`LAST_SAMPLED`), the row goes *pending* and is sent as a mask completion
//! (`Plan::mask_completion`) right after the previous step's result is applied, while the
//! worker runs this step's forward pass (see `plan::TokenMask`). Every pending row gets an
//! answer, even for a request that ended meanwhile (its token is then discarded), because the
//! worker waits for it.
//!
//! With a worker-side backend (`--grammar-backend xgrammar`, `Constraint::worker`) the engine
//! keeps no matcher: it sends the grammar once, as a `GrammarRow` of the plan that gives the
//! request its slot, and the worker masks and advances it (see python/tokenspeed/
//! grammar_backend.py). Such a request never has pending rows, so it keeps one-step-ahead
//! scheduling without a mask completion, and it ends like any request: a finished grammar
//! allows only eos, which stops it ("stop").

use std::collections::HashMap;

use tokenspeed_engine::{GrammarRow, Plan, RequestId, TokenMask, LAST_SAMPLED, MAX_GRAMMAR_REPLAY};
use tokenspeed_structured::Matcher;

use super::Constraint;
use crate::constraint::WorkerGrammar;

struct Constrained {
    enforced: Enforced,
    /// Reasoning still runs (unconstrained) until this token is sampled.
    starts_after: Option<u32>,
}

/// Where a request's grammar is enforced.
enum Enforced {
    /// Here: llguidance's matcher computes the masks the plan carries.
    Server(Box<Matcher>),
    /// On the worker, which needs the grammar at each admission, and after a retraction the
    /// tokens generated so far (to replay into its new matcher).
    Worker {
        grammar: WorkerGrammar,
        generated: Vec<u32>,
    },
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
    by_id: HashMap<RequestId, Constrained>,
    mask_words: usize,
    /// The latest plan sent with pending rows: its step and the (request, slot) of each row.
    pending: Option<(u64, Vec<(RequestId, u32)>)>,
}

impl Grammars {
    pub(super) fn new(mask_words: usize) -> Self {
        Grammars {
            by_id: HashMap::new(),
            mask_words,
            pending: None,
        }
    }

    pub(super) fn insert(&mut self, id: RequestId, c: Constraint) {
        let enforced = match c.worker {
            Some(grammar) => Enforced::Worker {
                grammar,
                generated: Vec::new(),
            },
            None => Enforced::Server(Box::new(c.grammar.matcher())),
        };
        self.by_id.insert(
            id,
            Constrained {
                enforced,
                starts_after: c.starts_after,
            },
        );
    }

    pub(super) fn remove(&mut self, id: RequestId) {
        self.by_id.remove(&id);
    }

    /// Every request gone (the worker group failed): nothing is pending any more either.
    pub(super) fn clear(&mut self) {
        self.by_id.clear();
        self.pending = None;
    }

    pub(super) fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// Adds a mask row to `plan` for every constrained request it samples for (past its
    /// reasoning): computed now when its input is known, pending when its input is the token in
    /// flight. `planned`: the plan's (id, slot, samples) rows. Returns the requests whose
    /// matcher failed: the caller ends them (their row allows everything; the step's token for
    /// them is discarded).
    pub(super) fn attach_masks(
        &mut self,
        plan: &mut Plan,
        planned: impl Iterator<Item = (RequestId, u32, bool)>,
    ) -> Vec<(RequestId, String)> {
        let ahead: Vec<u32> = plan
            .scheduled
            .iter()
            .filter(|r| r.tokens.contains(&LAST_SAMPLED))
            .map(|r| r.slot)
            .collect();
        let (mut now, mut pending) = (Vec::new(), Vec::new());
        let mut failed = Vec::new();
        let mut replayed = 0;
        for (id, slot, sample) in planned {
            let Some(c) = self.by_id.get(&id) else {
                continue;
            };
            if let Enforced::Worker { grammar, generated } = &c.enforced {
                // Admitted in this plan (its first chunk runs with it): the worker needs it.
                if plan.new_requests.iter().any(|n| n.slot == slot) {
                    replayed += generated.len();
                    if replayed > MAX_GRAMMAR_REPLAY {
                        failed.push((
                            id,
                            format!(
                                "readmitted after {} tokens, more than a plan replays to the \
                                 worker's grammar ({MAX_GRAMMAR_REPLAY})",
                                generated.len()
                            ),
                        ));
                        continue;
                    }
                    plan.grammars.push(GrammarRow {
                        slot,
                        kind: grammar.kind,
                        starts_after: c.starts_after.map_or(-1, i64::from),
                        text: grammar.text.as_bytes().to_vec(),
                        stop_ids: grammar.stop_ids.clone(),
                        generated: generated.clone(),
                    });
                }
                continue;
            }
            // Pending also while reasoning: the token in flight may be the think-end.
            if sample && ahead.contains(&slot) {
                pending.push((id, slot));
                plan.masks.push(TokenMask {
                    slot,
                    allowed: Vec::new(),
                });
            } else if sample && c.starts_after.is_none() {
                now.push((id, slot));
            }
        }
        if !pending.is_empty() {
            self.pending = Some((plan.step_id, pending));
        }
        let (masks, mask_failed) = self.masks_for(now);
        plan.masks.extend(masks);
        failed.extend(mask_failed);
        failed
    }

    /// The mask completion for the pending rows of plan `step_id`, once every plan before it has
    /// been answered (so each matcher has consumed the token the row depends on). Requests
    /// that ended meanwhile get an allow-all row; matchers that fail are returned to be ended.
    pub(super) fn complete(
        &mut self,
        oldest_in_flight: Option<u64>,
    ) -> Option<(Plan, Vec<(RequestId, String)>)> {
        let step = self.pending.as_ref()?.0;
        if oldest_in_flight != Some(step) {
            return None;
        }
        let (step, rows) = self.pending.take()?;
        let (masks, failed) = self.masks_for(rows);
        Some((Plan::mask_completion(step, masks), failed))
    }

    /// The next-token masks of these (request, slot) rows. A request that ended, or is still
    /// reasoning, gets an allow-all row; a failed matcher too, and is returned. One by one: on
    /// the H100 box, rayon over a batch's matchers (which share their grammar's lexer cache
    /// behind a lock) made decode slower, +43% instead of +6% per token at batch 16.
    fn masks_for(
        &mut self,
        rows: Vec<(RequestId, u32)>,
    ) -> (Vec<TokenMask>, Vec<(RequestId, String)>) {
        let words = self.mask_words;
        let mut failed = Vec::new();
        let masks = rows
            .into_iter()
            .map(|(id, slot)| {
                let allowed = match self.by_id.get_mut(&id) {
                    Some(Constrained {
                        enforced: Enforced::Server(matcher),
                        starts_after: None,
                    }) => {
                        let mut allowed = vec![0u32; words];
                        match matcher.fill_next_token_bitmask(&mut allowed) {
                            Ok(()) => allowed,
                            Err(e) => {
                                failed.push((id, e.to_string()));
                                vec![u32::MAX; words]
                            }
                        }
                    }
                    _ => vec![u32::MAX; words],
                };
                TokenMask { slot, allowed }
            })
            .collect();
        (masks, failed)
    }

    /// Feeds a request's newly accepted tokens to its matcher.
    pub(super) fn advance(&mut self, id: RequestId, tokens: &[u32]) -> Verdict {
        let Some(c) = self.by_id.get_mut(&id) else {
            return Verdict::Continue;
        };
        let matcher = match &mut c.enforced {
            Enforced::Server(m) => m,
            Enforced::Worker { generated, .. } => {
                // The worker's matcher has these tokens already; kept for a readmission.
                generated.extend_from_slice(tokens);
                return Verdict::Continue;
            }
        };
        for &token in tokens {
            if let Some(end) = c.starts_after {
                if token == end {
                    c.starts_after = None;
                }
                continue;
            }
            if matcher.is_finished() {
                break; // a token past the end (eos): the request ends with it
            }
            if let Err(e) = matcher.consume_token(token) {
                return Verdict::Failed(e.to_string());
            }
        }
        if c.starts_after.is_none() && matcher.is_finished() {
            Verdict::Complete
        } else {
            Verdict::Continue
        }
    }
}
