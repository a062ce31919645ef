//! Priority preemption: with `enable_priority_scheduling`, the most urgent waiting request that
//! cannot be admitted (no slot, or its pages do not fit beside the running requests') may
//! retract running requests it outranks by more than
//! `priority_scheduling_preemption_threshold` (SGLang's rule). Victims go least urgent first,
//! the latest admitted first within a priority, one at a time until the request fits; they are
//! retracted like any other (`retract`: their KV goes to the prefix cache, they wait with the
//! tokens they generated and resume from them). None is, unless retracting every eligible one
//! could make room.
//!
//! It runs at the start of `schedule()`, before any running request is put in the step, so a
//! victim is never both in the plan and retracted; admission then finds the slot and pages.
//!
//! Also the queue's: when the engine finds the queue full (`--max-queued-requests`), a more
//! urgent newcomer displaces the least urgent waiting request (`displace_for`).

use std::collections::HashSet;

use super::{FinishReason, Finished, Request, RequestId, Scheduler};

impl Scheduler {
    /// Makes room in a full queue for `newcomer` (SGLang's rule for `--max-queued-requests`
    /// under priority scheduling): the least urgent waiting request leaves the scheduler, ended
    /// as an abort with its resources freed, if `newcomer` is strictly more urgent; among
    /// equals the latest arrival goes (retracted requests wait at the queue's front, so they go
    /// last). Returns the record of the one removed; None without priority scheduling, with
    /// nothing waiting, or when the newcomer does not outrank it: the caller refuses the
    /// newcomer instead.
    pub fn displace_for(&mut self, newcomer: &Request) -> Option<Finished> {
        if !self.config.enable_priority_scheduling {
            return None;
        }
        // Ranks: smaller is more urgent. `max_by_key` keeps the last of equals: the latest.
        let (rank, victim) = self
            .waiting
            .iter()
            .filter_map(|id| Some((self.urgency(&self.requests.get(id)?.req), *id)))
            .max_by_key(|v| v.0)?;
        if rank <= self.urgency(newcomer) {
            return None;
        }
        self.finish(victim, FinishReason::Abort)
    }

    /// Retracts what the most urgent waiting request needs, if it outranks enough running
    /// requests by more than the threshold. Returns how many were retracted.
    pub(super) fn preempt_for_waiting(&mut self) -> usize {
        if !self.config.enable_priority_scheduling || self.running.is_empty() || self.admission_held
        {
            return 0;
        }
        let Some(head) = self.admission_order().first().copied() else {
            return 0;
        };
        let Some(need) = self.admission_need(head) else {
            return 0;
        };
        if !self.free_slots.is_empty() && self.fits_without(need, &HashSet::new(), 0) {
            return 0; // admission takes it as things are
        }
        let victims = self.preemption_victims(head);
        // At most what every eligible victim holds comes back (a prefix shared with a request
        // that stays remains locked): if even that is short, retracting any would be waste.
        let all: HashSet<RequestId> = victims.iter().map(|v| v.0).collect();
        let bound = victims.iter().map(|v| v.1).sum();
        if victims.is_empty() || !self.fits_without(need, &all, bound) {
            return 0;
        }
        let mut retracted = 0;
        for (id, _) in victims {
            self.retract(id);
            retracted += 1;
            let need = self.admission_need(head).unwrap_or(need);
            if !self.free_slots.is_empty() && self.fits_without(need, &HashSet::new(), 0) {
                break;
            }
        }
        retracted
    }

    /// Tokens waiting request `id` needs pages for on admission: its uncached tokens and
    /// expected growth (what `admit` tests).
    fn admission_need(&self, id: RequestId) -> Option<usize> {
        let seq = self.requests.get(&id)?;
        let cached = self.cache.peek_prefix_len_in(
            seq.req.sampling.lora_id,
            &seq.tokens[..super::admission::matchable_len(seq)],
        );
        Some(seq.tokens.len() - cached + self.expected_growth(seq))
    }

    /// Whether `need` tokens would fit beside the running requests once `gone` are retracted
    /// and `freed` of their pages are back (evictable in the cache or free): admission's test
    /// (`fits_beside_running`), the slot aside.
    fn fits_without(&self, need: usize, gone: &HashSet<RequestId>, freed: usize) -> bool {
        let ps = self.config.page_size as usize;
        let spare = self.pool.free_count() + self.cache.evictable_pages() + freed;
        let staying = self.running.iter().filter(|id| !gone.contains(id));
        let reserved = self.reserved_pages_of(staying);
        let nobody_left = self.running.iter().all(|id| gone.contains(id));
        nobody_left || spare >= reserved + need.div_ceil(ps)
    }

    /// Running requests `head` may preempt, in the order they give way, each with the pages it
    /// holds (its cached prefix's and its own).
    fn preemption_victims(&self, head: RequestId) -> Vec<(RequestId, usize)> {
        let Some(urgent) = self.requests.get(&head).map(|s| self.urgency(&s.req)) else {
            return Vec::new();
        };
        let threshold = self.config.priority_scheduling_preemption_threshold;
        // `running` is in admission order: reversed, the latest admitted come first and the
        // stable sort keeps that within a priority.
        let mut victims: Vec<(i64, RequestId, usize)> = self
            .running
            .iter()
            .rev()
            .filter_map(|id| {
                let seq = self.requests.get(id)?;
                let rank = self.urgency(&seq.req);
                let held = seq.active().map_or(0, |a| a.num_pages());
                (rank.saturating_sub(urgent) > threshold).then_some((rank, *id, held))
            })
            .collect();
        victims.sort_by_key(|v| std::cmp::Reverse(v.0));
        victims
            .into_iter()
            .map(|(_, id, held)| (id, held))
            .collect()
    }
}
