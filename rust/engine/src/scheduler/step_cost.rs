//! A mixed step's prompt share capped by time (`--max-mixed-step-ms`).
//!
//! Every running stream waits for the whole step, so a step that carries decodes and prompt
//! tokens is one inter-token gap for all of them. Its run time is about the decodes' part (what
//! a decode-only step of the same batch takes: linear in the context the decodes read, fitted
//! over recent decode-only steps) plus a part per prompt token (a moving average over mixed
//! steps). Both are learned from the run times the worker measures
//! (`Scheduler::observe_run_time`), so the cap follows the batch and the GPU: twenty short
//! decodes leave room for a whole 1024-token prompt, two hundred long-context ones for fewer
//! tokens. A token cap (`--max-mixed-prefill-tokens`) cannot tell these apart.

use std::collections::VecDeque;

/// Weight of the newest per-token cost in its moving average.
const EMA: f64 = 0.25;
/// Weight left to a decode-only step's run time after each newer one (half after ~35): the
/// batch and its contexts drift, the fit follows.
const DECAY: f64 = 0.98;
/// Plans whose run time may still come (the engine keeps at most two in flight; steps it never
/// times, e.g. without overlap, must not pile up).
const KEEP: usize = 8;

/// What a step carried, as far as its run time goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct StepShape {
    pub decodes: usize,
    /// Sum of the decodes' context lengths: the KV they read, what their time grows with.
    pub decode_context: usize,
    pub prompt_tokens: usize,
}

/// The decodes' part: run time = a + b x context (thousands of tokens), least squares over
/// recent decode-only steps, older ones weighted down by `DECAY`.
#[derive(Debug, Default)]
struct DecodeFit {
    w: f64,
    x: f64,
    xx: f64,
    y: f64,
    xy: f64,
}

impl DecodeFit {
    fn add(&mut self, context: usize, ms: f64) {
        let x = context as f64 / 1e3;
        for s in [
            &mut self.w,
            &mut self.x,
            &mut self.xx,
            &mut self.y,
            &mut self.xy,
        ] {
            *s *= DECAY;
        }
        self.w += 1.0;
        self.x += x;
        self.xx += x * x;
        self.y += ms;
        self.xy += x * ms;
    }

    /// Expected run time of decodes with `context` tokens in all; None before any was timed.
    fn predict(&self, context: usize) -> Option<f64> {
        if self.w <= 0.0 {
            return None;
        }
        let spread = self.w * self.xx - self.x * self.x;
        // All timed batches of one size tell nothing about the slope: take their mean.
        let slope = if spread > 1e-9 * self.w * self.w {
            ((self.w * self.xy - self.x * self.y) / spread).max(0.0)
        } else {
            0.0
        };
        let intercept = (self.y - slope * self.x) / self.w;
        Some((intercept + slope * context as f64 / 1e3).max(0.0))
    }
}

#[derive(Debug, Default)]
pub(super) struct StepCost {
    planned: VecDeque<(u64, StepShape)>,
    decode: DecodeFit,
    /// Run time a mixed step adds per prompt token over its decodes' part (ms).
    prompt_token_ms: Option<f64>,
}

impl StepCost {
    pub(super) fn planned(&mut self, step_id: u64, shape: StepShape) {
        if self.planned.len() == KEEP {
            self.planned.pop_front();
        }
        self.planned.push_back((step_id, shape));
    }

    /// Step `step_id` ran for `ms`; older plans without a run time are forgotten.
    pub(super) fn ran(&mut self, step_id: u64, ms: f64) {
        let Some(at) = self.planned.iter().position(|(id, _)| *id == step_id) else {
            return;
        };
        let shape = self.planned[at].1;
        self.planned.drain(..=at);
        if !ms.is_finite() || ms < 0.0 {
            return;
        }
        match (shape.decodes, shape.prompt_tokens) {
            // No decodes: nothing to cap, and its time holds the weights' read that decodes share.
            (0, _) => {}
            (_, 0) => self.decode.add(shape.decode_context, ms),
            (_, prompt) => {
                if let Some(decode) = self.decode.predict(shape.decode_context) {
                    let per_token = (ms - decode).max(0.0) / prompt as f64;
                    self.prompt_token_ms = Some(
                        self.prompt_token_ms
                            .map_or(per_token, |o| o + EMA * (per_token - o)),
                    );
                }
            }
        }
    }

