//! The engine's pure logic: who owns which KV page, what is cached, what runs next.
//! Nothing here does I/O, reads a clock or spawns a thread: the engine thread in
//! `tokenspeed-server` drives it, and the tests drive it with synthetic token ids.

pub mod pages;
pub mod plan;
pub mod radix;
pub mod scheduler;

pub use pages::{PagePool, Pages};
pub use plan::{
    NewRequestPlan, PageTableUpdate, Plan, SampledToken, SamplingParams, ScheduledRequest,
    StepResult, LAST_SAMPLED,
};
pub use radix::{NodeId, PrefixMatch, RadixCache};
pub use scheduler::{
    ConfigError, FinishReason, Request, RequestOutput, SchedulePolicy, Scheduler, SchedulerConfig,
    SchedulerStats, SubmitError,
};
