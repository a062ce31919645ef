//! Prometheus metrics for /metrics: vLLM's names and buckets under the `tokenspeed:` prefix
//! (a vLLM Grafana dashboard works after a prefix change), every series labelled `model_name`,
//! plus TokenSpeed's own engine-step series.

use std::collections::HashMap;
use std::time::Duration;

use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};
use tokenspeed_engine::scheduler::SchedulerStats;

mod kv_moves;
use kv_moves::KvMoveSeries;

pub struct Metrics {
    registry: Registry,
    /// Counted as requests arrive, produce tokens and finish.
    pub counters: RequestCounters,
    /// One observation per request: latencies, token counts, parameters.
    histograms: RequestHistograms,
    /// The engine's state and running totals, refreshed from the scheduler's stats.
    engine: EngineSeries,
    /// One observation per engine step.
    steps: StepSeries,
    /// KV that moves: the hierarchical cache's tiers below the device, PD transfers.
    kv_moves: KvMoveSeries,
}

pub struct RequestCounters {
    /// Prompt tokens looked up in the prefix cache, and those found there.
    pub prefix_cache_queries: IntCounter,
    pub prefix_cache_hits: IntCounter,
    pub prompt_tokens: IntCounter,
    pub generation_tokens: IntCounter,
    /// By `finished_reason`: stop, length, abort.
    pub request_success: IntCounterVec,
    /// Generating requests refused at admission (429: running + queued at the limit).
    pub requests_rejected: IntCounter,
}

struct RequestHistograms {
    time_to_first_token: Histogram,
    inter_token_latency: Histogram,
    e2e_request_latency: Histogram,
    request_queue_time: Histogram,
    request_prefill_time: Histogram,
    request_decode_time: Histogram,
    request_prompt_tokens: Histogram,
    request_generation_tokens: Histogram,
    /// Prefill plus decode: the time a request held a slot (vLLM's RUNNING phase).
    request_inference_time: Histogram,
    /// Decode time over the tokens after the first, per request.
    request_time_per_output_token: Histogram,
    /// Times a request was sent back to the queue before it finished.
    request_num_preemptions: Histogram,
    /// The sampling parameters of each API request (per prompt): `n` and `max_tokens` (as
    /// resolved: the room left in the context when the request gave none).
    request_params_n: Histogram,
    request_params_max_tokens: Histogram,
}

struct EngineSeries {
    num_requests_running: IntGauge,
    num_requests_waiting: IntGauge,
    kv_cache_usage_perc: Gauge,
    /// vLLM's `cache_config_info`: 1, labelled with the KV cache's configuration.
    cache_config_info: IntGaugeVec,
    /// Running requests sent back to the queue (vLLM's num_preemptions): KV pages ran out.
    num_preemptions: IntCounter,
    /// Speculative decoding, as vLLM names them: draft tokens verified and accepted.
    spec_decode_num_draft_tokens: IntCounter,
    spec_decode_num_accepted_tokens: IntCounter,
    /// Decoding steps run with speculation turned off (`spec_gate.rs`), and whether it is on.
    spec_decode_off_steps: IntCounter,
    spec_decode_enabled: IntGauge,
    free_kv_pages: IntGauge,
    cached_kv_pages: IntGauge,
}

struct StepSeries {
    steps: IntCounter,
    step_batch_size: Histogram,
    step_tokens: Histogram,
    step_cpu_seconds: Histogram,
    /// Tokens per engine step, vLLM's name and buckets (`step_tokens` is TokenSpeed's).
    iteration_tokens: Histogram,
}

/// The timestamps of one finished request, for the per-request histograms.
pub struct RequestTimes {
    pub queued: Duration,
    pub prefill: Duration,
    pub decode: Duration,
    pub e2e: Duration,
    pub prompt_tokens: u32,
    pub generation_tokens: u32,
    pub finished_reason: &'static str,
    pub preemptions: u32,
}

const PREFIX: &str = "tokenspeed:";

/// vLLM's buckets, as its source defines them (vllm/v1/metrics/loggers.py; in later versions
/// vllm/v1/metrics/buckets.py): TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY (also its older
/// time_per_output_token), and REQUEST_LATENCY for e2e, queue, prefill and decode times.
/// tests/test_e2e_openai_api.py reads them back from /metrics.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// vLLM's buckets of `iteration_tokens_total` (its CUDA-graph sizes and batch-token limits).
const ITERATION_TOKEN_BUCKETS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];

