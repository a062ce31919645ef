//! The step protocol, declared once: the plan (scheduler → worker) and the step result
//! (worker → scheduler). `schema.rs` derives the codec, the size bound of a shm slot and the
//! array names Python reads from these declarations (see its module doc for the layout).
//!
//! A plan is a *diff*: the worker keeps per-slot state (sampling parameters, page-table row)
//! across steps, so a plan carries new requests in full and running ones only as what
//! changed. The worker applies a plan's sections in order: finished slots are dropped, new
//! requests take their slots, page tables are updated, KV pages are copied, then the
//! scheduled requests run. A result holds one event per scheduled request that sampled
//! (or failed).

use crate::{message, section};

/// An input token equal to this stands for "the token the worker sampled for this slot in the
/// most recent step that sampled for it": the worker resolves it on the GPU, so the scheduler
/// can send step N+1 before step N's sampled token has come back (one-step-ahead, or "overlap",
/// scheduling). It only appears as the single input token of a decode, for a request whose
/// previous scheduled step (still in flight) samples and proposes no draft tokens.
pub const LAST_SAMPLED: u32 = u32::MAX;

/// `SamplingParams::seed` when the request has none (the worker's shared generator draws).
pub const NO_SEED: i64 = -1;

/// The most `logit_bias` entries one request may carry (bounds the plan's slot size).
pub const MAX_LOGIT_BIAS: usize = 1024;

/// The longest LoRA adapter path (bytes) a request carries to the worker.
pub const MAX_LORA_PATH: usize = 1024;

/// The most pinned LoRA adapters (`pinned` at load): bounds the plan's `lora_pins`.
pub const MAX_LORA_PINS: usize = 64;

section! {
    /// A slot whose request finished or was aborted/retracted since the last plan: the worker
    /// drops its state before taking new requests.
    pub struct FinishedSlot("finished") {
        pub slot: u32,
    }
    lists {}
}

section! {
    /// How a request samples; fixed at admission. In a plan's `new_requests` section it enters
    /// worker slot `slot` (the worker resets that slot's state). Neutral values disable a knob
    /// (temperature 0 is greedy).
    pub struct SamplingParams("new") {
        pub slot: u32,
        pub temperature: f32,
        /// 1.0 disables nucleus sampling.
        pub top_p: f32,
        /// -1 (or 0) disables top-k.
        pub top_k: i32,
        pub min_p: f32,
        /// 1.0 disables.
        pub repetition_penalty: f32,
        pub frequency_penalty: f32,
        pub presence_penalty: f32,
        /// Per-request RNG seed (63 bits), or `NO_SEED`.
        pub seed: i64,
        /// Top logprobs to return per sampled token (0: only the chosen token's).
        pub top_logprobs: u32,
        /// `stop_ids` cannot be sampled while the slot has sampled fewer tokens than this.
        pub min_tokens: u32,
        /// Report the logprob of each prompt token (and `top_logprobs` alternatives) as the
        /// prompt is computed; the prompt is then computed from its first token, uncached.
        pub prompt_logprobs: bool,
        /// The LoRA adapter the request runs: the server's registry id, never reused for
        /// another adapter (0: the base model).
        pub lora_id: u32,
        /// A pooling request (embedding, score, classification): prefill-only. The whole
        /// prompt runs in one step from its first token (uncached), nothing is sampled, and
        /// the step's event carries the model's pooled vector (`RequestEvent::pooled`); the
        /// request then ends (`FinishReason::Pooled`).
        pub pooling: bool,
        /// With `pooling`: the position where the second segment of a text pair starts (token
        /// type 1 for a BERT cross-encoder); 0: one segment.
        pub segment_b: u32,
    }
    lists {
        /// The tokens that would end the request (masked while `min_tokens` is not reached).
        pub stop_ids: Vec<u32>,
        /// Added to the logits of these token ids before sampling (OpenAI's `logit_bias`).
        pub logit_bias_ids: Vec<u32>,
        /// One per id in `logit_bias_ids`.
        pub logit_bias_values: Vec<f32>,
        /// The adapter's directory (UTF-8; empty for the base model): the worker reads it the
        /// first time it sees `lora_id`, or again after dropping it from its host cache.
        pub lora_path: Vec<u8>,
    }
}

