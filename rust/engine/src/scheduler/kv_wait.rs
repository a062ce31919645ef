//! A PD decode server's requests waiting for their prompt's KV (`KvTransfer::Recv`).
//!
//! SGLang's router sends a request to the prefill and the decode server at once, so the
//! decode server may hold it long before the prefill server's KV arrives. Such a request waits
//! *parked*: not in the admission queue, no slot and no pages, while other requests keep
//! stepping. The worker reports each transfer that arrived (`StepResult::kv_arrived`); its
//! request then joins the queue and receives the KV at admission without waiting. A room
//! that arrives before its request (our own router sends to the decode server only after the
//! prefill) is remembered until the request comes. A pair that went down
//! (`StepResult::kv_down`) fails every parked request; one whose KV never comes is failed by
//! the engine after its own deadline (the scheduler reads no clock).

use std::collections::VecDeque;

use super::{admission::received_room, FinishReason, RequestId, RequestOutput, Scheduler};
use crate::plan::{Plan, StepResult};

/// Rooms that arrived before their request, remembered at most (oldest forgotten first): a
/// request that never comes (its client went away first) must not grow the set forever.
const ARRIVED_KEEP: usize = 4096;

#[derive(Default)]
pub(super) struct KvWait {
    /// (room, request) of each parked request, in arrival order.
    parked: Vec<(u64, RequestId)>,
    /// Rooms reported before their request was submitted, oldest first.
    arrived: VecDeque<u64>,
}

impl Scheduler {
    /// Queues newly submitted request `id`, or parks it until its KV transfer arrives.
    pub(super) fn enqueue(&mut self, id: RequestId) {
        // A prompt within one page sends nothing: nothing to wait for.
        let seq = self.requests.get(&id);
        let room = seq
            .filter(|s| self.received_len(s) > 0)
            .and_then(received_room);
        match room {
            Some(room) if !self.kv_wait.take_arrived(room) => {
                self.kv_wait.parked.push((room, id));
            }
            _ => self.waiting.push_back(id),
        }
    }

    /// Applies a result's transfer reports: arrived rooms release their parked requests into
    /// the queue (in arrival order) and count in the stats (`KvTransferStats::arrived_*`), and
    /// a pair that is down fails every parked request.
    pub(super) fn note_kv(&mut self, result: &StepResult) -> Vec<RequestOutput> {
        for arrival in &result.kv_arrived {
            let t = &mut self.transfers;
            t.arrived_requests += 1;
            t.arrived_bytes += arrival.bytes.max(0) as u64;
            t.arrived_us += u64::from(arrival.transfer_us);
            let room = arrival.room as u64;
            let kv = &mut self.kv_wait;
            match kv.parked.iter().position(|&(r, _)| r == room) {
                Some(i) => {
                    let (_, id) = kv.parked.remove(i);
                    self.waiting.push_back(id);
                }
                None => {
                    if kv.arrived.len() == ARRIVED_KEEP {
                        kv.arrived.pop_front();
                    }
                    kv.arrived.push_back(room);
                }
            }
        }
        let Some(down) = result.kv_down.first() else {
            return Vec::new();
        };
        let why = String::from_utf8_lossy(&down.message).into_owned();
        let parked = std::mem::take(&mut self.kv_wait.parked);
        parked
            .into_iter()
            .filter_map(|(room, id)| {
                let message =
                    format!("KV transfer {room:#x} cannot arrive: the pair is down ({why})");
                self.fail_waiting(id, message)
            })
            .collect()
    }

    /// Ends a request that never ran with an error: its one (and last) output.
    pub fn fail_waiting(&mut self, id: RequestId, message: String) -> Option<RequestOutput> {
        let prompt_tokens = self.requests.get(&id)?.req.prompt.len() as u32;
        self.finish(id, FinishReason::Error)?;
        Some(RequestOutput {
            id,
            tokens: Vec::new(),
            logprobs: Vec::new(),
            top_logprobs: Vec::new(),
            prompt_logprobs: Vec::new(),
            prompt_top_logprobs: Vec::new(),
            prompt_ranks: Vec::new(),
            pooled: Vec::new(),
            finished: Some(FinishReason::Error),
            error: Some(message),
            prompt_tokens,
            cached_tokens: 0,
            completion_tokens: 0,
            preemptions: 0,
        })
    }

    /// Forgets a parked request that ended (`finish`).
    pub(super) fn unpark(&mut self, id: RequestId) {
        self.kv_wait.parked.retain(|&(_, r)| r != id);
    }

    /// The requests parked until their KV arrives (the engine fails those past its deadline).
    pub fn awaiting_kv(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.kv_wait.parked.iter().map(|&(_, id)| id)
    }

    /// A plan that runs nothing, for an engine with only parked requests and nothing in
    /// flight: its result carries the transfers that arrived meanwhile. None otherwise.
    pub fn poll_kv(&mut self) -> Option<Plan> {
        if self.kv_wait.parked.is_empty() || !self.in_flight.is_empty() {
            return None;
        }
        let step = super::StepBuilder {
            poll: true,
            ..Default::default()
        };
        self.seal(step, super::step_cost::StepShape::default())
    }
}

impl KvWait {
    /// Whether `room` arrived already (and forgets it: its request takes it now).
    fn take_arrived(&mut self, room: u64) -> bool {
        let at = self.arrived.iter().position(|&r| r == room);
        at.map(|i| self.arrived.remove(i)).is_some()
    }

    pub(super) fn parked(&self) -> usize {
        self.parked.len()
    }
}
