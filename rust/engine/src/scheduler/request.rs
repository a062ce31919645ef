//! The scheduler's vocabulary: its configuration, requests in, outputs out, stats and errors.

use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::plan::SamplingParams;
use crate::radix::{EvictionPolicy, HostStats, StorageStats, WritePolicy};

/// Which waiting request is admitted first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SchedulePolicy {
    /// First come, first served.
    #[default]
    Fcfs,
    /// Longest prefix match in the radix cache first (ties in arrival order).
    Lpm,
}

impl FromStr for SchedulePolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fcfs" => Ok(SchedulePolicy::Fcfs),
            "lpm" => Ok(SchedulePolicy::Lpm),
            other => Err(format!(
                "unknown schedule policy {other:?} (expected \"fcfs\" or \"lpm\")"
            )),
        }
    }
}

/// What the scheduler reads, as `tokenspeed serve` hands it over: each field is the flag of the
/// same name (`python/tokenspeed/config/table_*.py`, the flags whose readers include
/// "scheduler"; the one owner of their defaults and help) or, for `num_pages` and the like, what
/// the workers measured or built. Python sends every field (no serde defaults that could
/// disagree with the table).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerConfig {
    /// Tokens per KV page.
    pub page_size: u32,
    /// KV pages the workers allocated (reported by the worker at start).
    pub num_pages: u32,
    /// Worker slots; at most this many requests hold KV at once.
    pub max_running_requests: u32,
    /// Tokens per step, decodes included. Decodes always run, so a step can exceed it only when
    /// more requests decode than this many.
    pub chunked_prefill_size: u32,
    /// Prefill tokens per step.
    pub max_prefill_tokens: u32,
    /// Prefill tokens in a step that also carries decodes (0: no cap beyond the two above). A
    /// step's time grows with its prefill tokens and every running stream waits for the step,
    /// so this bounds the inter-token gap while a wave of prompts prefills: the wave is spread
    /// over more, shorter steps.
    pub max_mixed_prefill_tokens: u32,
    /// Run time a step that also carries decodes is planned to stay within, in ms (0: off):
    /// while the batch is full its prompt tokens are capped by what the measured run times of
    /// recent steps say fits (`step_cost.rs`), never below `MIN_TIME_CAPPED_PROMPT`.
    pub max_mixed_step_ms: f64,
    pub schedule_policy: SchedulePolicy,
    /// Admit waiting requests by `Request::priority` first (`schedule_policy` orders within a
    /// priority); off: every request's priority is ignored (the server refuses non-zero ones).
    pub enable_priority_scheduling: bool,
    /// With priority scheduling: smaller values are more urgent (vLLM's convention); otherwise
    /// larger ones are (SGLang's default).
    pub schedule_low_priority_values_first: bool,
    /// With priority scheduling: a waiting request that cannot be admitted retracts running
    /// requests it outranks by more than this many priority levels (`preemption.rs`).
    pub priority_scheduling_preemption_threshold: i64,
    pub disable_radix_cache: bool,
    /// Prompt plus generated tokens of one request.
    pub context_length: u32,
    /// `NGRAM` drafts tokens by prompt lookup (`ngram.rs`); `EAGLE3` and `NEXTN` (DeepSeek's
    /// MTP layer) take the drafts the worker's draft head proposes in each result
    /// (`worker_drafts`); None: no speculative decoding. The launcher refuses every other
    /// algorithm before it gets here.
    pub speculative_algorithm: Option<String>,
    /// Most draft tokens verified per request per step (the launcher fills it in).
    pub speculative_num_draft_tokens: Option<u32>,
    /// Shortest and longest suffix of the request's tokens that NGRAM looks up.
    pub speculative_ngram_min_match_window_size: u32,
    pub speculative_ngram_max_match_window_size: u32,
    /// Steps of this many decoding requests or more run without speculation (0: never;
    /// `spec_gate.rs`).
    pub speculative_disable_by_batch_size: u32,
    /// Speculation pauses while the running average of tokens per verifying request-step is
    /// below `speculative_break_even_accept_length + speculative_break_even_per_request *
    /// batch` (a base of 0: never), and is tried again every `speculative_probe_interval`
    /// plain steps (`spec_gate.rs`).
    pub speculative_break_even_accept_length: f64,
    pub speculative_break_even_per_request: f64,
    pub speculative_probe_interval: u32,
    /// Which unlocked cached prefix is evicted first.
    pub radix_eviction_policy: EvictionPolicy,
    /// Host slots of the radix cache's host tier, as the workers allocated them (0: no host
    /// tier, `--enable-hierarchical-cache` off).
    pub num_host_pages: u32,
    /// When cached KV is copied to the host tier.
    pub hicache_write_policy: WritePolicy,
    /// Pages the storage tier below the host tier may hold, as the workers sized it (0: none,
    /// `--hicache-storage-backend` unset).
    pub num_storage_pages: u32,
    /// Token counts of the worker's extend CUDA graphs, ascending (empty: none; reported by
    /// the workers at start). A step is padded to the next of them, so a mixed step's prompt
    /// budget is raised to fill that padding with prompt tokens (`step.rs`).
    pub extend_graph_tokens: Vec<u32>,
    /// Pages of the sliding-window layers' own pool, as the workers allocated it (0: one pool
    /// for every layer, the single layout; `--swa-full-tokens-ratio`, `scheduler/swa.rs`).
    pub num_swa_pages: u32,
    /// The largest sliding window of the model's layers, in tokens (0 with the single layout).
    pub swa_window: u32,
}

