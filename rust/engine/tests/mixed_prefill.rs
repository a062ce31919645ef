//! `max_mixed_prefill_tokens`: while requests decode, a step carries at most that many prompt
//! tokens, so a wave of prompts is spread over several short steps instead of stalling every
//! running stream for a few long ones; with nothing decoding the full budget applies.

mod common;

use common::{config, prompt, reference, request, Harness};
use tokenspeed_engine::{Plan, SchedulerConfig};

/// Prompt tokens of a plan (entries longer than one token: the prompts below never leave a
/// one-token chunk) and whether it carries a decode (a one-token entry).
fn split(plan: &Plan) -> (usize, bool) {
    let prefill = plan
        .scheduled
        .iter()
        .filter(|s| s.tokens.len() > 1)
        .map(|s| s.tokens.len())
        .sum();
    (prefill, plan.scheduled.iter().any(|s| s.tokens.len() == 1))
}

fn cfg(cap: u32) -> SchedulerConfig {
    SchedulerConfig {
        chunked_prefill_size: 64,
        max_mixed_prefill_tokens: cap,
        ..config(512, 1)
    }
}

/// One request decoding, then a wave of four 30-token prompts; returns the harness after the
/// run and the index of the first plan of the wave.
fn wave(cap: u32, overlap: bool) -> (Harness, usize) {
    wave_in(cfg(cap), overlap)
}

fn wave_in(config: SchedulerConfig, overlap: bool) -> (Harness, usize) {
    let mut h = Harness::with_overlap(config, overlap);
    h.submit(request(1, prompt(1, 4), 40));
    h.step();
    h.step();
    let first = h.plans.len();
    for id in 2..=5 {
        h.submit(request(id, prompt(id as u32, 30), 3));
    }
    h.run(200);
    (h, first)
}

#[test]
fn a_wave_is_spread_over_capped_steps_while_a_request_decodes() {
    for overlap in [false, true] {
        let (mut h, first) = wave(8, overlap);
        let wave_plans: Vec<(usize, bool)> = h.plans[first..].iter().map(split).collect();
        let prefill: usize = wave_plans.iter().map(|p| p.0).sum();
        assert_eq!(prefill, 4 * 30, "every prompt token prefilled once");
        for (i, &(tokens, decodes)) in wave_plans.iter().enumerate() {
            assert!(
                !decodes || tokens <= 8,
                "overlap {overlap}: plan {i} carries {tokens} prompt tokens beside decodes"
            );
        }
        // 120 prompt tokens, 8 a step (request 1 decodes 40 tokens, longer than the wave).
        assert!(wave_plans.iter().filter(|p| p.0 > 0).count() >= 15);
        assert!(wave_plans.iter().all(|p| p.0 == 0 || p.1));
        // Request 1 decoded in every step until it finished: no stream stalls for the wave.
        let slot1 = h.plans[0].scheduled[0].slot;
        let done = h
            .plans
            .iter()
            .rposition(|p| p.scheduled.iter().any(|s| s.slot == slot1));
        let done = done.expect("request 1 was scheduled");
        assert!(h.plans[..=done]
            .iter()
            .all(|p| p.scheduled.iter().any(|s| s.slot == slot1)));
        assert_eq!(h.tokens(1), reference(&prompt(1, 4), 40));
        for id in 2..=5u64 {
            assert_eq!(h.tokens(id), reference(&prompt(id as u32, 30), 3));
        }
        h.assert_no_leak();
    }
}

#[test]
fn without_decodes_the_full_budget_applies() {
    for overlap in [false, true] {
        let mut h = Harness::with_overlap(cfg(8), overlap);
        for id in 1..=3 {
            h.submit(request(id, prompt(id as u32, 30), 2));
        }
        h.step();
        assert_eq!(split(&h.plans[0]), (64, false), "overlap {overlap}");
        h.run(100);
        for id in 1..=3u64 {
            assert_eq!(h.tokens(id), reference(&prompt(id as u32, 30), 2));
        }
    }
}

#[test]
fn cap_zero_keeps_the_chunked_prefill_budget_in_mixed_steps() {
    let (h, first) = wave(0, false);
    let (tokens, decodes) = split(&h.plans[first]);
    assert!(decodes);
    assert_eq!(tokens, 63, "64-token budget minus one decode");
}

/// Extend CUDA graphs: a mixed step runs as the graph of the next captured token count, so its
/// prompt share is raised to fill that padding, as far as the chunked-prefill budget allows.
#[test]
fn a_mixed_step_fills_its_graphs_padding_with_prompt_tokens() {
    let graphs = |sizes: &[u32], chunk: u32| SchedulerConfig {
        extend_graph_tokens: sizes.to_vec(),
        chunked_prefill_size: chunk,
        ..cfg(8)
    };
    // (graph sizes, chunked-prefill size, the most prompt tokens a mixed step may carry)
    let cases: [(&[u32], u32, usize); 3] = [
        (&[4, 16, 48], 64, 15), // 1 decode + 8 capped -> the 16-token graph
        (&[16], 12, 8),         // filling 16 would pass the 12-token budget
        (&[4], 64, 8),          // no graph holds the step: it runs eagerly
    ];
    for (sizes, chunk, most) in cases {
        for overlap in [false, true] {
            let (mut h, first) = wave_in(graphs(sizes, chunk), overlap);
            let mixed: Vec<&Plan> = h.plans[first..]
                .iter()
                .filter(|p| matches!(split(p), (n, true) if n > 0))
                .collect();
            let shares: Vec<usize> = mixed.iter().map(|p| split(p).0).collect();
            assert_eq!(
                shares.iter().sum::<usize>(),
                4 * 30,
                "{sizes:?}: {shares:?}"
            );
            assert_eq!(shares.iter().max(), Some(&most), "{sizes:?}: {shares:?}");
            if most == 15 {
                // Every mixed step but the wave's last is exactly a graph's 16 tokens.
                let total = |p: &Plan| p.scheduled.iter().map(|s| s.tokens.len()).sum::<usize>();
                let (_, full) = mixed.split_last().expect("mixed steps");
                assert!(full.iter().all(|p| total(p) == 16), "{shares:?}");
            }
            for id in 2..=5u64 {
                assert_eq!(h.tokens(id), reference(&prompt(id as u32, 30), 3));
            }
            h.assert_no_leak();
        }
    }
}

