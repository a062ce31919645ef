//! The engine's pure logic: who owns which KV page, what is cached, what runs next.
//! Nothing here does I/O, reads a clock or spawns a thread: the engine thread in
//! `tokenspeed-server` drives it, and the tests drive it with synthetic token ids.

pub mod pages;
pub mod plan;
pub mod radix;
pub mod scheduler;
pub mod schema;

pub use pages::{PagePool, Pages};
pub use plan::{
    copy_kind, grammar_kind, op_kind, CopyOp, FinishedSlot, GrammarRow, KvArrival, KvPairDown,
    LoraPin, OpOutcome, PageTableUpdate, Plan, RequestEvent, SamplingParams, ScheduledRequest,
    StepLimits, StepResult, StepTiming, TokenMask, WorkerOp, LAST_SAMPLED, MAX_GRAMMAR_REPLAY,
    MAX_GRAMMAR_STOP_IDS, MAX_GRAMMAR_TEXT, MAX_LOGIT_BIAS, MAX_LORA_PATH, MAX_LORA_PINS,
    MAX_OP_TEXT, NO_SEED,
};
pub use radix::{
    block_hash, EvictionPolicy, HostStats, KvEvent, NodeId, PrefixMatch, RadixCache, StorageStats,
    WritePolicy,
};
pub use scheduler::{
    kv_transfer_len, ConfigError, FinishReason, Finished, KvTransfer, KvTransferStats, Request,
    RequestId, RequestOutput, SchedulePolicy, Scheduler, SchedulerConfig, SchedulerStats,
    SubmitError,
};
pub use schema::Message;