impl SchedulerConfig {
    /// Whether the worker proposes the drafts (a draft head after each step, returned in
    /// `RequestEvent::draft_tokens`) rather than the scheduler (NGRAM).
    pub fn worker_drafts(&self) -> bool {
        self.speculative_algorithm
            .as_deref()
            .is_some_and(Self::worker_drafts_for)
    }

    fn worker_drafts_for(algorithm: &str) -> bool {
        matches!(algorithm, "EAGLE3" | "NEXTN")
    }

    /// A small engine for tests, simulations and tools: `num_pages` pages of `page_size`
    /// tokens, `max_running` slots, steps of up to `context_length` prompt tokens; FCFS, no
    /// mixed-step caps, no priorities, no speculation, no host or storage tier. Not what a
    /// server runs with: the launcher fills every field from the flag table.
    pub fn small(page_size: u32, num_pages: u32, max_running: u32, context_length: u32) -> Self {
        SchedulerConfig {
            page_size,
            num_pages,
            max_running_requests: max_running,
            chunked_prefill_size: context_length,
            max_prefill_tokens: context_length,
            max_mixed_prefill_tokens: 0,
            max_mixed_step_ms: 0.0,
            schedule_policy: SchedulePolicy::Fcfs,
            enable_priority_scheduling: false,
            schedule_low_priority_values_first: false,
            priority_scheduling_preemption_threshold: 10,
            disable_radix_cache: false,
            speculative_algorithm: None,
            speculative_num_draft_tokens: None,
            speculative_ngram_min_match_window_size: 1,
            speculative_ngram_max_match_window_size: 12,
            speculative_disable_by_batch_size: 0,
            speculative_break_even_accept_length: 0.0,
            speculative_break_even_per_request: 0.0,
            speculative_probe_interval: 64,
            context_length,
            radix_eviction_policy: EvictionPolicy::default(),
            num_host_pages: 0,
            hicache_write_policy: WritePolicy::default(),
            num_storage_pages: 0,
            extend_graph_tokens: Vec::new(),
            num_swa_pages: 0,
            swa_window: 0,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("page_size", self.page_size),
            ("num_pages", self.num_pages),
            ("max_running_requests", self.max_running_requests),
            ("chunked_prefill_size", self.chunked_prefill_size),
            ("max_prefill_tokens", self.max_prefill_tokens),
            ("context_length", self.context_length),
        ];
        if let Some((field, _)) = positive.into_iter().find(|(_, v)| *v == 0) {
            return Err(ConfigError::Zero { field });
        }
        if let Some(alg) = self
            .speculative_algorithm
            .as_deref()
            .filter(|a| *a != "NGRAM" && !Self::worker_drafts_for(a))
        {
            return Err(ConfigError::Unsupported {
                field: "speculative_algorithm",
                value: alg.to_string(),
            });
        }
        if self.speculative_ngram_min_match_window_size == 0
            || self.speculative_ngram_min_match_window_size
                > self.speculative_ngram_max_match_window_size
        {
            return Err(ConfigError::Invalid {
                field: "speculative_ngram_min_match_window_size",
                rule: "at least 1 and at most speculative_ngram_max_match_window_size",
            });
        }
        let (base, slope) = (
            self.speculative_break_even_accept_length,
            self.speculative_break_even_per_request,
        );
        if !(base.is_finite() && base >= 0.0 && slope.is_finite() && slope >= 0.0) {
            return Err(ConfigError::Invalid {
                field: "speculative_break_even_accept_length",
                rule: "finite and >= 0, as speculative_break_even_per_request",
            });
        }
        if self.speculative_probe_interval == 0 {
            return Err(ConfigError::Zero {
                field: "speculative_probe_interval",
            });
        }
        if !(self.max_mixed_step_ms.is_finite() && self.max_mixed_step_ms >= 0.0) {
            return Err(ConfigError::Invalid {
                field: "max_mixed_step_ms",
                rule: "a finite number >= 0",
            });
        }
        if self.num_swa_pages > 0
            && (self.swa_window == 0
                || self.speculative_algorithm.is_some()
                || self.num_host_pages > 0)
        {
            return Err(ConfigError::Invalid {
                field: "num_swa_pages",
                rule: "0 or, for a hybrid sliding-window layout, given with swa_window and \
                       without speculative decoding or a host tier",
            });
        }
        if self.extend_graph_tokens.windows(2).any(|w| w[0] >= w[1]) {
            return Err(ConfigError::Invalid {
                field: "extend_graph_tokens",
                rule: "strictly ascending",
            });
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConfigError {
    #[error("scheduler config: {field} must be positive")]
    Zero { field: &'static str },
    #[error("scheduler config: {field} = {value:?} is not supported")]
    Unsupported { field: &'static str, value: String },
    #[error("scheduler config: {field} must be {rule}")]
    Invalid {
        field: &'static str,
        rule: &'static str,
    },
}

/// A request's id: one random UUID per API request, shared by the logs, the engine and the
/// response `id` (`chatcmpl-<uuid>`), plus the choice when one API request runs several
/// generations (`n`, batched prompts). Written as the UUID's 32 hex digits (the form vLLM and
/// SGLang put in their ids), followed by `-<choice>` for choices after the first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct RequestId {
    pub uuid: u128,
    pub choice: u32,
}

impl RequestId {
    pub const fn new(uuid: u128) -> Self {
        Self { uuid, choice: 0 }
    }

    /// Choice `i` of the same API request.
    pub const fn choice(self, i: u32) -> Self {
        Self {
            uuid: self.uuid,
            choice: i,
        }
    }

    /// The API request's part of the id (no choice): what response ids carry.
    pub fn request(&self) -> String {
        format!("{:032x}", self.uuid)
    }
}

/// Synthetic ids (tests, benchmarks).
impl From<u64> for RequestId {
    fn from(n: u64) -> Self {
        Self::new(u128::from(n))
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:032x}", self.uuid)?;
        if self.choice > 0 {
            write!(f, "-{}", self.choice)?;
        }
        Ok(())
    }
}

impl FromStr for RequestId {
    type Err = ();

    /// Parses what `Display` writes.
    fn from_str(s: &str) -> Result<Self, ()> {
        let (uuid, choice) = match s.split_once('-') {
            Some((u, c)) => (u, c.parse::<u32>().map_err(|_| ())?),
            None => (s, 0),
        };
        if uuid.len() != 32 || !uuid.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(());
        }
        let uuid = u128::from_str_radix(uuid, 16).map_err(|_| ())?;
        Ok(Self { uuid, choice })
    }
}

/// A tokenized, validated request as the engine sees it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Request {
    /// Unique among requests in the scheduler.
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// At least 1.
    pub max_new_tokens: u32,
    /// No stop token ends the request before this many tokens (the worker masks them).
    pub min_new_tokens: u32,
    /// The user's tokens that end generation; the stop token itself is the last output.
    pub stop_token_ids: Vec<u32>,
    /// The model's end-of-sequence ids: they end generation unless `ignore_eos`.
    pub eos_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Admission order with `enable_priority_scheduling` (which end is urgent:
    /// `schedule_low_priority_values_first`); 0 is neutral.
    pub priority: i64,
    /// Prefill/decode disaggregation: whether the prompt's KV crosses to or from a peer server.
    pub kv_transfer: KvTransfer,
}

/// Prefill/decode disaggregation (`--disaggregation-mode`): a request's KV crossing between a
/// prefill server and a decode server, named by the router's `bootstrap_room`. What crosses is
/// the KV of the prompt's full pages before its last token (`kv_transfer_len`): the decode
/// server computes the rest (less than a page, at least the last token) and samples from there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvTransfer {
    #[default]
    None,
    /// Prefill server: the step that computes the prompt's last chunk sends those pages to the
    /// decode server after its forward (`copy_kind::KV_SEND`).
    Send { room: u64 },
    /// Decode server: at its first admission the request receives those pages instead of
    /// computing them (`copy_kind::KV_RECV`, before the step's forward).
    Recv { room: u64 },
}

/// What crossed between a PD pair so far, as this scheduler planned it: requests and pages
/// sent after their prompt's forward (prefill server), and received at admission (decode
/// server). A failed transfer ends its request with an error; it is counted here all the same.
/// The `arrived_*` totals are the decode worker's own measure of what reached it
/// (`StepResult::kv_arrived`): transfers (one per request), bytes (its first rank's share) and
/// time on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct KvTransferStats {
    pub sent_requests: u64,
    pub sent_pages: u64,
    pub received_requests: u64,
    pub received_pages: u64,
    pub arrived_requests: u64,
    pub arrived_bytes: u64,
    pub arrived_us: u64,
}

