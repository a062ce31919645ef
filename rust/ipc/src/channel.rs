//! The two ends of a replica's channel: `PlanChannel` (server) and `WorkerChannel` (a rank).
//!
//! One segment holds a segment header, the plan ring (server → every rank) and the result
//! ring (rank 0 → server). The server creates it, the ranks attach by name and rank.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokenspeed_engine::{Message, Plan, StepResult};

use crate::codec;
use crate::ring::{Ring, RingReader, RingWriter, MAX_READERS, RING_HEADER_LEN};
use crate::shm::{my_pid, pid_alive, Segment};
use crate::IpcError;

/// "TSPDCHAN" — marks an initialised tokenspeed channel segment.
const MAGIC: u64 = 0x4e41_4843_4450_5354;
/// Bumped on any change of the segment, ring or payload layout.
pub const LAYOUT_VERSION: u32 = 2;

#[repr(C, align(64))]
struct SegHeader {
    /// Stored last (Release) by the creator: attachers check it with Acquire.
    magic: AtomicU64,
    version: u32,
    creator_pid: i32,
    total_len: u64,
    plan_ring_off: u64,
    result_ring_off: u64,
    shutdown: AtomicU32,
}

fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

fn seg_header(seg: &Segment) -> &SegHeader {
    // SAFETY: every segment is at least a SegHeader long (checked in create/attach before
    // this is called), and the mapping is page-aligned.
    unsafe { &*(seg.base() as *const SegHeader) }
}

/// Sets the shutdown flag and wakes every waiter of both rings.
fn shutdown_rings(seg: &Segment, rings: [&Ring; 2]) {
    seg_header(seg).shutdown.store(1, Ordering::Release);
    for r in rings {
        r.wake_all();
    }
}

/// The server's end: writes plans to every rank, reads results from rank 0.
/// Dropping it shuts the channel down (waking and failing every waiter) and unlinks it.
pub struct PlanChannel {
    seg: Arc<Segment>,
    plans: RingWriter,
    results: RingReader,
}

impl PlanChannel {
    /// Creates the segment `name` (replacing a stale one): `slots` slots of `slot_bytes`
    /// (rounded up to 64) in each direction, read by `n_readers` ranks.
    pub fn create(
        name: &str,
        slots: u32,
        slot_bytes: u32,
        n_readers: u32,
    ) -> Result<PlanChannel, IpcError> {
        if slots == 0 || slot_bytes == 0 || slot_bytes > u32::MAX - 64 {
            return Err(IpcError::InvalidConfig(format!(
                "{slots} slots of {slot_bytes} bytes"
            )));
        }
        if n_readers == 0 || n_readers as usize > MAX_READERS {
            return Err(IpcError::InvalidConfig(format!(
                "{n_readers} readers (1..={MAX_READERS})"
            )));
        }
        let slot_bytes = round_up(slot_bytes as usize, 64) as u32;
        let plan_hdr = round_up(std::mem::size_of::<SegHeader>(), 64);
        let result_hdr = round_up(plan_hdr + RING_HEADER_LEN, 64);
        let plan_slots = round_up(result_hdr + RING_HEADER_LEN, 4096);
        let ring_len = crate::ring::slots_len(slots, slot_bytes)
            .filter(|&l| l <= (1usize << 40))
            .ok_or_else(|| IpcError::InvalidConfig("ring too large".into()))?;
        let result_slots = round_up(plan_slots + ring_len, 4096);
        let total = result_slots + ring_len;

        let seg = Segment::create(name, total)?;
        Ring::init(&seg, plan_hdr, plan_slots, slots, slot_bytes, n_readers);
        Ring::init(&seg, result_hdr, result_slots, slots, slot_bytes, 1);
        // SAFETY: the segment is `total` >= size_of::<SegHeader>() bytes, zero-filled and not
        // yet published (magic is 0), so we are its only user.
        let hdr = unsafe { &mut *(seg.base() as *mut SegHeader) };
        hdr.version = LAYOUT_VERSION;
        hdr.creator_pid = my_pid();
        hdr.total_len = total as u64;
        hdr.plan_ring_off = plan_hdr as u64;
        hdr.result_ring_off = result_hdr as u64;
        hdr.magic.store(MAGIC, Ordering::Release);

        let seg = Arc::new(seg);
        let shutdown = &seg_header(&seg).shutdown as *const AtomicU32;
        let plans = RingWriter::new(Ring::open(seg.clone(), plan_hdr, shutdown)?);
        let results = Ring::open(seg.clone(), result_hdr, shutdown)?;
        results.header().reader_pid[0].store(my_pid(), Ordering::Release);
        let results = RingReader::new(results, 0);
        Ok(PlanChannel {
            seg,
            plans,
            results,
        })
    }

