//! The server's configuration, handed over from Python's resolved flag table as JSON.

use serde::{Deserialize, Serialize};
use tokenspeed_engine::SchedulerConfig;

/// Everything the Rust core needs to serve. Python resolves flags, spawns the workers and
/// learns the KV capacity (`num_pages`) from them before building this. Values come from the
/// flag table (`python/tokenspeed/config/table_*.py`), the one owner of defaults: nothing
/// here restates one.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    pub model_path: String,
    pub tokenizer_path: String,
    pub served_model_name: String,
    /// `--weight-version`: the label of the loaded weights, reported with every answer.
    pub weight_version: String,
    pub api_key: Option<String>,
    pub chat_template: Option<String>,
    /// What the scheduler reads (the flags whose readers include "scheduler", plus the KV
    /// pages the workers allocated): the engine crate's own type, so no field is restated here.
    pub scheduler: SchedulerConfig,
    /// One plan at a time instead of scheduling step N+1 while the worker runs step N.
    pub disable_overlap_schedule: bool,
    /// Plan step N+1 this many ms before a decode-only step N is expected to end (0: as soon
    /// as N starts).
    pub schedule_lead_ms: f64,
    pub log_requests: bool,
    /// Skip the one-token generation that proves the whole path works before binding HTTP.
    pub skip_server_warmup: bool,
    /// Requests waiting beyond this are refused (overload), not queued forever.
    pub max_queued_requests: u32,
    /// Larger request bodies are refused with 413 before they are read in full.
    pub max_request_body_bytes: u64,
    /// On SIGTERM/SIGINT, seconds in-flight requests get to finish before they are aborted.
    pub shutdown_timeout: f64,
    /// A forward step running longer than this many seconds fails the worker group.
    pub watchdog_timeout: f64,
    /// Process ids of the worker ranks, watched for liveness (under data parallelism, replica
    /// 0's ranks, then replica 1's, ...).
    pub worker_pids: Vec<i32>,
    /// Data-parallel replicas (`--dp-size`): one engine and worker group each; absent: 1.
    pub dp_size: Option<u32>,
    /// `--load-balance-method` over the replicas (needed when `dp_size` > 1).
    pub load_balance_method: Option<String>,
    /// Log a step line every this many steps (`--decode-log-interval`; 0 = never).
    pub decode_log_interval: u64,
    /// Serve Prometheus metrics at /metrics (`--enable-metrics`); without it the route is absent.
    pub enable_metrics: bool,
    /// Prefill/decode disaggregation role (`--disaggregation-mode`): "null", "prefill" or
    /// "decode"; requests carry the router's `bootstrap_room` only in the latter two.
    pub disaggregation_mode: String,
    /// Where a PD pair meets (`--disaggregation-bootstrap-host` / `-port`): requests that
    /// name another place (SGLang's `bootstrap_host` / `bootstrap_port`) are refused.
    #[serde(default)]
    pub disaggregation_bootstrap_host: String,
    #[serde(default)]
    pub disaggregation_bootstrap_port: u32,
    /// Sampling values for the fields a request omits (`--sampling-defaults model`: the model's
    /// generation_config.json; empty with `openai`).
    pub sampling_defaults: SamplingDefaults,
    /// The model's vocabulary size (config.json; may exceed the tokenizer's, padded ids are
    /// never sampled under a grammar); 0: the tokenizer's.
    pub vocab_size: u32,
    /// `--max-logprobs`: the most logprobs a request may ask for per token (-1: the whole
    /// vocabulary); the result ring's slots are sized for it.
    pub max_logprobs: i64,
    /// `--grammar-backend`: "llguidance", "xgrammar" (masks on the worker), or absent / "none"
    /// (structured output refused).
    pub grammar_backend: Option<String>,
    /// `--tool-call-parser`: how tool calls are read from chat output (tools need it).
    pub tool_call_parser: Option<String>,
    /// `--reasoning-parser`: splits think-tag reasoning from the answer in chat output.
    pub reasoning_parser: Option<String>,
    /// `--enable-auto-tool-choice`: tool_choice "auto" (and absent, with tools) is allowed.
    pub enable_auto_tool_choice: bool,
    /// Whitespace between JSON tokens under a schema: a regex, "any", or "compact"
    /// (`--constrained-json-whitespace-pattern`, `--constrained-json-disable-any-whitespace`);
    /// absent: any.
    pub json_whitespace: Option<String>,
    /// `--is-embedding`: serve pooling routes (embeddings, score, rerank, classify) and refuse
    /// the generating ones.
    pub is_embedding: bool,
    /// With `--is-embedding`: a classifier's label names by index (config.json `id2label`),
    /// empty for an embedding model (the worker's pooled vector is then an embedding).
    pub pooling_labels: Vec<String>,
    /// `--constrained-json-allow-additional-properties`: an object schema that leaves
    /// `additionalProperties` unspecified allows undeclared properties (else it does not).
    pub constrained_json_allow_additional_properties: bool,
    /// Extra facts reported verbatim by /get_server_info (the resolved flags, device, ...).
    pub server_info: serde_json::Value,
    /// LoRA adapters (`--enable-lora`, `--lora-paths`, ...), as the launcher resolved them.
    pub lora: crate::lora::LoraConfig,
    /// `--kv-events-config`: publish the radix cache's KV events to routers (None: off).
    pub kv_events_config: Option<crate::kv_events::KvEventsConfig>,
    /// `--enable-trace`: OpenTelemetry spans per request, exported to `otlp_traces_endpoint`.
    pub enable_trace: bool,
    /// `--otlp-traces-endpoint`: the OTLP/HTTP collector (`host:port` or an `http://` URL).
    pub otlp_traces_endpoint: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<f32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

impl ServerConfig {
    /// This server's side of its prefill/decode pair, as request validation checks it.
    pub fn pd_pair(&self) -> crate::validate::PdPair<'_> {
        crate::validate::PdPair {
            mode: &self.disaggregation_mode,
            host: &self.disaggregation_bootstrap_host,
            port: self.disaggregation_bootstrap_port,
        }
    }
}
