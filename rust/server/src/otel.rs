//! `--enable-trace`: OpenTelemetry spans per request, exported over OTLP/HTTP (protobuf) to
//! `--otlp-traces-endpoint`. The HTTP layer opens the server span (child of the request's W3C
//! `traceparent`), the front end adds `tokenize` and `detokenize`, and the engine thread adds
//! `queue`, one `prefill_chunk` per step that carried prompt tokens, and `decode`, all built
//! from timestamps after the fact (`span`), so no span object lives across a step.
//!
//! Off (the default) nothing here exists: `Frontend::tracer` is None, no layer is installed,
//! no request carries a trace. On, spans go to the SDK's batch processor: a bounded queue
//! (full: spans are dropped) drained by its own thread, so an unreachable collector never
//! slows or fails a request.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{SpanKind, TraceContextExt, Tracer as _, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracer};
use opentelemetry_sdk::Resource;

/// Spans waiting for export beyond this are dropped (the SDK counts them), never queued
/// without bound.
const MAX_QUEUED_SPANS: usize = 8192;
/// How long one export may take before the exporter gives up on it.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);
/// How often queued spans are sent.
const EXPORT_INTERVAL: Duration = Duration::from_millis(200);

/// Cheap to clone: the SDK's tracer and provider are handles.
#[derive(Clone)]
pub struct Tracer {
    tracer: SdkTracer,
    provider: SdkTracerProvider,
}

/// The OTLP/HTTP traces URL of `--otlp-traces-endpoint`: `host:port` or an `http://` URL,
/// with `/v1/traces` appended unless the URL's path already names it.
pub fn traces_url(endpoint: &str) -> Result<String, String> {
    let endpoint = endpoint.trim().trim_end_matches('/');
    if endpoint.is_empty() {
        return Err("--otlp-traces-endpoint is empty".into());
    }
    let url = match endpoint.split_once("://") {
        None => format!("http://{endpoint}"),
        Some(("http", _)) => endpoint.to_string(),
        Some((scheme, _)) => {
            return Err(format!(
                "not supported yet: --otlp-traces-endpoint {endpoint} (scheme {scheme}://): \
                 traces go over OTLP/HTTP without TLS, give host:port or http://host:port"
            ))
        }
    };
    Ok(if url.ends_with("/v1/traces") {
        url
    } else {
        format!("{url}/v1/traces")
    })
}

impl Tracer {
    /// Starts the exporter (its thread) for `endpoint`. Must run outside an async context:
    /// the exporter's blocking HTTP client owns a runtime of its own.
    pub fn start(endpoint: &str) -> Result<Tracer, String> {
        let url = traces_url(endpoint)?;
        if url.contains(":4317/") {
            tracing::warn!(
                "--otlp-traces-endpoint {endpoint}: 4317 is OTLP's gRPC port; TokenSpeed \
                 exports OTLP over HTTP (a collector's default HTTP port is 4318)"
            );
        }
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(url.clone())
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| format!("--otlp-traces-endpoint {endpoint}: {e}"))?;
        let batches = BatchConfigBuilder::default()
            .with_max_queue_size(MAX_QUEUED_SPANS)
            .with_scheduled_delay(EXPORT_INTERVAL)
            .build();
        let processor = BatchSpanProcessor::builder(exporter)
            .with_batch_config(batches)
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(Resource::builder().with_service_name("tokenspeed").build())
            .build();
        let tracer = provider.tracer("tokenspeed");
        tracing::info!("tracing: exporting spans to {url}");
        Ok(Tracer { tracer, provider })
    }

    /// Sends the spans still queued and stops the exporter, waiting at most `timeout` (a
    /// collector that does not answer must not hold the server's exit).
    pub fn shutdown(&self, timeout: Duration) {
        let provider = self.provider.clone();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("tokenspeed-trace-flush".into())
            .spawn(move || {
                let _ = provider.shutdown();
                let _ = done_tx.send(());
            });
        if spawned.is_ok() && done_rx.recv_timeout(timeout).is_err() {
            tracing::warn!("tracing: spans not exported within {timeout:?} at exit");
        }
    }

    /// Opens an HTTP request's server span: a child of the `traceparent` (and `tracestate`)
    /// among its `headers` when it has one, else the root of a new trace. The span lives in
    /// the returned context; `http/trace.rs` ends it.
    pub fn server_span(&self, headers: &dyn Extractor, name: String) -> Context {
        let parent = TraceContextPropagator::new().extract(headers);
        let span = self
            .tracer
            .span_builder(name)
            .with_kind(SpanKind::Server)
            .with_start_time(wall_time(Instant::now()))
            .start_with_context(&self.tracer, &parent);
        parent.with_span(span)
    }

    /// Records a finished child span of `parent`'s span, from `start` to `end`.
    pub fn span(
        &self,
        parent: &Context,
        name: &'static str,
        start: Instant,
        end: Instant,
        attributes: Vec<KeyValue>,
    ) {
        let (start, end) = (wall_time(start), wall_time(end));
        let mut span = self
            .tracer
            .span_builder(name)
            .with_kind(SpanKind::Internal)
            .with_start_time(start)
            .with_attributes(attributes)
            .start_with_context(&self.tracer, parent);
        opentelemetry::trace::Span::end_with_timestamp(&mut span, end);
    }
}

