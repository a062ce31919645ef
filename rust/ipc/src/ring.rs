//! One single-writer, N-reader broadcast ring of fixed-size slots inside a shared segment.
//!
//! Message `k` (0-based) lives in slot `k % n_slots`. The writer fills the payload, then
//! stores the slot's `seq = k + 1` (Release); a reader waits for `seq == k + 1` (Acquire).
//! Reader `r` stores `consumed[r] = k + 1` (Release) when it lets go of message `k`; the
//! writer reuses a slot only once every reader has consumed the message that was in it.
//! Waiting: a short spin, then a futex wait on a counter the other side bumps.

use std::sync::atomic::{fence, AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::shm::{futex_wait, futex_wake_all, Segment};
use crate::IpcError;

/// Most readers (ranks) one ring supports.
pub const MAX_READERS: usize = 64;
/// Bytes before each slot's payload (the sequence number and length); keeps payloads 64-aligned.
pub(crate) const SLOT_HEADER: usize = 64;
/// Spin iterations before sleeping on the futex.
const SPIN: u32 = 2000;

#[repr(C, align(64))]
pub(crate) struct Padded64(pub AtomicU64);

#[repr(C, align(64))]
pub(crate) struct RingHeader {
    n_slots: u32,
    slot_bytes: u32,
    stride: u32,
    n_readers: u32,
    slots_off: u64,
    // Writer side: number of published messages, and the "data available" futex.
    head: Padded64,
    data_futex: AtomicU32,
    data_waiters: AtomicU32,
    _pad1: [u8; 56],
    // Reader side: the "space available" futex.
    space_futex: AtomicU32,
    space_waiters: AtomicU32,
    _pad2: [u8; 56],
    consumed: [Padded64; MAX_READERS],
    pub(crate) reader_pid: [AtomicI32; MAX_READERS],
}

#[repr(C, align(64))]
struct SlotHeader {
    seq: AtomicU64,
    len: AtomicU32,
}

/// Bytes taken by a ring's slots (header not included).
pub(crate) fn slots_len(n_slots: u32, slot_bytes: u32) -> Option<usize> {
    (SLOT_HEADER + slot_bytes as usize).checked_mul(n_slots as usize)
}

pub(crate) const RING_HEADER_LEN: usize = std::mem::size_of::<RingHeader>();

/// A process-local view of one ring in a mapped segment.
pub(crate) struct Ring {
    /// Keeps the mapping alive as long as the pointers below are used.
    _seg: Arc<Segment>,
    hdr: *const RingHeader,
    slots: *mut u8,
    shutdown: *const AtomicU32,
    n_slots: u32,
    slot_bytes: u32,
    stride: usize,
    n_readers: u32,
}

// SAFETY: the pointers target the mapping owned (via Arc) by `_seg`, which outlives the Ring;
// all cross-thread access is through atomics or protocol-exclusive slots.
unsafe impl Send for Ring {}

impl Ring {
    /// Writes a fresh header at `hdr_off` (segment still private to its creator, zero-filled).
    pub(crate) fn init(
        seg: &Segment,
        hdr_off: usize,
        slots_off: usize,
        n_slots: u32,
        slot_bytes: u32,
        n_readers: u32,
    ) {
        assert!(hdr_off + RING_HEADER_LEN <= seg.len() && hdr_off.is_multiple_of(64));
        // SAFETY: in bounds and 64-aligned (checked above; the mapping is page-aligned). No
        // other process has seen the segment yet (the magic is published after this), and the
        // zero-filled memory is a valid RingHeader (all integers and atomics).
        let hdr = unsafe { &mut *(seg.base().add(hdr_off) as *mut RingHeader) };
        hdr.n_slots = n_slots;
        hdr.slot_bytes = slot_bytes;
        hdr.stride = (SLOT_HEADER + slot_bytes as usize) as u32;
        hdr.n_readers = n_readers;
        hdr.slots_off = slots_off as u64;
    }

    /// Checks the header at `hdr_off` against the mapping and builds a view of it.
    pub(crate) fn open(
        seg: Arc<Segment>,
        hdr_off: usize,
        shutdown: *const AtomicU32,
    ) -> Result<Ring, IpcError> {
        let bad = |what: &str| IpcError::Corrupt(format!("ring header at {hdr_off}: {what}"));
        if !hdr_off.is_multiple_of(64) || hdr_off + RING_HEADER_LEN > seg.len() {
            return Err(bad("out of bounds"));
        }
        // SAFETY: in bounds and aligned (checked above); the header was initialised before
        // the segment's magic was published (the caller checked the magic with Acquire).
        let hdr = unsafe { &*(seg.base().add(hdr_off) as *const RingHeader) };
        let (n_slots, slot_bytes, n_readers) = (hdr.n_slots, hdr.slot_bytes, hdr.n_readers);
        let stride = hdr.stride as usize;
        let slots_off = hdr.slots_off as usize;
        if n_slots == 0 || n_readers == 0 || n_readers as usize > MAX_READERS {
            return Err(bad("slot or reader count"));
        }
        if stride != SLOT_HEADER + slot_bytes as usize
            || !stride.is_multiple_of(64)
            || !slots_off.is_multiple_of(64)
        {
            return Err(bad("slot stride"));
        }
        match slots_len(n_slots, slot_bytes).and_then(|l| l.checked_add(slots_off)) {
            Some(end) if end <= seg.len() => {}
            _ => return Err(bad("slots out of bounds")),
        }
        // SAFETY: `slots_off` is within the mapping (checked above).
        let slots = unsafe { seg.base().add(slots_off) };
        Ok(Ring {
            _seg: seg,
            hdr,
            slots,
            shutdown,
            n_slots,
            slot_bytes,
            stride,
            n_readers,
        })
    }

    pub(crate) fn header(&self) -> &RingHeader {
        // SAFETY: validated in `open`; the mapping lives as long as `self._seg`.
        unsafe { &*self.hdr }
    }

    pub(crate) fn slot_bytes(&self) -> usize {
        self.slot_bytes as usize
    }

    pub(crate) fn n_readers(&self) -> u32 {
        self.n_readers
    }

    fn is_shutdown(&self) -> bool {
        // SAFETY: points into the segment header of the same mapping, kept alive by `_seg`.
        unsafe { &*self.shutdown }.load(Ordering::Acquire) != 0
    }

    fn slot(&self, k: u64) -> (&SlotHeader, *mut u8) {
        let i = (k % self.n_slots as u64) as usize;
        // SAFETY: `i < n_slots`, so the slot lies within the bounds checked in `open`; slots
        // are 64-aligned (stride and offset are multiples of 64).
        unsafe {
            let base = self.slots.add(i * self.stride);
            (&*(base as *const SlotHeader), base.add(SLOT_HEADER))
        }
    }

    /// Wakes every waiter of this ring (used on shutdown).
    pub(crate) fn wake_all(&self) {
        let h = self.header();
        h.data_futex.fetch_add(1, Ordering::SeqCst);
        h.space_futex.fetch_add(1, Ordering::SeqCst);
        futex_wake_all(&h.data_futex);
        futex_wake_all(&h.space_futex);
    }

    /// Waits until `ready()`; Ok(false) on timeout, Err(Shutdown) once the flag is set and
    /// the condition is not met (so readers drain what was published before the shutdown).
    fn wait(
        &self,
        futex: &AtomicU32,
        waiters: &AtomicU32,
        timeout: Option<Duration>,
        ready: impl Fn() -> bool,
    ) -> Result<bool, IpcError> {
        for _ in 0..SPIN {
            if ready() {
                return Ok(true);
            }
            if self.is_shutdown() {
                return Err(IpcError::Shutdown);
            }
            std::hint::spin_loop();
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let seen = futex.load(Ordering::SeqCst);
            if ready() {
                return Ok(true);
            }
            if self.is_shutdown() {
                return Err(IpcError::Shutdown);
            }
            let left = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => Some(left),
                    _ => return Ok(false),
                },
                None => None,
            };
            waiters.fetch_add(1, Ordering::SeqCst);
            // A signal after `seen` was read changed the futex word: the wait returns at once.
            futex_wait(futex, seen, left);
            waiters.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn signal(futex: &AtomicU32, waiters: &AtomicU32) {
        futex.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if waiters.load(Ordering::SeqCst) > 0 {
            futex_wake_all(futex);
        }
    }
}

/// The single writer of a ring.
pub(crate) struct RingWriter {
    ring: Ring,
    next: u64,
}

impl RingWriter {
    pub(crate) fn new(ring: Ring) -> RingWriter {
        let next = ring.header().head.0.load(Ordering::Acquire);
        RingWriter { ring, next }
    }

    pub(crate) fn ring(&self) -> &Ring {
        &self.ring
    }

    fn has_space(&self) -> bool {
        let h = self.ring.header();
        let oldest = (0..self.ring.n_readers as usize)
            .map(|r| h.consumed[r].0.load(Ordering::Acquire))
            .min()
            .unwrap_or(self.next);
        self.next < oldest + self.ring.n_slots as u64
    }

    /// Waits for a free slot, lets `fill` write at most `need` bytes into it, publishes.
    /// `fill` returns the bytes written. Err(TooLarge) before waiting when `need` > slot size.
    pub(crate) fn send_with(
        &mut self,
        need: usize,
        timeout: Option<Duration>,
        fill: impl FnOnce(&mut [u8]) -> Result<usize, IpcError>,
    ) -> Result<(), IpcError> {
        if need > self.ring.slot_bytes() {
            return Err(IpcError::TooLarge {
                need,
                cap: self.ring.slot_bytes(),
            });
        }
        if self.ring.is_shutdown() {
            return Err(IpcError::Shutdown);
        }
        let h = self.ring.header();
        if !self
            .ring
            .wait(&h.space_futex, &h.space_waiters, timeout, || {
                self.has_space()
            })?
        {
            return Err(IpcError::Timeout);
        }
        let (slot, payload) = self.ring.slot(self.next);
        // SAFETY: every reader has consumed the previous occupant of this slot (has_space,
        // Acquire), and no reader touches it before we publish `seq` below: we own it.
        let buf = unsafe { std::slice::from_raw_parts_mut(payload, need) };
        let len = fill(buf)?;
        debug_assert!(len <= need);
        slot.len.store(len as u32, Ordering::Relaxed);
        slot.seq.store(self.next + 1, Ordering::Release);
        self.next += 1;
        h.head.0.store(self.next, Ordering::Release);
        Ring::signal(&h.data_futex, &h.data_waiters);
        Ok(())
    }
}

/// One reader (rank) of a ring.
pub(crate) struct RingReader {
    ring: Ring,
    rank: usize,
    next: u64,
    holding: bool,
}

impl RingReader {
    pub(crate) fn new(ring: Ring, rank: u32) -> RingReader {
        let rank = rank as usize;
        let next = ring.header().consumed[rank].0.load(Ordering::Acquire);
        RingReader {
            ring,
            rank,
            next,
            holding: false,
        }
    }

    pub(crate) fn ring(&self) -> &Ring {
        &self.ring
    }

    /// Hands the held slot (if any) back to the writer.
    pub(crate) fn release(&mut self) {
        if !self.holding {
            return;
        }
        self.holding = false;
        self.next += 1;
        let h = self.ring.header();
        h.consumed[self.rank].0.store(self.next, Ordering::Release);
        Ring::signal(&h.space_futex, &h.space_waiters);
    }

    /// Releases the held slot, then waits for the next message; None on timeout.
    /// The payload stays valid (and the slot reserved) until the next `recv`/`release`.
    pub(crate) fn recv(&mut self, timeout: Option<Duration>) -> Result<Option<&[u8]>, IpcError> {
        self.release();
        let (slot, payload) = self.ring.slot(self.next);
        let want = self.next + 1;
        let h = self.ring.header();
        let ready = || slot.seq.load(Ordering::Acquire) == want;
        if !self
            .ring
            .wait(&h.data_futex, &h.data_waiters, timeout, ready)?
        {
            return Ok(None);
        }
        let len = slot.len.load(Ordering::Relaxed) as usize;
        if len > self.ring.slot_bytes() {
            return Err(IpcError::Corrupt(format!("slot length {len} > slot size")));
        }
        self.holding = true;
        // SAFETY: `seq == want` (Acquire) means the writer finished this payload and will not
        // touch the slot again until we store `consumed` in `release`; `len` is in bounds.
        Ok(Some(unsafe { std::slice::from_raw_parts(payload, len) }))
    }

    /// The payload currently held (after a successful `recv`), if any.
    pub(crate) fn held(&self) -> Option<&[u8]> {
        if !self.holding {
            return None;
        }
        let (slot, payload) = self.ring.slot(self.next);
        let len = (slot.len.load(Ordering::Relaxed) as usize).min(self.ring.slot_bytes());
        // SAFETY: as in `recv`: we hold this slot until `release`.
        Some(unsafe { std::slice::from_raw_parts(payload, len) })
    }
}