/// vLLM's `build_1_2_5_buckets(max_model_len)`: 1, 2, 5 times each power of ten, up to and
/// including `max` (the token-count histograms).
fn buckets_1_2_5(max: u32) -> Vec<f64> {
    let mut out = Vec::new();
    let mut scale = 1u64;
    'outer: loop {
        for m in [1, 2, 5] {
            let v = m * scale;
            if v > u64::from(max) {
                break 'outer;
            }
            out.push(v as f64);
        }
        scale *= 10;
    }
    out
}

struct Builder {
    registry: Registry,
}

impl Builder {
    fn register<M: prometheus::core::Collector + Clone + 'static>(&self, m: M) -> M {
        // Names are fixed and distinct, so registration cannot fail; a failure is a bug.
        self.registry
            .register(Box::new(m.clone()))
            .expect("metric names are unique");
        m
    }
    fn counter(&self, name: &str, help: &str) -> IntCounter {
        self.register(IntCounter::new(format!("{PREFIX}{name}"), help).expect("valid metric"))
    }
    fn gauge(&self, name: &str, help: &str) -> IntGauge {
        self.register(IntGauge::new(format!("{PREFIX}{name}"), help).expect("valid metric"))
    }
    fn histogram(&self, name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
        let opts = HistogramOpts::new(format!("{PREFIX}{name}"), help).buckets(buckets);
        self.register(Histogram::with_opts(opts).expect("valid metric"))
    }
}

impl Builder {
    fn gauge_f64(&self, name: &str, help: &str) -> Gauge {
        self.register(Gauge::new(format!("{PREFIX}{name}"), help).expect("valid metric"))
    }
    fn counter_vec(&self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        let opts = Opts::new(format!("{PREFIX}{name}"), help);
        self.register(IntCounterVec::new(opts, labels).expect("valid metric"))
    }
    fn gauge_vec(&self, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
        let opts = Opts::new(format!("{PREFIX}{name}"), help);
        self.register(IntGaugeVec::new(opts, labels).expect("valid metric"))
    }
}

impl Metrics {
    pub fn new(model_name: &str, max_model_len: u32) -> Self {
        let labels = HashMap::from([("model_name".to_string(), model_name.to_string())]);
        let registry = Registry::new_custom(None, Some(labels)).expect("valid labels");
        let b = Builder {
            registry: registry.clone(),
        };
        Metrics {
            counters: RequestCounters::new(&b),
            histograms: RequestHistograms::new(&b, max_model_len.max(1)),
            engine: EngineSeries::new(&b),
            steps: StepSeries::new(&b),
            kv_moves: KvMoveSeries::new(&b),
            registry,
        }
    }

    pub fn observe_step(&self, batch: usize, tokens: usize, cpu: Duration) {
        self.steps.steps.inc();
        self.steps.step_batch_size.observe(batch as f64);
        self.steps.step_tokens.observe(tokens as f64);
        self.steps.iteration_tokens.observe(tokens as f64);
        self.steps.step_cpu_seconds.observe(cpu.as_secs_f64());
    }

    pub fn observe_pool(&self, s: &SchedulerStats) {
        self.engine.num_requests_running.set(s.running as i64);
        self.engine.num_requests_waiting.set(s.waiting as i64);
        self.engine.free_kv_pages.set(s.free_pages as i64);
        self.engine.cached_kv_pages.set(s.cached_pages as i64);
        // A running total: the counter catches up with it.
        let new = s
            .retractions
            .saturating_sub(self.engine.num_preemptions.get());
        self.engine.num_preemptions.inc_by(new);
        let drafted = s.spec_draft_tokens;
        let accepted = s.spec_accepted_tokens;
        self.engine
            .spec_decode_num_draft_tokens
            .inc_by(drafted.saturating_sub(self.engine.spec_decode_num_draft_tokens.get()));
        self.engine
            .spec_decode_num_accepted_tokens
            .inc_by(accepted.saturating_sub(self.engine.spec_decode_num_accepted_tokens.get()));
        let off = s.spec_off_steps;
        self.engine
            .spec_decode_off_steps
            .inc_by(off.saturating_sub(self.engine.spec_decode_off_steps.get()));
        self.engine
            .spec_decode_enabled
            .set(i64::from(s.spec_enabled));
        self.kv_moves.observe(s);
        if s.total_pages > 0 {
            let busy = s
                .total_pages
                .saturating_sub(s.free_pages + s.evictable_pages);
            self.engine
                .kv_cache_usage_perc
                .set(busy as f64 / s.total_pages as f64);
        }
    }

    /// PD decode server: the KV transfers a step result reports arrived.
    pub fn observe_kv_arrivals(&self, arrivals: &[tokenspeed_engine::KvArrival]) {
        self.kv_moves.observe_arrivals(arrivals);
    }

