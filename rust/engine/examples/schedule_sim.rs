//! What a scheduling policy does to throughput and inter-token latency, without a GPU: the real
//! `Scheduler` is driven through a whole benchmark (S1: every request at once; S2: Poisson
//! arrivals) while each step's GPU time comes from a linear cost model fitted to H100
//! measurements of the Llama-3.1-8B config in bf16 (benches/RESULTS.md, sessions 9 and 10):
//!
//!   step ms = weights + per_prefill_token x prompt tokens + per_prefill_pair x sum over
//!             prompt tokens of their context + per_decode_ctx x sum of decode contexts
//!
//! weights 5.9 (a batch-1 decode step), prefill 1024 tokens ~21.5 ms and 4096 ~97 ms at
//! concurrency 1, a decode step of 256 requests at ~1.5k context ~27 ms (S1's TPOT).
//! The engine's one-step-ahead depth (two plans in flight) is kept: a result reaches the
//! scheduler one step late. Timings are the model's, so use it to compare policies (say, a
//! `--max-mixed-prefill-tokens` cap), then confirm the chosen one on the GPU.
//!
//!   cargo run --release -p tokenspeed-engine --example schedule_sim -- --cap 1024
//!   cargo run --release -p tokenspeed-engine --example schedule_sim -- --rate 8 --input 1024 --output 256 --prompts 600
//!   ... -- --cap 1024 --eager-host-ms 35   (eager steps bound by their ~35 ms host launch)
//!   ... -- --rate 8 --input 1024 --output 256 --prompts 600 --lead-ms 3   (`--schedule-lead-ms`:
//!   the next plan is made 3 ms before a running decode step ends, with its end known exactly)
//!   ... -- --cap 1024 --step-ms 40   (`--max-mixed-step-ms`: mixed steps capped by learned time)

use std::collections::{HashMap, VecDeque};

use tokenspeed_engine::{
    Plan, Request, RequestEvent, RequestId, Scheduler, SchedulerConfig, StepResult,
};

/// The GPU time of one step, in ms (see the module doc).
#[derive(Clone, Copy)]
struct CostModel {
    weights: f64,
    per_prefill_token: f64,
    per_prefill_pair: f64,
    per_decode_ctx: f64,
    /// Host time of launching a step eagerly (no CUDA graph fits it): the step takes at least
    /// this long. Steps with prompt tokens replay a graph only up to `GRAPH_MAX_REQUESTS`
    /// requests and `GRAPH_MAX_TOKENS` tokens (ExtendGraphRunner); decode-only steps always do.
    eager_host_ms: f64,
}

const GRAPH_MAX_REQUESTS: usize = 64;
const GRAPH_MAX_TOKENS: usize = 2048;

impl CostModel {
    fn step_ms(&self, plan: &Plan) -> f64 {
        let gpu = self.gpu_ms(plan);
        let tokens: usize = plan.scheduled.iter().map(|r| r.tokens.len()).sum();
        let eager = tokens > plan.scheduled.len()
            && (plan.scheduled.len() > GRAPH_MAX_REQUESTS || tokens > GRAPH_MAX_TOKENS);
        if eager {
            gpu.max(self.eager_host_ms)
        } else {
            gpu
        }
    }

    fn gpu_ms(&self, plan: &Plan) -> f64 {
        let mut ms = self.weights;
        for r in &plan.scheduled {
            let n = r.tokens.len() as f64;
            let start = f64::from(r.start_pos);
            if r.tokens.len() == 1 {
                ms += self.per_decode_ctx * (start + 1.0);
            } else {
                ms += self.per_prefill_token * n + self.per_prefill_pair * n * (start + n / 2.0);
            }
        }
        ms
    }
}