    /// Most prompt tokens a step whose decodes read `decode_context` tokens can carry and still
    /// run within `target_ms`; None until both parts have been measured.
    pub(super) fn prompt_tokens_within(
        &self,
        target_ms: f64,
        decode_context: usize,
    ) -> Option<usize> {
        let per_token = self.prompt_token_ms.filter(|&t| t > 0.0)?;
        let room = (target_ms - self.decode.predict(decode_context)?).max(0.0);
        Some((room / per_token) as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `decodes` requests of 1000 tokens of context each, and `prompt_tokens`.
    fn shape(decodes: usize, prompt_tokens: usize) -> StepShape {
        StepShape {
            decodes,
            decode_context: decodes * 1000,
            prompt_tokens,
        }
    }

    #[test]
    fn learns_the_decode_part_and_the_cost_of_a_prompt_token() {
        let mut cost = StepCost::default();
        cost.planned(1, shape(20, 0));
        cost.planned(2, shape(20, 1000));
        assert_eq!(
            cost.prompt_tokens_within(40.0, 20_000),
            None,
            "nothing measured"
        );
        cost.ran(1, 10.0);
        assert_eq!(
            cost.prompt_tokens_within(40.0, 20_000),
            None,
            "no mixed step yet"
        );
        cost.ran(2, 30.0); // 20 ms for 1000 prompt tokens
        let within = cost.prompt_tokens_within(40.0, 20_000).expect("measured");
        assert!(within.abs_diff(1500) <= 1, "{within}");
        let within = cost.prompt_tokens_within(5.0, 20_000);
        assert_eq!(within, Some(0), "decodes alone take longer");
    }

    #[test]
    fn the_decode_part_follows_the_context_the_decodes_read() {
        let mut cost = StepCost::default();
        // Decode-only steps: 5 ms + 1 ms per 10k tokens of context, batches of 20 to 200.
        for (id, decodes) in (1..).zip([20, 50, 100, 150, 200]) {
            let s = shape(decodes, 0);
            cost.planned(id, s);
            cost.ran(id, 5.0 + s.decode_context as f64 / 1e4);
        }
        // A mixed step beside 100 decodes (15 ms of them): 0.02 ms per prompt token.
        cost.planned(9, shape(100, 500));
        cost.ran(9, 15.0 + 10.0);
        let within = |ctx: usize| cost.prompt_tokens_within(40.0, ctx).expect("measured");
        assert!(within(20_000).abs_diff(1650) <= 1, "7 ms of decodes");
        assert!(
            within(200_000).abs_diff(750) <= 1,
            "25 ms of decodes, never timed beside a prompt"
        );
    }

    #[test]
    fn prompt_only_steps_teach_nothing_and_untimed_plans_do_not_pile_up() {
        let mut cost = StepCost::default();
        cost.planned(1, shape(0, 4096));
        cost.ran(1, 90.0);
        assert_eq!(cost.decode.predict(0), None);
        assert_eq!(cost.prompt_token_ms, None);
        for id in 2..100 {
            cost.planned(id, shape(1, 0));
        }
        assert_eq!(cost.planned.len(), KEEP);
        cost.ran(99, 7.0);
        assert!(cost.planned.is_empty(), "older plans are forgotten");
        cost.ran(5, 1.0);
        let decode = cost.decode.predict(1000);
        assert_eq!(decode, Some(7.0), "a forgotten plan's time is ignored");
    }
}