    /// A request's first token: its latency, and how much of its prompt the prefix cache held.
    pub fn observe_first_token(&self, latency: Duration, prompt_tokens: u32, cached_tokens: u32) {
        self.histograms
            .time_to_first_token
            .observe(latency.as_secs_f64());
        let c = &self.counters;
        c.prefix_cache_queries.inc_by(u64::from(prompt_tokens));
        c.prefix_cache_hits.inc_by(u64::from(cached_tokens));
    }

    /// The time between two outputs of one request.
    pub fn observe_token_gap(&self, gap: Duration) {
        self.histograms
            .inter_token_latency
            .observe(gap.as_secs_f64());
    }

    /// A request ended, by its `finished_reason` (stop, length, abort, error).
    pub fn count_finished(&self, reason: &str) {
        self.counters
            .request_success
            .with_label_values(&[reason])
            .inc();
    }

    pub fn observe_finished(&self, t: &RequestTimes) {
        self.count_finished(t.finished_reason);
        self.histograms
            .e2e_request_latency
            .observe(t.e2e.as_secs_f64());
        self.histograms
            .request_queue_time
            .observe(t.queued.as_secs_f64());
        self.histograms
            .request_prefill_time
            .observe(t.prefill.as_secs_f64());
        self.histograms
            .request_decode_time
            .observe(t.decode.as_secs_f64());
        self.histograms
            .request_inference_time
            .observe((t.prefill + t.decode).as_secs_f64());
        if t.generation_tokens > 1 {
            self.histograms
                .request_time_per_output_token
                .observe(t.decode.as_secs_f64() / f64::from(t.generation_tokens - 1));
        }
        self.histograms
            .request_num_preemptions
            .observe(f64::from(t.preemptions));
        self.histograms
            .request_prompt_tokens
            .observe(f64::from(t.prompt_tokens));
        self.histograms
            .request_generation_tokens
            .observe(f64::from(t.generation_tokens));
    }

    /// One API request's parameters, per prompt (vLLM counts a request with n samples once).
    pub fn observe_params(&self, n: usize, max_tokens: u32) {
        self.histograms.request_params_n.observe(n as f64);
        self.histograms
            .request_params_max_tokens
            .observe(f64::from(max_tokens));
    }

