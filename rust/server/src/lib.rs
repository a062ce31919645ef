//! The server process's Rust core: HTTP front end + engine thread. `serve` runs until
//! SIGINT/SIGTERM (then drains: Ok) or until the worker group fails (Err, so the process exits
//! non-zero and a supervisor restarts it); Python calls it (GIL released) once the workers are up.

pub mod chat_output;
pub mod config;
pub mod constraint;
pub mod engine;
pub mod error;
pub mod frontend;
pub mod generate;
pub mod http;
pub mod kv_events;
pub mod lora;
pub mod metrics;
pub mod otel;
pub mod pooling;
pub mod prompt;
pub mod replicas;
pub mod response_store;
pub mod router;
pub mod validate;
pub mod worker_link;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::serve::ListenerExt;
use tokenspeed_structured::JsonWhitespace;
use tokenspeed_text::TextTokenizer;

pub use config::ServerConfig;
pub use engine::{EngineHandle, EngineOptions, WorkerLink};
pub use replicas::Replicas;

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
    #[error("the engine stopped serving: {0}")]
    EngineFailed(String),
}

/// After the worker group fails, /health answers 503 this long before the process exits, so a
/// health checker sees why.
const FAILED_LINGER: Duration = Duration::from_secs(1);
/// Once every request has ended, how long open connections get to finish writing.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

pub fn init_logging(level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(format!("tokenspeed={level},{level}"))
    });
    // Colours only on a terminal: a log file or a collector gets plain `key=value` lines.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .try_init();
}

/// Everything needed to answer HTTP, with the engine thread already running.
pub fn build_state(
    config: ServerConfig,
    link: Box<dyn WorkerLink>,
) -> Result<http::AppState, ServeError> {
    build_state_replicas(config, vec![link])
}

/// `build_state` with one engine thread per data-parallel replica, each driving its own worker
/// group through `links[r]`.
pub fn build_state_replicas(
    config: ServerConfig,
    links: Vec<Box<dyn WorkerLink>>,
) -> Result<http::AppState, ServeError> {
    let dp = config.dp_size.unwrap_or(1) as usize;
    let policy = balance_policy(&config, dp, links.len())?;
    let tokenizer = TextTokenizer::from_dir(
        Path::new(&config.tokenizer_path),
        config.chat_template.as_deref(),
    )
    .map_err(|e| ServeError::Tokenizer {
        path: config.tokenizer_path.clone(),
        message: e.to_string(),
    })?;
    let grammar = grammar_compiler(&config, &tokenizer)?;
    let chat_parsers =
        chat_output::ChatParsers::from_config(&config, &tokenizer).map_err(ServeError::Config)?;
    let metrics = Arc::new(metrics::Metrics::new(
        &config.served_model_name,
        config.scheduler.context_length,
    ));
    metrics.set_cache_config(
        config.scheduler.page_size,
        config.scheduler.num_pages,
        !config.scheduler.disable_radix_cache,
    );
    let tracer = match config.enable_trace {
        true => {
            Some(otel::Tracer::start(&config.otlp_traces_endpoint).map_err(ServeError::Config)?)
        }
        false => None,
    };
    let options = engine_options(&config, grammar.as_deref(), dp);
    // The HTTP gate runs before the body is parsed, so it cannot tell an urgent request from
    // another: with priority scheduling it is off, and the engine alone bounds the queue,
    // displacing the least urgent waiting request for a more urgent one (event_loop.rs,
    // `queue_full`). A burst is then refused after tokenizing rather than before.
    let max_in_flight = match config.scheduler.enable_priority_scheduling {
        true => usize::MAX,
        false => options.max_queued_requests.saturating_mul(dp),
    };
    let engines = spawn_replicas(&config, links, options, &metrics)?;
    let engine = Replicas::new(engines, policy);
    let pins_to = engine.clone();
    let lora = lora::LoraRegistry::new(
        config.lora.clone(),
        Box::new(move |pins| pins_to.pin_adapters(pins)),
    )
    .map_err(ServeError::Config)?;
    Ok(http::AppState {
        lora: Arc::new(lora),
        weight_version: Arc::new(std::sync::RwLock::new(config.weight_version.clone())),
        frontend: Arc::new(frontend::Frontend {
            config: Arc::new(config),
            tokenizer: Arc::new(tokenizer),
            engine,
            grammar,
            chat_parsers,
            metrics,
            tracer,
        }),
        started: Instant::now(),
        lifecycle: Arc::new(http::Lifecycle::new(max_in_flight)),
        responses: Arc::default(),
    })
}

