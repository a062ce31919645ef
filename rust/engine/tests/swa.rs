//! Hybrid KV layout (`num_swa_pages` > 0): sliding-window layers draw from a pool of their own
//! and a request gives back the pages that fell out of its window while it runs. The fake
//! worker checks that every key a query's window sees is intact in the sliding pool.

mod common;

use common::{config, prompt, reference, request, Harness};
use tokenspeed_engine::{Request, SchedulerConfig, SubmitError};

const WINDOW: u32 = 8;
const PS: u32 = 4;
const CHUNK: u32 = 8;

fn hybrid(num_pages: u32, num_swa_pages: u32) -> SchedulerConfig {
    SchedulerConfig {
        chunked_prefill_size: CHUNK,
        max_prefill_tokens: CHUNK,
        num_swa_pages,
        swa_window: WINDOW,
        ..config(num_pages, PS)
    }
}

/// Most sliding pages one request may hold: its window and a chunk, plus the straddled pages.
fn cap() -> usize {
    ((WINDOW + CHUNK).div_ceil(PS) + 2) as usize
}

#[test]
fn sliding_pages_are_given_back_as_the_request_moves_past_its_window() {
    for overlap in [false, true] {
        let mut h = Harness::with_overlap(hybrid(64, 16), overlap);
        h.submit(request(1, prompt(1, 45), 60));
        let mut peak = 0;
        while h.step() {
            peak = peak.max(h.sched.swa_pool_usage().0);
        }
        assert_eq!(h.tokens(1u64), reference(&prompt(1, 45), 60));
        // 105 positions need 27 full pages; the sliding layers never hold more than the cap.
        assert!(peak <= cap(), "peak {peak} sliding pages > {}", cap());
        assert!(peak < 27);
        h.assert_no_leak();
    }
}

#[test]
fn admission_never_overcommits_the_sliding_pool_and_tokens_stay_right() {
    // Room in the full pool for all eight, in the sliding pool for two at a time.
    let mut h = Harness::new(hybrid(512, 2 * cap() as u32));
    let lens = [3, 40, 17, 26, 9, 33, 12, 50];
    for (i, &n) in lens.iter().enumerate() {
        h.submit(request(i as u64 + 1, prompt(i as u32 + 1, n), 30));
    }
    let mut most_running = 0;
    while h.step() {
        most_running = most_running.max(h.sched.stats().running);
        assert!(h.sched.swa_pool_usage().0 <= 2 * cap());
    }
    assert!(most_running >= 2);
    for (i, &n) in lens.iter().enumerate() {
        assert_eq!(
            h.tokens(i as u64 + 1),
            reference(&prompt(i as u32 + 1, n), 30)
        );
    }
    assert_eq!(
        h.sched.stats().retractions,
        0,
        "running requests never wait for sliding pages"
    );
    h.assert_no_leak();
}

#[test]
fn a_repeated_prompt_is_recomputed_not_matched() {
    let mut h = Harness::new(hybrid(256, 32));
    h.submit(request(1, prompt(7, 30), 10));
    h.run(1000);
    h.submit(request(2, prompt(7, 30), 10));
    h.run(1000);
    assert_eq!(h.tokens(2u64), h.tokens(1u64));
    assert_eq!(
        h.last_output(2u64).cached_tokens,
        0,
        "no prefix reuse in the hybrid layout"
    );
    h.assert_no_leak();
}

#[test]
fn a_request_whose_window_cannot_fit_the_sliding_pool_is_refused() {
    let mut sched = tokenspeed_engine::Scheduler::new(hybrid(256, 3)).expect("config");
    let req = Request {
        ..request(1, prompt(1, 40), 10)
    };
    assert!(matches!(
        sched.submit(req),
        Err(SubmitError::ExceedsKvPool { .. })
    ));
}

#[test]
fn hybrid_layout_needs_a_window() {
    let c = SchedulerConfig {
        swa_window: 0,
        ..hybrid(64, 16)
    };
    assert!(tokenspeed_engine::Scheduler::new(c).is_err());
}