impl KvTransferStats {
    /// The totals of two replicas.
    pub fn plus(&self, o: &KvTransferStats) -> KvTransferStats {
        KvTransferStats {
            sent_requests: self.sent_requests + o.sent_requests,
            sent_pages: self.sent_pages + o.sent_pages,
            received_requests: self.received_requests + o.received_requests,
            received_pages: self.received_pages + o.received_pages,
            arrived_requests: self.arrived_requests + o.arrived_requests,
            arrived_bytes: self.arrived_bytes + o.arrived_bytes,
            arrived_us: self.arrived_us + o.arrived_us,
        }
    }
}

/// Tokens whose KV crosses for a prompt of `prompt_len` tokens: its full pages before the last
/// token (the receiving side must compute at least that one to sample).
pub fn kv_transfer_len(prompt_len: usize, page_size: usize) -> usize {
    prompt_len.saturating_sub(1) / page_size * page_size
}

impl KvTransfer {
    /// Whether the KV crosses at all for a request sampling with `s`: not when the decode side
    /// must compute every prompt position itself (prompt logprobs, or a penalty whose history
    /// the worker builds from the tokens it is fed). Both sides decide alike from the same
    /// request, so neither sends nor waits for a transfer that will not happen.
    pub fn crosses(&self, s: &SamplingParams) -> bool {
        *self != KvTransfer::None && !(s.penalized() || s.prompt_logprobs || s.pooling)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token was sampled (the output's last token).
    Stop,
    /// `max_new_tokens` reached.
    Length,
    /// A stop string matched: only the front end sees text, so it reports the match and the
    /// scheduler ends the request (`Scheduler::finish`).
    StopString,
    /// The output is complete under its grammar (structured output): the server's grammar
    /// matcher reports it, the scheduler ends the request.
    Complete,
    /// The client went away or asked to stop.
    Abort,
    /// The worker (or the request's grammar) failed this request.
    Error,
    /// A pooling request's prompt ran and its pooled vector came back (prefill-only: nothing
    /// is generated).
    Pooled,
}

impl FinishReason {
    /// The API's name for it: OpenAI's "stop" / "length", vLLM's "abort", or "error".
    pub fn api_name(self) -> &'static str {
        match self {
            FinishReason::Stop
            | FinishReason::StopString
            | FinishReason::Complete
            | FinishReason::Pooled => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
        }
    }
}

/// How a request ended (`Scheduler::finish`): the one record of every ending.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    pub id: RequestId,
    pub reason: FinishReason,
    /// Tokens generated when it ended (those kept: none after a stop).
    pub completion_tokens: u32,
    /// Times it was sent back to the queue to free KV pages.
    pub preemptions: u32,
}