/// A request's place in its trace, handed down the pipeline (cheap to clone): the tracer and
/// the context of its server span (spans recorded with it are that span's children).
#[derive(Clone)]
pub struct RequestTrace(Arc<(Tracer, Context)>);

impl RequestTrace {
    /// The trace of the server span `cx` holds, if that span records (a `traceparent` whose
    /// sampled flag is off makes a span that does not: nothing is timed for it).
    pub fn of(tracer: &Tracer, cx: &Context) -> Option<RequestTrace> {
        cx.span()
            .is_recording()
            .then(|| RequestTrace(Arc::new((tracer.clone(), cx.clone()))))
    }

    pub fn span(&self, name: &'static str, start: Instant, end: Instant, attrs: Vec<KeyValue>) {
        let (tracer, parent) = &*self.0;
        tracer.span(parent, name, start, end, attrs);
    }
}

/// A traced generation's `detokenize` span: from the first token's rendering to the last
/// one's, with the time actually spent in it (the rest is waiting for tokens). Recorded when
/// the generation is dropped, however it ended.
pub struct DetokenizeSpan {
    trace: RequestTrace,
    first: Option<Instant>,
    last: Instant,
    busy: Duration,
    tokens: u32,
}

impl DetokenizeSpan {
    pub fn new(trace: RequestTrace) -> Box<DetokenizeSpan> {
        Box::new(DetokenizeSpan {
            trace,
            first: None,
            last: Instant::now(),
            busy: Duration::ZERO,
            tokens: 0,
        })
    }

    /// `tokens` were rendered from `start` to `end`.
    pub fn add(&mut self, start: Instant, end: Instant, tokens: usize) {
        self.first.get_or_insert(start);
        self.last = end;
        self.busy += end - start;
        self.tokens += tokens as u32;
    }
}

impl Drop for DetokenizeSpan {
    fn drop(&mut self) {
        if let Some(first) = self.first {
            let attrs = vec![
                KeyValue::new("tokenspeed.tokens", i64::from(self.tokens)),
                KeyValue::new("tokenspeed.busy_us", self.busy.as_micros() as i64),
            ];
            self.trace.span("detokenize", first, self.last, attrs);
        }
    }
}

/// The wall-clock time of an `Instant` (spans carry Unix times; the engine keeps Instants),
/// through one anchor taken once: every span's times come from the one monotonic clock, so two
/// spans' order and gaps are exactly those the server saw (two reads of the wall clock could
/// disagree by more than the microseconds between a step's result and a first token).
pub fn wall_time(t: Instant) -> SystemTime {
    static ANCHOR: OnceLock<(Instant, SystemTime)> = OnceLock::new();
    let &(instant, wall) = ANCHOR.get_or_init(|| (Instant::now(), SystemTime::now()));
    match t.checked_duration_since(instant) {
        Some(after) => wall + after,
        None => wall.checked_sub(instant - t).unwrap_or(wall),
    }
}

#[cfg(test)]
mod tests {
    use super::{traces_url, wall_time};
    use std::time::{Duration, Instant};

    #[test]
    fn wall_times_keep_the_monotonic_order_and_gaps() {
        let t = Instant::now();
        let later = t + Duration::from_micros(3);
        assert_eq!(wall_time(t), wall_time(t));
        assert_eq!(
            wall_time(later).duration_since(wall_time(t)).unwrap(),
            Duration::from_micros(3)
        );
        let earlier = t.checked_sub(Duration::from_millis(5)).unwrap_or(t);
        assert!(wall_time(earlier) <= wall_time(t));
    }

    #[test]
    fn endpoints_become_otlp_http_traces_urls() {
        let url = |e| traces_url(e).unwrap();
        assert_eq!(url("localhost:4318"), "http://localhost:4318/v1/traces");
        assert_eq!(url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(url("http://c:4318/v1/traces"), "http://c:4318/v1/traces");
        assert_eq!(url("http://c/otlp"), "http://c/otlp/v1/traces");
        assert!(traces_url("https://c:4318")
            .unwrap_err()
            .contains("not supported yet"));
        assert!(traces_url("grpc://c:4317").is_err());
    }
}