/// `max_mixed_step_ms`: a fake GPU where a step takes 1 ms, plus 0.3 ms per decode, plus 0.02 ms
/// per prompt token. `decoders` requests decode while prompts of `prompt_lens` tokens arrive in a
/// pool of `num_pages` one-token pages; returns, for every plan of the wave that carried decodes
/// and prompt tokens but the last, its prompt tokens and whether it admitted a request.
fn timed_wave(decoders: u64, prompt_lens: &[usize], num_pages: u32) -> Vec<(usize, bool)> {
    fn step_ms(plan: &Plan) -> f64 {
        let (prompt, _) = split(plan);
        let decodes = plan
            .scheduled
            .iter()
            .filter(|s| s.tokens.len() == 1)
            .count();
        1.0 + 0.3 * decodes as f64 + 0.02 * prompt as f64
    }
    let config = SchedulerConfig {
        max_running_requests: 256,
        chunked_prefill_size: 8192,
        max_prefill_tokens: 16384,
        max_mixed_prefill_tokens: 1024,
        max_mixed_step_ms: 40.0,
        context_length: 4096,
        ..config(num_pages, 1)
    };
    let mut h = Harness::with_overlap(config, true);
    h.step_ms = Some(step_ms);
    for id in 1..=decoders {
        h.submit(request(id, prompt(id as u32, 4), 120));
    }
    for _ in 0..5 {
        h.step();
    }
    let first = h.plans.len();
    let ids: Vec<u64> = (1000..).take(prompt_lens.len()).collect();
    for (&id, &len) in ids.iter().zip(prompt_lens) {
        h.submit(request(id, prompt(id as u32, len), 2));
    }
    h.run(2000);
    for (&id, &len) in ids.iter().zip(prompt_lens) {
        assert_eq!(h.tokens(id), reference(&prompt(id as u32, len), 2));
    }
    h.assert_no_leak();
    let mut chunks: Vec<(usize, bool)> = h.plans[first..]
        .iter()
        .map(|p| (split(p), !p.new_requests.is_empty()))
        .filter(|&((tokens, decodes), _)| decodes && tokens > 0)
        .map(|((tokens, _), admits)| (tokens, admits))
        .collect();
    assert_eq!(
        chunks.iter().map(|c| c.0).sum::<usize>(),
        prompt_lens.iter().sum::<usize>(),
        "every prompt beside decodes"
    );
    chunks.pop();
    chunks
}

fn tokens(chunks: &[(usize, bool)]) -> Vec<usize> {
    chunks.iter().map(|c| c.0).collect()
}

#[test]
fn a_time_cap_fits_the_prompt_share_to_what_the_decodes_leave() {
    // 100 decodes take 31 ms: 9 ms left for prompt tokens, 450 of them, rounded down to a
    // multiple of 64: 448. The step that admits the prompt takes the token cap (the batch has
    // room, below), and so does the next, before a mixed step has been timed.
    let chunks = tokens(&timed_wave(100, &[4000], 40_000));
    assert!(chunks[..2].iter().all(|&n| n == 1024), "{chunks:?}");
    let timed = &chunks[2..];
    assert!(timed.len() >= 4, "{chunks:?}");
    assert!(timed.iter().all(|&n| n == 448), "{chunks:?}");
}

#[test]
fn a_time_cap_leaves_a_few_decodes_the_token_cap() {
    let chunks = tokens(&timed_wave(10, &[4000], 40_000));
    assert!(chunks.iter().all(|&n| n == 1024), "{chunks:?}");
}

#[test]
fn a_time_cap_never_stops_a_wave_when_decodes_alone_fill_it() {
    // 150 decodes take 46 ms, more than the 40 ms target: prompts still move, 256 tokens a step.
    let chunks = tokens(&timed_wave(150, &[4000], 40_000));
    assert!(chunks[2..].iter().all(|&n| n == 256), "{chunks:?}");
}

#[test]
fn while_the_next_request_fits_the_pool_a_step_takes_the_token_cap_not_the_time_cap() {
    // 150 decodes fill the target, but two prompts wait and the pool has room for both: every
    // step takes 1024 prompt tokens until the second is admitted (a batch that cannot refill
    // costs more than a longer gap: issue 29); the rest of it is time capped.
    let chunks = timed_wave(150, &[3000, 3000], 40_000);
    let admit_second = chunks
        .iter()
        .rposition(|c| c.1)
        .expect("the second prompt was admitted beside decodes");
    assert!(
        chunks[..=admit_second].iter().all(|c| c.0 == 1024),
        "{chunks:?}"
    );
    assert!(
        chunks[admit_second + 1..].iter().all(|c| c.0 == 256),
        "{chunks:?}"
    );
    // With a pool that holds only one of them beside the decodes (150 x 124 tokens), the first
    // one's later chunks are time capped while the second waits for pages.
    let chunks = timed_wave(150, &[3000, 3000], 150 * 124 + 3002 + 1000);
    let second = chunks
        .iter()
        .rposition(|c| c.1)
        .expect("the second prompt was admitted");
    assert!(chunks[2..second].iter().all(|c| c.0 == 256), "{chunks:?}");
}