    /// The KV cache's configuration, as vLLM's `cache_config_info` labels it.
    pub fn set_cache_config(&self, page_size: u32, num_pages: u32, prefix_caching: bool) {
        self.engine
            .cache_config_info
            .with_label_values(&[
                &page_size.to_string(),
                &num_pages.to_string(),
                &prefix_caching.to_string(),
            ])
            .set(1);
    }

    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl RequestCounters {
    fn new(b: &Builder) -> Self {
        RequestCounters {
            prefix_cache_queries: b.counter(
                "prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache",
            ),
            prefix_cache_hits: b.counter(
                "prefix_cache_hits_total",
                "Prompt tokens found in the prefix cache",
            ),
            prompt_tokens: b.counter("prompt_tokens_total", "Prompt tokens of accepted requests"),
            generation_tokens: b.counter("generation_tokens_total", "Generated tokens"),
            request_success: b.counter_vec(
                "request_success_total",
                "Finished requests by finish reason",
                &["finished_reason"],
            ),
            requests_rejected: b.counter(
                "requests_rejected_total",
                "Generating requests refused with 429 (the admission limit was reached)",
            ),
        }
    }
}

impl RequestHistograms {
    /// Latencies in vLLM's buckets; token counts in 1-2-5 buckets up to the context length.
    fn new(b: &Builder, max_model_len: u32) -> Self {
        let latency = || REQUEST_LATENCY_BUCKETS.to_vec();
        let tokens = || buckets_1_2_5(max_model_len);
        RequestHistograms {
            time_to_first_token: b.histogram(
                "time_to_first_token_seconds",
                "Time to first token",
                TTFT_BUCKETS.to_vec(),
            ),
            inter_token_latency: b.histogram(
                "inter_token_latency_seconds",
                "Time between two outputs of a request",
                ITL_BUCKETS.to_vec(),
            ),
            e2e_request_latency: b.histogram(
                "e2e_request_latency_seconds",
                "Request latency, arrival to finish",
                latency(),
            ),
            request_queue_time: b.histogram(
                "request_queue_time_seconds",
                "Time waiting before the first prefill",
                latency(),
            ),
            request_prefill_time: b.histogram(
                "request_prefill_time_seconds",
                "Time from the first prefill to the first token",
                latency(),
            ),
            request_decode_time: b.histogram(
                "request_decode_time_seconds",
                "Time from the first token to the last",
                latency(),
            ),
            request_prompt_tokens: b.histogram(
                "request_prompt_tokens",
                "Prompt tokens per finished request",
                tokens(),
            ),
            request_generation_tokens: b.histogram(
                "request_generation_tokens",
                "Generated tokens per finished request",
                tokens(),
            ),
            request_inference_time: b.histogram(
                "request_inference_time_seconds",
                "Time from the first prefill to the last token (prefill + decode)",
                latency(),
            ),
            request_time_per_output_token: b.histogram(
                "request_time_per_output_token_seconds",
                "Mean time per output token after the first, per request",
                ITL_BUCKETS.to_vec(),
            ),
            request_num_preemptions: b.histogram(
                "request_num_preemptions",
                "Times a finished request was sent back to the queue to free KV pages",
                vec![0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0],
            ),
            request_params_n: b.histogram(
                "request_params_n",
                "The n of each request (per prompt)",
                vec![1.0, 2.0, 5.0, 10.0, 20.0],
            ),
            request_params_max_tokens: b.histogram(
                "request_params_max_tokens",
                "The max_tokens of each request (per prompt; the room left when not given)",
                tokens(),
            ),
        }
    }
}

impl EngineSeries {
    fn new(b: &Builder) -> Self {
        EngineSeries {
            num_requests_running: b.gauge("num_requests_running", "Requests holding a slot"),
            num_requests_waiting: b.gauge("num_requests_waiting", "Requests waiting for a slot"),
            kv_cache_usage_perc: b.gauge_f64(
                "kv_cache_usage_perc",
                "KV cache usage: 1 is full (evictable cached pages count as free)",
            ),
            cache_config_info: b.gauge_vec(
                "cache_config_info",
                "Information of the KV cache's configuration (value 1)",
                &["block_size", "num_gpu_blocks", "enable_prefix_caching"],
            ),
            num_preemptions: b.counter(
                "num_preemptions_total",
                "Running requests sent back to the queue to free KV pages (retracted; they \
                 recompute their KV when readmitted)",
            ),
            spec_decode_num_draft_tokens: b.counter(
                "spec_decode_num_draft_tokens_total",
                "Speculative draft tokens sent to the model for verification",
            ),
            spec_decode_num_accepted_tokens: b.counter(
                "spec_decode_num_accepted_tokens_total",
                "Speculative draft tokens the model accepted",
            ),
            spec_decode_off_steps: b.counter(
                "spec_decode_off_steps_total",
                "Decoding steps run without speculation while it is configured (turned off by \
                 the batch size or the acceptance rate)",
            ),
            spec_decode_enabled: b.gauge(
                "spec_decode_enabled",
                "1 while speculative decoding is configured and on, else 0",
            ),
            free_kv_pages: b.gauge("free_kv_pages", "Free KV pages"),
            cached_kv_pages: b.gauge("cached_kv_pages", "KV pages held by the radix cache"),
        }
    }
}

impl StepSeries {
    fn new(b: &Builder) -> Self {
        StepSeries {
            steps: b.counter("steps_total", "Engine steps run"),
            step_batch_size: b.histogram(
                "step_batch_size",
                "Requests per engine step",
                buckets_1_2_5(4096),
            ),
            step_tokens: b.histogram(
                "step_tokens",
                "Tokens per engine step",
                buckets_1_2_5(65536),
            ),
            step_cpu_seconds: b.histogram(
                "step_cpu_seconds",
                "Engine CPU time to apply one step's result",
                vec![1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2],
            ),
            iteration_tokens: b.histogram(
                "iteration_tokens_total",
                "Tokens per engine step",
                ITERATION_TOKEN_BUCKETS.to_vec(),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_buckets_are_1_2_5_up_to_the_context() {
        assert_eq!(
            buckets_1_2_5(1000),
            vec![1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0]
        );
        // Stops at the last value not above the maximum, as vLLM's build_buckets does.
        assert_eq!(
            buckets_1_2_5(2048),
            vec![1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0]
        );
        assert_eq!(buckets_1_2_5(1), vec![1.0]);
    }

    #[test]
    fn every_series_carries_the_model_name() {
        let m = Metrics::new("m1", 64);
        m.count_finished("stop");
        let text = m.render();
        assert!(
            text.contains(
                "tokenspeed:request_success_total{finished_reason=\"stop\",model_name=\"m1\"} 1"
            ),
            "{text}"
        );
        assert!(text.contains("tokenspeed:num_requests_running{model_name=\"m1\"} 0"));
    }
}
