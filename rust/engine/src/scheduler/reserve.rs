//! What admission keeps back for the running requests: the most pages they will need, over the
//! steps to come, above what they hold now (`Reservation`).
//!
//! A request whose end is known (decoding, ignoring EOS, so it runs to `max_new_tokens` one
//! token a step) is *timed*: it grows a page every `page_size` steps and, when it ends, gives
//! back what only it holds. Any other request is *open-ended*: it needs the rest of its prompt
//! at once, grows a token a step up to its expected growth (a guess unless it ignores EOS,
//! `RESERVE_*`), and is assumed to keep all of it to the end, since a prompt may wait many
//! steps for its chunks and an EOS may come late. A candidate for admission is open-ended too.
//!
//! Pages only come back when a timed request ends, so the need peaks just before one does, or
//! after the last one (`Reservation::pages`). The sum of every request's growth, the bound
//! before, is that need only when all requests end together; staggered, as a wave of requests
//! becomes once the first ones end (BENCHMARKS.md's S1), a running request holds 1.5k tokens
//! on average and 2k at its end, and the sum kept a quarter of the pool idle.
//!
//! Speculative decoding grows requests by different amounts a step, so they may end in
//! another order: then every request is open-ended.

use super::{Phase, RequestId, Scheduler, Sequence, RESERVE_CLIP};

/// Steps between a request's last decode being planned and its pages coming back: the engine
/// keeps up to two plans in flight, so an end is seen that many steps late.
const FINISH_LAG_STEPS: usize = 2;

/// A timed request: the tokens it will still generate, and the pages it gives back at its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Timed {
    pub growth: usize,
    pub frees: usize,
}

/// The pages running requests need over the steps to come, above what they hold now: at each
/// step where a timed request's pages are about to come back (the need is largest there), and
/// after the last of them.
#[derive(Debug, Clone, Default)]
pub(super) struct Reservation {
    page_size: usize,
    /// (step, pages needed at that step), the step ascending.
    moments: Vec<(usize, isize)>,
    /// Pages needed once every timed request has ended.
    end: isize,
}

impl Reservation {
    /// The profile of `timed` requests: with growth sorted g_1 <= ... <= g_n, at step
    /// g_k + lag - 1 the requests k.. hold at most ceil((g_k + lag - 1) / page) grown pages
    /// each, and those with less growth gave theirs back.
    pub fn new(timed: &mut [Timed], page_size: usize) -> Self {
        timed.sort_unstable_by_key(|t| t.growth);
        let n = timed.len();
        let mut moments = vec![(0, 0)];
        let (mut freed, mut ended) = (0, 0);
        for k in 0..n {
            let g = timed[k].growth;
            while timed[ended].growth < g {
                freed += timed[ended].frees;
                ended += 1;
            }
            let step = g + FINISH_LAG_STEPS - 1;
            moments.push((
                step,
                ((n - k) * step.div_ceil(page_size)) as isize - freed as isize,
            ));
        }
        let end = -(timed.iter().map(|t| t.frees).sum::<usize>() as isize);
        Self {
            page_size,
            moments,
            end,
        }
    }

    /// Counts an open-ended request: `now` tokens of pages at once, then a token a step up to
    /// `growth` more, all held to the end.
    pub fn add(&mut self, now: usize, growth: usize) {
        let ps = self.page_size;
        for (step, need) in &mut self.moments {
            *need += (now + growth.min(*step)).div_ceil(ps) as isize;
        }
        self.end += (now + growth).div_ceil(ps) as isize;
    }

    /// The pages to keep back once an open-ended request of `now` and `growth` tokens is
    /// added: the largest need at any step (never below zero).
    pub fn pages_with(&self, now: usize, growth: usize) -> usize {
        let ps = self.page_size;
        let at = |step: usize| (now + growth.min(step)).div_ceil(ps) as isize;
        let peak = self
            .moments
            .iter()
            .map(|&(step, need)| need + at(step))
            .fold(self.end + at(usize::MAX), isize::max);
        peak.max(0) as usize
    }
}

impl Scheduler {
    /// Tokens a request is still expected to generate, as admission budgets them.
    pub(super) fn expected_growth(&self, seq: &Sequence) -> usize {
        let remaining = (seq.req.max_new_tokens as usize).saturating_sub(seq.completion_tokens());
        // A request that ignores EOS runs to max_new_tokens (barring an abort): no guessing.
        let ratio = if seq.req.ignore_eos {
            1.0
        } else {
            self.reserve_ratio
        };
        (remaining.min(RESERVE_CLIP) as f64 * ratio).ceil() as usize
    }

    /// The reservation of the running requests (see the module doc).
    pub(super) fn reservation(&self) -> Reservation {
        self.reservation_of(self.running.iter())
    }

