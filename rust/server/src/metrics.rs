//! Prometheus metrics for /metrics (names follow the `tokenspeed:` prefix style of SGLang/vLLM).

use std::time::Duration;

use prometheus::{Encoder, Histogram, HistogramOpts, IntCounter, IntGauge, Registry, TextEncoder};
use tokenspeed_engine::scheduler::SchedulerStats;

pub struct Metrics {
    registry: Registry,
    pub requests_total: IntCounter,
    pub requests_aborted: IntCounter,
    pub requests_rejected: IntCounter,
    pub prompt_tokens: IntCounter,
    pub cached_prompt_tokens: IntCounter,
    pub generation_tokens: IntCounter,
    pub steps: IntCounter,
    pub running: IntGauge,
    pub waiting: IntGauge,
    pub free_pages: IntGauge,
    pub cached_pages: IntGauge,
    pub batch_size: Histogram,
    pub step_tokens: Histogram,
    pub step_schedule_seconds: Histogram,
    pub ttft: Histogram,
    pub e2e: Histogram,
}

fn counter(registry: &Registry, name: &str, help: &str) -> IntCounter {
    let c = IntCounter::new(name, help).expect("valid metric");
    registry
        .register(Box::new(c.clone()))
        .expect("unique metric");
    c
}
fn gauge(registry: &Registry, name: &str, help: &str) -> IntGauge {
    let g = IntGauge::new(name, help).expect("valid metric");
    registry
        .register(Box::new(g.clone()))
        .expect("unique metric");
    g
}
fn histogram(registry: &Registry, name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
    let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))
        .expect("valid metric");
    registry
        .register(Box::new(h.clone()))
        .expect("unique metric");
    h
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let r = Registry::new();
        let latency = vec![
            0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
        ];
        let sizes = vec![
            1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
        ];
        let tokens = vec![
            1.0, 8.0, 64.0, 256.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
        ];
        Metrics {
            requests_total: counter(&r, "tokenspeed_requests_total", "Requests accepted"),
            requests_aborted: counter(&r, "tokenspeed_requests_aborted_total", "Requests aborted"),
            requests_rejected: counter(
                &r,
                "tokenspeed_requests_rejected_total",
                "Requests refused with 429 (overload)",
            ),
            prompt_tokens: counter(&r, "tokenspeed_prompt_tokens_total", "Prompt tokens"),
            cached_prompt_tokens: counter(
                &r,
                "tokenspeed_cached_prompt_tokens_total",
                "Prompt tokens served from the radix cache",
            ),
            generation_tokens: counter(
                &r,
                "tokenspeed_generation_tokens_total",
                "Generated tokens",
            ),
            steps: counter(&r, "tokenspeed_steps_total", "Engine steps run"),
            running: gauge(&r, "tokenspeed_num_running_reqs", "Requests holding a slot"),
            waiting: gauge(
                &r,
                "tokenspeed_num_waiting_reqs",
                "Requests waiting for a slot",
            ),
            free_pages: gauge(&r, "tokenspeed_free_kv_pages", "Free KV pages"),
            cached_pages: gauge(
                &r,
                "tokenspeed_cached_kv_pages",
                "KV pages held by the radix cache",
            ),
            batch_size: histogram(
                &r,
                "tokenspeed_step_batch_size",
                "Requests per engine step",
                sizes,
            ),
            step_tokens: histogram(
                &r,
                "tokenspeed_step_tokens",
                "Tokens per engine step",
                tokens,
            ),
            step_schedule_seconds: histogram(
                &r,
                "tokenspeed_step_cpu_seconds",
                "CPU time of the engine between two steps",
                vec![1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2],
            ),
            ttft: histogram(
                &r,
                "tokenspeed_time_to_first_token_seconds",
                "TTFT",
                latency.clone(),
            ),
            e2e: histogram(
                &r,
                "tokenspeed_e2e_request_latency_seconds",
                "End-to-end latency",
                latency,
            ),
            registry: r,
        }
    }

    pub fn observe_step(&self, batch: usize, tokens: usize, cpu: Duration) {
        self.steps.inc();
        self.batch_size.observe(batch as f64);
        self.step_tokens.observe(tokens as f64);
        self.step_schedule_seconds.observe(cpu.as_secs_f64());
    }

    pub fn observe_pool(&self, s: &SchedulerStats) {
        self.running.set(s.running as i64);
        self.waiting.set(s.waiting as i64);
        self.free_pages.set(s.free_pages as i64);
        self.cached_pages.set(s.cached_pages as i64);
    }

    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}