impl SamplingParams {
    /// Whether a penalty reads the request's token history. The worker builds that history from
    /// the tokens it is fed, so such a request must be fed all of them: no cached prefix.
    /// (A repetition penalty of 0, the derived default, is none: the worker reads it as 1.0.)
    pub fn penalized(&self) -> bool {
        let rep = self.repetition_penalty;
        (rep > 0.0 && rep != 1.0) || self.frequency_penalty != 0.0 || self.presence_penalty != 0.0
    }

    /// The neutral parameters: plain sampling at temperature 1 from the full distribution.
    pub fn neutral() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            repetition_penalty: 1.0,
            seed: NO_SEED,
            ..Default::default()
        }
    }

    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..Self::neutral()
        }
    }
}

section! {
    /// Pages appended to a slot's page table: entries `first..first + pages.len()`.
    pub struct PageTableUpdate("pt") {
        pub slot: u32,
        pub first: u32,
        /// Page table: 0 full layers' (all in one layout), 1 sliding-window layers' (`swa.rs`).
        pub pool: u8,
    }
    lists {
        pub pages: Vec<u32>,
    }
}

section! {
    /// A KV page copy, `src` → `dst`, done before this step's forward, in list order (a page
    /// or host slot freed by one copy may be the target of a later one). `kind` says between
    /// which pools (`copy_kind`): the host tier's writebacks and loads (`--enable-hierarchical-cache`),
    /// the storage tier's stores, fetches and drops (`--hicache-storage-backend`).
    pub struct CopyOp("copy") {
        pub src: u32,
        pub dst: u32,
        /// `copy_kind::*`.
        pub kind: u8,
        /// The page's key in the storage tier (its block hash) for STORE, FETCH and DROP;
        /// 0 otherwise.
        pub key: i64,
    }
    lists {}
}

/// `CopyOp::kind` values.
pub mod copy_kind {
    /// Device page `src` → device page `dst`.
    pub const DEVICE: u8 = 0;
    /// Device page `src` → host slot `dst` (a node written to the host tier).
    pub const WRITEBACK: u8 = 1;
    /// Host slot `src` → device page `dst` (a host-tier hit loaded back).
    pub const LOAD: u8 = 2;
    /// Host slot `src` → the storage tier's page `key` (a page dropped from the host tier).
    pub const STORE: u8 = 3;
    /// The storage tier's page `key` → host slot `dst` (a storage hit, loaded on from there).
    pub const FETCH: u8 = 4;
    /// The storage tier forgets page `key` (its room is needed).
    pub const DROP: u8 = 5;
    /// Prefill/decode disaggregation, prefill server: device page `src` (of slot `dst`) goes to
    /// the decode server as the next page of transfer `key` (the request's bootstrap room).
    /// Unlike every other kind it runs *after* the step's forward, which computes that KV.
    pub const KV_SEND: u8 = 6;
    /// Decode server: the next page of transfer `key`, from the prefill server, → device page
    /// `dst`, for slot `src` (the worker fails that slot's request if the transfer fails).
    pub const KV_RECV: u8 = 7;
}

section! {
    /// One request's share of this step.
    pub struct ScheduledRequest("sched") {
        pub slot: u32,
        /// Position (0-based, in the request's full sequence) of the first input token. The KV
        /// of positions `< start_pos` is already in the slot's pages.
        pub start_pos: u32,
        /// The step ends at the sequence's last known token, so the worker samples for it
        /// (false for a prefill chunk that is not the prompt's last).
        pub sample: bool,
        /// Speculative decoding: the last `num_draft_tokens` of `tokens` are draft tokens (a
        /// chain) that follow the sequence's last known token. The worker computes their KV like
        /// any input, verifies them against the model's own choices and reports the accepted
        /// ones plus one token of its own (`RequestEvent::tokens`); the KV of rejected positions
        /// is overwritten by later steps (the scheduler rewinds to the accepted length). 0: plain.
        pub num_draft_tokens: u32,
        /// Speculation paused (`spec_gate.rs`): a draft head writes its KV, drafts nothing after.
        pub pause_drafts: bool,
    }
    lists {
        /// Input token ids (`LAST_SAMPLED` for a one-step-ahead decode).
        pub tokens: Vec<u32>,
    }
}

