//! The server process's Rust core: HTTP front end + engine thread. `serve` runs until
//! SIGINT/SIGTERM; Python calls it (GIL released) once the workers are up.

pub mod config;
pub mod engine;
pub mod generate;
pub mod http;
pub mod metrics;
pub mod validate;
pub mod worker_link;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use axum::serve::ListenerExt;
use tokenspeed_engine::scheduler::{SchedulePolicy, SchedulerConfig};
use tokenspeed_text::TextTokenizer;

pub use config::ServerConfig;
pub use engine::{EngineHandle, EngineOptions, WorkerLink};

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("loading the tokenizer from {path}: {message}")]
    Tokenizer { path: String, message: String },
    #[error("binding {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("warm-up generation failed: {0}")]
    Warmup(String),
    #[error("server I/O: {0}")]
    Io(#[from] std::io::Error),
}

pub fn init_logging(level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(format!("tokenspeed={level},{level}"))
    });
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .try_init();
}

pub fn scheduler_config(c: &ServerConfig) -> Result<SchedulerConfig, ServeError> {
    let policy = match c.schedule_policy.as_str() {
        "fcfs" => SchedulePolicy::Fcfs,
        "lpm" => SchedulePolicy::Lpm,
        other => {
            return Err(ServeError::Config(format!(
                "unknown schedule policy {other:?} (fcfs, lpm)"
            )))
        }
    };
    Ok(SchedulerConfig {
        page_size: c.page_size,
        num_pages: c.num_pages,
        max_running_requests: c.max_running_requests,
        chunked_prefill_size: c.chunked_prefill_size,
        max_prefill_tokens: c.max_prefill_tokens,
        max_mixed_prefill_tokens: c.max_mixed_prefill_tokens,
        policy,
        enable_radix_cache: !c.disable_radix_cache,
        max_context_len: c.context_length,
    })
}

/// Everything needed to answer HTTP, with the engine thread already running.
pub fn build_state(
    config: ServerConfig,
    link: Box<dyn WorkerLink>,
) -> Result<http::AppState, ServeError> {
    let tokenizer = TextTokenizer::from_dir(
        Path::new(&config.tokenizer_path),
        config.chat_template.as_deref(),
    )
    .map_err(|e| ServeError::Tokenizer {
        path: config.tokenizer_path.clone(),
        message: e.to_string(),
    })?;
    let metrics = Arc::new(metrics::Metrics::new(
        &config.served_model_name,
        config.context_length,
    ));
    let options = EngineOptions {
        max_queued_requests: config.max_queued_requests as usize,
        step_log_interval: config.step_log_interval,
        overlap: !config.disable_overlap_schedule,
        liveness_interval: std::time::Duration::from_millis(200),
    };
    let (engine, _thread) =
        engine::spawn_engine(scheduler_config(&config)?, link, options, metrics.clone())
            .map_err(ServeError::Config)?;
    Ok(http::AppState {
        config: Arc::new(config),
        tokenizer: Arc::new(tokenizer),
        engine,
        metrics,
        started: Instant::now(),
    })
}

/// Serves HTTP until SIGINT or SIGTERM.
pub fn serve(config: ServerConfig, link: Box<dyn WorkerLink>) -> Result<(), ServeError> {
    let addr = format!("{}:{}", config.host, config.port);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("tokenspeed-http")
        .build()?;
    let state = build_state(config, link)?;
    let engine = state.engine.clone();
    let result = runtime.block_on(async move {
        if !state.config.skip_server_warmup {
            warm_up(&state).await?;
        }
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|source| ServeError::Bind {
                addr: addr.clone(),
                source,
            })?;
        let local: SocketAddr = listener.local_addr()?;
        tracing::info!("TokenSpeed serving on http://{local}");
        // Streams are many small writes: with Nagle's algorithm a chunk written while the
        // previous one is unacknowledged waits for the client's delayed ACK (40 ms on Linux),
        // which lands on time to first token (the first chunk with text often follows an empty
        // one) and on inter-token gaps. Every serving HTTP stack turns it off.
        let listener = listener.tap_io(|tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!("TCP_NODELAY on an accepted connection: {e}");
            }
        });
        axum::serve(listener, http::router(state))
            .with_graceful_shutdown(shutdown_signal())
            .await?;
        Ok(())
    });
    engine.shutdown();
    result
}

/// Generates one token through the whole path (tokenizer, scheduler, shm, worker) before the
/// port opens, so the first user request pays no start-up cost and a broken worker is caught.
async fn warm_up(state: &http::AppState) -> Result<(), ServeError> {
    let started = Instant::now();
    let prompt = generate::Prompt::Text("Hello".into());
    generate::probe(state, prompt, std::time::Duration::from_secs(600))
        .await
        .map_err(|e| ServeError::Warmup(e.message))?;
    tracing::info!(
        "warm-up request done in {:.2}s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    tracing::info!("shutting down");
}