/// How requests are spread over `dp` replicas, once each has its worker group.
fn balance_policy(
    config: &ServerConfig,
    dp: usize,
    links: usize,
) -> Result<router::Policy, ServeError> {
    if links != dp || dp == 0 {
        return Err(ServeError::Config(format!(
            "--dp-size {dp} needs {dp} worker groups, got {links}"
        )));
    }
    match (dp, config.load_balance_method.as_deref()) {
        (_, Some(m)) => m.parse().map_err(ServeError::Config),
        (1, None) => Ok(router::Policy::RoundRobin), // one replica: nothing to choose
        (_, None) => Err(ServeError::Config(format!(
            "--dp-size {dp} needs a --load-balance-method"
        ))),
    }
}

/// Each replica's engine thread options (without its KV-event publisher).
fn engine_options(
    config: &ServerConfig,
    grammar: Option<&tokenspeed_structured::GrammarCompiler>,
    dp: usize,
) -> EngineOptions {
    // The HTTP layer admits at most max_running + max_queued generating requests (a fast 429
    // before tokenizing), so the waiting queue stays within --max-queued-requests once the
    // running slots are full. The engine's own check is a backstop at that same total: a
    // request waiting only because the scheduler has not run since a slot freed up is not
    // over the limit, and refusing it there would come late (after tokenizing, between steps).
    // Under data parallelism both limits are per replica, so the HTTP layer admits N times as
    // many (the router spreads them). With priority scheduling the HTTP gate is off and the
    // engine's check at this total is the bound (`build_state_replicas`).
    let max_in_flight =
        config.scheduler.max_running_requests as usize + config.max_queued_requests as usize;
    EngineOptions {
        max_queued_requests: max_in_flight,
        step_log_interval: config.decode_log_interval,
        overlap: !config.disable_overlap_schedule,
        plan_lead: (config.schedule_lead_ms > 0.0)
            .then(|| Duration::from_secs_f64(config.schedule_lead_ms / 1e3)),
        liveness_interval: std::time::Duration::from_millis(200),
        watchdog: (config.watchdog_timeout > 0.0)
            .then(|| Duration::from_secs_f64(config.watchdog_timeout)),
        mask_words: grammar.map_or(0, |g| g.bitmask_words()),
        pool_metrics: dp == 1,
        max_adapters: config.lora.max_per_batch_limit(),
        kv_events: None,
        trace: config.enable_trace,
    }
}

/// One engine thread per worker group; each publishes its own cache's KV events, on the
/// endpoint's port + its rank.
fn spawn_replicas(
    config: &ServerConfig,
    links: Vec<Box<dyn WorkerLink>>,
    options: EngineOptions,
    metrics: &Arc<metrics::Metrics>,
) -> Result<Vec<EngineHandle>, ServeError> {
    let mut engines = Vec::with_capacity(links.len());
    for (rank, link) in links.into_iter().enumerate() {
        let kv_events = match &config.kv_events_config {
            Some(kv) => Some(kv_events::start(kv, rank as u32).map_err(ServeError::Config)?),
            None => None,
        };
        let (engine, _thread) = engine::spawn_engine(
            config.scheduler.clone(),
            link,
            EngineOptions {
                kv_events,
                ..options.clone()
            },
            metrics.clone(),
        )
        .map_err(ServeError::Config)?;
        engines.push(engine);
    }
    Ok(engines)
}