section! {
    /// The tokens a grammar-constrained request may sample this step (structured output). Only
    /// for requests the step samples for, and only those whose next token is constrained.
    ///
    /// A row whose input is `LAST_SAMPLED` cannot be known when its plan is sent (it depends
    /// on the token in flight): it comes *pending*, with `allowed` empty, and the server sends
    /// it once the previous step's result is in, as a *mask completion*: a plan with the same
    /// `step_id` carrying only `masks`, every pending row filled. The worker runs the forward
    /// pass meanwhile and waits for the completion only to sample (the mask takes tens of
    /// microseconds, a forward pass milliseconds, so the GPU does not wait).
    pub struct TokenMask("mask") {
        pub slot: u32,
    }
    lists {
        /// Bit `i % 32` of word `i / 32` set: token `i` is allowed; `StepLimits::mask_words`
        /// words (the model's vocabulary, padded ids never allowed), or none while pending.
        pub allowed: Vec<u32>,
    }
}

/// `GrammarRow::kind` values: how the worker reads a grammar row's `text`.
pub mod grammar_kind {
    /// A JSON schema (JSON text); `json_object` requests send `{"type": "object"}`.
    pub const JSON_SCHEMA: u8 = 0;
    /// A regex over the whole output.
    pub const REGEX: u8 = 1;
    /// A grammar: GBNF/EBNF (with `::=` rules and a `root`) or Lark.
    pub const GRAMMAR: u8 = 2;
    /// A JSON list of strings, exactly one of which is the output.
    pub const CHOICE: u8 = 3;
    /// SGLang's structural tag (JSON text).
    pub const STRUCTURAL_TAG: u8 = 4;
}

/// The longest grammar text (bytes) one request may send to a worker-side grammar backend.
pub const MAX_GRAMMAR_TEXT: usize = 32 * 1024;
/// The most stop ids a grammar row carries (the tokens a finished grammar allows).
pub const MAX_GRAMMAR_STOP_IDS: usize = 8;
/// The most already-generated tokens the grammar rows of one plan replay (a request
/// readmitted after a retraction); the engine fails a request that would exceed it.
pub const MAX_GRAMMAR_REPLAY: usize = 4096;

section! {
    /// A grammar the *worker* enforces (`--grammar-backend xgrammar`): sent once, in the plan
    /// that gives the request its slot (`new_requests`); the worker keeps a matcher for the
    /// slot until the slot is finished or taken by another request, computes the slot's mask
    /// before each sample and advances the matcher with each sampled token itself, so no mask
    /// crosses the plan and no mask completion is needed. The server still validated the
    /// grammar (llguidance) before admitting the request.
    pub struct GrammarRow("grammar") {
        pub slot: u32,
        /// `grammar_kind::*`.
        pub kind: u8,
        /// With a reasoning parser: the think-end token after which the grammar starts
        /// (reasoning is unconstrained); -1: from the first generated token.
        pub starts_after: i64,
    }
    lists {
        /// The grammar, UTF-8.
        pub text: Vec<u8>,
        /// The tokens a finished grammar allows (the model's eos ids): the request ends on one.
        pub stop_ids: Vec<u32>,
        /// Tokens the request generated before this admission (readmitted after a
        /// retraction): the worker feeds them to the new matcher first.
        pub generated: Vec<u32>,
    }
}

/// `WorkerOp::kind` values: what an operation on the worker group does.
pub mod op_kind {
    /// Reload the weights from `args` (`{"model_path": ..., "load_format": ...}`) into the
    /// running model, same architecture (`/update_weights_from_disk`).
    pub const UPDATE_WEIGHTS: u8 = 1;
    /// Free the weights (a host copy kept), the KV cache and the CUDA graphs
    /// (`/release_memory_occupation`); the engine admits nothing until `RESUME_MEMORY`.
    pub const RELEASE_MEMORY: u8 = 2;
    /// Undo `RELEASE_MEMORY` (`/resume_memory_occupation`).
    pub const RESUME_MEMORY: u8 = 3;
}

/// The longest argument text (bytes) of a `WorkerOp`, and of its outcome's message.
pub const MAX_OP_TEXT: usize = 8 * 1024;

section! {
    /// An operation on the worker group rather than a step: sent alone in a plan while no
    /// request holds a slot (the engine waits for that), applied by every rank; the lead rank's
    /// result carries its outcome (`OpOutcome`).
    pub struct WorkerOp("op") {
        /// `op_kind::*`.
        pub kind: u8,
    }
    lists {
        /// The operation's arguments, JSON text (UTF-8).
        pub args: Vec<u8>,
    }
}