    /// The reservation of running requests `ids` (`reservation` of a subset).
    pub(super) fn reservation_of<'a>(
        &self,
        ids: impl Iterator<Item = &'a RequestId>,
    ) -> Reservation {
        let ps = self.config.page_size as usize;
        let mut timed = Vec::new();
        let mut open = Vec::new();
        for seq in ids.filter_map(|id| self.requests.get(id)) {
            let Some(a) = seq.active() else {
                continue;
            };
            // A placeholder in flight puts `computed` one past the known tokens.
            let unprefilled = seq.tokens.len().saturating_sub(a.computed);
            let growth = self.expected_growth(seq);
            if self.end_is_known(seq) && unprefilled == 0 {
                // At its end it gives back its own pages, every page it grows into, and its
                // cached prefix's pages that no other request holds.
                let grown = (a.computed + growth)
                    .div_ceil(ps)
                    .saturating_sub(a.num_pages());
                let prefix = self.cache.sole_locked_pages(a.prefix_node);
                timed.push(Timed {
                    growth,
                    frees: a.own.len() + grown + prefix,
                });
            } else {
                open.push((unprefilled, growth));
            }
        }
        let mut reservation = Reservation::new(&mut timed, ps);
        for (now, growth) in open {
            reservation.add(now, growth);
        }
        reservation
    }

    /// Whether a running request ends at a step admission can tell: it is decoding, ignores
    /// EOS, and no speculation changes how fast it grows.
    fn end_is_known(&self, seq: &Sequence) -> bool {
        seq.req.ignore_eos
            && matches!(seq.phase, Phase::Decoding(_))
            && self.config.speculative_algorithm.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timed(growth: usize, frees: usize) -> Timed {
        Timed { growth, frees }
    }

    /// The need at every step by brute force, from each request's own timeline: timed ones
    /// grow until they end and give their pages back `FINISH_LAG_STEPS` later; open-ended
    /// ones (now, growth) keep theirs.
    fn brute(timed: &[Timed], open: &[(usize, usize)], ps: usize) -> usize {
        let last = timed.iter().map(|t| t.growth).max().unwrap_or(0);
        let last = last.max(open.iter().map(|o| o.1).max().unwrap_or(0)) + FINISH_LAG_STEPS;
        (0..=last)
            .map(|step| {
                let timed: isize = timed
                    .iter()
                    .map(|t| {
                        if step < t.growth + FINISH_LAG_STEPS {
                            step.min(t.growth).div_ceil(ps) as isize
                        } else {
                            -(t.frees as isize)
                        }
                    })
                    .sum();
                let open: isize = open
                    .iter()
                    .map(|&(now, g)| (now + g.min(step)).div_ceil(ps) as isize)
                    .sum();
                (timed + open).max(0) as usize
            })
            .max()
            .unwrap_or(0)
    }

    fn reservation(timed: &[Timed], open: &[(usize, usize)], ps: usize) -> usize {
        let mut r = Reservation::new(&mut timed.to_vec(), ps);
        for &(now, growth) in open {
            r.add(now, growth);
        }
        r.pages_with(0, 0)
    }

    /// The reservation never falls below the need at any step, and is at most a page a
    /// timed request above it (each timed request's growth is rounded up at a peak).
    fn assert_bounds(timed: &[Timed], open: &[(usize, usize)], ps: usize) {
        let (pages, exact) = (reservation(timed, open, ps), brute(timed, open, ps));
        assert!(
            exact <= pages && pages <= exact + timed.len(),
            "{timed:?} {open:?} ps {ps}: reserved {pages}, need {exact}"
        );
    }

    #[test]
    fn requests_that_end_together_need_all_their_growth() {
        let t = vec![timed(64, 20); 10];
        assert_eq!(reservation(&t, &[], 16), 10 * 5); // 65 tokens held: 5 pages each
        assert_bounds(&t, &[], 16);
    }

    #[test]
    fn a_staggered_batch_needs_far_less_than_the_sum_of_its_growth() {
        // 100 requests of 64 prompt and 1,000 output tokens, ten steps apart (a steady state
        // in miniature): each gives back its prompt's 4 pages and its 63 of output at its end.
        let t: Vec<Timed> = (0..100).map(|i| timed(i * 10, 4 + 63)).collect();
        let sum: usize = t.iter().map(|t| t.growth.div_ceil(16)).sum();
        let pages = reservation(&t, &[], 16);
        assert_bounds(&t, &[], 16);
        // About a page each for the two steps before the first end, against 3,137 pages.
        assert!(pages <= 100 + 5, "reserved {pages} vs sum {sum}");
    }

    #[test]
    fn a_candidate_may_use_what_ending_requests_give_back() {
        // 8 requests end within 2 steps and give back 10 pages each; a candidate of 40 prompt
        // tokens and 100 growth (10 + 25 pages) needs its prompt now and its growth later.
        let t = vec![timed(1, 10); 8];
        let r = Reservation::new(&mut t.clone(), 4);
        assert_eq!(r.pages_with(40, 100), 8 + 10 + 1); // at step 2: 8 grown pages + 11 of its own
        assert_bounds(&t, &[(40, 100)], 4);
    }

    #[test]
    fn matches_the_step_by_step_need_for_any_mix() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |m: u64| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % m) as usize
        };
        for _ in 0..300 {
            let t: Vec<Timed> = (0..next(12)).map(|_| timed(next(50), next(9))).collect();
            let open: Vec<(usize, usize)> = (0..next(4)).map(|_| (next(30), next(60))).collect();
            for ps in [1, 4, 16] {
                assert_bounds(&t, &open, ps);
                let (now, g) = (next(30), next(60));
                let with = Reservation::new(&mut t.clone(), ps);
                let mut added = with.clone();
                added.add(now, g);
                assert_eq!(with.pages_with(now, g), added.pages_with(0, 0));
            }
        }
    }
}