/// The grammar compiler `--grammar-backend` asks for, over the model's vocabulary.
fn grammar_compiler(
    config: &ServerConfig,
    tokenizer: &TextTokenizer,
) -> Result<Option<Arc<tokenspeed_structured::GrammarCompiler>>, ServeError> {
    // The two backends share everything but where masks are computed: every request form maps
    // to one `GrammarSpec` (constraint.rs), which llguidance compiles here before the request
    // is queued, so an invalid grammar is the same 400 under either backend. With llguidance
    // its matcher then computes each step's mask on the engine thread (engine/grammar.rs);
    // with xgrammar the spec travels to the worker once, at admission (plan.rs `GrammarRow`),
    // whose xgrammar matcher masks and advances on the sampled tokens it has itself
    // (python/tokenspeed/worker/grammar_backend.py), so no mask completion is needed. The worker
    // checked at start that xgrammar imports and maps the JSON whitespace flags.
    if config.is_embedding {
        return Ok(None); // an embedding server generates nothing (and BERT's WordPiece has no bytes)
    }
    match config.grammar_backend.as_deref() {
        None | Some("none") => Ok(None),
        Some(backend @ ("llguidance" | "xgrammar")) => {
            let vocab = match config.vocab_size {
                0 => tokenizer.vocab_size(),
                n => n as usize,
            };
            let ws = match config.json_whitespace.as_deref() {
                None | Some("any") => JsonWhitespace::Flexible,
                Some("compact") => JsonWhitespace::Compact,
                Some(pattern) => JsonWhitespace::Pattern(pattern.to_string()),
            };
            tokenspeed_structured::GrammarCompiler::new(tokenizer, vocab)
                .map(|c| Some(Arc::new(c.with_json_whitespace(ws))))
                .map_err(|e| ServeError::Config(format!("--grammar-backend {backend}: {e}")))
        }
        Some(other) => Err(ServeError::Config(format!(
            "--grammar-backend {other} is not supported (llguidance, xgrammar, none)"
        ))),
    }
}

/// Serves HTTP until SIGINT or SIGTERM (Ok, after the drain) or until the engine can no longer
/// serve (Err). Either way the engine thread ends, which closes and unlinks the worker channel.
pub fn serve(config: ServerConfig, links: Vec<Box<dyn WorkerLink>>) -> Result<(), ServeError> {
    let addr = format!("{}:{}", config.host, config.port);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("tokenspeed-http")
        .build()?;
    let state = build_state_replicas(config, links)?;
    let engine = state.engine.clone();
    let tracer = state.tracer.clone();
    let result = runtime.block_on(run_http(state, addr));
    engine.shutdown();
    if !engine.wait_stopped(Duration::from_secs(10)) {
        tracing::warn!("the engine thread did not stop within 10s");
    }
    if let Some(tracer) = tracer {
        // Short: the launcher watches the workers, which the same SIGTERM stops, and counts
        // their end as a failure unless the core returns soon after.
        tracer.shutdown(Duration::from_millis(300));
    }
    // A task stuck on a dead client must not hold the exit.
    runtime.shutdown_timeout(Duration::from_secs(1));
    result
}

/// The engine without HTTP, for the in-process API (`tokenspeed._core.Engine`): the same state
/// `serve` builds (engine threads, tokenizer, grammar compiler, parsers), warmed up as `serve`
/// warms it before opening its port. On a failed warm-up the engine threads are stopped.
pub fn start_in_process(
    config: ServerConfig,
    links: Vec<Box<dyn WorkerLink>>,
    runtime: &tokio::runtime::Runtime,
) -> Result<http::AppState, ServeError> {
    let state = build_state_replicas(config, links)?;
    if !state.config.skip_server_warmup {
        if let Err(e) = runtime.block_on(warm_up(&state)) {
            state.engine.shutdown();
            state.engine.wait_stopped(Duration::from_secs(10));
            return Err(e);
        }
    }
    Ok(state)
}

/// Pending connections the kernel queues before `accept` (capped by `net.core.somaxconn`).
/// Benchmark clients and routers open thousands of connections at once; tokio's `bind` asks
/// for 1,024, and a full accept queue drops the handshake's last ACK, so the client writes its
/// request into a connection the server never sees and reads a reset.
const LISTEN_BACKLOG: u32 = 8192;