section! {
    /// A pinned LoRA adapter (loaded with `pinned`): once in the worker's pool it is never
    /// evicted, and the scheduler keeps a pool slot for it. Every step plan lists all of them
    /// (a handful at most), so the worker needs no state about pins between plans.
    pub struct LoraPin("lora_pin") {
        /// The adapter's registry id (`SamplingParams::lora_id`).
        pub adapter: u32,
    }
    lists {}
}

message! {
    /// One step of work for the worker group.
    pub struct Plan(magic = 0x4e4c_5054) {
        pub finished: Vec<FinishedSlot>,
        pub new_requests: Vec<SamplingParams>,
        pub page_tables: Vec<PageTableUpdate>,
        pub copies: Vec<CopyOp>,
        pub scheduled: Vec<ScheduledRequest>,
        pub masks: Vec<TokenMask>,
        pub grammars: Vec<GrammarRow>,
        pub ops: Vec<WorkerOp>,
        pub lora_pins: Vec<LoraPin>,
    }
}

impl Plan {
    /// Input tokens of the step.
    pub fn num_tokens(&self) -> usize {
        self.scheduled.iter().map(|r| r.tokens.len()).sum()
    }
    /// True when every scheduled request feeds exactly one token (a decode-only step).
    pub fn is_pure_decode(&self) -> bool {
        self.scheduled.iter().all(|r| r.tokens.len() == 1)
    }
    pub fn is_empty(&self) -> bool {
        self.scheduled.is_empty()
            && self.finished.is_empty()
            && self.copies.is_empty()
            && self.ops.is_empty()
    }
    /// The mask completion of plan `step_id`: only the rows it left pending (`TokenMask`).
    pub fn mask_completion(step_id: u64, masks: Vec<TokenMask>) -> Plan {
        Plan {
            step_id,
            masks,
            ..Default::default()
        }
    }
}

/// Upper bounds of one step, from which the size of a shm slot follows.
#[derive(Debug, Clone, Copy)]
pub struct StepLimits {
    /// Worker slots (`--max-running-requests`).
    pub max_running: usize,
    /// Input tokens of one step (the chunked-prefill budget; decodes may add one per slot).
    pub max_step_tokens: usize,
    /// Pages of the longest request (context length / page size, rounded up).
    pub max_pages_per_request: usize,
    /// Words of one token mask row (the model's vocabulary / 32, rounded up); 0 without
    /// structured output.
    pub mask_words: usize,
    /// Grammars travel to the worker (`GrammarRow`, a worker-side grammar backend).
    pub worker_grammars: bool,
    /// Floats of one pooled vector (`RequestEvent::pooled`: the model's hidden size or label
    /// count); 0 when the model does not pool (`--is-embedding` off).
    pub pooled_dim: usize,
    /// The radix cache has a host tier (`--enable-hierarchical-cache`): a step carries its
    /// writebacks and loads, besides the device copies.
    pub host_copies: bool,
    /// The host tier has a storage tier below it (`--hicache-storage-backend`): a step also
    /// carries a fetch per page it loads from there and a store and a drop per page the host
    /// tier lets go.
    pub storage_copies: bool,
    /// Prefill/decode disaggregation (`--disaggregation-mode`): a step carries the page
    /// transfers of the requests it starts (decode) or whose prompt it completes (prefill).
    pub kv_transfer: bool,
    /// Columns of a token's top logprobs (`RequestEvent::top_k`) at most: `--max-logprobs`
    /// within the vocabulary. A request asking for more is refused before it is queued.
    pub top_logprobs: usize,
    /// Draft tokens one event proposes at most (`RequestEvent::draft_tokens`: EAGLE-3's
    /// chain length); 0 without a worker-side drafter.
    pub max_drafts: usize,
}

