//! Shared-memory channel between the engine thread (server) and the worker ranks: a plan ring
//! (one writer, every rank reads every plan) and a result ring (rank 0 → server), futex wake-up.
//!
//! ```no_run
//! # use std::time::Duration;
//! # use tokenspeed_ipc::{PlanChannel, WorkerChannel};
//! let mut server = PlanChannel::create("tokenspeed-demo", 8, 1 << 20, 1)?;
//! let mut worker = WorkerChannel::attach("tokenspeed-demo", 0)?;
//! server.send_plan(&Default::default(), None)?;
//! let plan = worker.recv_plan(Some(Duration::from_secs(1)))?;
//! # Ok::<(), tokenspeed_ipc::IpcError>(())
//! ```

mod channel;
pub mod codec;
mod ring;
mod shm;

pub use channel::{ChannelStatus, PlanChannel, ShutdownHandle, WorkerChannel, LAYOUT_VERSION};
pub use codec::{ArrayDesc, DType, Layout};
pub use ring::MAX_READERS;

/// Everything that can go wrong on a channel.
#[derive(Debug, thiserror::Error)]
pub enum IpcError {
    #[error("invalid shm name {0:?} (one path component, at most 254 bytes)")]
    InvalidName(String),
    #[error("invalid channel config: {0}")]
    InvalidConfig(String),
    #[error("{op} failed for shm segment {name:?}: {source}")]
    Os {
        op: &'static str,
        name: String,
        source: std::io::Error,
    },
    #[error("shm segment {0:?} does not exist (yet)")]
    NotFound(String),
    #[error("shm segment {0:?} is not ready (being created, or left by a dead server)")]
    NotReady(String),
    #[error("shm segment {name:?} is not a channel of layout v{LAYOUT_VERSION} (magic {magic:#x}, version {version})")]
    BadHeader {
        name: String,
        magic: u64,
        version: u32,
    },
    #[error("rank {rank} out of range: the channel has {n_readers} readers")]
    BadRank { rank: u32, n_readers: u32 },
    #[error("rank {rank} is already attached by live process {pid}")]
    RankTaken { rank: u32, pid: i32 },
    #[error("only rank 0 sends results (this is rank {0})")]
    NotRankZero(u32),
    #[error("message of {need} bytes does not fit a slot of {cap} bytes")]
    TooLarge { need: usize, cap: usize },
    #[error("malformed result arrays: {0}")]
    BadResult(String),
    #[error("timed out waiting for a free slot")]
    Timeout,
    #[error("channel shut down")]
    Shutdown,
    #[error("corrupt channel data: {0}")]
    Corrupt(String),
}
