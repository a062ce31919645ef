//! What the server's integration tests share: the test model's directory and one baseline
//! configuration, which each test overrides field by field (`..common::server_config()`), so a
//! new config field is added here once.

// Each test binary compiles this module and uses part of it.
#![allow(dead_code)]

pub mod chat;

use std::path::PathBuf;

use serde_json::Value;
use tokenspeed_engine::SchedulerConfig;
use tokenspeed_server::ServerConfig;

/// SmolLM2's tokenizer and chat template, from the test assets.
pub fn smollm2_dir() -> PathBuf {
    let root = std::env::var("TOKENSPEED_TEST_ASSETS").unwrap_or_else(|_| {
        format!(
            "{}/.cache/tokenspeed/test-assets",
            std::env::var("HOME").unwrap_or_default()
        )
    });
    let dir = PathBuf::from(root).join("smollm2");
    assert!(
        dir.join("tokenizer.json").exists(),
        "test assets missing at {dir:?}: run `python -m tokenspeed.launch.assets test-assets`"
    );
    dir
}

/// A small scheduler: 4-token pages, FCFS, no mixed-step caps, no speculation, no host tier.
pub fn scheduler_config() -> SchedulerConfig {
    SchedulerConfig {
        chunked_prefill_size: 256,
        max_prefill_tokens: 256,
        ..SchedulerConfig::small(4, 512, 8, 1024)
    }
}

/// A server of SmolLM2's tokenizer over `scheduler_config()`: no key, no warm-up, no grammar
/// backend, no parsers, metrics off.
pub fn server_config() -> ServerConfig {
    ServerConfig {
        host: "127.0.0.1".into(),
        port: 0,
        model_path: "test-model".into(),
        tokenizer_path: smollm2_dir().to_string_lossy().into_owned(),
        served_model_name: "test-model".into(),
        weight_version: "default".into(),
        api_key: None,
        chat_template: None,
        scheduler: scheduler_config(),
        disable_overlap_schedule: false,
        schedule_lead_ms: 0.0,
        log_requests: false,
        skip_server_warmup: true,
        max_queued_requests: 100,
        max_request_body_bytes: 1 << 20,
        shutdown_timeout: 5.0,
        watchdog_timeout: 300.0,
        worker_pids: vec![],
        dp_size: None,
        load_balance_method: None,
        decode_log_interval: 0,
        enable_metrics: false,
        disaggregation_mode: "null".into(),
        disaggregation_bootstrap_host: String::new(),
        disaggregation_bootstrap_port: 0,
        sampling_defaults: Default::default(),
        vocab_size: 0,
        max_logprobs: 20,
        grammar_backend: None,
        tool_call_parser: None,
        reasoning_parser: None,
        enable_auto_tool_choice: false,
        json_whitespace: None,
        is_embedding: false,
        pooling_labels: vec![],
        constrained_json_allow_additional_properties: false,
        server_info: Value::Null,
        lora: Default::default(),
        kv_events_config: None,
        enable_trace: false,
        otlp_traces_endpoint: "localhost:4318".into(),
    }
}