impl Plan {
    /// Bytes of the largest plan within `l`. Each section's bound is stated here, next to
    /// the declaration, so a new section or list field states its own.
    pub fn max_encoded_len(l: &StepLimits) -> usize {
        use crate::schema::Message;
        let (r, pages) = (l.max_running, l.max_pages_per_request);
        let g = if l.worker_grammars { r } else { 0 };
        let counts = [
            r, // finished
            r,
            r * pages, // new requests, their stop ids (bounded by the vocabulary in practice)
            r * MAX_LOGIT_BIAS,
            r * MAX_LOGIT_BIAS, // their logit bias ids and values
            r * MAX_LORA_PATH,  // their LoRA adapter paths
            2 * r,
            2 * r * pages, // page-table updates: prefix rewrite + new pages (hybrid: full + sliding)
            // Copies. Host tier: loads (at most every admitted request's prefix), writebacks of
            // the nodes cached since the last plan (write-through) and of the pages evicted
            // for this step (what it allocates, plus one node's overshoot).
            // Storage tier: a fetch per loaded page, and host evictions (as many as the host
            // slots this step takes: writebacks and fetches) each a store and a drop.
            if l.host_copies {
                (4 * r * pages + l.max_step_tokens + 2 * r) * if l.storage_copies { 3 } else { 1 }
            } else {
                r * pages
            } + if l.kv_transfer { r * pages } else { 0 }, // PD: a transfer per slot at most
            r,
            l.max_step_tokens + r, // scheduled, their tokens
            r,
            r * l.mask_words, // token masks: at most one row per slot
            g,
            g * MAX_GRAMMAR_TEXT,
            g * MAX_GRAMMAR_STOP_IDS,
            if l.worker_grammars {
                MAX_GRAMMAR_REPLAY
            } else {
                0
            }, // grammar rows: one per new request, each bounded
            1,
            MAX_OP_TEXT,   // worker ops: one at most, alone in its plan
            MAX_LORA_PINS, // pinned adapters
        ];
        <Plan as Message>::max_encoded_len(&counts)
    }
}

/// `RequestEvent::error` values.
pub mod event_error {
    pub const NONE: u32 = 0;
    /// The worker could not produce this request's tokens (e.g. non-finite logits).
    pub const FAILED: u32 = 1;
    /// The worker's grammar backend could not enforce the request's grammar (xgrammar could
    /// not compile it, or a sampled token broke it, e.g. `min_tokens` past the grammar's end).
    pub const GRAMMAR: u32 = 2;
}

section! {
    /// What one scheduled request produced in a step.
    pub struct RequestEvent("event") {
        pub slot: u32,
        /// `event_error::*`; tokens are empty unless NONE.
        pub error: u32,
        /// Columns of the `top_*` lists per token (0 when the request asked for none).
        pub top_k: u32,
    }
    lists {
        /// Accepted tokens, in order: one for a plain decode, up to `1 + num_draft_tokens`
        /// with speculative decoding, none for a step that only computed KV.
        pub tokens: Vec<u32>,
        /// Logprob of each accepted token under the model's distribution.
        pub logprobs: Vec<f32>,
        /// `tokens.len() * top_k` ids, best first per token.
        pub top_ids: Vec<u32>,
        pub top_logprobs: Vec<f32>,
        /// Logprob of each of this step's input prompt tokens given the ones before it (the
        /// first prompt token has none), when the request asked for prompt logprobs.
        pub prompt_logprobs: Vec<f32>,
        /// `prompt_logprobs.len() * top_k` ids and logprobs, best first.
        pub prompt_top_ids: Vec<u32>,
        pub prompt_top_logprobs: Vec<f32>,
        /// 1-based rank of each prompt token in its scorer's distribution (1 + how many tokens
        /// have a strictly larger logprob), one per prompt logprob: vLLM reports it even for a
        /// token outside the top-k.
        pub prompt_ranks: Vec<u32>,
        /// The pooled vector of a `pooling` request (float32; an embedding, or a classifier's
        /// scores), on the event of the step that computed its prompt.
        pub pooled: Vec<f32>,
        /// Draft tokens the worker proposes to follow this event's last token (EAGLE-3: its
        /// draft head ran after the step); the scheduler verifies them in the request's next
        /// step. Empty without a worker-side drafter.
        pub draft_tokens: Vec<u32>,
    }
}

impl RequestEvent {
    /// The top logprobs of accepted token `i`, as (id, logprob) pairs.
    pub fn top(&self, i: usize) -> Vec<(u32, f32)> {
        let k = self.top_k as usize;
        let ids = self.top_ids.get(i * k..(i + 1) * k).unwrap_or(&[]);
        let lps = self.top_logprobs.get(i * k..(i + 1) * k).unwrap_or(&[]);
        ids.iter().copied().zip(lps.iter().copied()).collect()
    }