async fn bind(addr: &str) -> std::io::Result<tokio::net::TcpListener> {
    let mut last = None;
    for a in tokio::net::lookup_host(addr).await? {
        let socket = if a.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        // As std's and tokio's `bind` do: a restarted server can reuse a port in TIME_WAIT.
        socket.set_reuseaddr(true)?;
        match socket.bind(a).and_then(|()| socket.listen(LISTEN_BACKLOG)) {
            Ok(listener) => return Ok(listener),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "no address to bind")
    }))
}

async fn run_http(state: http::AppState, addr: String) -> Result<(), ServeError> {
    if !state.config.skip_server_warmup {
        warm_up(&state).await?;
    }
    let listener = bind(&addr).await.map_err(|source| ServeError::Bind {
        addr: addr.clone(),
        source,
    })?;
    let local: SocketAddr = listener.local_addr()?;
    tracing::info!("TokenSpeed serving on http://{local}");
    // Streams are many small writes: with Nagle's algorithm a chunk written while the previous
    // one is unacknowledged waits for the client's delayed ACK (40 ms on Linux), which lands on
    // time to first token (the first chunk with text often follows an empty one) and on
    // inter-token gaps. Every serving HTTP stack turns it off.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("TCP_NODELAY on an accepted connection: {e}");
        }
    });
    let (close_tx, close_rx) = tokio::sync::oneshot::channel::<()>();
    let server =
        axum::serve(listener, http::router(state.clone())).with_graceful_shutdown(async move {
            let _ = close_rx.await;
        });
    let mut server = tokio::spawn(async move { server.await });
    let outcome = tokio::select! {
        _ = shutdown_signal() => Ok(()),
        message = state.engine.failed() => Err(ServeError::EngineFailed(message)),
        ended = &mut server => {
            return match ended {
                Ok(r) => r.map_err(ServeError::Io),
                Err(e) => Err(ServeError::Io(std::io::Error::other(e))),
            };
        }
    };
    state.lifecycle.start_draining();
    match &outcome {
        Ok(()) => drain(&state).await,
        Err(e) => {
            tracing::error!("{e}; exiting");
            tokio::time::sleep(FAILED_LINGER).await;
        }
    }
    let _ = close_tx.send(());
    if tokio::time::timeout(CLOSE_GRACE, &mut server)
        .await
        .is_err()
    {
        tracing::warn!("connections still open after {CLOSE_GRACE:?}; closing them");
        server.abort();
    }
    outcome
}

/// New requests already get 503; in-flight ones get --shutdown-timeout seconds to finish (a
/// second signal cuts that short), then the rest end with an error.
async fn drain(state: &http::AppState) {
    let timeout = Duration::from_secs_f64(state.config.shutdown_timeout.max(0.0));
    tracing::info!(
        in_flight = state.lifecycle.in_flight(),
        "shutting down: new requests get 503; waiting up to {:.0}s for requests in flight",
        timeout.as_secs_f64()
    );
    let finished = tokio::select! {
        r = tokio::time::timeout(timeout, state.lifecycle.wait_idle()) => r.is_ok(),
        _ = shutdown_signal() => false,
        _ = state.engine.failed() => false,
    };
    if !finished {
        tracing::warn!(
            in_flight = state.lifecycle.in_flight(),
            "aborting the requests still in flight"
        );
        state.engine.abort_all("the server is shutting down");
        let _ = tokio::time::timeout(CLOSE_GRACE, state.lifecycle.wait_idle()).await;
    }
}

/// Generates one token through the whole path (tokenizer, scheduler, shm, worker) on every
/// replica before the port opens, so the first user request pays no start-up cost and a
/// broken worker is caught.
async fn warm_up(state: &http::AppState) -> Result<(), ServeError> {
    let started = Instant::now();
    let probes = (0..state.engine.len()).map(|r| {
        let prompt = generate::Prompt::Text("Hello".into());
        generate::probe(state, prompt, std::time::Duration::from_secs(600), Some(r))
    });
    for (r, result) in futures_util::future::join_all(probes)
        .await
        .into_iter()
        .enumerate()
    {
        result.map_err(|e| match state.engine.len() {
            1 => ServeError::Warmup(e.to_string()),
            _ => ServeError::Warmup(format!("data-parallel replica {r}: {}", e)),
        })?;
    }
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
    tracing::info!("shutdown signal received");
}
