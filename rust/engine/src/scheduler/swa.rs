//! The hybrid KV layout's sliding-window pool (`SchedulerConfig::num_swa_pages` > 0): the
//! sliding-window layers' pages come from a pool of their own, and a request gives back the
//! ones that fell out of its window while it runs (docs/models.md, "Sliding-window KV pool").
//!
//! A running request holds the logical pages `[swa_released, swa_released + swa.len())` of its
//! sequence there. A query at position q sees keys `> q - window`, so before a step that starts
//! at position P every page whose last position is `<= P - window` is dead for this and every
//! later step of the request: it goes back to the pool (`swa_advance`). Admission keeps back
//! what each running request may still take (`swa_fits`), so a running request never waits for
//! sliding pages.

use super::{Active, Scheduler, SchedulerConfig, Sequence, StepBuilder};
use crate::pages::PagePool;
use crate::plan::PageTableUpdate;

/// `PageTableUpdate::pool` of the sliding-window layers' page table.
pub const SWA_POOL: u8 = 1;

/// Leading logical pages of a request that no query from position `start` on can see.
fn dead_pages(start: usize, window: usize, ps: usize) -> usize {
    start.saturating_sub(window) / ps
}

/// Before a step of `n` tokens from `a.computed`: gives `a`'s dead sliding pages back, then
/// takes pages for the step's new positions and plans their page-table rows. False (and
/// nothing taken) when the pool has too few free pages; true at once with the single layout.
pub(super) fn swa_advance(
    c: &SchedulerConfig,
    pool: &PagePool,
    a: &mut Active,
    n: usize,
    step: &mut StepBuilder,
) -> bool {
    if c.num_swa_pages == 0 {
        return true;
    }
    let (window, ps, end) = (c.swa_window as usize, c.page_size as usize, a.computed + n);
    let dead = dead_pages(a.computed, window, ps);
    let held_end = a.swa_released + a.swa.len();
    if dead > a.swa_released {
        a.swa.release_front(dead - a.swa_released);
        // Pages between what it held and `dead` were never taken (nothing reads them).
        a.swa_released = if a.swa.is_empty() {
            dead
        } else {
            dead.min(held_end)
        };
    }
    let first = a.swa_released + a.swa.len();
    let need = end.div_ceil(ps).saturating_sub(first);
    let Some(pages) = pool.alloc(need) else {
        return false;
    };
    if !pages.is_empty() {
        step.plan.page_tables.push(PageTableUpdate {
            slot: a.slot,
            first: first as u32,
            pool: SWA_POOL,
            pages: pages.ids().to_vec(),
        });
    }
    a.swa.append(pages);
    true
}

impl Scheduler {
    /// The hybrid layout: sliding-window layers have a pool of their own.
    pub(super) fn hybrid(&self) -> bool {
        self.config.num_swa_pages > 0
    }

    /// Most sliding pages one request holds at once: its window and one step's tokens, plus
    /// the pages either end of that span straddles.
    fn swa_cap(&self) -> usize {
        let c = &self.config;
        // A step's prompt tokens of one request: at most the prompt budget (`prompt_budget`).
        let step = c.chunked_prefill_size.min(c.max_prefill_tokens).max(1) as usize;
        (c.swa_window as usize + step).div_ceil(c.page_size as usize) + 2
    }

    /// The most sliding pages a request whose KV covers `tokens` positions ever holds.
    pub(super) fn swa_peak_for(&self, tokens: usize) -> usize {
        tokens
            .div_ceil(self.config.page_size as usize)
            .min(self.swa_cap())
    }

    fn swa_peak(&self, seq: &Sequence) -> usize {
        let total = seq.req.prompt.len() + seq.req.max_new_tokens as usize;
        self.swa_peak_for(total.min(self.config.context_length as usize))
    }

    /// Whether admitting `seq` keeps the sliding pool able to serve every running request's
    /// peak and `seq`'s (always true with the single layout).
    pub(super) fn swa_fits(&self, seq: &Sequence) -> bool {
        if !self.hybrid() {
            return true;
        }
        let reserved: usize = self
            .running
            .iter()
            .filter_map(|id| self.requests.get(id))
            .map(|s| {
                let held = s.active().map_or(0, |a| a.swa.len());
                self.swa_peak(s).saturating_sub(held)
            })
            .sum();
        self.swa_pool.free_count() >= reserved + self.swa_peak(seq)
    }

    /// Tokens from `a.computed` on that the sliding pool can hold now, its dead pages given
    /// back (unbounded with the single layout).
    pub(super) fn swa_fit(&self, a: &Active) -> usize {
        if !self.hybrid() {
            return usize::MAX;
        }
        let ps = self.config.page_size as usize;
        let dead = dead_pages(a.computed, self.config.swa_window as usize, ps);
        let releasable = dead.saturating_sub(a.swa_released).min(a.swa.len());
        // What it covers once the dead pages are back, then what the free pages add.
        let end = (a.swa_released + a.swa.len()).max(dead);
        ((end + self.swa_pool.free_count() + releasable) * ps).saturating_sub(a.computed)
    }

    /// Sliding pages held by running requests, and the pool's size (0, 0: single layout).
    pub fn swa_pool_usage(&self) -> (usize, usize) {
        let total = self.swa_pool.total();
        (total - self.swa_pool.free_count(), total)
    }
}