    /// The segment's name (with its leading `/`).
    pub fn name(&self) -> &str {
        self.seg.name()
    }

    pub fn n_readers(&self) -> u32 {
        self.plans.ring().n_readers()
    }

    /// Payload capacity of one slot, in bytes.
    pub fn slot_bytes(&self) -> usize {
        self.plans.ring().slot_bytes()
    }

    /// Broadcasts `plan` to every rank. Blocks while the ring is full (some rank has not
    /// released the oldest slot); Err(Timeout) after `timeout`, Err(TooLarge) at once if
    /// the plan does not fit a slot, Err(Shutdown) once shut down.
    pub fn send_plan(&mut self, plan: &Plan, timeout: Option<Duration>) -> Result<(), IpcError> {
        let need = plan.encoded_len();
        self.plans
            .send_with(need, timeout, |buf| codec::encode(plan, buf))
    }

    /// The next result from rank 0, or None after `timeout`.
    pub fn recv_result(
        &mut self,
        timeout: Option<Duration>,
    ) -> Result<Option<StepResult>, IpcError> {
        let Some(payload) = self.results.recv(timeout)? else {
            return Ok(None);
        };
        let result = codec::decode::<StepResult>(payload);
        self.results.release();
        result.map(Some)
    }

    /// Whether rank `rank` is attached and its process alive.
    pub fn reader_alive(&self, rank: u32) -> bool {
        (rank as usize) < MAX_READERS
            && pid_alive(
                self.plans.ring().header().reader_pid[rank as usize].load(Ordering::Acquire),
            )
    }

    /// Fails every current and future wait on both ends with `IpcError::Shutdown`.
    pub fn shutdown(&self) {
        shutdown_rings(&self.seg, [self.plans.ring(), self.results.ring()]);
    }

    /// A handle that can shut the channel down from another thread.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle {
            seg: self.seg.clone(),
        }
    }
}

impl Drop for PlanChannel {
    fn drop(&mut self) {
        self.shutdown();
        // The Segment (last Arc) unlinks the name.
    }
}

/// Shuts a channel down from any thread (see `PlanChannel::shutdown`).
#[derive(Clone)]
pub struct ShutdownHandle {
    seg: Arc<Segment>,
}

impl ShutdownHandle {
    pub fn shutdown(&self) {
        let h = seg_header(&self.seg);
        let shutdown = &h.shutdown as *const AtomicU32;
        let (p, r) = (h.plan_ring_off as usize, h.result_ring_off as usize);
        if let (Ok(p), Ok(r)) = (
            Ring::open(self.seg.clone(), p, shutdown),
            Ring::open(self.seg.clone(), r, shutdown),
        ) {
            shutdown_rings(&self.seg, [&p, &r]);
        }
    }
}

/// A worker rank's end: reads every plan; rank 0 also writes results.
pub struct WorkerChannel {
    seg: Arc<Segment>,
    rank: u32,
    plans: RingReader,
    results: Option<RingWriter>,
}

impl WorkerChannel {
    /// Attaches to the segment `name` as `rank`. Err(NotFound)/Err(NotReady) when the
    /// server has not created it yet (or it was left by a dead server): see `attach_wait`.
    pub fn attach(name: &str, rank: u32) -> Result<WorkerChannel, IpcError> {
        let seg = Segment::open(name)?;
        if seg.len() < std::mem::size_of::<SegHeader>() {
            return Err(IpcError::NotReady(name.to_string()));
        }
        let h = seg_header(&seg);
        let magic = h.magic.load(Ordering::Acquire);
        if magic == 0 || !pid_alive(h.creator_pid) {
            return Err(IpcError::NotReady(name.to_string()));
        }
        if magic != MAGIC || h.version != LAYOUT_VERSION || h.total_len as usize != seg.len() {
            return Err(IpcError::BadHeader {
                name: name.to_string(),
                magic,
                version: h.version,
            });
        }
        let (p_off, r_off) = (h.plan_ring_off as usize, h.result_ring_off as usize);
        let seg = Arc::new(seg);
        let shutdown = &seg_header(&seg).shutdown as *const AtomicU32;
        let plans = Ring::open(seg.clone(), p_off, shutdown)?;
        let n_readers = plans.n_readers();
        if rank >= n_readers {
            return Err(IpcError::BadRank { rank, n_readers });
        }
        let me = my_pid();
        let slot = &plans.header().reader_pid[rank as usize];
        let prev = slot.load(Ordering::Acquire);
        if prev != 0 && prev != me && pid_alive(prev) {
            return Err(IpcError::RankTaken { rank, pid: prev });
        }
        if slot
            .compare_exchange(prev, me, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            let pid = slot.load(Ordering::Acquire);
            return Err(IpcError::RankTaken { rank, pid });
        }
        let results = if rank == 0 {
            Some(RingWriter::new(Ring::open(seg.clone(), r_off, shutdown)?))
        } else {
            None
        };
        Ok(WorkerChannel {
            seg,
            rank,
            plans: RingReader::new(plans, rank),
            results,
        })
    }