struct Args {
    cap: u32,
    chunk: u32,
    max_running: u32,
    pool_tokens: u32,
    prompts: usize,
    input: usize,
    output: u32,
    /// Requests per second (Poisson); 0: all at once.
    rate: f64,
    eager_host_ms: f64,
    /// Plan the next step this long before a running decode-only step ends (0: at once).
    lead_ms: f64,
    /// `--max-mixed-step-ms` (0: off); the scheduler learns the model's step times.
    step_ms: f64,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        cap: 0,
        chunk: 8192,
        max_running: 256,
        pool_tokens: 422_880, // the H100's bf16 pool for the 8B config (26,430 pages of 16)
        prompts: 2000,
        input: 1024,
        output: 1024,
        rate: 0.0,
        eager_host_ms: 0.0,
        lead_ms: 0.0,
        step_ms: 0.0,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    for pair in argv.chunks(2) {
        let [flag, value] = pair else {
            return Err(format!("{pair:?}: every flag takes a value"));
        };
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--cap" => a.cap = value.parse().map_err(|e| bad(&e))?,
            "--chunk" => a.chunk = value.parse().map_err(|e| bad(&e))?,
            "--max-running" => a.max_running = value.parse().map_err(|e| bad(&e))?,
            "--pool-tokens" => a.pool_tokens = value.parse().map_err(|e| bad(&e))?,
            "--prompts" => a.prompts = value.parse().map_err(|e| bad(&e))?,
            "--input" => a.input = value.parse().map_err(|e| bad(&e))?,
            "--output" => a.output = value.parse().map_err(|e| bad(&e))?,
            "--rate" => a.rate = value.parse().map_err(|e| bad(&e))?,
            "--eager-host-ms" => a.eager_host_ms = value.parse().map_err(|e| bad(&e))?,
            "--lead-ms" => a.lead_ms = value.parse().map_err(|e| bad(&e))?,
            "--step-ms" => a.step_ms = value.parse().map_err(|e| bad(&e))?,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(a)
}

/// Exponential gaps from a fixed-seed xorshift: the same arrivals every run.
fn arrivals(n: usize, rate: f64) -> Vec<f64> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            if rate > 0.0 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let u = (x >> 11) as f64 / (1u64 << 53) as f64;
                t += -(1.0 - u).ln() / rate * 1e3;
            }
            t
        })
        .collect()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("schedule_sim: {e}");
            std::process::exit(2);
        }
    };
    let page = 16;
    let config = SchedulerConfig {
        chunked_prefill_size: a.chunk,
        max_prefill_tokens: 16384,
        max_mixed_prefill_tokens: a.cap,
        max_mixed_step_ms: a.step_ms,
        ..SchedulerConfig::small(page, a.pool_tokens / page, a.max_running, 8192)
    };
    let mut sched = match Scheduler::new(config) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("schedule_sim: {e}");
            std::process::exit(2);
        }
    };
    let model = CostModel {
        weights: 5.9,
        per_prefill_token: 0.0129,
        per_prefill_pair: 4.56e-6,
        per_decode_ctx: 5.2e-5,
        eager_host_ms: a.eager_host_ms,
    };
    let arrive = arrivals(a.prompts, a.rate);
    let mut next = 0;
    let mut now = 0.0f64;
    // Per request: arrival and the times its tokens arrived.
    let mut times: HashMap<RequestId, (f64, Vec<f64>)> = HashMap::new();
    // Steps queued or running: their result, when they end, whether decode-only, run time.
    let mut in_flight: VecDeque<(StepResult, f64, bool, f64)> = VecDeque::new();
    let (mut steps, mut most_running) = (0u64, 0usize);
    loop {
        while next < arrive.len() && arrive[next] <= now {
            let id = RequestId::from(next as u64);
            // Distinct prompts: random ones share no prefix.
            let base = (next * a.input) as u32;
            let req = Request {
                id,
                prompt: (0..a.input as u32).map(|i| base.wrapping_add(i)).collect(),
                max_new_tokens: a.output,
                ignore_eos: true,
                ..Request::default()
            };
            if let Err(e) = sched.submit(req) {
                eprintln!("schedule_sim: request {next} refused: {e}");
                std::process::exit(1);
            }
            times.insert(id, (arrive[next], Vec::new()));
            next += 1;
        }
        // With a lead, the plan behind a running decode step waits until `lead` before its end,
        // and the arrivals until then join it.
        let hold = match in_flight.front() {
            Some(&(_, end, true, _)) if a.lead_ms > 0.0 && in_flight.len() == 1 => {
                Some(end - a.lead_ms).filter(|&t| t > now)
            }
            _ => None,
        };
        if let Some(t) = hold {
            now = t;
            continue;
        }
        let plan = if in_flight.len() < 2 {
            sched.schedule()
        } else {
            None
        };
        let made = plan.is_some();
        if let Some(plan) = plan {
            // The GPU starts this step when the previous one ends (it is queued behind it).
            let start = in_flight.back().map_or(now, |(_, end, _, _)| end.max(now));
            let run = model.step_ms(&plan);
            let end = start + run;
            let events = plan
                .scheduled
                .iter()
                .filter(|r| r.sample)
                .map(|r| RequestEvent {
                    slot: r.slot,
                    tokens: vec![7],
                    logprobs: vec![0.0],
                    ..RequestEvent::default()
                })
                .collect();
            let result = StepResult {
                step_id: plan.step_id,
                events,
                ..Default::default()
            };
            let decode_only =
                !plan.scheduled.is_empty() && plan.scheduled.iter().all(|r| r.tokens.len() == 1);
            in_flight.push_back((result, end, decode_only, run));
            steps += 1;
        }
        if in_flight.len() >= 2 || (!made && !in_flight.is_empty()) {
            let Some((result, end, _, run)) = in_flight.pop_front() else {
                continue;
            };
            now = now.max(end);
            sched.observe_run_time(
                result.step_id,
                std::time::Duration::from_secs_f64(run / 1e3),
            );
            for out in sched.advance(&result) {
                if let Some(entry) = times.get_mut(&out.id) {
                    entry.1.extend(out.tokens.iter().map(|_| end));
                }
            }
        } else if !made {
            if next >= arrive.len() {
                break;
            }
            now = arrive[next]; // idle until the next arrival
        }
        most_running = most_running.max(sched.stats().running);
    }
    let mut ttft = Vec::new();
    let mut itl = Vec::new();
    let mut tpot = Vec::new();
    let mut output = 0usize;
    for (arrived, toks) in times.values() {
        output += toks.len();
        if let Some(first) = toks.first() {
            ttft.push(first - arrived);
        }
        itl.extend(toks.windows(2).map(|w| w[1] - w[0]));
        if toks.len() > 1 {
            tpot.push((toks[toks.len() - 1] - toks[0]) / (toks.len() - 1) as f64);
        }
    }
    for v in [&mut ttft, &mut itl, &mut tpot] {
        v.sort_by(f64::total_cmp);
    }
    println!(
        "cap {} step-ms {} chunk {} max-running {} pool {} | {} x {}/{} at {} | steps {} most running {} retractions {}",
        a.cap,
        a.step_ms,
        a.chunk,
        a.max_running,
        a.pool_tokens,
        a.prompts,
        a.input,
        a.output,
        if a.rate > 0.0 {
            format!("{} req/s", a.rate)
        } else {
            "once".to_string()
        },
        steps,
        most_running,
        sched.stats().retractions
    );
    println!(
        "output tok/s {:.0} | TTFT median {:.1} ms p99 {:.1} | TPOT median {:.2} ms | ITL median {:.2} p99 {:.1} max {:.1} ms",
        output as f64 / now * 1e3,
        percentile(&ttft, 0.5),
        percentile(&ttft, 0.99),
        percentile(&tpot, 0.5),
        percentile(&itl, 0.5),
        percentile(&itl, 0.99),
        itl.last().copied().unwrap_or(f64::NAN)
    );
}
