//! The step plan (scheduler → worker) and the step result (worker → scheduler).
//!
//! A plan is a *diff*: the worker keeps per-slot state (sampling params, page table row)
//! across steps, so a plan carries new requests in full and running ones only as what
//! changed. `tokenspeed-ipc` encodes these into shared memory; Python sees flat numpy arrays.

use serde::{Deserialize, Serialize};

/// An entry of `Plan::input_ids` equal to this stands for "the token the worker sampled for this
/// slot in the most recent step that sampled for it": the worker resolves it on the GPU, so the
/// scheduler can send step N+1 before step N's sampled token has come back (one-step-ahead, or
/// "overlap", scheduling). It only appears as the single input token of a decode
/// (`num_tokens == 1`), for a request whose previous scheduled step (still in flight) has
/// `sample == true` and whose `start_pos` is exactly the position after that step's last token.
pub const LAST_SAMPLED: u32 = u32::MAX;

/// Per-request sampling parameters, fixed when the request is admitted.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0.0 means greedy.
    pub temperature: f32,
    /// 1.0 disables nucleus sampling.
    pub top_p: f32,
    /// -1 (or 0) disables top-k.
    pub top_k: i32,
    /// 0.0 disables min-p.
    pub min_p: f32,
    /// 1.0 disables.
    pub repetition_penalty: f32,
    /// 0.0 disables.
    pub frequency_penalty: f32,
    /// 0.0 disables.
    pub presence_penalty: f32,
    /// Per-request RNG seed; `None` draws from the worker's global generator.
    pub seed: Option<u64>,
    /// Number of top logprobs to return per sampled token (0 = only the chosen token's).
    pub top_logprobs: u32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: None,
            top_logprobs: 0,
        }
    }
}

/// A request entering a worker slot: the worker resets that slot's state.
#[derive(Debug, Clone, PartialEq)]
pub struct NewRequestPlan {
    pub slot: u32,
    pub sampling: SamplingParams,
}

/// One request's share of this step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledRequest {
    pub slot: u32,
    /// Tokens of this request in `Plan::input_ids` (in order of `Plan::scheduled`).
    pub num_tokens: u32,
    /// Position (0-based, in the request's full sequence) of the first of those tokens.
    /// The KV of positions `< start_pos` is already in the slot's pages.
    pub start_pos: u32,
    /// Prompt tokens served from the radix cache when this request was admitted.
    pub cached_len: u32,
    /// True when this step ends at the sequence's last known token, so the worker samples
    /// one token for it (false for a prefill chunk that is not the prompt's last).
    pub sample: bool,
}

/// Pages appended to a slot's page table: entries `first_index..first_index+pages.len()`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageTableUpdate {
    pub slot: u32,
    pub first_index: u32,
    pub pages: Vec<u32>,
}

/// One step of work for the worker group.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    pub step_id: u64,
    /// Slots whose requests finished or were aborted/retracted since the last plan:
    /// the worker drops their state *before* applying `new_requests`.
    pub finished_slots: Vec<u32>,
    pub new_requests: Vec<NewRequestPlan>,
    pub page_table_updates: Vec<PageTableUpdate>,
    pub scheduled: Vec<ScheduledRequest>,
    /// Concatenated input token ids of `scheduled`, in order.
    pub input_ids: Vec<u32>,
}

impl Plan {
    pub fn num_tokens(&self) -> usize {
        self.input_ids.len()
    }
    /// True when every scheduled request feeds exactly one token (a decode-only step).
    pub fn is_pure_decode(&self) -> bool {
        self.scheduled.iter().all(|r| r.num_tokens == 1)
    }
    pub fn is_empty(&self) -> bool {
        self.scheduled.is_empty() && self.finished_slots.is_empty()
    }
}

/// A sampled token for one slot.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    pub slot: u32,
    pub token: u32,
    pub logprob: f32,
    /// (token, logprob) pairs, best first; empty unless the request asked for top logprobs.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// What the worker sends back after a step: one entry per scheduled request with `sample`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepResult {
    pub step_id: u64,
    pub sampled: Vec<SampledToken>,
}