    /// `attach`, retrying while the segment is missing or not ready, for up to `timeout`.
    pub fn attach_wait(
        name: &str,
        rank: u32,
        timeout: Duration,
    ) -> Result<WorkerChannel, IpcError> {
        let deadline = Instant::now() + timeout;
        loop {
            match Self::attach(name, rank) {
                Err(IpcError::NotFound(_) | IpcError::NotReady(_)) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                other => return other,
            }
        }
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Releases the previously received plan, then waits for the next one; None after
    /// `timeout`. The payload stays valid until the next `recv_raw`/`recv_plan`/`release`.
    pub fn recv_raw(&mut self, timeout: Option<Duration>) -> Result<Option<&[u8]>, IpcError> {
        self.plans.recv(timeout)
    }

    /// The payload of the plan currently held (after `recv_raw`), if any.
    pub fn held(&self) -> Option<&[u8]> {
        self.plans.held()
    }

    /// Receives and decodes the next plan (a copy); the slot is released at once.
    pub fn recv_plan(&mut self, timeout: Option<Duration>) -> Result<Option<Plan>, IpcError> {
        let Some(payload) = self.plans.recv(timeout)? else {
            return Ok(None);
        };
        let plan = codec::decode::<Plan>(payload);
        self.plans.release();
        plan.map(Some)
    }

    /// Hands the held plan slot back to the server.
    pub fn release(&mut self) {
        self.plans.release();
    }

    fn result_writer(&mut self) -> Result<&mut RingWriter, IpcError> {
        let rank = self.rank;
        self.results.as_mut().ok_or(IpcError::NotRankZero(rank))
    }

    /// Sends a step result (rank 0 only); blocks while the result ring is full.
    pub fn send_result(
        &mut self,
        r: &StepResult,
        timeout: Option<Duration>,
    ) -> Result<(), IpcError> {
        let need = r.encoded_len();
        self.result_writer()?
            .send_with(need, timeout, |buf| codec::encode(r, buf))
    }

    /// Sends a step result given as raw little-endian arrays by schema name (rank 0 only):
    /// what the Python worker has from numpy. See `Message::encode_arrays`.
    pub fn send_result_arrays<'a>(
        &mut self,
        step_id: u64,
        get: impl Fn(&str) -> Option<&'a [u8]>,
        timeout: Option<Duration>,
    ) -> Result<(), IpcError> {
        let writer = self.result_writer()?;
        let cap = writer.ring().slot_bytes();
        writer.send_with(cap, timeout, |buf| {
            codec::encode_arrays::<StepResult>(step_id, get, buf)
        })
    }

    /// Whether the server that created the segment is still alive.
    pub fn server_alive(&self) -> bool {
        self.status().server_alive()
    }

    pub fn is_shutdown(&self) -> bool {
        self.status().is_shutdown()
    }

    /// Keeps this process's mapping of the segment alive until the process exits, even after
    /// the channel is dropped: for zero-copy views (numpy) that may outlive the channel.
    pub fn keep_mapped_forever(&self) {
        std::mem::forget(self.seg.clone());
    }

    /// A lock-free handle to ask about the server and shutdown from any thread.
    pub fn status(&self) -> ChannelStatus {
        ChannelStatus {
            seg: self.seg.clone(),
        }
    }
}

/// Server liveness and the shutdown flag, readable from any thread (see `WorkerChannel::status`).
#[derive(Clone)]
pub struct ChannelStatus {
    seg: Arc<Segment>,
}

impl ChannelStatus {
    pub fn server_alive(&self) -> bool {
        pid_alive(seg_header(&self.seg).creator_pid)
    }

    pub fn is_shutdown(&self) -> bool {
        seg_header(&self.seg).shutdown.load(Ordering::Acquire) != 0
    }
}

impl Drop for WorkerChannel {
    fn drop(&mut self) {
        let slot = &self.plans.ring().header().reader_pid[self.rank as usize];
        let _ = slot.compare_exchange(my_pid(), 0, Ordering::AcqRel, Ordering::Relaxed);
    }
}