/// What one step produced for one request: its accepted tokens (usually one), or an error.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestOutput {
    pub id: RequestId,
    pub tokens: Vec<u32>,
    /// One per token.
    pub logprobs: Vec<f32>,
    /// One list of (token, logprob) per token, best first; empty lists unless asked for.
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// With `prompt_logprobs`: the logprobs of the prompt tokens this step computed, in order
    /// (the prompt's first token has none, so they cover positions 1.. over all steps).
    pub prompt_logprobs: Vec<f32>,
    /// One list of (token, logprob) per prompt logprob, best first.
    pub prompt_top_logprobs: Vec<Vec<(u32, f32)>>,
    /// 1-based rank of each prompt token in its distribution, one per prompt logprob.
    pub prompt_ranks: Vec<u32>,
    /// A pooling request's vector (`FinishReason::Pooled`), float32; empty otherwise.
    pub pooled: Vec<f32>,
    /// Set on the request's last output; the request is gone from the scheduler afterwards.
    pub finished: Option<FinishReason>,
    /// The worker failed this request; it is gone from the scheduler.
    pub error: Option<String>,
    pub prompt_tokens: u32,
    /// Prompt tokens served from the prefix cache (at first admission).
    pub cached_tokens: u32,
    /// Tokens generated so far, this one included.
    pub completion_tokens: u32,
    /// Times it was sent back to the queue so far (retracted to free KV pages).
    pub preemptions: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SchedulerStats {
    pub total_pages: usize,
    pub free_pages: usize,
    /// Held by running requests (not counting cached prefixes they lock).
    pub used_pages: usize,
    /// Owned by the radix cache, locked or not.
    pub cached_pages: usize,
    /// Cached pages no running request locks.
    pub evictable_pages: usize,
    pub running: usize,
    pub waiting: usize,
    /// Running requests sent back to the queue so far (pages ran out, or a step's KV was
    /// wrong): each recomputes its KV when readmitted, and its stream pauses meanwhile.
    pub retractions: u64,
    /// Speculative decoding: draft tokens sent for verification, how many of them the worker
    /// accepted, and the request-steps that verified at least one draft.
    pub spec_draft_tokens: u64,
    pub spec_accepted_tokens: u64,
    pub spec_verify_steps: u64,
    /// Whether speculation is on (configured, and the latest decoding step ran with it), and
    /// the decoding steps that ran without it while configured (`spec_gate.rs`).
    pub spec_enabled: bool,
    pub spec_off_steps: u64,
    /// Steps planned one step ahead (behind a step in flight) while speculation was paused.
    pub spec_ahead_steps: u64,
    /// The radix cache's host tier (zeros without one).
    pub host: HostStats,
    /// Its storage tier (zeros without one).
    pub storage: StorageStats,
    /// PD disaggregation's KV transfers (zeros on a combined server).
    pub kv_transfer: KvTransferStats,
}