    /// The top logprobs of prompt logprob `i`, as (id, logprob) pairs.
    pub fn prompt_top(&self, i: usize) -> Vec<(u32, f32)> {
        let k = self.top_k as usize;
        let ids = self.prompt_top_ids.get(i * k..(i + 1) * k).unwrap_or(&[]);
        let lps = self
            .prompt_top_logprobs
            .get(i * k..(i + 1) * k)
            .unwrap_or(&[]);
        ids.iter().copied().zip(lps.iter().copied()).collect()
    }
}

section! {
    /// The worker's own timing, sent with a step's result: at most one row (none from a sender
    /// that measures nothing, e.g. a test's fake worker).
    pub struct StepTiming("timing") {
        /// Microseconds the GPU sat idle between the worker's steps since its previous result:
        /// from the end of one step's GPU work to the start of the next one's (CUDA events; host
        /// wall clock on the CPU). Saturates at u32::MAX (71 minutes).
        pub gpu_idle_us: u32,
        /// Microseconds this step ran: from when the GPU could start it (the previous step's
        /// work done) to the end of its own; 0 when not measured. What the scheduler learns
        /// step costs from (`Scheduler::observe_run_time`).
        pub gpu_busy_us: u32,
    }
    lists {}
}

section! {
    /// How a `WorkerOp` went, in the result of its plan (one row).
    pub struct OpOutcome("op_result") {
        pub ok: bool,
    }
    lists {
        /// What happened, or why it failed (UTF-8, at most `MAX_OP_TEXT` bytes).
        pub message: Vec<u8>,
    }
}

section! {
    /// PD decode server: a transfer whose KV has arrived at the worker group's first rank,
    /// reported once; its request waits outside the batch until then (`Scheduler::advance`).
    pub struct KvArrival("kv_arrived") {
        /// The transfer's room (`KvTransfer::Recv`), spelt as `CopyOp::key`.
        pub room: i64,
        /// Bytes received (this rank's share: its TP heads), and microseconds from its header
        /// to its last byte (saturates at u32::MAX); 0 from a sender that measures nothing.
        pub bytes: i64,
        pub transfer_us: u32,
    }
    lists {}
}

section! {
    /// PD: the transfer pair is down, so nothing more arrives (one row, in every result while
    /// it is): the requests waiting for their KV fail.
    pub struct KvPairDown("kv_down") {}
    lists {
        /// Why (UTF-8, at most `MAX_OP_TEXT` bytes).
        pub message: Vec<u8>,
    }
}

message! {
    /// What the worker sends back after a step.
    pub struct StepResult(magic = 0x5345_5254) {
        pub events: Vec<RequestEvent>,
        pub timing: Vec<StepTiming>,
        pub op_results: Vec<OpOutcome>,
        pub kv_arrived: Vec<KvArrival>,
        pub kv_down: Vec<KvPairDown>,
    }
}

impl StepResult {
    /// Bytes of the largest result within `l`.
    pub fn max_encoded_len(l: &StepLimits) -> usize {
        use crate::schema::Message;
        let r = l.max_running;
        let k = l.top_logprobs;
        // Tokens: one per slot, plus the accepted drafts, which are step input tokens.
        let (tokens, prompt) = (r + l.max_step_tokens, l.max_step_tokens);
        let counts = [
            r,
            tokens,
            tokens,
            tokens * k,
            tokens * k,
            prompt,
            prompt * k,
            prompt * k,
            prompt,           // prompt ranks
            r * l.pooled_dim, // pooled vectors: at most one per slot
            r * l.max_drafts, // proposed drafts: a chain per slot
            1,                // timing: one row
            1,
            MAX_OP_TEXT,                       // an op's outcome: one row
            if l.kv_transfer { r } else { 0 }, // arrivals: the worker reports r at most a step
            usize::from(l.kv_transfer),
            if l.kv_transfer { MAX_OP_TEXT } else { 0 }, // the pair down: one row
        ];
        <StepResult as Message>::max_encoded_len(&counts)
    }

    /// This step's run time on the worker's GPU, when it was measured.
    pub fn gpu_busy(&self) -> Option<std::time::Duration> {
        let us = self.timing.first()?.gpu_busy_us;
        (us > 0).then(|| std::time::Duration::from_micros(u64::from(us)))
    }

    /// Microseconds the worker's GPU sat idle between steps since its previous result (0 when
    /// the result carries no timing).
    pub fn gpu_idle_us(&self) -> u64 {
        self.timing.iter().map(|t| u64::from(t.gpu_idle_us)).sum()
    }
}