impl SchedulerStats {
    /// Tokens a verifying request-step produced on average (accepted drafts plus the one the
    /// target model always adds), SGLang's `avg_spec_accept_length`; 0 before any.
    pub fn avg_spec_accept_length(&self) -> f64 {
        if self.spec_verify_steps == 0 {
            return 0.0;
        }
        (self.spec_accepted_tokens + self.spec_verify_steps) as f64 / self.spec_verify_steps as f64
    }
}

/// Why `submit` refused a request. Each names the request and the numbers involved.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SubmitError {
    #[error("request {id}: a request with this id is already queued or running")]
    DuplicateId { id: RequestId },
    #[error("request {id}: the prompt is empty")]
    EmptyPrompt { id: RequestId },
    #[error("request {id}: max_new_tokens must be at least 1")]
    ZeroMaxNewTokens { id: RequestId },
    #[error(
        "request {id}: prompt ({prompt_tokens} tokens) plus max_new_tokens ({max_new_tokens}) \
         exceeds the context length ({max_context_len})"
    )]
    ContextTooLong {
        id: RequestId,
        prompt_tokens: usize,
        max_new_tokens: u32,
        max_context_len: u32,
    },
    #[error(
        "request {id}: a pooling request's prompt ({prompt_tokens} tokens) must run in one \
         step, but a step holds at most {max_step_tokens} prompt tokens (--chunked-prefill-size)"
    )]
    PoolingPromptTooLong {
        id: RequestId,
        prompt_tokens: usize,
        max_step_tokens: u32,
    },
    #[error(
        "request {id}: {tokens} tokens need {pages_needed} KV pages but the pool has only \
         {total_pages}"
    )]
    ExceedsKvPool {
        id: RequestId,
        tokens: u64,
        pages_needed: u64,
        total_pages: u32,
    },
}

#[cfg(test)]
mod tests {
    use super::RequestId;

    #[test]
    fn request_ids_read_back_what_they_write() {
        let id = RequestId::new(0x0123_4567_89ab_cdef_0123_4567_89ab_cdef);
        assert_eq!(id.to_string(), "0123456789abcdef0123456789abcdef");
        assert_eq!(id.request(), id.to_string());
        let third = id.choice(2);
        assert_eq!(third.to_string(), "0123456789abcdef0123456789abcdef-2");
        assert_eq!(third.request(), id.to_string());
        for written in [id, third, RequestId::from(7)] {
            assert_eq!(written.to_string().parse::<RequestId>(), Ok(written));
        }
        for bad in [
            "",
            "12",
            "0123456789abcdef0123456789abcdeg",
            "0123456789abcdef0123456789abcdef-x",
        ] {
            assert!(bad.parse::<RequestId>().is_err(), "{bad}");
        }
    }
}
